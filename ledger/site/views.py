"""The site's view types: what phase one computes and the templates read (``SiteContext`` and
the rows, tables, findings, predictions and plots in it). Data only; computed by the page
modules (``index_page``, ``plot_data``, ``estimators_page``, ``fits_page``) and assembled in
``context``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ledger.core.results import Calibration, Fits, Scoreboard

#: Tables with more rows than this show a grouped summary on the page instead; every row is
#: in vram.csv and vram.json. A browser opens a page of this many rows quickly.
ROW_LIMIT = 2000


@dataclass
class GpuSpec:
    key: str
    anchor: str
    title: str
    specs: list[tuple[str, str]]
    notes: list[str]
    source: Optional[str]
    measured_on: Optional[str]
    inferred: bool


@dataclass
class Row:
    """One measurement as every table shows it (display strings plus sort keys)."""

    id: str
    kind: str
    model: str
    quant: str
    rank: Optional[int]
    alpha: Optional[float]
    rslora: Optional[bool]
    dropout: Optional[float]
    dora: Optional[bool]
    seq_len: Optional[int]
    fixes: str
    after_load_mib: Optional[float]
    pre_step_mib: Optional[float]
    peak_allocated_mib: Optional[float]
    peak_reserved_mib: Optional[float]
    step_s: Optional[float]
    status: Optional[str]
    inferred: bool
    peak_text: str
    detail: str
    notes: list[str]
    source: str
    measured_on: str
    provenance_title: str


@dataclass
class Table:
    """A measurement table. Up to ROW_LIMIT rows are shown on the page; a larger table is shown
    as a grouped summary, with every row in vram.csv and vram.json."""

    id: str
    title: str
    rows: list[Row]
    total: int
    summary: list[dict] = field(default_factory=list)

    @property
    def summarised(self) -> bool:
        return self.total > len(self.rows)


@dataclass
class FigureRow:
    label: str
    value: str
    source: str


@dataclass
class FindingGroup:
    anchor: Optional[str]
    title: Optional[str]
    figures: list[FigureRow]
    details: list[tuple[str, str]]


@dataclass
class FindingView:
    id: str
    title: str
    claim: Optional[str]
    groups: list[FindingGroup]
    evidence: list[str]
    status: str
    source: str
    measured_on: str
    notes: list[str]


@dataclass
class PredictionRow:
    id: str
    gpu: str
    config: str
    predicted_mib: float
    interval: str
    actual_mib: Optional[float]
    error_pct: Optional[float]
    scored_against: Optional[str]
    made_on: str
    basis: list[str]
    method: Optional[str]
    source: str


@dataclass
class PlotPoint:
    x: float
    y: float
    id: str
    status: str
    exceeded: bool = False


@dataclass
class PlotSeries:
    label: str
    points: list[PlotPoint]


@dataclass
class Plot:
    id: str
    file: str
    title: str
    caption: str
    alt: str
    xlabel: str
    ylabel: str
    series: list[PlotSeries]
    limit_mib: Optional[float] = None
    limit_label: Optional[str] = None
    diagonal: bool = False
    log: bool = False
    markers_only: bool = False


@dataclass(frozen=True)
class SiteContext:
    """Everything every output shows, computed once in phase one (``compute_site``); phase two
    renders each output from it and from nothing else. Frozen: a later step makes a new one with
    ``dataclasses.replace`` rather than patching this one."""

    title: str
    about: Optional[str]
    ledger_sha256: str
    schema_version: int
    build_date: Optional[str]
    counts: dict[str, int]
    training_gpu: Optional[GpuSpec]
    measurements: Table
    cross_gpus: list[tuple[GpuSpec, Table]]
    cross_gpu_intro: Optional[FindingView]
    findings: list[FindingView]
    predictions: list[PredictionRow]
    plots: list[Plot]
    ids: list[str]
    fitted: Optional[Calibration] = None
    scoreboard: Optional[Scoreboard] = None
    fits: Optional[Fits] = None
    #: The first section's grids (ledger.answer.fits.ledger_grids): what fits on the ledger's own cards.
    fit_grids: list = field(default_factory=list)
    #: Every model of the fit table with its page's data (``site.fits_page.FitModel``), and the
    #: model a per-model page is about (None on the other pages).
    fit_models: list = field(default_factory=list)
    #: The cards fits.md and the model pages list several-GPU rows for (``worlds.WORLD_PAGE_CARDS``).
    world_cards: tuple = ()
    #: GPUs a several-GPU table has rows for (``worlds.WORLD_GPUS``).
    world_gpus: tuple = ()
    fit_model: Optional[object] = None
    #: The relative path from a page to the site's root ("" at the top, "../" under fits/).
    root: str = ""
    estimator_plot: Optional[Plot] = None
    base_url: Optional[str] = None
    downloads: list[dict] = field(default_factory=list)
    changes: Optional[dict] = None
    #: The inlined stylesheet and script (the page opens from file:// with nothing fetched).
    css: str = ""
    js: str = ""
    #: The fit picker's script (inlined on the pages that have the picker).
    picker_js: str = ""
    #: In-page link of every measurement id shown in a table.
    hrefs: dict[str, str] = field(default_factory=dict)
    #: The data files and plot images, by path in the output folder.
    data_files: dict[str, str] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)

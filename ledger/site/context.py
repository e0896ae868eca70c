"""Phase one of the build: everything the pages show, computed once from the ledger.

The templates get a ``SiteContext`` and nothing else. Every output (HTML, Markdown,
vram.json, plots) is rendered from the same object, so they cannot disagree.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ..results import Calibration, Fits, Scoreboard
from ..recipe import capacity_mib, fixes_key, seq_len_of
from ..models import Finding, Gpu, Ledger, Measurement, Prediction
from . import filters

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
    #: The first section's grids (ledger.fits.ledger_grids): what fits on the ledger's own cards.
    fit_grids: list = field(default_factory=list)
    estimator_plot: Optional[Plot] = None
    base_url: Optional[str] = None
    downloads: list[dict] = field(default_factory=list)
    changes: Optional[dict] = None
    #: The inlined stylesheet and script (the page opens from file:// with nothing fetched).
    css: str = ""
    js: str = ""
    #: In-page link of every measurement id shown in a table.
    hrefs: dict[str, str] = field(default_factory=dict)
    #: The data files and plot images, by path in the output folder.
    data_files: dict[str, str] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)


# -- helpers ------------------------------------------------------------------------------


def anchor(text: str) -> str:
    """An HTML id from any text: lower case, a-z0-9 and '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def canonical_json(ledger: Ledger) -> str:
    """The ledger's compact canonical JSON (model field order, defaults and nulls left out, as
    the ledger file stores it): a field added to the format with a default changes no hash."""
    return ledger.model_dump_json(exclude_defaults=True)


def ledger_hash(ledger: Ledger, text: Optional[str] = None) -> str:
    """sha256 of the ledger's canonical JSON: changes when and only when the content does."""
    return hashlib.sha256((text if text is not None else canonical_json(ledger)).encode("utf-8")).hexdigest()


def _fixes(m: Measurement) -> str:
    """The memory fixes as the tables show them (blank when the row does not say)."""
    return "" if m.memory_fixes is None else fixes_key(m.memory_fixes)


def _gpu_label(ledger: Ledger, key: Optional[str]) -> str:
    if key is None:
        return ""
    gpu = ledger.gpus[key]
    short = [a for a in gpu.aliases if " " in a]
    return short[0] if short else gpu.name


def _oom_text(m: Measurement) -> str:
    o = m.outcome.oom
    if o is None:
        return "OOM"
    parts = []
    for label, value in (
        ("tried", o.tried_mib),
        ("free", o.free_mib),
        ("in use", o.in_use_mib),
        ("allocated", o.allocated_mib),
        ("reserved-unallocated", o.reserved_unallocated_mib),
        ("max allocated before", o.max_allocated_mib),
    ):
        if value is not None:
            parts.append(f"{label} {filters.mib(value)}")
    return "OOM" + (": " + ", ".join(parts) if parts else "")


def _provenance_title(m: Measurement) -> str:
    p = m.provenance
    bits = []
    if p.source:
        bits.append(f"source: {p.source}")
    if p.measured_on:
        bits.append(f"measured on {p.measured_on.isoformat()}")
    if p.inferred:
        bits.append("inferred, not read off an instrument")
    if p.simulated:
        bits.append("simulated")
    if p.inferred_fields:
        bits.append("filled from stated defaults or derived: " + ", ".join(p.inferred_fields))
    return "; ".join(bits)


def make_row(ledger: Ledger, m: Measurement) -> Row:
    o = m.outcome
    lora = m.lora
    seq = seq_len_of(m)
    if o.status == "oom":
        peak_text = _oom_text(m)
    elif o.peak_allocated_mib is not None:
        peak_text = filters.num(o.peak_allocated_mib)
    elif o.per_device_peak_mib:
        peak_text = " + ".join(f"{filters.mib(v)} on {k}" for k, v in o.per_device_peak_mib.items())
    else:
        peak_text = o.peak_as_reported or ""
    detail_bits = []
    if m.config_text:
        detail_bits.append(f"Config: {m.config_text}")
    if o.result_text and o.status != "oom":
        detail_bits.append(f"Result: {o.result_text}")
    elif o.result_text:
        detail_bits.append(f"Message: {o.result_text}")
    if o.failed_at_step is not None and "step" not in (o.result_text or ""):
        detail_bits.append(f"Failed at step {o.failed_at_step}")
    if m.dataset:
        d = m.dataset
        ds = [x for x in (d.name, f"{d.examples} examples" if d.examples else None,
                          f"{d.epochs:g} epochs" if d.epochs else None) if x]
        if ds:
            detail_bits.append("Dataset: " + ", ".join(ds))
    if m.logits_to_keep:
        detail_bits.append(f"logits_to_keep {m.logits_to_keep}")
    if o.peak_delta_mib is not None:
        detail_bits.append(f"Peak delta (HF Trainer's peaked memory) {filters.num(o.peak_delta_mib)} MiB")
    if o.oom is not None and (o.oom.total_mib is not None or o.oom.in_use_mib is not None):
        detail_bits.append("OOM message: " + ", ".join(
            x for x in (f"card total {filters.num(o.oom.total_mib)} MiB" if o.oom.total_mib is not None else None,
                        f"in use {filters.num(o.oom.in_use_mib)} MiB" if o.oom.in_use_mib is not None else None) if x))
    env = m.environment
    if env is not None and (env.device or env.device_name):
        detail_bits.append("Device: " + " ".join(x for x in (env.device, f"({env.device_name})" if env.device_name
                                                              else None) if x))
    return Row(
        id=m.id,
        kind=m.kind,
        model=m.model or "",
        quant=m.quant or "",
        rank=lora.rank if lora else None,
        alpha=lora.alpha if lora else None,
        rslora=lora.rslora if lora else None,
        dropout=lora.dropout if lora else None,
        dora=lora.dora if lora else None,
        seq_len=seq,
        fixes=_fixes(m),
        after_load_mib=o.after_load_mib,
        pre_step_mib=o.pre_step_mib,
        peak_allocated_mib=o.peak_allocated_mib,
        peak_reserved_mib=o.peak_reserved_mib,
        step_s=o.step_s,
        status=o.status,
        inferred=m.provenance.inferred,
        peak_text=peak_text,
        detail="; ".join(detail_bits),
        notes=list(m.provenance.notes),
        source=m.provenance.source or "",
        measured_on=m.provenance.measured_on.isoformat() if m.provenance.measured_on else "",
        provenance_title=_provenance_title(m),
    )


def _summary(ledger: Ledger, measurements: list[Measurement]) -> list[dict]:
    groups: dict[tuple, list[Measurement]] = defaultdict(list)
    labels = {key: _gpu_label(ledger, key) for key in ledger.gpus}
    for m in measurements:
        lora = m.lora
        key = (labels.get(m.gpu, ""), m.kind, m.model or "", m.quant or "", _fixes(m),
               bool(lora and lora.dropout), bool(lora and lora.dora))
        groups[key].append(m)
    out = []
    for key in sorted(groups, key=lambda k: tuple(str(x) for x in k)):
        ms = groups[key]
        peaks = [m.outcome.peak_allocated_mib for m in ms if m.outcome.peak_allocated_mib is not None]
        ranks = [m.lora.rank for m in ms if m.lora]
        seqs = [m.seq_len for m in ms if m.seq_len]
        status = Counter(m.outcome.status or "unknown" for m in ms)
        out.append(
            {
                "gpu": key[0], "kind": key[1], "model": key[2], "quant": key[3], "fixes": key[4],
                "dropout": "yes" if key[5] else "no", "dora": "yes" if key[6] else "no",
                "rows": len(ms),
                "ranks": f"{min(ranks)}–{max(ranks)}" if ranks else "",
                "seq_lens": f"{min(seqs)}–{max(seqs)}" if seqs else "",
                "peak_min_mib": min(peaks) if peaks else None,
                "peak_max_mib": max(peaks) if peaks else None,
                "status": ", ".join(f"{k} {v}" for k, v in sorted(status.items())),
            }
        )
    return out


def make_table(ledger: Ledger, table_id: str, title: str, measurements: list[Measurement]) -> Table:
    if len(measurements) <= ROW_LIMIT:
        rows = [make_row(ledger, m) for m in measurements]
        return Table(id=table_id, title=title, rows=rows, total=len(rows))
    return Table(id=table_id, title=title, rows=[], total=len(measurements),
                 summary=_summary(ledger, measurements))


def gpu_spec(key: str, gpu: Gpu) -> GpuSpec:
    specs = [("Name", gpu.name)]
    for label, value in (
        ("Vendor", gpu.vendor),
        ("Arch", gpu.arch),
        ("Total", f"{filters.mib(gpu.total_mib)} ({filters.gib(gpu.total_mib)})" if gpu.total_mib else None),
        ("Usable as torch reports it", f"{gpu.usable_gib_torch:.2f} GiB" if gpu.usable_gib_torch else None),
        ("OS", gpu.os),
        ("Driver", gpu.driver),
        ("Stack", gpu.stack),
        ("Libraries", gpu.libraries),
        ("Python", gpu.python),
    ):
        if value:
            specs.append((label, value))
    p = gpu.provenance
    return GpuSpec(
        key=key, anchor=f"gpu-{key}", title=gpu.name, specs=specs, notes=list(p.notes), source=p.source,
        measured_on=p.measured_on.isoformat() if p.measured_on else None, inferred=p.inferred,
    )


def _figure_value(fig) -> str:
    unit = fig.unit or ""
    if isinstance(fig.value, bool):
        return "yes" if fig.value else "no"
    if fig.low is not None and fig.high is not None:
        text = f"{fig.low:g}–{fig.high:g} {unit}".strip()
    elif fig.value is not None:
        text = f"{fig.value:g} {unit}".strip() if unit != "%" else f"{fig.value:g}%"
    else:
        text = fig.text or ""
    if fig.text and fig.text not in text and not re.fullmatch(r"[\d.\s\-–]+", fig.text):
        text += f" ({fig.text})"
    return text


def finding_view(f: Finding) -> FindingView:
    groups: dict[Optional[str], FindingGroup] = {}

    def group(label: str) -> tuple[FindingGroup, str]:
        head, sep, rest = label.partition(": ")
        name = head if sep else None
        if name not in groups:
            groups[name] = FindingGroup(
                anchor=f"{f.id}-{anchor(name)}" if name else None, title=name, figures=[], details=[]
            )
        return groups[name], (rest if sep else label)

    for fig in f.figures:
        g, label = group(fig.label)
        src = ""
        if fig.provenance and (fig.provenance.source or fig.provenance.measured_on):
            src = "; ".join(
                x for x in (fig.provenance.source,
                            f"measured on {fig.provenance.measured_on}" if fig.provenance.measured_on else None) if x
            )
        g.figures.append(FigureRow(label=label, value=_figure_value(fig), source=src))
    for d in f.details:
        g, label = group(d.label)
        g.details.append((label, d.text))
    ordered = [groups[k] for k in groups if k is None] + [groups[k] for k in groups if k is not None]
    p = f.provenance
    return FindingView(
        id=f.id, title=f.title, claim=f.claim, groups=ordered, evidence=list(f.evidence), status=f.status,
        source=p.source or "", measured_on=p.measured_on.isoformat() if p.measured_on else "",
        notes=list(p.notes),
    )


def prediction_row(ledger: Ledger, p: Prediction) -> PredictionRow:
    bits = []
    if p.lora:
        bits.append(f"r{p.lora.rank}")
        if p.lora.rslora:
            bits.append("rsLoRA" + (f" alpha {p.lora.alpha:g}" if p.lora.alpha else ""))
        if p.lora.dropout:
            bits.append(f"dropout {p.lora.dropout:g}")
        if p.lora.dora:
            bits.append("DoRA")
    if p.quant:
        bits.append(p.quant)
    if p.seq_len:
        bits.append(f"{p.seq_len} tokens")
    interval = ""
    if p.interval_low_mib is not None and p.interval_high_mib is not None:
        interval = f"{filters.num(p.interval_low_mib)}–{filters.num(p.interval_high_mib)}"
    return PredictionRow(
        id=p.id, gpu=_gpu_label(ledger, p.gpu), config=", ".join(bits), predicted_mib=p.predicted_peak_mib,
        interval=interval, actual_mib=p.score.actual_peak_mib if p.score else None,
        error_pct=p.score.error_pct if p.score else None,
        scored_against=p.score.measurement if p.score else None,
        made_on=p.made_on.isoformat() if p.made_on else "", basis=list(p.basis), method=p.method,
        source=p.provenance.source or "",
    )


def training_gpu_key(ledger: Ledger) -> Optional[str]:
    """The card the real runs were trained on (most real runs); else the first card."""
    reals = Counter(m.gpu for m in ledger.measurements if m.kind == "real" and m.gpu)
    if reals:
        return sorted(reals.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    return next(iter(ledger.gpus), None)


# -- plots --------------------------------------------------------------------------------


def _natural(key: tuple) -> tuple:
    """A sort key that orders numbers as numbers (2048 before 12288) and the rest as text."""
    return tuple((0, float(x), "") if isinstance(x, (int, float)) and not isinstance(x, bool) else (1, 0.0, str(x))
                 for x in key)


def _series_label(key: tuple) -> str:
    quant, fixes, dropout, dora, seq = key
    bits = [quant, f"fixes {fixes}", "dropout" if dropout else "no dropout"]
    if dora:
        bits.append("DoRA")
    if seq:
        bits.append(f"{seq} tokens")
    return ", ".join(bits)


def _keep_highest(points: dict, x: float, m: Measurement, limit: Optional[float]) -> None:
    """Keep, per x, the highest peak of a series; an OOM (drawn at the card's limit as
    'exceeded') outranks any peak that fit. Readable at any ledger size."""
    o = m.outcome
    if o.status == "oom":
        if limit is None:
            return
        cand = (True, limit, m.id, "oom")
    elif o.peak_allocated_mib is not None and o.status in ("ok", "spilled", None):
        cand = (False, o.peak_allocated_mib, m.id, o.status or "ok")
    else:
        return
    old = points.get(x)
    if old is None or cand[:2] > old[:2]:
        points[x] = cand


def _points(points: dict) -> list[PlotPoint]:
    return [PlotPoint(x=x, y=v[1], id=v[2], status=v[3], exceeded=v[0]) for x, v in sorted(points.items())]


def make_plots(ledger: Ledger) -> list[Plot]:
    """Peak vs rank per card, peak vs sequence length, probe vs real: one pass over the rows."""
    limits = {key: capacity_mib(gpu) for key, gpu in ledger.gpus.items()}
    by_rank: dict[str, dict[tuple, dict]] = defaultdict(lambda: defaultdict(dict))
    by_seq: dict[tuple, dict] = defaultdict(dict)
    probe_real: dict[str, dict[tuple, dict]] = defaultdict(lambda: defaultdict(dict))
    has_real: set[str] = set()
    for m in ledger.measurements:
        gpu, lora = m.gpu, m.lora
        if not gpu or not lora:
            continue
        limit, rank = limits[gpu], float(lora.rank)
        dropout, dora = bool(lora.dropout), bool(lora.dora)
        ok = m.outcome.status == "ok" and m.outcome.peak_allocated_mib is not None
        if m.kind == "probe":
            fixes = _fixes(m)
            seq = seq_len_of(m)
            _keep_highest(by_rank[gpu][(m.quant or "?", fixes or "?", dropout, dora, seq)], rank, m, limit)
            if m.seq_len:
                _keep_highest(by_seq[(gpu, m.quant, lora.rank, dropout, dora, fixes)], float(m.seq_len), m, limit)
            if ok:
                _keep_highest(probe_real[gpu][(0, dropout)], rank, m, limit)
        elif m.kind == "real" and ok:
            has_real.add(gpu)
            _keep_highest(probe_real[gpu][(1, dropout)], rank, m, limit)

    plots: list[Plot] = []
    for key, gpu in ledger.gpus.items():
        series = by_rank.get(key)
        if not series:
            continue
        plots.append(
            Plot(
                id=f"peak-vs-rank-{key}", file=f"plots/peak-vs-rank-{key}.svg",
                title=f"Probe peak allocated vs LoRA rank on the {gpu.name}",
                caption=(f"One-step probes on the {gpu.name}: peak allocated (MiB) by rank, one line per quant × "
                         "memory fixes × dropout × DoRA × sequence length (the highest value per rank). An OOM is "
                         "drawn as a red × on the card's line: the step needed more than the card could give; a run "
                         "that finished only by spilling past the card is an orange ▲ just above the line, its real "
                         "peak written beside it. Hover a point for its id and peak."),
                alt=(f"Line chart of probe peak allocated memory in MiB against LoRA rank on the {gpu.name}, "
                     f"{len(series)} series; OOM probes are marked at the card limit."),
                xlabel="LoRA rank", ylabel="peak allocated (MiB)",
                series=[PlotSeries(_series_label(k), _points(v)) for k, v in sorted(series.items(),
                                                                                     key=lambda kv: _natural(kv[0]))],
                limit_mib=limits[key], limit_label="card limit (torch)" if gpu.usable_gib_torch else "card total",
            )
        )
    seq_series = {k: v for k, v in by_seq.items() if len(v) >= 2}
    if seq_series:
        plots.append(
            Plot(
                id="peak-vs-seq-len", file="plots/peak-vs-seq-len.svg",
                title="Probe peak allocated vs sequence length",
                caption=("One-step probes: peak allocated (MiB) by sequence length, one line per card × quant × rank × "
                         "dropout × DoRA × memory fixes. The growth is not linear over long sequences."),
                alt="Line chart of probe peak allocated memory in MiB against sequence length in tokens.",
                xlabel="sequence length (tokens)", ylabel="peak allocated (MiB)",
                series=[
                    PlotSeries(
                        f"{_gpu_label(ledger, k[0])}, {k[1]}, r{k[2]}"
                        + (", dropout" if k[3] else "") + (", DoRA" if k[4] else "") + f", fixes {k[5]}",
                        _points(v),
                    )
                    for k, v in sorted(seq_series.items(), key=lambda kv: _natural(kv[0]))
                ],
            )
        )
    names = ("probes (one step)", "real runs")
    for key, gpu in ledger.gpus.items():
        if key not in has_real:
            continue
        groups = probe_real[key]
        plots.append(
            Plot(
                id=f"probe-vs-real-{key}", file=f"plots/probe-vs-real-{key}.svg",
                title=f"Probe vs real-run peaks on the {gpu.name}",
                caption=("Peak allocated (MiB) by rank for one-step probes and for real training runs on the same card "
                         "(highest value per rank). The probe has no optimizer step and over-estimates the real peak."),
                alt=f"Scatter chart comparing probe and real-run peak allocated memory by LoRA rank on the {gpu.name}.",
                xlabel="LoRA rank", ylabel="peak allocated (MiB)",
                series=[PlotSeries(f"{names[k[0]]}, {'dropout' if k[1] else 'no dropout'}", _points(groups[k]))
                        for k in sorted(groups)],
                limit_mib=limits[key], limit_label="card limit (torch)" if gpu.usable_gib_torch else "card total",
            )
        )
    return plots


# -- the context --------------------------------------------------------------------------

#: Sections of the page with fixed anchors; a finding with one of these ids is shown inside it.
BUILTIN_SECTIONS = ("gpu", "measurements", "cross-gpu", "plots", "predictions", "downloads", "fitted")

#: Leave-one-out refits the calibration once per row: above this many rows the site skips it
#: (``vram calibrate`` still runs it).
LOO_LIMIT = 1000


def estimator_scoreboard(ledger: Ledger) -> Scoreboard:
    """How every VRAM estimator fares against the ledger's measured peaks."""
    from ..scoreboard import _sort_key, scoreboard

    from ..dry_runs import load_dry_runs

    board = scoreboard(ledger, keep_rows=ROW_LIMIT, dry_runs=load_dry_runs())
    # Views the pages show: each slice's values, and one row per measurement across estimators.
    board["slice_values"] = {}
    for est in board["estimators"]:
        for key, groups in est.get("slices", {}).items():
            board["slice_values"].setdefault(key, set()).update(groups)
    board["slice_values"] = {k: sorted(v, key=_sort_key) for k, v in board["slice_values"].items()}
    table: dict[str, dict] = {}
    models = {m.id: m.model for m in ledger.measurements}
    for i, est in enumerate(board["estimators"]):
        for r in est.get("rows", []):
            row = table.setdefault(r["id"], {"id": r["id"], "model": models.get(r["id"]), "status": r["status"],
                                             "allocated_mib": r["allocated_mib"],
                                             "reserved_mib": r["reserved_mib"],
                                             "cells": [None] * len(board["estimators"])})
            row["cells"][i] = {"estimate_mib": r["estimate_mib"], "error_pct": r["error_pct"]}
    board["table"] = list(table.values())
    return Scoreboard.model_validate(board)


def estimator_plot(board: Scoreboard) -> Optional[Plot]:
    """Estimate vs measured, one series per estimator, with the y = x line."""
    series = []
    for est in board.estimators:
        pts = [PlotPoint(x=r.measured_mib, y=r.estimate_mib, id=r.id, status=r.status)
               for r in est.rows if r.measured_mib is not None]
        if pts:
            series.append(PlotSeries(f"{est.name} (predicts {est.predicts})",
                                     sorted(pts, key=lambda p: (p.x, p.y, p.id))))
    if not series:
        return None
    return Plot(id="estimators", file="plots/estimators.svg", title="VRAM estimators: estimate vs measured peak",
                caption=("Each point is one measured run or probe: the measured peak (the quantity the estimator "
                         "claims to predict, where the ledger has it) against the estimator's figure. On the "
                         "dashed line the estimate is exact; above it the estimator over-estimates."),
                alt="Scatter chart of estimated against measured peak memory in MiB, one series per estimator, "
                    "with the diagonal where estimate equals measurement.",
                xlabel="measured peak (MiB)", ylabel="estimate (MiB)", series=series, diagonal=True, log=True,
                markers_only=True)


def fit_table_doc(ledger: Ledger) -> tuple[Optional[Fits], list]:
    """The fit table (site/fits.html) from the committed dry-run rows (None without any), and the
    first section's grids of the ledger's own cards (none above LOO_LIMIT rows)."""
    from ..fits import fits_document, ledger_grids
    from ..dry_runs import load_dry_runs
    from ..predictor import Predictor

    p = Predictor(ledger, load_dry_runs())
    small = len(ledger.measurements) <= LOO_LIMIT
    grids = ledger_grids(p) if small else []
    if not p.dry:
        return None, grids
    # Above LOO_LIMIT rows the whole ladder per cell is too slow for a build: the dry run answers.
    return Fits.model_validate(fits_document(p, ladder=small)), grids


def fitted(ledger: Ledger) -> Calibration:
    """The calibration the page shows, computed from the ledger at build time."""
    from ..calibration_report import calibrate

    from ..dry_runs import load_dry_runs

    small = len(ledger.measurements) <= LOO_LIMIT
    doc = calibrate(ledger, with_loo=small, with_ceilings=small, dry_runs=load_dry_runs())
    doc["loo_skipped"] = doc["loo"] is None
    return Calibration.model_validate(doc)


def build_context(
    ledger: Ledger,
    *,
    build_date: Optional[str] = None,
    title: str = "VRAM measurements",
    ledger_sha256: Optional[str] = None,
    plots: Optional[list[Plot]] = None,
    fitted_doc=None,
    scoreboard_doc=None,
) -> SiteContext:
    """Compute everything the outputs show. Pure: the same ledger gives the same context."""
    train_key = training_gpu_key(ledger)
    by_gpu: dict[Optional[str], list[Measurement]] = defaultdict(list)
    for m in ledger.measurements:
        by_gpu[m.gpu if m.gpu != train_key else None].append(m)
    cross = []
    for key, gpu in ledger.gpus.items():
        if key == train_key:
            continue
        cross.append((gpu_spec(key, gpu), make_table(ledger, f"gpu-{key}-table", gpu.name, by_gpu.get(key, []))))
    views = [finding_view(f) for f in ledger.findings]
    intro = next((v for v in views if v.id == "cross-gpu"), None)
    status = Counter(m.outcome.status or "unknown" for m in ledger.measurements)
    counts = {
        "measurements": len(ledger.measurements),
        "gpus": len(ledger.gpus),
        "findings": len(ledger.findings),
        "predictions": len(ledger.predictions),
        "ok": status.get("ok", 0),
        "oom": status.get("oom", 0),
    }
    return SiteContext(
        title=title,
        about=ledger.about,
        ledger_sha256=ledger_sha256 or ledger_hash(ledger),
        schema_version=ledger.schema_version,
        build_date=build_date,
        counts=counts,
        training_gpu=gpu_spec(train_key, ledger.gpus[train_key]) if train_key else None,
        measurements=make_table(ledger, "measurements-table", "Measurements", by_gpu.get(None, [])),
        cross_gpus=cross,
        cross_gpu_intro=intro,
        findings=[v for v in views if v.id not in BUILTIN_SECTIONS],
        predictions=[prediction_row(ledger, p) for p in ledger.predictions],
        plots=plots if plots is not None else make_plots(ledger),
        ids=[m.id for m in ledger.measurements],
        fitted=fitted_doc.result() if fitted_doc is not None else fitted(ledger),
        scoreboard=scoreboard_doc.result() if scoreboard_doc is not None else estimator_scoreboard(ledger),
    )


def all_tables(ctx: SiteContext) -> Iterable[Table]:
    yield ctx.measurements
    for _, table in ctx.cross_gpus:
        yield table

"""Phase one of the build: everything the pages show, computed once from the ledger.

The templates get a ``SiteContext`` (``views``) and nothing else. Every output (HTML, Markdown,
vram.json, plots) is rendered from the same object, so they cannot disagree. Each page's data is
computed by its own module (``index_page``, ``plot_data``, ``estimators_page``, ``fits_page``);
this one assembles them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable, Optional

from ledger.report.calibration_report import calibrate
from ledger.storage.dry_runs import load_dry_runs
from ledger.core.models import Ledger, Measurement
from ledger.core.results import Calibration
from .estimators_page import estimator_scoreboard
from .fits_page import LOO_LIMIT
from .index_page import finding_view, gpu_spec, ledger_hash, make_table, prediction_row, training_gpu_key
from .plot_data import make_plots
from .views import Plot, SiteContext, Table

# -- the context --------------------------------------------------------------------------

#: Sections of the page with fixed anchors; a finding with one of these ids is shown inside it.
BUILTIN_SECTIONS = ("gpu", "measurements", "cross-gpu", "plots", "predictions", "downloads", "fitted")

def fitted(ledger: Ledger) -> Calibration:
    """The calibration the page shows, computed from the ledger at build time."""
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
        fitted=fitted_doc if fitted_doc is not None else fitted(ledger),
        scoreboard=scoreboard_doc if scoreboard_doc is not None else estimator_scoreboard(ledger),
    )


def all_tables(ctx: SiteContext) -> Iterable[Table]:
    yield ctx.measurements
    for _, table in ctx.cross_gpus:
        yield table

"""The estimators page's data (``estimators.html``, ``estimators.md``): the scoreboard with its
per-slice values and its one-row-per-measurement table, the mixtures of experts' board against this
project's dry runs, and the estimate-against-measured plot."""

from __future__ import annotations

from typing import Optional

from ledger.storage.dry_runs import load_dry_runs
from ledger.core.models import Ledger
from ledger.core.results import Scoreboard
from ledger.report.dry_board import full_board, moe_board, world_board
from ledger.report.held_out import shared_predictor
from ledger.report.scoreboard import _sort_key, scoreboard
from .views import ROW_LIMIT, Plot, PlotPoint, PlotSeries


def estimator_scoreboard(ledger: Ledger) -> Scoreboard:
    """How every VRAM estimator fares against the ledger's measured peaks."""
    dry_runs = load_dry_runs()
    board = scoreboard(ledger, keep_rows=ROW_LIMIT, dry_runs=dry_runs)
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
    p = shared_predictor(ledger, dry_runs)
    moe, full = moe_board(p), full_board(p)
    board["moe"] = moe if moe["recipes"] else None
    board["full"] = full if full["recipes"] else None
    board["world"] = world_board(p, dry_runs)
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

"""The dry run's depth extrapolation on a sample of the fit grid: its figures against the committed
rows that ran every layer, and what the whole grid's regeneration costs with it.

    python benchmarks/dry_depth.py [--every 10] [--offset 0] [--sweep sweeps/fit-grid.toml]

Every ``--every``-th point of the grid (from ``--offset``) is run as the sweep runs it
(``probe_kit.run_sweep.run_dry_point``: the dry run with its depth extrapolated from short stacks
of the model's layers, ``probe_kit.depth``; the rows appended together every 30 s, as the sweep
appends them) into a temporary copy of ``ledger/dry-runs.json`` (an append costs what it costs on
the real file). Printed per point: how
the depth was run, the signed % difference of after load, pre-step and peak allocated from the
committed row where that row ran every layer, and the seconds. Then the largest |difference|,
how many peaks came out below the full run, and the whole grid's regeneration projected from the
sample (its seconds, appends included, x every, on one core and on two shards), beside the
committed rows' recorded seconds for the same points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ledger.storage import store  # noqa: E402
from ledger.storage.dry_runs import load_dry_runs  # noqa: E402
from ledger.core.paths import DRY_RUNS  # noqa: E402


def breakdown(m) -> dict:
    for note in m.provenance.notes:
        if "Breakdown: " in note:
            return json.loads(note.split("Breakdown: ", 1)[1])
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--sweep", default=str(REPO / "sweeps" / "fit-grid.toml"))
    args = ap.parse_args()
    from probe_kit.run_sweep import DryRows, load_sweep, run_dry_point

    sweep = load_sweep(args.sweep)
    sample = sweep.points[args.offset::args.every]
    committed = {d.id: d for d in load_dry_runs(DRY_RUNS)}
    diffs, below, spent, recorded, seen = [], 0, 0.0, 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        ledger = str(Path(tmp) / "dry-runs.json")  # the grid's rows less the sample's: each appended anew
        grid = store.load(DRY_RUNS)
        grid.measurements = [m for m in grid.measurements if m.id not in {p.id for p in sample}]
        store.save(grid, ledger)
        statuses = {}
        rows = DryRows(ledger)  # appended as the sweep appends them: together, every 30 s
        for point in sample:
            t = time.perf_counter()
            statuses[point.id] = run_dry_point(point, sweep, ledger, rows).status
            spent += time.perf_counter() - t
        t = time.perf_counter()
        rows.flush()
        spent += time.perf_counter() - t
        rows = {m.id: m for m in load_dry_runs(ledger)}
    for point in sample:
        row, old = rows.get(point.id), committed.get(point.id)
        if row is None or row is old or row.outcome.status != "ok":
            print(f"{point.config.label()}: {statuses[point.id]}", flush=True)
            continue
        b = breakdown(row)
        depth = b.get("depth", {})
        how = (f"{depth['layers']} layers from stacks of {depth['from_layers']}"
               if depth.get("method") == "extrapolated" else "every layer")
        line = f"{point.config.label()}: {how}, {b.get('seconds', 0):.1f} s"
        if old is not None and old.outcome.status == "ok" and "depth" not in breakdown(old):
            d = [(getattr(row.outcome, k) - getattr(old.outcome, k)) / getattr(old.outcome, k) * 100
                 for k in ("after_load_mib", "pre_step_mib", "peak_allocated_mib")]
            diffs.append(max(abs(x) for x in d))
            below += d[2] < -0.005
            recorded += breakdown(old).get("seconds", 0.0)
            seen += 1
            line += (f"; against the full run: after load {d[0]:+.4f}%, pre-step {d[1]:+.4f}%, peak {d[2]:+.4f}% "
                     f"({row.outcome.peak_allocated_mib} vs {old.outcome.peak_allocated_mib} MiB; it took "
                     f"{breakdown(old).get('seconds', 0):.1f} s)")
        print(line)
    whole = spent * len(sweep.points) / len(sample)
    print(f"{len(sample)} of {len(sweep.points)} grid points: {spent:.0f} s with appends; the whole grid projected "
          f"{whole / 60:.1f} min on one core, {whole / 120:.1f} min on two shards (target <= 60)")
    if diffs:
        print(f"{seen} against committed rows that ran every layer: largest |difference| {max(diffs):.4f}%, median "
              f"{statistics.median(diffs):.4f}%; peaks below the full run by more than 0.005%: {below}; their full "
              f"runs had taken {recorded:.0f} s of dry-run time")


if __name__ == "__main__":
    main()

"""The one predictor (ledger.answer.predictor) against the bundled ledger, leave-one-out, and its targets.

    python benchmarks/predictor_targets.py [--ledger PATH] [--dry-runs PATH] [--cli N]

Nothing here is tuned to a held-out row: every figure is predicted by a predictor fitted without
the row it is scored on.

- Fit verdicts: each ok/oom probe, held out, answered fits / tight / won't fit / unknown. Printed:
  decisive verdicts correct (target >= 97%), the costly cell ("fits" for a probe that ran out of
  memory; target 0), and how many were hedged (tight) or unknown. The estimator page's
  vram-ledger row uses the same verdict: its costly cell is printed too.
- Real runs: each ok real run, held out, predicted (a) from its probe figure and the calibration
  alone (the probe's core, less the kept logits, x (1 - the over-estimate); target: median
  |error| <= 1.0%) and (b) by the whole ladder, as `vram predict` answers. The pairs'
  over-estimate on the raw probe peak is printed beside it, for comparison.
- The dry run as the command line applies it: the committed dry-run rows plus the remainder fitted
  without the row, on the row's card (`--gpu`) and on all cards (no flags beyond the recipe):
  median |error| (target <= 2%) and the worst row (target <= 5%). ``--cli N`` also runs
  `python -m probe_kit.dry_run` afresh for the first N rows and checks it prints the same figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ledger.storage import store  # noqa: E402
from ledger.report.calibration_report import loo  # noqa: E402
from ledger.report.scoreboard import scoreboard  # noqa: E402
from ledger.core.paths import DEFAULT_LEDGER, DRY_RUNS  # noqa: E402
from ledger.storage.dry_runs import load_dry_runs  # noqa: E402
from ledger.answer.predictor import Predictor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ledger", default=str(DEFAULT_LEDGER))
    ap.add_argument("--dry-runs", default=str(DRY_RUNS))
    ap.add_argument("--cli", type=int, default=0, metavar="N", help="rerun the dry-run CLI for N rows")
    args = ap.parse_args()
    lg = store.load(args.ledger)
    dry = load_dry_runs(args.dry_runs)

    v = loo(lg, lg.measurements, dry)
    pct = v["verdict_pct"]
    print(f"fit verdicts (leave-one-out, {len(v['verdicts'])} probes): {v['verdict_correct']}/{v['verdict_total']} "
          f"decisive correct = {pct}% (target >= 97%: {'met' if pct is not None and pct >= 97 else 'NOT met'}); "
          f"costly 'fits' for an OOM: {v['verdict_costly']} (target 0: {'met' if v['verdict_costly'] == 0 else 'NOT met'}); "
          f"tight {v['verdict_tight']}, unknown {v['verdict_unaddressed']}")
    for r in v["verdicts"]:
        if r["verdict"] != ("fits" if r["fits_actual"] else "won't fit"):
            print(f"  {r['id']}: {r['verdict']} ({r['method']}, {r['predicted_mib']} MiB, top {r['high_mib']} MiB, "
                  f"limit {r['limit'][0]}–{r['limit'][1]} MiB); it {'fit' if r['fits_actual'] else 'ran out of memory'}")
    board = scoreboard(lg, dry_runs=dry)
    for e in board["estimators"]:
        c = e.get("confusion") or {}
        print(f"estimator page, {e['name']}: 'fits' for a row that ran out of memory: {c.get('fits_but_oom')}; "
              f"median |error| {e.get('median_abs_err_pct')}% over {e.get('n')} rows")

    full = Predictor(lg, dry)
    print("probe/real pairs: over-estimate on the raw probe peak -> on the probe's core (less its kept logits)")
    for pr in full.over.pairs:
        print(f"  {pr.probe} ({pr.probe_mib} MiB, {pr.kept_positions} kept positions = {pr.logits_mib} MiB of fp32 "
              f"logits) vs {pr.real_mib} MiB real: {pr.raw_overestimate_pct}% -> {pr.overestimate_pct}%")
    raw = [pr.raw_overestimate_pct for pr in full.over.pairs]
    print(f"  spread: raw {min(raw)}–{max(raw)}%, core {full.over.low_pct}–{full.over.high_pct}%")
    probe_errs, ladder_errs = [], []
    print("real runs (held out): id, measured, probe x calibration, ladder (method)")
    for m in lg.measurements:
        if m.kind != "real" or m.outcome.status != "ok" or m.outcome.peak_allocated_mib is None:
            continue
        recipe = full.fit.recipe_for(m)
        if recipe is None or recipe.seq_len is None:
            continue
        p = Predictor(lg, dry, exclude=[m.id])
        probe, _, _, evidence = p.probe_figure(recipe, m.gpu, None)
        actual = m.outcome.peak_allocated_mib
        from_probe = (p.probe_to_real(probe, recipe, evidence)[0].mib if probe and probe.mib and p.over.pct is not None
                      else None)
        a = p.predict(recipe, m.gpu, run="real")
        ladder = a.real_allocated.mib if a.real_allocated else None
        e1 = None if from_probe is None else (from_probe - actual) / actual * 100
        e2 = None if ladder is None else (ladder - actual) / actual * 100
        if e1 is not None:
            probe_errs.append(abs(e1))
        if e2 is not None:
            ladder_errs.append(abs(e2))
        print(f"  {m.id}: {actual} MiB; {from_probe and round(from_probe, 1)} ({e1 and round(e1, 2)}%); "
              f"{ladder} ({e2 and round(e2, 2)}%, {a.method})")
    med1 = statistics.median(probe_errs) if probe_errs else None
    med2 = statistics.median(ladder_errs) if ladder_errs else None
    print(f"real runs: probe x calibration median |error| {med1:.2f}% over {len(probe_errs)} "
          f"(target <= 1.0%: {'met' if med1 is not None and med1 <= 1.0 else 'NOT met'}); the whole ladder "
          f"(as vram predict answers) {med2:.2f}% over {len(ladder_errs)}")

    card = full.dry_loo
    rows_all = []
    for m, peak, d in full.dry_cal.pairs:
        others = [pp - dd for mm, pp, dd in full.dry_cal.pairs if mm.id != m.id]
        pred = d + statistics.median(others)
        rows_all.append((m.id, peak, pred, (pred - peak) / peak * 100))
    errs_all = [abs(e) for *_, e in rows_all]
    med_all, worst_all = statistics.median(errs_all), max(errs_all)
    print(f"dry run with --gpu (card's remainder, leave-one-out): median |error| {card['median_abs_err_pct']}%, "
          f"worst {card['max_abs_err_pct']}% over {card['n']} probes")
    print(f"dry run with no flags beyond the recipe (all cards' remainder, leave-one-out): median |error| "
          f"{med_all:.2f}% (target <= 2%: {'met' if med_all <= 2 else 'NOT met'}), worst {worst_all:.2f}% "
          f"(target <= 5%: {'met' if worst_all <= 5 else 'NOT met'}) over {len(rows_all)} probes")
    for mid, peak, pred, err in rows_all[: args.cli]:
        m = next(x for x in lg.measurements if x.id == mid)
        cmd = [sys.executable, "-m", "probe_kit.dry_run", "--model", "gemma-3-4b-it", "--rank", str(m.lora.rank),
               "--seq-len", str(m.seq_len), "--response-len", str(m.response_len), "--quant", m.quant,
               "--fixes", m.memory_fixes or "all", "--json"] + (["--dropout", str(m.lora.dropout)] if m.lora.dropout
                                                               else []) + (["--dora"] if m.lora.dora else [])
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        cli = json.loads(out.stdout)["answer"]["probe_allocated"]["mib"]
        print(f"  CLI {mid}: {cli} MiB (measured {peak}; full-ledger remainder, so it may differ from the held-out "
              f"{pred:.1f} by the row's own share)")


if __name__ == "__main__":
    main()

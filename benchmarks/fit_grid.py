"""The fit table's grid: what it cost, how good its interpolations are, and whether it agrees with
the ledger's measured probes.

    python benchmarks/fit_grid.py [--dry-runs PATH]

1. Cost: the committed grid rows (sweeps/fit-grid.toml), their count, and the sum of their dry-run
   step times as recorded in each row (one core), and that over two cores (two shards).
2. Interpolation: each held-out point of sweeps/make_fit_grid.py (computed directly) is predicted
   from the other rows the way the table predicts it (affine in rank, slope linear in length,
   dropout / DoRA cost interpolated in length); printed: signed % error of each, median and worst.
3. Agreement: every measured ok / oom probe of gemma-3-4b-it on the RTX 3070 Ti and the RX 7900 XTX
   is judged by the calibrated dry run alone (the remainder fitted without the probe) against the
   card's limit: fits / tight / won't fit vs what happened; every disagreement is listed.
4. Coverage: models x cards x quants x fixes x lengths with an answer, with gradient checkpointing
   and (stock) without.
5. The grid alone: the rows a regeneration of sweeps/fit-grid.toml writes (committed rows of
   points the grid no longer computes left out: rank 8 of the stock recipe between 2,048 tokens and
   a full-attention model's longest, which the table interpolates), their coverage, and every cell
   whose largest fitting rank differs from the table of all committed rows (lower: the derived
   figure's wider interval; higher would be a derivation that under-estimates).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "sweeps"))

from ledger.storage import store  # noqa: E402
from ledger.answer.fits import GRID_MODELS, cards, fit_table, grid_points  # noqa: E402
from ledger.core.paths import DEFAULT_LEDGER, DRY_RUNS  # noqa: E402
from ledger.storage.dry_runs import load_dry_runs  # noqa: E402
from ledger.vocab.model_configs import model_name  # noqa: E402
from ledger.answer.predictor import Predictor  # noqa: E402
from ledger.vocab.recipe import Recipe, recipe_of  # noqa: E402
from make_fit_grid import held_out  # noqa: E402


def seconds(m) -> float:
    for note in m.provenance.notes:
        if "Breakdown: " in note:
            return json.loads(note.split("Breakdown: ", 1)[1]).get("seconds", 0.0)
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-runs", default=str(DRY_RUNS))
    args = ap.parse_args()
    lg = store.load(DEFAULT_LEDGER)
    dry = load_dry_runs(args.dry_runs)
    grid = [d for d in dry if "fit-grid" in (d.provenance.source or "")]
    ok = [d for d in grid if d.outcome.status == "ok"]
    total = sum(seconds(d) for d in grid)
    print(f"cost: {len(grid)} grid rows ({len(ok)} ok, {len(grid) - len(ok)} not), {len(GRID_MODELS)} models; "
          f"dry-run step time as recorded {total / 60:.1f} min on one core, ~{total / 120:.1f} min on two (rows "
          f"computed before the depth was extrapolated ran every layer: benchmarks/dry_depth.py projects a "
          f"regeneration as this version runs it)")

    errs = []
    for point in held_out():
        recipe = Recipe(model=point["model"], rank=point["rank"], quant=point["quant"],
                        dropout=point.get("dropout", 0) > 0, dora=point.get("dora", False), seq_len=point["seq_len"],
                        fixes=point["fixes"], response_len=point["response_len"],
                        checkpointing=not point.get("no_gradient_checkpointing"))
        direct = [d for d in dry if recipe_of(d) == recipe]
        if not direct:
            print(f"  held-out {recipe.describe()}: not computed yet")
            continue
        p = Predictor(lg, [d for d in dry if d.id != direct[0].id])
        pred, _ = p.dry_raw(recipe)
        actual = direct[0].outcome.peak_allocated_mib
        if pred is None:
            print(f"  held-out {recipe.describe()}: the table cannot derive it")
            continue
        err = (pred - actual) / actual * 100
        errs.append(err)
        print(f"  held-out {recipe.describe()}: direct {actual:.1f} MiB, derived {pred:.1f} MiB ({err:+.2f}%)")
    if errs:
        print(f"interpolation: median |error| {statistics.median(abs(e) for e in errs):.2f}%, worst "
              f"{max(errs, key=abs):+.2f}% over {len(errs)} held-out points")

    disagree, agree = [], 0
    for m in lg.measurements:
        if (m.kind != "probe" or m.gpu not in ("rtx-3070-ti", "rx-7900-xtx") or m.lora is None
                or model_name(m.model) != "gemma-3-4b-it" or m.outcome.status not in ("ok", "oom", "spilled")):
            continue
        r = recipe_of(m)
        p = Predictor(lg, dry, exclude=[m.id])
        raw, _ = p.dry_raw(r)
        if raw is None:
            print(f"  {m.id}: no dry run of this recipe")
            continue
        a = p.judge_dry(r, raw, m.gpu)
        fit = m.outcome.status == "ok"
        good = (a.verdict == "fits" and fit) or (a.verdict == "won't fit" and not fit) or a.verdict == "tight"
        if good:
            agree += 1
        else:
            disagree.append(m.id)
        if not good or a.verdict == "tight":
            print(f"  {m.id}: measured {m.outcome.status} ({m.outcome.peak_allocated_mib} MiB), dry run "
                  f"{a.probe_allocated.mib} MiB -> {a.verdict} (limit {a.limit_low_mib}–{a.limit_high_mib} MiB)")
    print(f"agreement with measured probes of gemma-3-4b-it on the RTX 3070 Ti and RX 7900 XTX: {agree} agree "
          f"(tight counts as agreeing: it never says fits), {len(disagree)} disagree: {', '.join(disagree) or 'none'}")

    t = time.perf_counter()
    p = Predictor(lg, dry)
    cells = fit_table(p, gpus=list(cards(p)))  # every card, as the site's whole fit table has them
    answered = [c for c in cells if c.status != "unknown"]
    print(f"coverage: {len({c.model for c in answered})} models x {len({c.gpu for c in answered})} cards x "
          f"{len({c.quant for c in answered})} quants x {len({c.fixes for c in answered})} fixes x "
          f"{len({c.seq_len for c in answered})} lengths; {len(answered)} of {len(cells)} cells answered; the table "
          f"computed in {time.perf_counter() - t:.1f} s (no torch)")
    t = time.perf_counter()
    p = Predictor(lg, dry)
    cells = fit_table(p, gpus=list(cards(p)), checkpointing=False)
    answered = [c for c in cells if c.status != "unknown"]
    print(f"without gradient checkpointing (stock): {len({c.model for c in answered})} models; {len(answered)} of "
          f"{len(cells)} cells answered, in {time.perf_counter() - t:.1f} s")
    grid_alone(lg, dry)


def point_recipe(point: dict) -> Recipe:
    return Recipe(model=point["model"], rank=point["rank"], quant=point["quant"], dropout=point.get("dropout", 0) > 0,
                  dora=point.get("dora", False), seq_len=point["seq_len"], fixes=point["fixes"],
                  response_len=point["response_len"], checkpointing=not point.get("no_gradient_checkpointing"))


def grid_alone(lg, dry) -> None:
    """The table from the rows a regeneration of the grid writes, against the table of every row."""
    points = {point_recipe(p) for m in GRID_MODELS for ck in (True, False) for p in grid_points(m, checkpointing=ck)}
    points |= {point_recipe(p) for p in held_out()}
    grid = [d for d in dry if "fit-grid" not in (d.provenance.source or "") or recipe_of(d) in points]
    extra = [d for d in dry if d not in grid]
    print(f"the grid alone: {len(points)} points; {len(extra)} committed rows of points it no longer computes "
          f"(derived in its table)")
    for ck in (True, False):
        full = {(c.model, c.gpu, c.quant, c.fixes, c.setting, c.seq_len): c
                for c in fit_table(Predictor(lg, dry), gpus=list(cards(Predictor(lg, dry))), checkpointing=ck)}
        alone = fit_table(Predictor(lg, grid), gpus=list(cards(Predictor(lg, grid))), checkpointing=ck)
        answered = [c for c in alone if c.status != "unknown"]
        lower = higher = 0
        for c in alone:
            f = full[(c.model, c.gpu, c.quant, c.fixes, c.setting, c.seq_len)]
            if (c.fits_rank or 0) < (f.fits_rank or 0):
                lower += 1
            elif (c.fits_rank or 0) > (f.fits_rank or 0):
                higher += 1
                print(f"  higher: {c.model} {c.quant} {c.fixes} {c.setting} {c.seq_len} on {c.gpu}: "
                      f"{c.label()} vs {f.label()}")
        print(f"  checkpointing {'on' if ck else 'off'}: {len(answered)} of {len(alone)} cells answered; largest "
              f"fitting rank lower in {lower}, higher in {higher} (of {len(alone)})")


if __name__ == "__main__":
    main()

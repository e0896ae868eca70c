"""Sweep costs on the CPU with the tiny Llama.

    python benchmarks/sweep_bench.py [--ranks 4,8,16,32,64,128,256,512]

1. Isolation: a sweep over the ranks runs each probe in a fresh process; its wall time is printed
   against the sum of the probes' step times (what the probes themselves measured).
2. Ceiling: with a budget between two ranks' peaks (the tracker meter raises an OOM above it),
   --find-ceiling's probe count against the full grid's, by plain bisection and confirm-first
   from the ceiling the dry run predicts (two ranks dry-run, affine in rank, under the budget).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from ledger.storage import store
from probe_kit import run_sweep
from probe_kit.probe_vram import run_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8,16,32,64,128,256,512")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        sweep_file = Path(tmp, "s.toml")
        sweep_file.write_text(
            '[sweep]\nname = "bench"\ndevice = "cpu"\ntimeout_s = 600\n'
            '[base]\nmodel = "tiny-llama"\nrandom_weights = true\nseq_len = 1024\nresponse_len = 32\n'
            f"[axes]\nrank = {ranks}\n"
        )
        ledger = Path(tmp, "full.json")
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            run_sweep.main([str(sweep_file), "--ledger", str(ledger), "--no-progress"])
        wall = time.perf_counter() - t0
        ms = store.load(ledger).measurements
        steps = sum(m.outcome.step_s or 0 for m in ms)
        print(f"isolation: {len(ms)} probes, sweep wall {wall:.1f} s, sum of step times {steps:.2f} s, "
              f"ratio {wall / steps:.0f}x, {wall / len(ms):.1f} s per probe")

        sweep = run_sweep.load_sweep(str(sweep_file))
        with contextlib.redirect_stdout(sys.stderr):
            peaks = {p.config.rank: run_probe(p.config, device="cpu")[0].outcome.peak_allocated_mib
                     for p in sweep.points}
        mid = ranks[len(ranks) // 2 - 1]
        nxt = ranks[len(ranks) // 2]
        budget = (peaks[mid] + peaks[nxt]) / 2
        from probe_kit.dry_run import dry_run

        with contextlib.redirect_stdout(sys.stderr):
            d = {r: dry_run(run_sweep.replace(sweep.points[0].config, rank=r))["peak_mib"] for r in (ranks[0], ranks[-1])}
        slope = (d[ranks[-1]] - d[ranks[0]]) / (ranks[-1] - ranks[0])
        predicted = max([r for r in ranks if d[ranks[0]] + slope * (r - ranks[0]) <= budget], default=ranks[0])
        real = run_sweep.probe_command
        run_sweep.probe_command = lambda p, s, l: real(p, s, l) + ["--budget-mib", str(budget)]
        results = {}
        try:
            for label, extra in (("bisection", []), ("confirm-first", ["--start-rank", str(predicted)])):
                out = io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                    run_sweep.main([str(sweep_file), "--ledger", str(Path(tmp, f"{label}.json")), "--find-ceiling",
                                    "rank", "--no-progress", *extra])
                results[label] = re.search(r"ceiling: rank (\S+) .*\((\d+) probes", out.getvalue())
        finally:
            run_sweep.probe_command = real
        b, c = results["bisection"], results["confirm-first"]
        print(f"ceiling: rank {b[1]} (budget {budget:.1f} MiB): plain bisection {b[2]} probes (promised at most "
              f"{math.ceil(math.log2(len(ranks))) + 1}); confirm-first from the dry run's predicted rank {predicted}: "
              f"rank {c[1]} in {c[2]} probes; the full grid: {len(ranks)} probes. Ratios: grid/confirm-first "
              f"{len(ranks) / int(c[2]):.1f}x, bisection/confirm-first {int(b[2]) / int(c[2]):.1f}x")


if __name__ == "__main__":
    main()

"""Sweep costs on the CPU with the tiny Llama, and the fit grid's dry runs on Ray.

    python benchmarks/sweep_bench.py [--ranks 4,8,16,32,64,128,256,512]
    python benchmarks/sweep_bench.py --ray [--points 20] [--model qwen2.5-0.5b] [--json]

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


def _warm() -> str:
    """A Ray task that brings a worker to where a sweep's worker is after its first point: the
    libraries imported and one tiny dry run done (what a long sweep pays once per worker)."""
    import contextlib as cl
    import io as _io
    import os as _os

    from probe_kit.dry_run import predict
    from probe_kit.recipe import ProbeConfig

    with cl.redirect_stdout(_io.StringIO()), cl.redirect_stderr(_io.StringIO()):
        predict(ProbeConfig(model="tiny-llama", rank=4, seq_len=64, response_len=8, random_weights=True))
    return str(_os.getpid())


def ray_bench(points: int, model: str, as_json: bool) -> None:
    """3. Ray: a sample of the fit grid's dry runs (its first ``points`` of ``model``) in this
    process as the plain sweep runs them, then as Ray tasks on a local instance of 1 and of 2
    CPUs, each worker warmed first. Prints each rate, 2 workers over 1 (the target: >= 1.7x, the
    CPU bound of this 2-core machine), Ray's own cost per point (1 worker's wall less the plain
    sweep's, per point; the target: <= 0.5 s), and the whole grid's regeneration time on N
    workers, from the seconds the shipped rows recorded and the measured efficiency."""
    import json
    import os

    import ray

    from ledger.core.paths import DRY_RUNS
    from probe_kit.cluster import Cluster

    grid = run_sweep.load_sweep(str(Path(__file__).resolve().parent.parent / "sweeps" / "fit-grid.toml"))
    sample = [p for p in grid.points if p.config.model == model][:points + 1]
    if len(sample) < points + 1:
        raise SystemExit(f"sweep_bench: the grid has {len(sample)} points of {model}; ask for fewer")
    warm, sample = sample[0], sample[1:]
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_sweep.DryRows(str(Path(tmp, "rows.json")), every_s=1e9)  # kept, not written: not timed
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run_sweep.run_dry_point(warm, grid, "", rows)
            t0 = time.perf_counter()
            plain = [run_sweep.run_dry_point(p, grid, "", rows) for p in sample]
            walls["plain"] = time.perf_counter() - t0
        for k in (1, 2):
            cluster = Cluster(cpus=k).connect()
            try:
                warm_task = ray.remote(num_cpus=1)(_warm)
                ray.get([warm_task.remote() for _ in range(k)])
                got: list = []
                t0 = time.perf_counter()
                run_sweep.run_on_cluster(cluster, sample, grid, rows, lambda p, r: got.append(r))
                walls[f"ray{k}"] = time.perf_counter() - t0
            finally:
                cluster.close()
            bad = [r for r in got if r.status != "ok"]
            if len(got) != len(sample) or bad:
                raise SystemExit(f"sweep_bench: {len(bad)} of the Ray run's points were not ok: {bad[:1]}")
    n = len(sample)
    speedup = walls["ray1"] / walls["ray2"]
    overhead = (walls["ray1"] - walls["plain"]) / n
    efficiency = speedup / 2
    recorded: dict[str, float] = {}
    for m in json.loads(Path(DRY_RUNS).read_text(encoding="utf-8"))["measurements"]:
        for note in m["provenance"].get("notes", []):
            if "Breakdown: " in note:
                recorded[m["id"]] = json.loads(note.split("Breakdown: ", 1)[1]).get("seconds") or 0.0
    per_point_here = sum(r.seconds for r in plain) / n
    # The rows' seconds were recorded by the machines and versions that computed them: scaled by
    # this machine's time over theirs on the sample's own rows.
    then = sum(recorded.get(p.id, 0.0) for p in sample)
    scale = sum(r.seconds for r in plain) / then if then else 1.0
    total = sum(recorded.values()) * scale
    regen = {w: (total + max(overhead, 0.0) * len(recorded)) / (w * (efficiency if w > 1 else 1.0))
             for w in (1, 2, 8, 32, 128)}
    out = {"points": n, "model": model, "cpus_here": os.cpu_count(), "plain_s": round(walls["plain"], 2),
           "ray1_s": round(walls["ray1"], 2), "ray2_s": round(walls["ray2"], 2),
           "rate_plain_per_min": round(60 * n / walls["plain"], 2), "rate_ray1_per_min": round(60 * n / walls["ray1"], 2),
           "rate_ray2_per_min": round(60 * n / walls["ray2"], 2), "ray2_over_ray1": round(speedup, 3),
           "ray_overhead_s_per_point": round(overhead, 3), "dry_run_s_per_point_here": round(per_point_here, 2),
           "grid_rows": len(recorded), "grid_recorded_cpu_s": round(sum(recorded.values()), 1),
           "here_over_recorded": round(scale, 3), "grid_cpu_s_here": round(total, 1),
           "grid_regeneration_h": {str(w): round(v / 3600, 2) for w, v in regen.items()}}
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"ray: {n} dry runs of the fit grid's {model} points ({per_point_here:.2f} s each in this process)")
    print(f"  plain sweep, one process: {walls['plain']:.1f} s ({out['rate_plain_per_min']} points/min)")
    print(f"  Ray, 1 worker: {walls['ray1']:.1f} s ({out['rate_ray1_per_min']} points/min); 2 workers: "
          f"{walls['ray2']:.1f} s ({out['rate_ray2_per_min']} points/min)")
    print(f"  2 workers / 1 worker: {speedup:.2f}x (target >= 1.7x on this {os.cpu_count()}-core machine)")
    print(f"  Ray's own cost per point: {overhead:+.3f} s (1 worker's wall less the plain sweep's, per point; "
          "target <= 0.5 s)")
    print(f"  the whole grid ({len(recorded)} rows; {sum(recorded.values()) / 3600:.2f} h of CPU as its rows recorded, "
          f"{total / 3600:.2f} h at this machine's speed on the sample, {scale:.2f}x), regenerated on "
          f"N workers at the measured efficiency {efficiency:.2f}: "
          + ", ".join(f"{w}: {v / 3600:.2f} h" for w, v in regen.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8,16,32,64,128,256,512")
    ap.add_argument("--ray", action="store_true", help="the fit grid's dry runs on Ray instead (section 3)")
    ap.add_argument("--points", type=int, default=20, help="with --ray: dry runs in the sample")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="with --ray: the grid model the sample is of")
    ap.add_argument("--json", action="store_true", help="with --ray: the figures as JSON")
    args = ap.parse_args()
    if args.ray:
        ray_bench(args.points, args.model, args.json)
        return
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

"""Site build cost across ledger sizes and shapes, with each stage's share, so a cliff anywhere shows.

    python benchmarks/build_bench.py [--sizes 100,200,400,1000,5000,10000,20000,100000] [--kinds synthetic,realistic]
                                     [--repeat N] [--rebuild]

Ledgers: *synthetic* (``synthetic.synthetic_ledger``: three cards, one model, random ranks, lengths,
dropout and DoRA) and *realistic* (``synthetic.realistic_ledger``: the bundled ledger's rows and
clones of them with new ids, what a user's ledger looks like after a few sweeps of the same
recipes). The bundled ledger is built first as the reference.

For each ledger: the build (``render_site``: the context, every page, vram.json, the CSVs, the
plots; the calibration, scoreboard and fit table in two worker processes) is run once (or
``--repeat`` times, the run with the least CPU shown: this machine's speed swings) and timed in
wall seconds and in CPU seconds of this process and its workers together; the floor is json.dumps
of the same ledger. Printed: rows, floor, wall, CPU, CPU / floor, CPU / the bundled build's CPU, and
each stage's CPU share (the workers' stages in their own process, so shares add up to more than
the wall time). Targets (issue "the build at scale"): the bundled build <= 3 s of CPU; a realistic
200- and 1,000-row ledger <= 2x the bundled build; 100k rows <= 10x the floor; 10k -> 100k growth
<= 12x.

``--rebuild`` also times what a deploy does after each sweep: the ledger built once without its
last 1% of rows, then built again, whole and with one row's peak changed, into the same folder
(the earlier build's vram.json is the previous publication: changes.json and feed.xml list the
rows added and the one changed). Printed as ``<kind>+re``; its floor is the whole ledger's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from synthetic import realistic_ledger, synthetic_ledger  # noqa: E402

from ledger.storage import store  # noqa: E402
from ledger.core.paths import DEFAULT_LEDGER  # noqa: E402
from ledger.site.render import render_site  # noqa: E402


def cpu() -> float:
    """CPU seconds of this process and of its children that have ended (the build's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def rebuild_once(path: Path, out: Path) -> dict:
    """A deploy's build after a sweep (``--rebuild``): the ledger less its last 1% of rows built
    into ``out``, then the whole ledger, one row's peak changed, built into the same folder."""
    whole = store.load(path)
    rows = whole.measurements
    k = max(1, len(rows) // 100)
    store.save(whole.model_copy(update={"measurements": rows[:-k]}), path)
    render_site(store.load(path), out)
    changed = next((i for i, m in enumerate(rows) if m.outcome.peak_allocated_mib), None)
    if changed is not None:
        m = rows[changed]
        rows = [*rows[:changed], m.model_copy(update={"outcome": m.outcome.model_copy(
            update={"peak_allocated_mib": m.outcome.peak_allocated_mib + 1.0})}), *rows[changed + 1:]]
    store.save(whole.model_copy(update={"measurements": rows}), path)
    data = json.loads(path.read_text())
    floor = time.perf_counter()
    json.dumps(data)
    floor = time.perf_counter() - floor
    c0, w0 = cpu(), time.perf_counter()
    result = render_site(store.load(path), out)
    return {"floor": floor, "wall": time.perf_counter() - w0, "cpu": cpu() - c0, "stages": result.stages,
            "mib": sum(result.files.values()) / 2**20}


def build_once(path: Path, out: Path, repeat: int = 1) -> dict:
    """The build's figures (the run with the least CPU of ``repeat``: this machine's speed swings
    some 20% run to run), with the json.dumps floor (its fastest of as many)."""
    data = json.loads(path.read_text())
    floors, runs = [], []
    for i in range(repeat):
        t0 = time.perf_counter()
        json.dumps(data)
        floors.append(time.perf_counter() - t0)
        c0, w0 = cpu(), time.perf_counter()
        result = render_site(store.load(path), Path(f"{out}-{i}"))
        runs.append({"wall": time.perf_counter() - w0, "cpu": cpu() - c0, "stages": result.stages,
                     "mib": sum(result.files.values()) / 2**20})
    return {"floor": min(floors), **min(runs, key=lambda r: r["cpu"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,200,400,1000,5000,10000,20000,100000")
    ap.add_argument("--kinds", default="synthetic,realistic")
    ap.add_argument("--repeat", type=int, default=1, help="builds per ledger; the one with the least CPU is shown")
    ap.add_argument("--rebuild", action="store_true",
                    help="also time a deploy's build after a sweep (1%% more rows, one changed; the previous build in the folder)")
    args = ap.parse_args()
    make = {"synthetic": synthetic_ledger, "realistic": realistic_ledger}
    with tempfile.TemporaryDirectory() as tmp:
        ref = build_once(DEFAULT_LEDGER, Path(tmp, "site-bundled"), args.repeat)
        bundled_rows = len(store.load(DEFAULT_LEDGER).measurements)
        header = f"{'ledger':>10} {'rows':>7} {'floor s':>8} {'wall s':>7} {'CPU s':>7} {'/floor':>8} {'/bundled':>8}  stages (CPU s)"
        print(header)

        def line(kind: str, n: int, r: dict) -> None:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["stages"].items(), key=lambda kv: -kv[1]) if v >= 0.01)
            print(f"{kind:>10} {n:>7} {r['floor']:>8.3f} {r['wall']:>7.2f} {r['cpu']:>7.2f} {r['cpu'] / r['floor']:>8.1f} "
                  f"{r['cpu'] / ref['cpu']:>8.2f}  {stages}", flush=True)

        line("bundled", bundled_rows, ref)
        print(f"target: the bundled build <= 3 s of CPU: {'met' if ref['cpu'] <= 3 else 'NOT met'} ({ref['cpu']:.2f} s)")
        cpus: dict[tuple[str, int], float] = {}
        for kind in args.kinds.split(","):
            for n in map(int, args.sizes.split(",")):
                path = Path(tmp, f"{kind}-{n}.json")
                store.save(make[kind](n), path)
                r = build_once(path, Path(tmp, f"site-{kind}-{n}"), args.repeat)
                cpus[(kind, n)] = r["cpu"]
                line(kind, n, r)
                if n == 100000:
                    print(f"{'':>10} target <= 10x the floor at 100k: {'met' if r['cpu'] / r['floor'] <= 10 else 'NOT met'}")
                if args.rebuild:
                    line(f"{kind[:7]}+re", n, rebuild_once(path, Path(tmp, f"site-{kind}-{n}-re")))
                os.remove(path)
            if (kind, 10000) in cpus and (kind, 100000) in cpus:
                g = cpus[(kind, 100000)] / cpus[(kind, 10000)]
                print(f"{kind}: growth 10k -> 100k {g:.1f}x (target <= 12x: {'met' if g <= 12 else 'NOT met'})")
            for n in (200, 1000):
                if kind == "realistic" and (kind, n) in cpus:
                    ratio = cpus[(kind, n)] / ref["cpu"]
                    print(f"realistic {n}: {ratio:.2f}x the bundled build (target <= 2x: {'met' if ratio <= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()

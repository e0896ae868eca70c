"""Ledger I/O cost: load + validate + save, as a ratio to plain json.loads + json.dumps.

    python benchmarks/ledger_bench.py [--sizes 1000,10000,100000] [--repeat 3]

For each size: a synthetic ledger is written once; then the best of --repeat runs of
  floor : json.loads(text) + json.dumps(data, indent=2)          (no validation)
  ledger: store.load(path) (pydantic + cross-references) + store.save(ledger, path2)
  check : store.validate_file(path) (the compiled JSON Schema check + pydantic + references)
  append: store.append(path, [one new measurement]) (what a probe, a sweep point or the callback
          does: locked load, the change, one re-validation, one atomic write)
is printed, with ledger/floor, check/floor and append/ledger ratios. Targets (issue "the build at
scale"): load+save <= 1.1x the floor, validate <= 2x the floor at 20k and 100k, one append <= 1.3x
load+save at 100k.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import synthetic_ledger  # noqa: E402

from ledger.storage import store  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the jsonschema column (slow at 100k)")
    args = ap.parse_args()
    print(f"{'rows':>8} {'MiB':>7} {'floor s':>8} {'ledger s':>9} {'ratio':>6} {'check s':>8} {'ratio':>6}"
          f" {'append s':>9} {'/ledger':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.sizes.split(",")):
            path, out = Path(tmp, f"l{n}.json"), Path(tmp, f"o{n}.json")
            store.save(synthetic_ledger(n), path)
            text = path.read_text()

            def floor():
                Path(out).write_text(json.dumps(json.loads(text), indent=2) + "\n")

            def ledger_io():
                store.save(store.load(path), out)

            f = best(floor, args.repeat)
            g = best(ledger_io, args.repeat)
            line = f"{n:>8} {len(text) / 2**20:>7.1f} {f:>8.3f} {g:>9.3f} {g / f:>6.2f}"
            if not args.no_check:
                c = best(lambda: store.validate_file(path), 1)
                line += f" {c:>8.2f} {c / f:>6.1f}"
            else:
                line += f" {'-':>8} {'-':>6}"
            extra = synthetic_ledger(n + 1).measurements[-1].model_copy(update={"id": "appended-row"})

            def append_one():
                Path(out).write_text(text)
                t0 = time.perf_counter()
                store.append(out, [extra])
                return time.perf_counter() - t0

            a = min(append_one() for _ in range(args.repeat))
            line += f" {a:>9.3f} {a / g:>8.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()

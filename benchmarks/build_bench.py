"""Site build cost: synthetic ledgers of 1k / 10k / 100k measurements.

    python benchmarks/build_bench.py [--sizes 1000,10000,100000]

For each size, the build (load the ledger file, compute the context, render index.html, the
table pages, vram.md, vram.json, the schema and the plots) is timed once and printed as a ratio
to the floor: json.dumps of the same ledger. Targets: at 100k the ratio is at most 10; ten
times the rows take at most twelve times as long (the growth factor from 10k to 100k).
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

from ledger import store  # noqa: E402
from ledger.site.render import render_site  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    args = ap.parse_args()
    print(f"{'rows':>8} {'floor s':>8} {'build s':>8} {'ratio':>6} {'site MiB':>9} {'files':>6}")
    times: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.sizes.split(",")):
            path = Path(tmp, f"l{n}.json")
            store.save(synthetic_ledger(n), path)
            data = json.loads(path.read_text())
            t0 = time.perf_counter()
            json.dumps(data)
            floor = time.perf_counter() - t0
            out = Path(tmp, f"site{n}")
            t0 = time.perf_counter()
            result = render_site(store.load(path), out)
            build = time.perf_counter() - t0
            times[n] = build
            size = sum(result.files.values()) / 2**20
            print(f"{n:>8} {floor:>8.3f} {build:>8.2f} {build / floor:>6.1f} {size:>9.1f} {len(result.files):>6}",
                  flush=True)
    if 10000 in times and 100000 in times:
        print(f"growth 10k -> 100k: {times[100000] / times[10000]:.1f}x (target <= 12x)")


if __name__ == "__main__":
    main()

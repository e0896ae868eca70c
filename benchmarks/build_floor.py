"""What a site's outputs cost to produce once every figure in them is known: the build's floor.

    python benchmarks/build_floor.py [--ledger PATH | --synthetic N | --realistic N] [--repeat N]

The build (``render_site``) computes a context (the calibration, the scoreboard, the fit tables,
the plots' data: phase one) and then produces its outputs from it. This script computes the
context once, untimed, and then times only the production of the same outputs, byte for byte, from
it, in CPU seconds (each step the fastest of ``--repeat`` runs):

- ``load``: reading the ledger file (validated, and proved canonical), what every build starts with;
- ``ledger JSON``: the ledger's canonical JSON that vram.json holds and the hash is taken of;
- ``plots``: importing matplotlib and drawing every plot's SVG, in a forked process as the build's
  worker does (the import and matplotlib's first-use set-up are part of every build);
- ``data files``: vram.json's text around the ledger JSON, vram.csv, fits.csv, each model's
  picker data (JSON and script), vram.schema.json, changes.json and feed.xml;
- ``pages``: every page from its template (templates already compiled, as after a first build);
- ``hashes``: the sha256 and size the pages list for each download;
- ``write``: writing the tree into an empty folder (each file atomically).

It prints each step, their sum (the floor), the whole build's CPU in the same run, and the share
of the build that is computation rather than output. A build target below the floor cannot be met
by computing faster: only by producing less (or producing it differently, which changes the
published bytes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from build_bench import cpu  # noqa: E402
from ledger.storage import store  # noqa: E402
from ledger.storage.dry_runs import rows_from  # noqa: E402
from ledger.report.held_out import shared_held_out  # noqa: E402
from ledger.core.paths import DEFAULT_LEDGER  # noqa: E402
from ledger.vocab.recipe import row_keys_cached  # noqa: E402
from ledger.site import filters  # noqa: E402
from ledger.site.index_page import canonical_json  # noqa: E402
from ledger.site.render import (SiteWriter, compute_site, data_files, download, environment,  # noqa: E402
                                render_outputs, render_site, template_dirs)
from ledger.storage.store import gc_paused  # noqa: E402


def fastest(fn, repeat: int) -> tuple[float, object]:
    """The least CPU of ``repeat`` runs of ``fn`` (this machine's speed swings run to run)."""
    best, value = float("inf"), None
    for _ in range(repeat):
        c0 = cpu()
        value = fn()
        best = min(best, cpu() - c0)
    return best, value


#: The downloads the pages list with their size and hash (``render.compute_site``), and vram.md.
DOWNLOADS = ("vram.json", "vram.csv", "fits.csv", "vram.schema.json", "changes.json", "feed.xml")


def _draw(plots: list, conn) -> None:
    """In a forked child, as the build's worker: matplotlib imported here, every plot drawn."""
    if "matplotlib" in sys.modules:
        sys.exit("build_floor.py: matplotlib was imported before the fork: the plots' figure would leave out its import")
    from ledger.site.plots import render_svg

    conn.send([filters.neutral(render_svg(p)) for p in plots])
    conn.close()


def draw_in_child(plots: list) -> list[str]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_draw, args=(plots, child))
    proc.start()
    svgs = parent.recv()
    proc.join()
    return svgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--ledger", type=Path, default=DEFAULT_LEDGER)
    which.add_argument("--synthetic", type=int, metavar="N", help="a synthetic ledger of N rows (benchmarks/synthetic.py)")
    which.add_argument("--realistic", type=int, metavar="N", help="a realistic ledger of N rows (benchmarks/synthetic.py)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each step; the fastest is shown")
    args = ap.parse_args()
    if "fork" not in multiprocessing.get_all_start_methods():
        sys.exit("build_floor.py: needs fork (the build's workers are forked too)")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.ledger
        if args.synthetic or args.realistic:
            from synthetic import realistic_ledger, synthetic_ledger

            path = Path(tmp, "ledger.json")
            store.save(synthetic_ledger(args.synthetic) if args.synthetic else realistic_ledger(args.realistic), path)
        data = json.loads(path.read_text(encoding="utf-8"))
        floor_json = min(_timed_dumps(data) for _ in range(args.repeat))
        del data
        dirs = template_dirs()
        render_site(store.load(path), Path(tmp, "warm"))  # templates compiled, caches as after a first build
        build_cpu, _ = fastest(lambda: render_site(store.load(path), Path(tmp, f"build-{time.monotonic_ns()}")),
                               args.repeat)
        steps: dict[str, float] = {}
        steps["load"], ledger = fastest(lambda: store.load(path), args.repeat)
        with gc_paused(), row_keys_cached(), shared_held_out(), rows_from(None):
            ctx = compute_site(ledger, Path(tmp, "ctx"), build_date=None, base_url=None, previous=None, dirs=dirs)
            steps["ledger JSON"], ledger_json = fastest(lambda: canonical_json(ledger), args.repeat)
            plots = [*ctx.plots, *([ctx.estimator_plot] if ctx.estimator_plot else [])]
            steps["plots"], svgs = fastest(lambda: draw_in_child(plots), args.repeat)
            same_svgs = svgs == [ctx.images[p.file] for p in plots]

            picker = [json.loads(m.data_json) for m in ctx.fit_models]  # as the build holds it before its text
            history = json.loads(ctx.data_files["changes.json"])

            def data() -> dict[str, str]:
                # The picker's data is made text with the pages' tables in a build: its text counts here too.
                [json.dumps(d, separators=(",", ":"), ensure_ascii=False) for d in picker]
                return data_files(ctx, ledger, ledger_json, history, None)

            steps["data files"], files = fastest(data, args.repeat)
            same_data = all(files[k] == ctx.data_files[k] for k in files)
            env = environment(dirs)
            steps["pages"], outputs = fastest(lambda: render_outputs(ctx, env), args.repeat)
            listed = {n: files[n] for n in DOWNLOADS if n in files}
            listed["vram.md"] = outputs["vram.md"]
            steps["hashes"], _ = fastest(lambda: [download(n, t, None) for n, t in listed.items()], args.repeat)

            def write() -> None:
                writer = SiteWriter(Path(tmp, f"out-{time.monotonic_ns()}"))
                for name, text in outputs.items():
                    writer.write(name, text)
                writer.finish()

            steps["write"], _ = fastest(write, args.repeat)
        rows = len(ledger.measurements)
        floor = sum(steps.values())
        size = sum(len(t.encode("utf-8")) for t in outputs.values()) / 2**20
        print(f"{path.name if not (args.synthetic or args.realistic) else ('synthetic' if args.synthetic else 'realistic')}: "
              f"{rows} rows, {len(outputs)} files, {size:.1f} MiB; json.dumps of the ledger {floor_json:.3f} s")
        for name, took in steps.items():
            print(f"  {name:<12} {took:6.2f} s CPU")
        print(f"  {'floor':<12} {floor:6.2f} s CPU: producing the outputs, every figure given")
        print(f"  {'build':<12} {build_cpu:6.2f} s CPU: load + render_site, the fastest of {args.repeat}")
        print(f"  computation {max(0.0, build_cpu - floor):.2f} s ({max(0.0, 1 - floor / build_cpu):.0%} of the build); "
              f"floor / json.dumps {floor / floor_json:.1f}x")
        print(f"  the outputs reproduced byte for byte: plots {'yes' if same_svgs else 'NO'}, "
              f"data files {'yes' if same_data else 'NO'}")


def _timed_dumps(data) -> float:
    t0 = time.perf_counter()
    json.dumps(data)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

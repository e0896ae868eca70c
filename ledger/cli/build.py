"""``vram build``: the site from a ledger (the same code path as ``python build.py``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ledger.storage import store
from .options import Command, add_ledger_option


def add_build_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    p.add_argument("--out", default="site", help="output folder (default: %(default)s)")
    p.add_argument("--build-date", help="date to print on the page (default: SOURCE_DATE_EPOCH, else none)")
    p.add_argument("--base-url", help="public address of the site: canonical and download links, $ids "
                   "(default: [tool.vram-ledger] base_url in ./pyproject.toml; none = relative links)")
    p.add_argument("--previous", help="the last published vram.json (path or URL) to list changes against "
                   "(default: OUT/vram.json)")
    p.add_argument("--templates", metavar="DIR", help="a folder of templates (and static/style.css, static/sort.js) "
                   "that replace the shipped ones of the same name")
    p.add_argument("--dry-runs", metavar="FILE", help="the dry-run rows the fit table is built from (default: the "
                   "shipped ledger/dry-runs.json; never the user's cache, so a site is the same on any install)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def configured_base_url() -> str | None:
    """``[tool.vram-ledger] base_url`` from ./pyproject.toml, if set."""
    path = Path("pyproject.toml")
    if not path.is_file():
        return None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("tool", {}).get("vram-ledger", {}).get("base_url")
    return value if isinstance(value, str) and value else None


def build(args: argparse.Namespace) -> int:
    """Render the ledger into OUT: index.html, vram.md, vram.json, vram.schema.json and plots/*.svg.
    The same ledger gives a byte-identical tree; files from an earlier build that this one did not
    write are removed, and nothing else in OUT is touched."""
    from ledger.core.paths import shown
    from ..site.render import build_date_from_env, render_site

    t0 = time.perf_counter()
    ledger = store.load(args.ledger)
    result = render_site(ledger, Path(args.out), build_date=build_date_from_env(args.build_date),
                         base_url=args.base_url or configured_base_url(), previous=args.previous,
                         protect=[Path(args.ledger)], templates=Path(args.templates) if args.templates else None,
                         dry_runs=Path(args.dry_runs) if args.dry_runs else None)
    if not args.quiet:
        size = sum(result.files.values())
        print(
            f"{shown(result.out)}: {len(result.files)} files, {size / 1024:.0f} KiB from {args.ledger} "
            f"({len(ledger.measurements)} measurements) in {time.perf_counter() - t0:.1f} s"
            + (f"; removed {len(result.removed)} stale" if result.removed else "")
        )
        pages = {k: v for k, v in result.files.items() if k.endswith(".html")}
        if pages:
            largest = max(pages, key=lambda k: (pages[k], k))
            print(f"  largest page {largest} {pages[largest] / 1024:.0f} KiB; {len(pages)} pages "
                  f"{sum(pages.values()) / 1024:.0f} KiB; the whole site {size / 1024:.0f} KiB")
    return 0


COMMANDS = [Command("build", "render the ledger into a static site (HTML, Markdown, vram.json, plots)",
                   add_build_options, build)]

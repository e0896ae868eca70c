"""Phase two of the build: render every output from one SiteContext, and write the tree.

The writer refuses paths outside the output folder and two outputs with the same path, writes
each file atomically, and removes the files it wrote in an earlier build that this build did
not write (it keeps a manifest); it never touches anything else.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from ..errors import Issue, UserError
from ..models import Ledger
from ..store import atomic_write_text, gc_paused
from . import filters
from .context import (SiteContext, all_tables, build_context, canonical_json, fitted, ledger_hash, make_plots,
                      training_gpu_key)
from .downloads import measurements_csv
from .public import PUBLIC_SCHEMA_VERSION, Derived, public_schema

HERE = Path(__file__).resolve().parent
MANIFEST = ".vram-build-manifest"


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(enabled_extensions=("html.j2",), default_for_string=True, default=False),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(filters.FILTERS)
    return env


class SiteWriter:
    """Writes files under one folder, safely and exactly once each."""

    def __init__(self, out: Path):
        self.out = out.resolve()
        self.written: dict[str, int] = {}

    def _target(self, rel: str) -> Path:
        target = (self.out / rel).resolve()
        if target == self.out or self.out not in target.parents:
            raise UserError(Issue(str(rel), "", f"refusing to write outside {self.out}"))
        return target

    def write(self, rel: str, content: str) -> None:
        if rel in self.written:
            raise UserError(Issue(rel, "", "two outputs with the same path"))
        target = self._target(rel)
        atomic_write_text(target, content)
        self.written[rel] = len(content.encode("utf-8"))

    def finish(self) -> list[str]:
        """Remove stale files from the previous build; record this build's files."""
        manifest = self.out / MANIFEST
        removed = []
        if manifest.exists():
            try:
                previous = json.loads(manifest.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                previous = []
            for rel in previous if isinstance(previous, list) else []:
                if not isinstance(rel, str) or rel in self.written:
                    continue
                try:
                    target = self._target(rel)
                except UserError:
                    continue
                if target.is_file():
                    target.unlink()
                    removed.append(rel)
                    parent = target.parent
                    while parent != self.out and parent.is_dir() and not any(parent.iterdir()):
                        parent.rmdir()
                        parent = parent.parent
        atomic_write_text(manifest, json.dumps(sorted(self.written), indent=1) + "\n")
        return removed


def build_date_from_env(explicit: Optional[str] = None) -> Optional[str]:
    """The build date: --build-date, else SOURCE_DATE_EPOCH (UTC), else none (reproducible)."""
    if explicit:
        return explicit
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            return dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc).date().isoformat()
        except ValueError:
            raise UserError(Issue("SOURCE_DATE_EPOCH", "", f"not a Unix time: {epoch!r}")) from None
    return None


@dataclass
class BuildResult:
    out: Path
    files: dict[str, int]
    removed: list[str]


def public_json(ledger_json: str, ctx: SiteContext, ledger: Ledger) -> str:
    """vram.json text, assembled around the ledger's canonical JSON (serialised only once)."""
    derived = Derived(counts=ctx.counts, training_gpu=training_gpu_key(ledger), plots=ctx.plots,
                      calibration=ctx.fitted)
    return (
        f'{{"schema_version":{PUBLIC_SCHEMA_VERSION},"ledger_sha256":{json.dumps(ctx.ledger_sha256)},'
        f'"build_date":{json.dumps(ctx.build_date)},"ledger":{ledger_json},'
        f'"derived":{derived.model_dump_json()}}}\n'
    )


def render_site(ledger: Ledger, out: Path, *, build_date: Optional[str] = None) -> BuildResult:
    """Compute the context once, then render and write every output."""
    with gc_paused():  # the build makes many short-lived objects and no cycles worth collecting
        return _render_site(ledger, Path(out), build_date)


#: The ledger being built, for the worker process (inherited by fork, never pickled).
_LEDGER: Optional[Ledger] = None


def _svgs(plots: list) -> list[str]:
    from .plots import render_svg  # matplotlib is imported only when a site is built

    return [render_svg(p) for p in plots]


def _fitted() -> Optional[dict]:
    return fitted(_LEDGER)


class _Inline:
    """Runs the work in this process when forking is not available (same results)."""

    def submit(self, fn, *args):
        class Done:
            def __init__(self, value):
                self.value = value

            def result(self):
                return self.value

        return Done(fn(*args))

    def shutdown(self, **kwargs) -> None:
        pass


def _render_site(ledger: Ledger, out: Path, build_date: Optional[str]) -> BuildResult:
    # The calibration and the plots are computed in a second process while this one renders the
    # rest (two cores: a third of the build time at 100k rows). Fork (Linux only)
    # hands the worker the ledger without pickling it.
    global _LEDGER
    _LEDGER = ledger
    plot_list = make_plots(ledger)
    if sys.platform.startswith("linux"):
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
    else:
        pool = _Inline()
    try:
        jobs = {"fitted": pool.submit(_fitted), "svgs": pool.submit(_svgs, plot_list)}
        return _render_rest(ledger, out, build_date, plot_list, jobs)
    finally:
        pool.shutdown(cancel_futures=True)
        _LEDGER = None


def _render_rest(ledger: Ledger, out: Path, build_date: Optional[str], plot_list: list, jobs: dict) -> BuildResult:
    ledger_json = canonical_json(ledger)
    ctx = build_context(ledger, build_date=build_date, ledger_sha256=ledger_hash(ledger, ledger_json),
                        plots=plot_list, fitted_doc=jobs["fitted"])
    env = environment()
    css = (HERE / "static" / "style.css").read_text(encoding="utf-8")
    js = (HERE / "static" / "sort.js").read_text(encoding="utf-8")
    hrefs = {r.id: f"#m-{r.id}" for t in all_tables(ctx) for r in t.rows}

    writer = SiteWriter(Path(out))
    common = {"ctx": ctx, "css": css, "js": js, "hrefs": hrefs}
    writer.write("index.html", env.get_template("index.html.j2").render(**common))
    writer.write("vram.md", env.get_template("vram.md.j2").render(**common))
    writer.write("vram.json", public_json(ledger_json, ctx, ledger))
    writer.write("vram.schema.json", json.dumps(public_schema(), indent=2) + "\n")
    writer.write("vram.csv", measurements_csv(ledger))
    for plot, svg in zip(ctx.plots, jobs["svgs"].result()):
        writer.write(plot.file, svg)
    removed = writer.finish()
    return BuildResult(out=writer.out, files=dict(writer.written), removed=removed)

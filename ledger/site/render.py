"""The build in two phases: ``compute_site`` computes everything into one frozen SiteContext
(the calibration, the scoreboard, plots and their images, the data files, downloads and changes);
``render_outputs`` renders every output from it (templates receive ``ctx`` and nothing else);
then the tree is written.

The writer refuses paths outside the output folder and two outputs with the same path, writes
each file atomically, and removes the files it wrote in an earlier build that this build did
not write (it keeps a manifest); it never touches anything else.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import CodeType
from typing import Optional, Sequence

import jinja2
from jinja2 import (ChoiceLoader, Environment, FileSystemBytecodeCache, FileSystemLoader, StrictUndefined,
                    select_autoescape)

from ledger.core.errors import Issue, UserError
from ledger.core.models import Ledger
from ledger.storage.atomic import atomic_write_text
from ledger.storage.dry_runs import load_dry_runs, rows_from
from ledger.answer.fits import library_versions
from ledger.report.held_out import shared_held_out, shared_predictor
from ledger.vocab.recipe import row_keys_cached
from ledger.storage.store import gc_paused
from . import filters
from .context import all_tables, build_context, fitted
from .estimators_page import estimator_plot, estimator_scoreboard
from ledger.answer.worlds import WORLD_GPUS, WORLD_PAGE_CARDS
from .fits_page import (PICKER_SHARES, as_tuples, data_script, fit_models, fit_table_doc, fits_of,
                        picker_tables)
from .index_page import canonical_json, ledger_hash, training_gpu_key
from .plot_data import make_plots
from .views import SiteContext
from .changes import atom_feed, history_for, load_previous, parse_document
from .downloads import fits_csv, measurements_csv
from .public import PUBLIC_SCHEMA_VERSION, Derived, public_schema

MANIFEST = ".vram-build-manifest"


def template_dirs(override: Optional[Path] = None) -> list[Path]:
    """Where templates and static files are looked up: a publisher's folder first (``--templates``),
    then the shipped ones, so an override needs only the files it changes."""
    from ledger.core.paths import shipped_templates

    if override is not None and not Path(override).is_dir():
        raise UserError(Issue(str(override), "", "--templates needs a folder of templates"))
    return ([Path(override)] if override is not None else []) + [shipped_templates()]


def static_text(name: str, dirs: list[Path]) -> str:
    """A static file (CSS, JS) from the first template folder that has it."""
    for d in dirs:
        path = d / "static" / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise UserError(Issue(name, "", f"no static/{name} in {', '.join(map(str, dirs))}"))


def environment(dirs: Optional[list[Path]] = None, cache: bool = True) -> Environment:
    """The templates' environment; ``cache``: compiled templates kept between builds
    (``TemplateCache``, in the user's cache folder)."""
    dirs = dirs or template_dirs()
    env = Environment(
        loader=ChoiceLoader([FileSystemLoader(str(d)) for d in dirs]),
        autoescape=select_autoescape(enabled_extensions=("html.j2",), default_for_string=True, default=False),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(filters.FILTERS)
    if cache:
        env.bytecode_cache = TemplateCache.for_environment(env)
    return env


class TemplateCache(FileSystemBytecodeCache):
    """Compiled templates kept between builds: jinja's bytecode cache in ``templates/`` of the
    user's cache folder (``VRAM_LEDGER_CACHE``, else the platform's, as the computed dry runs), so
    a machine compiles each template once (about 0.35 s of a build's CPU) instead of every build.
    Jinja files each template by its path and its source's checksum (an edited template, or a
    publisher's ``--templates`` override, is compiled again); the file names here also carry a
    fingerprint of what else shapes the compiled code without being in a template (jinja's and
    Python's versions, the environment's syntax options, its autoescape per kind of template and
    the filters and tests it may fold constants with). The cache is never needed: a folder that
    cannot be made or written, one another user owns or others may write to (compiled code is run
    as it is read), or a file that cannot be read back, is compiled as before."""

    @classmethod
    def for_environment(cls, env: Environment) -> Optional["TemplateCache"]:
        from ledger.storage.dry_runs import user_cache_dir

        folder = user_cache_dir() / "templates"
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = folder.stat()
        except OSError:
            return None
        # Compiled code is run as it is read: only from a folder no one else may write to.
        if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
            return None
        mine = environment_fingerprint(env)
        _prune(folder, mine)
        return cls(str(folder), f"{mine}-%s.cache")

    def load_bytecode(self, bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # a file cut short or not jinja's: compiled again (and rewritten)
            bucket.reset()

    def dump_bytecode(self, bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:  # a full disk or a read-only folder: the next build compiles again
            pass


#: Compiled templates of another fingerprint (another version of the project or of jinja, an
#: edited filter) are removed once this many days old: one version's set is some 600 KB.
TEMPLATE_CACHE_DAYS = 7


def _prune(folder: Path, mine: str) -> None:
    """Remove the cached templates of other fingerprints written more than ``TEMPLATE_CACHE_DAYS``
    ago (a version still in use on the machine compiles its own again when it next builds)."""
    cutoff = time.time() - TEMPLATE_CACHE_DAYS * 86400
    try:
        for entry in os.scandir(folder):
            if entry.name.endswith(".cache") and not entry.name.startswith(f"{mine}-") \
                    and entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
    except OSError:  # another build removed it first, or the folder is not ours to clean
        pass


def environment_fingerprint(env: Environment) -> str:
    """What, besides a template's source, decides its compiled code: jinja's and Python's versions,
    the syntax and whitespace options, the autoescape of each kind of template and each filter
    and test (jinja folds constant expressions through them at compile time), as a short hash."""
    def const(k) -> str:  # the same text in every process (no addresses, no set order)
        if isinstance(k, CodeType):
            return f"code({k.co_code.hex()}:{','.join(map(const, k.co_consts))})"
        if isinstance(k, (tuple, frozenset)):
            items = [const(v) for v in k]
            return f"{type(k).__name__}({','.join(sorted(items) if isinstance(k, frozenset) else items)})"
        return repr(k)

    def code(f) -> str:
        c = getattr(f, "__code__", None)
        what = f"{getattr(f, '__module__', None) or type(f).__module__}.{getattr(f, '__qualname__', type(f).__qualname__)}"
        return what if c is None else f"{what}:{const(c)}"

    autoescape = env.autoescape
    parts = [jinja2.__version__, sys.version, env.block_start_string, env.block_end_string,
             env.variable_start_string, env.variable_end_string, env.comment_start_string, env.comment_end_string,
             env.line_statement_prefix, env.line_comment_prefix, env.trim_blocks, env.lstrip_blocks,
             env.newline_sequence, env.keep_trailing_newline, env.optimized, sorted(env.extensions),
             [autoescape(n) if callable(autoescape) else autoescape for n in ("t.html.j2", "t.md.j2", "t.j2", None)],
             sorted((n, code(f)) for n, f in env.filters.items()), sorted((n, code(f)) for n, f in env.tests.items())]
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:16]


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
    #: CPU seconds of each stage (the workers' stages in their own process), for benchmarks/build_bench.py.
    stages: dict[str, float] = field(default_factory=dict)


def public_json(ledger_json: str, ctx: SiteContext, ledger: Ledger, base_url: Optional[str] = None) -> str:
    """vram.json text, assembled around the ledger's canonical JSON (serialised only once)."""
    derived = Derived(counts=ctx.counts, training_gpu=training_gpu_key(ledger), plots=ctx.plots,
                      calibration=ctx.fitted, estimators=ctx.scoreboard,
                      **({"fits": ctx.fits} if ctx.fits is not None else {}))
    url = f"{base_url}/vram.json" if base_url else None
    schema = f"{base_url}/vram.schema.json" if base_url else "vram.schema.json"
    return (
        f'{{"schema_version":{PUBLIC_SCHEMA_VERSION},"url":{json.dumps(url)},"schema_url":{json.dumps(schema)},'
        f'"ledger_sha256":{json.dumps(ctx.ledger_sha256)},'
        f'"build_date":{json.dumps(ctx.build_date)},"ledger":{ledger_json},'
        f'"derived":{derived.model_dump_json(exclude_unset=True)}}}\n'
    )


def download(name: str, text: str, base_url: Optional[str]) -> dict:
    data = text.encode("utf-8")
    return {"name": name, "href": f"{base_url}/{name}" if base_url else name, "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def latest_date(ledger: Ledger) -> str:
    """The feed's date when no build date is given: the newest measurement's (reproducible)."""
    dates = [m.provenance.measured_on for m in ledger.measurements if m.provenance.measured_on]
    return max(dates).isoformat() if dates else "1970-01-01"


#: Names a build writes at the top of its output folder (plots go under plots/).
OUTPUT_NAMES = ("index.html", "vram.md", "estimators.html", "estimators.md", "fits.html", "fits.md", "vram.json",
                "vram.schema.json", "vram.csv", "fits.csv", "changes.json", "feed.xml", MANIFEST)


def check_output_folder(out: Path, protect: Sequence[Path] = ()) -> None:
    """Refuse, before anything is written, an output folder that is a file or whose outputs
    would overwrite or remove a protected file (the ledger being built)."""
    if out.exists() and not out.is_dir():
        raise UserError(Issue(str(out), "", "is a file, not a folder: --out needs a folder"))
    root = Path(os.path.realpath(out))
    for path in protect:
        real = Path(os.path.realpath(path))
        if (real.parent == root and real.name in OUTPUT_NAMES) or (root / "plots") in real.parents \
                or (root / "fits") in real.parents:
            raise UserError(Issue(str(path), "", f"the build would overwrite this ledger with its output "
                                  f"{real.relative_to(root)}: choose another --out"))


def render_site(ledger: Ledger, out: Path, *, build_date: Optional[str] = None, base_url: Optional[str] = None,
                previous: Optional[str] = None, protect: Sequence[Path] = (),
                templates: Optional[Path] = None, dry_runs: Optional[Path] = None) -> BuildResult:
    """Compute the context once (phase one), render every output from it (phase two), write the
    tree. ``base_url`` makes links and
    ``$id``s absolute; ``previous`` (a path or URL of the last published vram.json, default the
    one in the output folder) is what changes.json and feed.xml compare with; ``protect`` lists
    files the build must never overwrite (the ledger it reads); ``templates`` is a folder whose
    templates and static files replace the shipped ones of the same name; ``dry_runs`` a dry-run
    file to build the fit table from instead of the shipped rows."""
    if base_url is not None and not base_url.startswith(("http://", "https://")):
        raise UserError(Issue("--base-url", "", f"must be an http(s) URL, got {base_url!r}"))
    check_output_folder(Path(out), protect)
    dirs = template_dirs(templates)
    library_versions()  # a malformed VRAM_LEDGER_LIBRARY_VERSIONS is refused before any work, not in a worker
    # The build makes many short-lived objects and no cycles worth collecting; rows do not change
    # while it runs, so their keys are computed once.
    if dry_runs is not None and not Path(dry_runs).is_file():
        raise UserError(Issue(str(dry_runs), "", "no such file: --dry-runs needs a dry-run file (ledger/dry-runs.json's form)"))
    with gc_paused(), row_keys_cached(), shared_held_out(), rows_from(dry_runs):
        stages: dict[str, float] = {}
        ctx = compute_site(ledger, Path(out), build_date=build_date,
                           base_url=base_url.rstrip("/") if base_url else None, previous=previous, dirs=dirs,
                           stages=stages)
        t0 = time.process_time()
        files = render_outputs(ctx, environment(dirs))
        stages["pages"] = time.process_time() - t0
        t0 = time.process_time()
        writer = SiteWriter(Path(out))
        for name, text in files.items():
            writer.write(name, text)
        removed = writer.finish()
        stages["write"] = time.process_time() - t0
    return BuildResult(out=writer.out, files=dict(writer.written), removed=removed, stages=stages)


# -- phase one: compute ------------------------------------------------------------------------

#: The ledger being built, in a worker process (set there by the pool's initializer: with fork
#: it is inherited, never pickled).
_WORKER_LEDGER: Optional[Ledger] = None


def _worker_init(ledger: Ledger) -> None:
    global _WORKER_LEDGER
    _WORKER_LEDGER = ledger


def _svgs(plots: list) -> list[str]:
    from .plots import render_svg  # matplotlib is imported only when a site is built

    return [filters.neutral(render_svg(p)) for p in plots]


def _timed(name: str, fn, *args) -> tuple[dict[str, float], object]:
    """Run a job and say how much CPU it took in the process that ran it."""
    t0 = time.process_time()
    value = fn(*args)
    return {name: time.process_time() - t0}, value


def _fitted_scoreboard_plots(plots: list) -> tuple:
    # One process computes the calibration and the scoreboard (they ask the same held-out answers,
    # ledger.report.held_out, once) and draws every plot, the scoreboard's too (matplotlib loads once).
    board = estimator_scoreboard(_WORKER_LEDGER)
    board_plot = estimator_plot(board)
    return fitted(_WORKER_LEDGER), board, board_plot, _svgs([*plots, *([board_plot] if board_plot else [])])


def _fit_tables() -> tuple[dict[str, float], tuple]:
    """The fit table and the picker's other tables, in one process: they ask the predictor many
    of the same questions (a micro-batch of B x L tokens is the recipe of B x L tokens before its
    widening; every optimizer's answer is the same answer before its state), asked once."""
    took, (doc, grids) = _timed("fit table", fit_table_doc, _WORKER_LEDGER)
    others = {}
    for i, share in enumerate(PICKER_SHARES):
        spent, tables = _timed(f"picker share {i}", picker_tables, _WORKER_LEDGER, share)
        took.update(spent)
        others.update({k: as_tuples(cells) for k, cells in tables.items()})
    return took, (doc and {**doc, "cells": as_tuples(doc["cells"])}, grids, others)


class _Inline:
    """Runs the work in this process when forking is not available (same results)."""

    def __init__(self, ledger: Ledger):
        _worker_init(ledger)

    def submit(self, fn, *args):
        class Done:
            def __init__(self, value):
                self.value = value

            def result(self):
                return self.value

        return Done(fn(*args))

    def shutdown(self, **kwargs) -> None:
        _worker_init(None)  # type: ignore[arg-type]


def compute_site(ledger: Ledger, out: Path, *, build_date: Optional[str], base_url: Optional[str],
                 previous: Optional[str], dirs: list[Path], stages: Optional[dict] = None) -> SiteContext:
    """Phase one: everything the outputs show, in one frozen SiteContext. Two worker processes
    (two cores) compute, one the fit tables and the other the calibration, the scoreboard and the
    plot images, while this one serialises the ledger. ``stages`` gets each stage's CPU seconds."""
    stages = {} if stages is None else stages
    t0 = time.process_time()
    prev_doc, prev_history = load_previous(previous, out.resolve())
    stages["previous"] = time.process_time() - t0
    plot_list = make_plots(ledger)
    # The whole ledger's fits, made once here: the workers inherit them (fork) instead of each
    # fitting the ledger again for the calibration, the scoreboard and the fit table.
    t0 = time.process_time()
    from ledger.answer.fits import cards

    p = shared_predictor(ledger, load_dry_runs())
    p.warm(cards(p))
    stages["ledger fit"] = time.process_time() - t0
    if sys.platform.startswith("linux"):
        pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_worker_init, initargs=(ledger,))
    else:
        pool = _Inline(ledger)
    try:
        jobs = {"fits": pool.submit(_fit_tables),
                "fitted": pool.submit(_timed, "calibration, scoreboard and plots", _fitted_scoreboard_plots, plot_list)}
        t0 = time.process_time()
        ledger_json = canonical_json(ledger)
        sha = ledger_hash(ledger, ledger_json)
        stages["ledger json"] = time.process_time() - t0
        done = {}
        for name, job in jobs.items():
            took, done[name] = job.result()
            stages.update(took)
    finally:
        # The workers end before this process builds anything more: while a forked child lives,
        # every page this one writes is copied first (seconds of system time for a large ledger).
        pool.shutdown(cancel_futures=True)
    fitted_doc, scoreboard_doc, board_plot, svgs = done["fitted"]
    t0 = time.process_time()
    ctx = build_context(ledger, build_date=build_date, ledger_sha256=sha, plots=plot_list,
                        fitted_doc=fitted_doc, scoreboard_doc=scoreboard_doc)
    images = dict(zip([p.file for p in ctx.plots] + ([board_plot.file] if board_plot else []), svgs))
    doc, grids, others = done["fits"]
    fits = fits_of(doc)  # the cells as they came, plain tuples: typed once, for vram.json and the pages
    ctx = replace(ctx, fits=fits, fit_grids=grids, fit_models=fit_models(fits, others) if fits else [],
                  world_cards=tuple(k for k in WORLD_PAGE_CARDS if fits and k in {c.key for c in fits.cards}),
                  world_gpus=WORLD_GPUS)
    stages["page tables"] = time.process_time() - t0
    t0 = time.process_time()

    # The data files: the pages list each download with its size and hash.
    ctx = replace(ctx, estimator_plot=board_plot, base_url=base_url)
    unchanged = prev_doc is not None and prev_doc.get("ledger_sha256") == sha
    ledger_doc = None if unchanged or prev_doc is None else parse_document(ledger_json)
    history = history_for(prev_doc if not unchanged else None, prev_history, ledger_doc or {}, sha, build_date)
    if unchanged and isinstance(prev_history, dict):
        history = {**history, "history": prev_history.get("history", [])[:50]}
    data = data_files(ctx, ledger, ledger_json, history, build_date)
    stages["downloads"] = time.process_time() - t0
    return replace(
        ctx,
        changes=history["history"][0] if history["history"] else None,
        downloads=[download(name, data[name], base_url) for name in
                   ("vram.json", "vram.csv", "fits.csv", "vram.schema.json", "changes.json", "feed.xml")
                   if name in data],
        css=static_text("style.css", dirs), js=static_text("sort.js", dirs), picker_js=static_text("picker.js", dirs),
        hrefs={r.id: f"#m-{r.id}" for t in all_tables(ctx) for r in t.rows},
        data_files=data, images=images,
    )


def data_files(ctx: SiteContext, ledger: Ledger, ledger_json: str, history: dict,
               build_date: Optional[str]) -> dict[str, str]:
    """The data files' texts by path (vram.json around the ledger's canonical JSON, its schema, the
    CSVs, each model's picker data, changes.json and feed.xml), from the context and the change set."""
    base_url = ctx.base_url
    data: dict[str, str] = {}
    data["vram.json"] = public_json(ledger_json, ctx, ledger, base_url)
    data["vram.schema.json"] = json.dumps(public_schema(base_url), indent=2) + "\n"
    data["vram.csv"] = filters.neutral(measurements_csv(ledger))
    if ctx.fits is not None:
        data["fits.csv"] = filters.neutral(fits_csv(ctx.fits))
    for m in ctx.fit_models:  # the picker's data, per model: JSON to download, a script for the pages
        data[f"fits/{m.slug}.json"] = m.data_json + "\n"
        data[f"fits/{m.slug}.js"] = data_script(m)
    data["changes.json"] = json.dumps(history, indent=1, ensure_ascii=False) + "\n"
    data["feed.xml"] = filters.neutral(atom_feed(history, title=ctx.title, base_url=base_url,
                                                 updated=f"{build_date or latest_date(ledger)}T00:00:00Z"))
    return data


# -- phase two: render -------------------------------------------------------------------------


def render_outputs(ctx: SiteContext, env: Environment) -> dict[str, str]:
    """Phase two: every output's text by its path, rendered from the context alone. The
    Markdown page is itself a download the HTML page lists, so it is rendered first."""
    # Bidirectional controls are shown, never obeyed, in everything a person reads (filters.neutral);
    # the JSON files are the data and keep every character.
    def page(name: str, c: SiteContext) -> str:
        return filters.neutral(env.get_template(name).render(ctx=c))

    md = page("vram.md.j2", ctx)
    page_ctx = replace(ctx, downloads=[*ctx.downloads, download("vram.md", md, ctx.base_url)])
    files = {
        "index.html": page("index.html.j2", page_ctx),
        "vram.md": md,
        "estimators.html": page("estimators.html.j2", page_ctx),
        "estimators.md": page("estimators.md.j2", page_ctx),
    }
    if ctx.fits is not None:
        files["fits.html"] = page("fits.html.j2", page_ctx)
        files["fits.md"] = page("fits.md.j2", page_ctx)
        for m in ctx.fit_models:
            files[f"fits/{m.slug}.html"] = page("fit_model.html.j2", replace(page_ctx, fit_model=m, root="../"))
    files.update(ctx.data_files)
    files.update(ctx.images)
    return files

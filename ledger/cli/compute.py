"""Dry runs computed when an answer needs them: a model without committed rows (a config path or
folder, a Hub id in the local cache), or a length the committed grid does not reach. They run as
a dry-run sweep (``python -m probe_kit.run_sweep``, device "dry", torch on the CPU) into the
user's cache (``ledger.storage.dry_runs.cache_file``), never into the shipped rows, and are reused by
every later command.

A cached row is reused only while it was computed from the same config and the same library
versions: a user's config is copied into the cache under its content hash (the rows name that
copy), and rows of an edited config or of other torch / transformers / peft versions are left out
and computed again.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ledger.vocab.adapter import ALL_LINEAR
from ledger.storage.atomic import atomic_write_text
from ledger.storage.dry_runs import cache_file, load_dry_runs
from ledger.core.errors import Issue, UserError
from ledger.answer.fits import full_point, lora_point, stale_rows, sweep_toml, target_option
from ledger.vocab.model_configs import CONFIG_DIR, config_path, load_arch, model_name
from ledger.core.paths import DRY_RUNS
from ledger.vocab.recipe import Recipe

#: Ranks a length needs dry-run so that any rank there is derived (a step's peak is affine in rank).
RANKS = (8, 64)


def add_compute_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-compute", action="store_true",
                   help="never run dry runs: a model or length without dry-run rows is answered 'unknown' (by "
                        "default the few dry runs the answer needs are run on the CPU, with a time estimate first, "
                        "and kept in --cache)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run those dry runs as tasks on a Ray cluster (the optional extra: pip install -e '.[ray]'): "
                        "without ADDRESS on a Ray instance started on this machine, 'auto' the one `ray start` runs "
                        "here, HOST:PORT a remote one")


def config_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _rows_config(model: str, cache: Optional[str]) -> tuple[Optional[Path], Optional[Path]]:
    """(the user's config, where its copy lives in the cache) — (path, None) for a shipped config."""
    path = config_path(model)
    if path is None or path.parent == CONFIG_DIR:
        return path, None
    name = model_name(model) or path.stem
    return path, Path(cache_file(cache)).parent / "configs" / config_sha(path) / f"{name}.json"


def model_for_rows(model: str, cache: Optional[str]) -> str:
    """The model name computed rows record: a shipped config's name as given; a user's config is
    copied into the cache under its content hash (``configs/<sha>/<name>.json``) and named by that
    path, so rows of an edited config are never taken for the new one's."""
    path, target = _rows_config(model, cache)
    if target is None:
        return model
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, path.read_text(encoding="utf-8"))
    return str(target)


def fresh_rows(rows: list, model: Optional[str], cache: Optional[str]) -> list:
    """Dry-run rows less the cache's rows of ``model`` that no longer describe it: computed from
    another version of its config, or with other library versions than the installed ones."""
    if not model or cache is None:
        return rows
    name = model_name(model)
    target = _rows_config(model, cache)[1]  # reading rows writes nothing
    current = str(target) if target is not None else model
    cached = [m for m in rows if model_name(m.model) == name and _in_cache(m.model, cache)]
    stale = set(stale_rows(cached)) | {m.id for m in cached if m.model != current and "/configs/" in str(m.model)}
    return [m for m in rows if m.id not in stale]


def _in_cache(model: Optional[str], cache: Optional[str]) -> bool:
    return bool(model) and str(Path(cache_file(cache)).parent) in str(model)


def needed_points(predictor, recipe: Recipe, model_rows: str) -> list[dict]:
    """The dry runs an answer for ``recipe`` lacks: none when the dry-run table already has a
    figure for it; else ranks 8 and 64 at its length (for its quant, fixes, dropout, DoRA,
    response length, gradient checkpointing and micro-batch), from which every rank there is derived."""
    if recipe.seq_len is None or recipe.model is None or predictor.table.raw(replace(recipe, rank=RANKS[0]))[0]:
        return []
    if recipe.response_len is not None and not 0 < recipe.response_len < recipe.seq_len:
        return []
    return [{**lora_point(recipe, model_rows), "rank": r} for r in RANKS]


def full_points(predictor, recipe: Recipe, model_rows: str, run: str = "real") -> list[dict]:
    """The dry run a full fine-tuning answer lacks: none when the full table has a row of its very
    length (a chord between two lengths is at or above the step, and an answer computed on the spot
    has the step itself), else its own length, with the optimizer's step for a training run
    (``ledger.answer.full_ft``)."""
    from ledger.answer.full_ft import optimizer_of

    optimizer = optimizer_of(recipe, run)
    found = predictor.full.table.figure(recipe, optimizer) if recipe.seq_len and recipe.model else None
    if recipe.seq_len is None or recipe.model is None or (found is not None and found.how != "chord"):
        return []
    return [{**full_point(recipe, model_rows), **({"optim": optimizer} if optimizer else {})}]


def seconds_for(points: list[dict]) -> Optional[float]:
    """The expected wall seconds of these dry runs on this kind of machine: a least-squares fit of
    the shipped rows' recorded times in the model's layers and the length (seconds = a + b layers +
    c tokens + d layers x tokens: fake tensors cost per op, and ops grow with both), over the rows
    whose depth was extrapolated as this version does it where there are enough of them."""
    import numpy as np

    xs, ys, current = [], [], []
    archs: dict = {}
    for m in load_dry_runs(DRY_RUNS):
        if m.model not in archs:
            archs[m.model] = load_arch(m.model) if m.model else None
        a = archs[m.model]
        notes = " ".join(m.provenance.notes)
        found = re.search(r'"seconds": ([0-9.]+)', notes) if a and m.seq_len else None
        if found:
            xs.append(_terms(a.layers, m.seq_len))
            ys.append(float(found.group(1)))
            current.append('"depth": {"method": "extrapolated"' in notes)
    if sum(current) >= 8:  # rows run as this version runs them: the depth from short stacks of layers
        xs, ys = [x for x, c in zip(xs, current) if c], [y for y, c in zip(ys, current) if c]
    if len(xs) < 8:
        return None
    coef = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]
    total = 0.0
    for p in points:
        a = load_arch(p["model"])
        if a is None:
            return None
        total += max(float(np.dot(coef, _terms(a.layers, p["seq_len"]))), 1.0)
    return total


def _terms(layers: int, seq_len: int) -> list[float]:
    return [1.0, layers, seq_len / 1000, layers * seq_len / 1000]


#: What a sweep process costs before its first dry run: Python with torch, transformers and peft
#: loaded (6.7 s of wall on this project's 2-core CPU, ``python -c "import transformers, peft"``).
#: A compute shares its points among processes only while each has at least this much to run.
SHARD_START_S = 7.0


def compute_points(points: list[dict], label: str, cache: Optional[str], *, no_compute: bool = False,
                   shards: Optional[int] = None, ray: Optional[str] = None) -> None:
    """Run these dry runs (a dry-run sweep appending to the cache's rows), with a time estimate
    first and the sweep's progress on stderr; ``no_compute`` refuses with what would run. The
    points are shared among ``shards`` processes (default: one per core, at most one per point
    pair and per ``SHARD_START_S`` of expected work), each appending under the ledger's lock."""
    if not points:
        return
    target = cache_file(cache)
    missing = [name for name in ("torch", "transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing and not no_compute:
        raise UserError(Issue("--compute", "", f"{label} needs {len(points)} dry runs, which need {', '.join(missing)}: "
                              "install the probe extra (pip install -e '.[probe]'), or answer from the shipped rows "
                              "alone with --no-compute"))
    if ray is not None and importlib.util.find_spec("ray") is None and not no_compute:
        raise UserError(Issue("--ray", "", "needs Ray, an optional extra: pip install -e '.[ray]'"))
    _drop_crashed(target)
    secs = seconds_for(points)
    if shards is None:  # one a core, while each has more to run than its start costs
        shards = min(os.cpu_count() or 1, len(points) // 2 or 1)
        if secs is not None:
            shards = min(shards, int(secs // SHARD_START_S) or 1)
    shards = max(1, shards)
    if ray is not None:  # one driver; the cluster shares the points among its workers
        shards = 1
    guess = f"about {secs / shards:.0f} s" if secs else "time unknown"
    if ray is not None and secs:
        guess = f"about {secs:.0f} s of CPU, shared among the Ray cluster's workers"
    if no_compute:
        raise UserError(Issue("--no-compute", "", f"{label} needs {len(points)} dry runs not computed yet ({guess} on "
                              "the CPU): run again without --no-compute"))
    print(f"computing {len(points)} dry runs of {label} on the CPU into {target} ({guess}, from the shipped dry runs' "
          "times by layers and length; this machine may differ; --no-compute refuses)", file=sys.stderr, flush=True)
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="vram-dry-")
    t0 = time.perf_counter()
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(sweep_toml(points, f"dry-{model_name(label) or 'model'}"))
        argv = [sys.executable, "-m", "probe_kit.run_sweep", path, "--resume", "--ledger", str(target)]
        if ray is not None:
            argv += ["--ray", ray] if ray else ["--ray"]
        try:  # the sweep's progress goes to our stderr (its stdout too: ours is for the answer)
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a stream with no file (captured in a library call)
            out = None
        shard_args = [[]] if shards == 1 else [["--shard", f"{k}/{shards}"] for k in range(1, shards + 1)]
        if shards == 1 and ray is None and threading.current_thread() is threading.main_thread():
            codes = [_sweep_here(argv[3:])]
        elif out is not None:
            procs = [subprocess.Popen(argv + extra, stdout=out) for extra in shard_args]
            codes = [proc.wait() for proc in procs]
        else:
            procs = [subprocess.Popen(argv + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for extra in shard_args]
            codes = []
            for proc in procs:
                text, _ = proc.communicate()
                sys.stderr.write(text or "")
                codes.append(proc.returncode)
    finally:
        os.unlink(path)
    crashed = _drop_crashed(target)
    failed = [c for c in codes if c != 0]
    if failed:
        raise UserError(Issue("--compute", "", f"the dry-run sweep exited {failed[0]} (see above)"))
    if crashed:
        raise UserError(Issue("--compute", "", f"{len(crashed)} of the dry runs crashed and were not kept: "
                              f"{crashed[0]}"))
    print(f"computed in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def _sweep_here(argv: list[str]) -> int:
    """One shard's sweep in this process (``probe_kit.run_sweep``, its output on stderr): torch,
    transformers and peft load once for every compute a command asks (a ceiling's lengths, a fit
    after an estimate) rather than once a compute, in a process of its own. What it records is
    under the cache's lock as a process's would be; a crash of the sweep itself is its traceback
    and exit code 1, as the process's would be."""
    from probe_kit.run_sweep import main as sweep

    with contextlib.redirect_stdout(sys.stderr):
        try:
            return sweep(argv)
        except Exception:
            traceback.print_exc()
            return 1
        finally:
            if "triton" in sys.modules and _quiet_teardown not in _QUIET:
                _QUIET.append(_quiet_teardown)
                atexit.register(_quiet_teardown)


_QUIET: list = []


def _quiet_teardown() -> None:
    """At exit, once the command has answered: standard error closed to what follows. Triton's
    bindings, which torch loads during a dry run, list the objects still alive as the interpreter
    tears its modules down (hundreds of lines of "nanobind: leaked ..."): noise, never the
    answer's. Exit handlers run before that teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def _drop_crashed(target: Path) -> list[str]:
    """Remove the cache's crashed dry runs (a missing library, a bug: never an answer, and a kept
    one would stop ``--resume`` from running the point again); their first lines of error."""
    if not Path(target).is_file():
        return []
    from ledger.storage import store

    found: list[str] = []

    def change(lg):
        crashed = [m for m in lg.measurements if m.kind == "dry_run" and m.outcome.status == "crashed"]
        if not crashed:
            return store.UNCHANGED
        found.extend(f"{m.id}: {(m.outcome.result_text or 'crashed').splitlines()[0]}" for m in crashed)
        ids = {m.id for m in crashed}
        return lg.model_copy(update={"measurements": [m for m in lg.measurements if m.id not in ids]})
    store.update(target, change)
    return found


def ensure_dry_runs(args: argparse.Namespace, predictor, recipe: Recipe) -> bool:
    """Compute the dry runs ``recipe`` lacks (see ``needed_points``); whether any were computed
    (the caller then fits its predictor again). None are when the recipe cannot use them: a model
    without a config."""
    from ledger.fit.response_span import answerable

    model = getattr(args, "model", None)
    if not model or config_path(model) is None:
        return False
    if recipe.method == "full":
        points = full_points(predictor, recipe, model_for_rows(model, args.cache),
                             "real" if getattr(args, "real", True) else "probe")
        if points:
            compute_points(points, f"{model_name(model)} full fine-tuning at {recipe.seq_len} tokens", args.cache,
                           no_compute=args.no_compute, ray=getattr(args, "ray", None))
        return bool(points)
    one, _ = answerable(recipe)  # LoRA on fewer projections: the dry runs of those projections
    if one is None:
        return False
    try:
        target_option(model, one.targets)
    except ValueError as exc:
        raise UserError(Issue("--target-modules", "", f"{model_name(model)}: {exc}")) from None
    points = needed_points(predictor, one, model_for_rows(model, args.cache))
    if not points:
        return False
    if args.no_compute and one.targets != ALL_LINEAR:  # answered by the all-7 figure, an upper bound
        return ensure_dry_runs(args, predictor, recipe.replace(targets=ALL_LINEAR))
    batch = f"micro-batch {one.batch} x " if one.batch != 1 else ""
    compute_points(points, f"{model_name(model)} at {batch}{one.seq_len} tokens", args.cache, no_compute=args.no_compute,
                   ray=getattr(args, "ray", None))
    return True

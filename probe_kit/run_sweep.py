"""A sweep: many probes, each in a fresh subprocess, appended to the ledger as each finishes.

    python -m probe_kit.run_sweep SWEEP.toml --ledger L [--shard K/N] [--resume] [--list]
                                   [--find-ceiling rank] [--ray [ADDRESS]]

A sweep file has ``[sweep]`` (name, device, timeout_s, gpu), ``[base]`` (probe options),
``[axes]`` (lists: the grid is their product) and ``[[points]]`` (explicit points over the
base). Option names are probe_vram's flags with '_' for '-' (``seq_len``, ``random_weights``).

Each point runs as ``python -m probe_kit.probe_vram ... --ledger L`` in its own process, with a
timeout: a child that dies (segfault, illegal memory access, killed, timed out) is recorded as
status crashed with the tail of its stderr, and the sweep goes on. A point whose options are
wrong is reported before anything runs. ``--resume`` skips points whose id (derived from the
configuration) is already in the ledger (without it, a sweep whose points are there already stops
before probing anything); SIGINT or SIGTERM, foreground or background, ends the running probe
unrecorded and exits 128 + the signal with one line naming ``--resume``; ``--shard K/N`` takes every N-th point from the K-th,
so N machines split a sweep without overlap (then ``vram merge`` their ledgers). ``--ray [ADDRESS]``
runs every point as a task on a Ray cluster instead (probe_kit.cluster): one card per probe, this
process the ledger's one writer.
A sweep with ``device = "dry"`` runs the dry run (``probe_kit.dry_run``: the real step under fake
tensors, no card) for each point, in this process, and appends rows of kind dry_run (default
ledger: ledger/dry-runs.json); everything else (``--resume``, ``--shard``, signals) is the same.
``--find-ceiling rank`` finds the largest rank that fits for each combination of the other axes (a
larger rank never uses less memory): it probes the predicted ceiling (the one predictor's, for the
sweep's card, or ``--start-rank``) and the rank above it first - two probes when the prediction is
right - and bisects only what they leave open (plain bisection: at most ceil(log2(steps)) + 1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

from ledger.storage import store
from ledger.core.errors import Issue, UserError
from ledger.core.models import Environment, Gpu, Measurement, Outcome, Provenance
from ledger.core.paths import DEFAULT_LEDGER, DRY_RUNS, shown

from .bisect import find_ceiling
from .probe_vram import EXIT_CRASHED, EXIT_REFUSED
from .recipe import ProbeConfig, RecipeError, parse_fixes

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

#: Sweep options that are not probe options.
SWEEP_KEYS = {"name", "device", "timeout_s", "gpu", "host_ram_cap_gib", "ray_resources", "simulate_allocator"}
#: Options of one point that are not probe options: the card it is for (its ledger key) and, on a
#: Ray cluster, the resources its task needs (``{"RTX_4090" = 1}``: a node started with that
#: resource; see probe_kit.cluster).
POINT_KEYS = {"gpu", "ray_resources"}
BOOL_FLAGS = {"rslora", "dora", "random_weights", "no_double_quant", "no_gradient_checkpointing", "cpu_offload"}
PROBE_KEYS = {"model", "rank", "alpha", "rslora", "dropout", "dora", "quant", "no_double_quant", "seq_len",
              "response_len", "fixes", "logits_to_keep", "mlp_chunk", "target_modules", "random_weights", "seed",
              "batch_size", "no_gradient_checkpointing", "optim", "method", "gpus", "strategy", "cpu_offload"}


@dataclass
class Point:
    index: int
    options: dict
    config: ProbeConfig
    id: str
    where: str
    #: The card's ledger key this point is for (default: the sweep's ``gpu``; none: the card's name).
    gpu: Optional[str] = None
    #: Ray resources its task needs besides one card or one CPU (default: the sweep's).
    resources: dict = field(default_factory=dict)

    def flags(self) -> list[str]:
        out: list[str] = []
        for key, value in self.options.items():
            flag = "--" + key.replace("_", "-")
            if key in BOOL_FLAGS:
                if value:
                    out.append(flag)
            elif key == "target_modules" and isinstance(value, list):
                out += [flag, ",".join(value)]
            else:
                out += [flag, str(value)]
        return out


@dataclass
class Sweep:
    path: str
    name: str
    device: str
    timeout_s: float
    gpu: Optional[str]
    host_ram_cap_gib: Optional[float]
    axes: dict[str, list]
    resources: dict
    base: dict
    points: list[Point] = field(default_factory=list)
    #: A dry-run sweep's rows also replay the step through the caching allocator's model
    #: (``outcome.allocator``); a row of the ledger without it is run again and replaced.
    simulate_allocator: bool = False


def _config(options: dict, where: str) -> ProbeConfig:
    unknown = sorted(set(options) - PROBE_KEYS)
    if unknown:
        raise UserError(Issue(where, unknown[0], f"unknown option (known: {', '.join(sorted(PROBE_KEYS | POINT_KEYS))})"))
    kw = {k: v for k, v in options.items()
          if k not in ("no_double_quant", "fixes", "target_modules", "no_gradient_checkpointing", "optim")}
    try:
        return ProbeConfig(
            **kw,
            double_quant=not options.get("no_double_quant", False),
            gradient_checkpointing=not options.get("no_gradient_checkpointing", False),
            optimizer=options.get("optim"),
            fixes=parse_fixes(str(options.get("fixes", "all"))),
            **({"target_modules": list(options["target_modules"])} if "target_modules" in options else {}),
        )
    except (RecipeError, TypeError) as exc:
        raise UserError(Issue(where, "", str(exc))) from None


def load_sweep(path: str) -> Sweep:
    """Read and check a sweep file: every point is validated before anything runs."""
    from probe_kit.probe_vram import probe_id

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(Issue(path, "", "no such file")) from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(Issue(path, "", f"invalid TOML: {exc}")) from None
    head = data.get("sweep", {})
    unknown = sorted(set(head) - SWEEP_KEYS)
    if unknown:
        raise UserError(Issue(path, f"sweep.{unknown[0]}", "unknown key"))
    base = data.get("base", {})
    axes = data.get("axes", {})
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UserError(Issue(path, f"axes.{key}", "must be a non-empty list"))
    sweep = Sweep(
        path=path, name=str(head.get("name", Path(path).stem)), device=str(head.get("device", "cuda")),
        timeout_s=float(head.get("timeout_s", 1800)), gpu=head.get("gpu"),
        host_ram_cap_gib=head.get("host_ram_cap_gib"), axes=axes, base=base,
        resources=_resources(head.get("ray_resources", {}), path, "sweep.ray_resources"),
        simulate_allocator=head.get("simulate_allocator", False),
    )
    if not isinstance(sweep.simulate_allocator, bool):
        raise UserError(Issue(path, "sweep.simulate_allocator", "must be true or false"))
    if sweep.simulate_allocator and sweep.device != "dry":
        raise UserError(Issue(path, "sweep.simulate_allocator", "simulates a dry run's allocations: needs "
                              'device = "dry" (a card\'s probe measures its reserved memory itself)'))
    combos: list[tuple[dict, str]] = []
    if axes:
        names = list(axes)
        for i, values in enumerate(itertools.product(*(axes[n] for n in names))):
            combos.append(({**base, **dict(zip(names, values))}, f"{path}:axes[{i}]"))
    for i, extra in enumerate(data.get("points", [])):
        combos.append(({**base, **extra}, f"{path}:points[{i}]"))
    if not combos and base:
        combos.append((dict(base), f"{path}:base"))
    seen: dict[str, str] = {}
    for index, (options, where) in enumerate(combos):
        options = dict(options)
        gpu = options.pop("gpu", None) or sweep.gpu
        resources = {**sweep.resources, **_resources(options.pop("ray_resources", {}), where, "ray_resources")}
        cfg = _config(options, where)
        if sweep.device == "dry":
            from probe_kit.dry_run import dry_id

            if gpu:
                raise UserError(Issue(path, "sweep.gpu" if sweep.gpu else f"{where}.gpu",
                                      "a dry-run sweep has no card (its rows hold for every card)"))
            pid = dry_id(cfg)
        else:
            pid = probe_id(cfg, sweep.device.split(":")[0], gpu)
        if pid in seen:
            continue  # the same configuration twice (e.g. a point repeating a grid cell)
        seen[pid] = where
        sweep.points.append(Point(index=len(sweep.points), options=options, config=cfg, id=pid, where=where,
                                  gpu=gpu, resources=resources))
    if not sweep.points:
        raise UserError(Issue(path, "", "no points: give [base] with [axes] and/or [[points]]"))
    return sweep


def _resources(value, where: str, key: str) -> dict:
    """Ray resources a task needs, as a sweep file gives them: a table of names to positive amounts."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in value.items()):
        raise UserError(Issue(where, key, "must be a table of resource names to positive amounts, e.g. "
                              '{ RTX_4090 = 1 }'))
    if {"CPU", "GPU"} & set(value):
        raise UserError(Issue(where, key, "CPU and GPU are set by the sweep (one card per probe, one CPU per dry "
                              "run); name custom resources or an accelerator_type:NAME"))
    return dict(value)


def for_point(sweep: Sweep, point: Point) -> Sweep:
    """The sweep as one of its points runs: its card is the point's."""
    return sweep if point.gpu == sweep.gpu else replace(sweep, gpu=point.gpu)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(Issue("--shard", "", f"must be K/N, got {text!r}")) from None
    if not 1 <= k <= n:
        raise UserError(Issue("--shard", "", f"needs 1 <= K <= N, got {text!r}"))
    return k, n


def shard(points: list[Point], k: int, n: int) -> list[Point]:
    """Every n-th point starting from the k-th (1-based): disjoint, together complete."""
    return [p for p in points if p.index % n == k - 1]


# -- running ----------------------------------------------------------------------------


def probe_command(point: Point, sweep: Sweep, ledger: str) -> list[str]:
    """The child's command line (one fresh interpreter per probe)."""
    cmd = [sys.executable, "-m", "probe_kit.probe_vram", *point.flags(), "--device", sweep.device,
           "--ledger", ledger, "--id", point.id, "--json"]
    if sweep.gpu:
        cmd += ["--gpu", sweep.gpu]
    if sweep.host_ram_cap_gib is not None:
        cmd += ["--host-ram-cap-gib", str(sweep.host_ram_cap_gib)]
    return cmd


@dataclass
class Result:
    point: Point
    status: str
    seconds: float
    step_s: Optional[float] = None
    message: str = ""


def crashed_measurement(point: Point, sweep: Sweep, why: str, stderr_tail: str,
                        gpu_key: Optional[str] = None) -> Measurement:
    return point.config.measurement(
        id=point.id, kind="probe", gpu=gpu_key,
        outcome=Outcome(status="crashed", result_text=f"{why}\n{stderr_tail}".strip()),
        environment=Environment(device=sweep.device),
        provenance=Provenance(source=f"probe_kit.run_sweep {sweep.path} ({point.where})",
                              measured_on=dt.date.today(), notes=[why]),
    )


#: Card entries already described, by (device, --gpu): one child per sweep, not per crash.
_CARDS: dict[tuple[str, Optional[str]], Optional[tuple[str, Gpu]]] = {}


def card_of(sweep: Sweep) -> Optional[tuple[str, Gpu]]:
    """The key and entry a successful child would file its card under, so a crashed point of a
    GPU sweep lands under the same key (read in a fresh child, as the probes are: the sweep
    itself never initialises the GPU). None for a CPU sweep or when the card cannot be read."""
    if sweep.device.split(":")[0] != "cuda":
        return None
    cache = (sweep.device, sweep.gpu)
    if cache not in _CARDS:
        code = ("import json, sys; from probe_kit.probe_vram import describe_device; "
                "print(json.dumps(describe_device(sys.argv[1], sys.argv[2] or None)))")
        try:
            proc = subprocess.run([sys.executable, "-c", code, sweep.device, sweep.gpu or ""], capture_output=True,
                                  text=True, timeout=120)
            doc = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
            _CARDS[cache] = (doc["key"], Gpu.model_validate(doc["gpu"])) if doc else None
        except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
            _CARDS[cache] = None
    return _CARDS[cache]


def record_crash(point: Point, sweep: Sweep, ledger: str, why: str, stderr_tail: str) -> None:
    card = card_of(sweep)
    if card is None and sweep.gpu:
        key = None  # the card could not be read: file the crash without one rather than under a bad key
    else:
        key = card[0] if card else None
    store.append(ledger, [crashed_measurement(point, sweep, why, stderr_tail, key)],
                 gpus_if_missing=dict([card]) if card else None, create=True)


class SweepInterrupted(Exception):
    """SIGINT or SIGTERM reached the sweep: stop after killing the running probe."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_interrupted(signum, frame) -> None:
    raise SweepInterrupted(signum)


def _kill_group(proc: subprocess.Popen) -> None:
    """End a probe child and everything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_point(point: Point, sweep: Sweep, ledger: str,
              command: Optional[Callable[[Point, Sweep, str], list[str]]] = None) -> Result:
    """Run one point in a fresh process (``command`` builds its command line; default
    ``probe_command``); a dead child becomes a crashed record. The child leads its own process
    group, so a terminal's Ctrl-C reaches the sweep alone, and the sweep ends the child (and
    anything it started) when it stops for any reason."""
    command = command or probe_command
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(point, sweep, ledger), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=sweep.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stderr = (proc.stderr.read() if proc.stderr else "") or ""
        why = f"timed out after {sweep.timeout_s:g} s"
        record_crash(point, sweep, ledger, why, stderr[-2000:])
        return Result(point, "crashed", time.perf_counter() - t0, message=why)
    except BaseException:
        _kill_group(proc)
        raise
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        try:
            m = json.loads(stdout.strip().splitlines()[-1])
            return Result(point, m["outcome"]["status"], seconds, m["outcome"].get("step_s"))
        except (ValueError, IndexError, KeyError):
            pass
        why = "the probe exited 0 without a result"
    elif proc.returncode == EXIT_REFUSED:  # the probe refused its input: not a crash, nothing recorded
        line = (stderr.strip().splitlines() or ["exit 1"])[-1]
        return Result(point, "error", seconds, message=line)
    elif proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = str(-proc.returncode)
        why = f"the probe process died of signal {name}"
    elif proc.returncode == EXIT_CRASHED:
        why = "the probe crashed (an error other than an OOM)"
    else:
        why = f"the probe process exited with status {proc.returncode}"
    record_crash(point, sweep, ledger, why, stderr[-2000:])
    return Result(point, "crashed", seconds, message=why)


class DryRows:
    """Dry-run rows on their way to the ledger, appended together: a dry run takes a few
    seconds, and each append reads, checks and rewrites the whole file (a quarter of a second
    for the fit grid's 5.5 MB), so one append per row was a tenth of a grid's regeneration.
    Rows are written once ``every_s`` seconds have passed since the last write, and whenever
    the sweep ends, is stopped by a signal or asks (``flush``): a process killed outright loses
    at most the last ``every_s`` seconds of dry runs, which ``--resume`` runs again."""

    def __init__(self, ledger: str, every_s: float = 30.0, replace: frozenset = frozenset()):
        self.ledger = ledger
        self.every_s = every_s
        #: Ids whose row in the ledger this sweep's row replaces (the same dry run, now with what
        #: the old row lacks: the allocator's simulation).
        self.replace = replace
        self.pending: list[Measurement] = []
        self.gpus: dict[str, Gpu] = {}
        self.last = time.monotonic()

    def add(self, m: Measurement, gpus: Optional[dict[str, Gpu]] = None) -> None:
        """Queue a row (with the entries of the cards it names, added where the ledger lacks them)."""
        self.pending.append(m)
        for key, gpu in (gpus or {}).items():
            self.gpus.setdefault(key, gpu)
        if time.monotonic() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Append what is pending. A row another writer recorded meanwhile (the same point, an
        overlapping shard) is left as that writer wrote it."""
        rows, self.pending = self.pending, []
        gpus, self.gpus = self.gpus, {}
        self.last = time.monotonic()
        swap = {m.id: m for m in rows if m.id in self.replace}
        if swap:
            rows = [m for m in rows if m.id not in swap]

            def change(lg):
                lg.measurements = [swap.pop(m.id, m) for m in lg.measurements] + list(swap.values())
            store.update(self.ledger, change)
        if not rows:
            return
        try:
            store.append(self.ledger, rows, gpus_if_missing=gpus or None, create=True)
        except UserError:
            there = {m.id for m in store.load(self.ledger).measurements}
            left = [m for m in rows if m.id not in there]
            if len(left) == len(rows):
                raise
            if left:
                store.append(self.ledger, left, gpus_if_missing=gpus or None, create=True)


def crashed_dry_row(point: Point, sweep: Sweep, why: str) -> Measurement:
    """A dry run that could not finish, as a row: status crashed, with why."""
    return point.config.measurement(id=point.id, kind="dry_run", outcome=Outcome(status="crashed", result_text=why),
                                    environment=Environment(device="fake cpu", meter="tracker"),
                                    provenance=Provenance(source=f"probe_kit.run_sweep {sweep.path} ({point.where})",
                                                          measured_on=dt.date.today(), inferred=True, notes=[why]))


def run_dry_point(point: Point, sweep: Sweep, ledger: str, rows: Optional[DryRows] = None) -> Result:
    """One dry run in this process (fake tensors hold no memory worth isolating), appended as a
    dry_run row with no card: the modelled terms use PyTorch's defaults, and each card's remainder
    is fitted from its measured rows when the row is used (ledger.answer.predictor). With ``rows`` the
    row joins that batch (the sweep writes it with the next ones); without, it is appended now."""
    from probe_kit.dry_run import measurement, predict

    t0 = time.perf_counter()
    batch = rows if rows is not None else DryRows(ledger, every_s=0.0)
    # No read of the ledger first (a dry run is seconds; a read of a grid's rows is a fraction of
    # that): a point another writer recorded meanwhile is found when the row is written.
    cfg = point.config if point.config.random_weights else replace(point.config, random_weights=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            outcome, breakdown = predict(cfg)
    except RecipeError as exc:
        return Result(point, "error", time.perf_counter() - t0, message=str(exc))
    except SweepInterrupted:
        raise
    except Exception as exc:  # a library that cannot build or step this model: recorded, the sweep goes on
        why = f"the dry run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        batch.add(crashed_dry_row(point, sweep, why))
        return Result(point, "crashed", time.perf_counter() - t0, message=why)
    if sweep.simulate_allocator:
        from probe_kit.allocator import AllocConf
        from probe_kit.dry_run import simulate_allocator

        with contextlib.redirect_stdout(sys.stderr):
            breakdown["allocator"] = simulate_allocator(cfg, AllocConf())
    m = measurement(cfg, outcome, breakdown, None, point.id)
    m.provenance.source = f"probe_kit.run_sweep {sweep.path} ({point.where}): dry run under fake tensors" + (
        ", its allocations replayed through probe_kit.allocator" if sweep.simulate_allocator else "")
    batch.add(m)
    return Result(point, m.outcome.status, time.perf_counter() - t0, breakdown["seconds"])


# -- on a Ray cluster (probe_kit.cluster): each point a task, this process the one writer -------


class _Collect:
    """Rows a task made, kept for the driver (a task never writes the ledger)."""

    def __init__(self) -> None:
        self.pending: list[Measurement] = []

    def add(self, m: Measurement, gpus=None) -> None:
        self.pending.append(m)


def _node() -> str:
    """The machine a task ran on, by its address in the cluster (its host name outside Ray)."""
    ray = sys.modules.get("ray")  # a task's worker has it; nothing else imports it for this
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    import socket

    return socket.gethostname()


def dry_task(point: Point, sweep: Sweep) -> dict:
    """One dry run on a worker: its row made there (the worker's library versions), returned."""
    rows = _Collect()
    r = run_dry_point(point, sweep, "", rows)
    return {"status": r.status, "seconds": r.seconds, "step_s": r.step_s, "message": r.message, "node": _node(),
            "rows": [m.model_dump_json() for m in rows.pending], "gpus": {}}


def probe_task(point: Point, sweep: Sweep) -> dict:
    """One probe on a worker, in a fresh process on the card Ray gave the task, into a ledger of
    the worker's own; its rows and card entry returned (a crashed child's row too, filed under the
    card the worker read)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vram-probe-") as tmp:
        ledger = str(Path(tmp, "ledger.json"))
        r = run_point(point, for_point(sweep, point), ledger)
        rows: list[str] = []
        gpus: dict[str, str] = {}
        if Path(ledger).exists():
            lg = store.load(ledger)
            rows = [m.model_dump_json() for m in lg.measurements]
            gpus = {k: g.model_dump_json() for k, g in lg.gpus.items()}
    return {"status": r.status, "seconds": r.seconds, "step_s": r.step_s, "message": r.message, "node": _node(),
            "rows": rows, "gpus": gpus}



def ray_crashed(sweep: Sweep) -> Callable[[Point, str], Measurement]:
    """The row of a point whose Ray worker kept dying (the card unknown: no worker lived to read it)."""
    def crashed(point: Point, why: str) -> Measurement:
        if sweep.device == "dry":
            return crashed_dry_row(point, sweep, why)
        return crashed_measurement(point, for_point(sweep, point), why, "")
    return crashed


def run_on_cluster(cluster, points: list[Point], sweep: Sweep, rows: DryRows,
                   on_result: Callable[[Point, Result], None]) -> None:
    """The points as Ray tasks (dry_task / probe_task); their rows written by ``rows`` here."""
    def done(p: Point, out: dict) -> None:
        message = out["message"]
        if sweep.device != "dry" and out.get("node"):
            message = f"{message}; on {out['node']}" if message else f"on {out['node']}"
        on_result(p, Result(p, out["status"], out["seconds"], out["step_s"], message))

    cluster.run_many(dry_task if sweep.device == "dry" else probe_task, points, sweep, ray_crashed(sweep), rows.add,
                     done)


def ceiling_groups(sweep: Sweep, axis: str) -> list[list[Point]]:
    """Points grouped by everything but the axis, each group sorted by the axis."""
    if axis != "rank":
        raise UserError(Issue("--find-ceiling", "", f"only the rank axis is searched, got {axis!r}"))
    groups: dict[str, list[Point]] = {}
    for p in sweep.points:
        other = {k: v for k, v in p.options.items() if k != axis}
        groups.setdefault(repr(sorted(other.items())), []).append(p)
    return [sorted(g, key=lambda p: p.config.rank) for g in groups.values()]


def predicted_start(group: list[Point], sweep: Sweep, ledger: str, start_rank: Optional[int]) -> tuple[Optional[int], str]:
    """Index of the predicted ceiling in a group: ``start_rank`` when given, else the one
    predictor's ceiling (ledger.answer.predictor) for the sweep's card; (None, why) when it cannot say."""
    if start_rank is None:
        if not sweep.gpu:
            return None, "no card to predict for: plain bisection"
        from ledger.core.paths import DEFAULT_LEDGER as BUNDLED
        from ledger.vocab.cards import resolve_card
        from ledger.storage.dry_runs import load_dry_runs
        from ledger.answer.predictor import Predictor

        path = ledger if Path(ledger).exists() else str(BUNDLED)
        lg = store.load(path)
        found = resolve_card(lg, sweep.gpu)
        if found is None:
            return None, f"{sweep.gpu} is not a known card: plain bisection"
        cfg = group[0].config
        recipe = cfg.recipe()
        p = Predictor(lg, load_dry_runs() + [m for m in lg.measurements if m.kind == "dry_run"])
        c = p.ceiling(recipe, found[0], entry=found[1])
        if c.fits_rank is None:
            return None, f"the predictor has no ceiling ({c.status}): plain bisection"
        start_rank, source = c.fits_rank, f"the predictor's ceiling, rank {c.fits_rank}"
    else:
        source = f"--start-rank {start_rank}"
    below = [i for i, p in enumerate(group) if p.config.rank <= start_rank]
    return (below[-1] if below else 0), source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m probe_kit.run_sweep", description=__doc__.split("\n\n")[0],
                                 epilog="Exit codes: 0 ok, 1 bad sweep file or a point refused, 2 bad usage.")
    ap.add_argument("sweep", help="sweep file (TOML)")
    ap.add_argument("--ledger", help="ledger to append to (default for a GPU sweep: the bundled ledger/vram.json; "
                    "a CPU sweep must name one: CPU measurements never go into the published ledger)")
    ap.add_argument("--shard", help="K/N: run every N-th point from the K-th (1-based)")
    ap.add_argument("--resume", action="store_true", help="skip points already in the ledger")
    ap.add_argument("--list", action="store_true", help="print the points and run nothing")
    ap.add_argument("--find-ceiling", metavar="AXIS", help="find the largest AXIS (rank) that fits: confirm the "
                    "predicted ceiling and the rank above it first, bisect only when the prediction was wrong")
    ap.add_argument("--start-rank", type=int, help="with --find-ceiling: the rank to confirm first (default: the "
                    "predictor's ceiling for the sweep's card; none: plain bisection)")
    ap.add_argument("--timeout", type=float, help="seconds per probe (default: the sweep's timeout_s or 1800)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                    help="run each point as a Ray task (the optional extra: pip install -e '.[ray]'): a probe on one "
                         "card of the cluster, a dry run on one CPU; this process is the ledger's one writer. Without "
                         "ADDRESS a Ray instance is started on this machine for the run; 'auto' joins the one "
                         "`ray start` runs here; HOST:PORT or ray://HOST:10001 a remote cluster")
    ap.add_argument("--ray-cpus", type=int, metavar="N",
                    help="with --ray and no address: the CPUs the local Ray instance offers (default: every core)")
    ap.add_argument("--retries", type=int, default=None, metavar="N",
                    help="with --ray: times a point whose worker died in the middle of it is run again before it "
                         "is recorded as crashed (default 2)")
    ap.add_argument("--write-every", type=float, default=30.0, metavar="SECONDS",
                    help="a dry-run sweep appends its finished rows together at most this often (default 30; "
                         "a killed sweep loses at most that much work, which --resume runs again)")
    args = ap.parse_args(argv)
    try:
        sweep = load_sweep(args.sweep)
        if args.ledger is None and sweep.device == "dry":
            args.ledger = shown(DRY_RUNS)
        if args.ledger is None:
            if sweep.device.split(":")[0] == "cpu" and not args.list:
                raise UserError(Issue(args.sweep, "sweep.device", "a CPU sweep needs --ledger: CPU measurements "
                                      "never go into the published ledger (ledger/vram.json)"))
            args.ledger = shown(DEFAULT_LEDGER)
        if args.timeout:
            sweep.timeout_s = args.timeout
        cluster = None
        if args.ray is None:
            for flag, value in (("--ray-cpus", args.ray_cpus), ("--retries", args.retries)):
                if value is not None:
                    raise UserError(Issue(flag, "", "only with --ray"))
        else:
            from .cluster import DEFAULT_RETRIES, Cluster, require_ray

            if args.ray_cpus is not None and (args.ray or args.ray_cpus < 1):
                raise UserError(Issue("--ray-cpus", "", "needs --ray without an address (a cluster's CPUs are its "
                                      "own), and N >= 1"))
            if args.retries is not None and args.retries < 0:
                raise UserError(Issue("--retries", "", f"must be 0 or more, got {args.retries}"))
            if not args.list:
                require_ray()
            cluster = Cluster(address=args.ray or None, cpus=args.ray_cpus,
                              retries=DEFAULT_RETRIES if args.retries is None else args.retries)
        if args.write_every < 0:
            raise UserError(Issue("--write-every", "", f"must be 0 or more seconds, got {args.write_every:g}"))
        points = sweep.points
        if args.shard:
            points = shard(points, *parse_shard(args.shard))
        if args.list:
            for p in points:
                print(f"{p.id}\t{' '.join(p.flags())}")
            print(f"{len(points)} points", file=sys.stderr)
            return 0
        done: dict[str, str] = {}
        replace: frozenset = frozenset()
        if Path(args.ledger).exists():
            rows = store.load(args.ledger).measurements
            recorded = {m.id: m.outcome.status or "" for m in rows}
            if sweep.simulate_allocator:  # a dry run recorded without the simulation is run again, and replaced
                replace = frozenset(m.id for m in rows if m.outcome.allocator is None and m.outcome.status == "ok")
                recorded = {k: v for k, v in recorded.items() if k not in replace}
            if args.resume:
                done = recorded
            else:
                present = [p.id for p in points if p.id in recorded]
                if present:
                    raise UserError(Issue(args.ledger, "", f"{len(present)} of {len(points)} points are in this "
                                          f"ledger already (first: {present[0]}): run again with --resume to skip "
                                          "them"))
        return run_sweep(sweep, points, ledger=args.ledger, done=done, ceiling_axis=args.find_ceiling,
                         progress=not args.no_progress, start_rank=args.start_rank, cluster=cluster,
                         write_every=args.write_every, replace=replace)
    except UserError as exc:
        for issue in exc.issues:
            print(str(issue), file=sys.stderr)
        return 1


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise SweepInterrupted in the main thread, whether or not the sweep
    runs in the foreground (a background job starts with SIGINT ignored; an explicit
    ``kill -INT`` must still stop it)."""
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class CeilingUnknown(Exception):
    """A probe of the bisection neither fit nor ran out of memory."""


def fits(status: str, point: Point) -> bool:
    """Whether a probe's outcome says the point fits. Only ok fits; an OOM, a spill past free
    memory or the host-RAM cap does not; a crash or a refused point says nothing about memory,
    so the ceiling is unknown rather than guessed."""
    if status == "ok":
        return True
    if status in ("oom", "spilled", "host_oom"):
        return False
    raise CeilingUnknown(f"{point.id} ended as {status or 'unknown'}; nothing can be said about memory")


def run_sweep(sweep: Sweep, points: list[Point], *, ledger: str, done: dict[str, str],
              ceiling_axis: Optional[str] = None, progress: bool = True, start_rank: Optional[int] = None,
              cluster=None, write_every: float = 30.0, replace: frozenset = frozenset()) -> int:
    """Run the points (or bisect ``ceiling_axis`` within each group of them), appending to
    ``ledger``; points in ``done`` are skipped. With ``cluster`` (``probe_kit.cluster.Cluster``)
    each point runs as a Ray task and this process appends what comes back. Returns the exit code."""
    from tqdm import tqdm

    results: list[Result] = []
    bar = tqdm(total=len(points), unit="probe", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    running: dict[str, Point] = {}
    # A probe run here writes its own row; one run on a cluster comes back to be written at once.
    rows = DryRows(ledger, every_s=write_every if sweep.device == "dry" else 0.0, replace=replace)
    t_start = time.perf_counter()

    def record(p: Point, r: Result) -> None:
        results.append(r)
        bar.update(1)
        if r.status not in ("skipped",):
            bar.write(f"{p.id}: {r.status}" + (f" ({r.message})" if r.message else ""))

    def run(p: Point) -> Result:
        if p.id in done:
            r = Result(p, "skipped", 0.0, message=f"already in the ledger: {done[p.id]}")
        else:
            bar.set_postfix_str(p.config.label())
            running["point"] = p
            if cluster is not None:
                found: list[Result] = []
                run_on_cluster(cluster, [p], sweep, rows, lambda _, res: found.append(res))
                r = found[0]
            elif sweep.device == "dry":
                r = run_dry_point(p, sweep, ledger, rows)
            else:
                r = run_point(p, for_point(sweep, p), ledger)
            running.pop("point")
        record(p, r)
        return r

    try:
        if cluster is not None and any(p.id not in done for p in points):
            cluster.connect()
            print(f"run_sweep: on Ray ({cluster.describe()}); this process writes {ledger}", file=sys.stderr)
        with _stop_on_signals():
            if ceiling_axis:
                for group in ceiling_groups(sweep, ceiling_axis):
                    group = [p for p in group if p in points]
                    if not group:
                        continue
                    bar.total = None
                    ranks = [p.config.rank for p in group]
                    start, source = predicted_start(group, sweep, ledger, start_rank)
                    try:
                        best, probes = find_ceiling(group, lambda p: fits(done.get(p.id) or run(p).status, p), start)
                    except CeilingUnknown as exc:
                        print(f"ceiling: unknown for {ranks}: {exc}")
                        continue
                    limit = math.ceil(math.log2(len(group))) + 1 if len(group) > 1 else 1
                    confirmed = (start is not None and best is not None and group.index(best) == start)
                    print(f"ceiling: rank {best.config.rank if best else 'none'} of {ranks} "
                          f"({probes} probes; plain bisection takes at most {limit}; started from {source}"
                          + (", confirmed" if confirmed else "") + ")")
            elif cluster is not None:
                for p in points:
                    if p.id in done:
                        run(p)
                bar.set_postfix_str("on Ray")
                run_on_cluster(cluster, [p for p in points if p.id not in done], sweep, rows, record)
            else:
                for p in points:
                    run(p)
    except SweepInterrupted as exc:
        bar.close()
        rows.flush()  # the points that finished before the signal are recorded
        point = running.get("point")
        recorded = sum(1 for r in results if r.status not in ("skipped", "error"))
        where = ""
        if point is not None:
            kept = Path(ledger).exists() and any(m.id == point.id for m in store.load(ledger).measurements)
            where = (f" during {point.id} (" + ("it had finished and is recorded" if kept else "stopped, not recorded")
                     + ")")
        elif cluster is not None and cluster.in_flight:
            where = f" ({cluster.in_flight} points queued or running on Ray cancelled, not recorded)"
        print(f"run_sweep: stopped by {exc}{where}; {recorded} points recorded in {ledger} by this run. "
              "Run the same command with --resume to continue.", file=sys.stderr)
        return 128 + exc.signum
    except BaseException:
        with contextlib.suppress(Exception):  # what finished is recorded, whatever stopped the sweep
            rows.flush()
        raise
    finally:
        if cluster is not None:
            cluster.close()
    bar.close()
    rows.flush()
    ran = [r for r in results if r.status != "skipped"]
    step_total = sum(r.step_s or 0 for r in ran)
    wall = sum(r.seconds for r in ran) if cluster is None else time.perf_counter() - t_start
    counts = {s: sum(1 for r in results if r.status == s) for s in sorted({r.status for r in results})}
    print(f"{len(results)} points: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; wall {wall:.1f} s" + (" on Ray" if cluster is not None else "") + f", step time {step_total:.1f} s",
          file=sys.stderr)
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

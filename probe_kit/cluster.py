"""A sweep's points as Ray tasks: one laptop's cores, or every free card of a cluster.

    python -m probe_kit.run_sweep SWEEP.toml --ray [ADDRESS] [--resume] [--shard K/N]

Each point is one Ray task: a probe takes one card (``num_gpus=1``; Ray hands the task its card
through ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES``, and the probe runs in a fresh process
on that worker exactly as ``run_point`` runs it on one machine), a dry run one CPU. A point may
name what else its task needs (``ray_resources = { RTX_4090 = 1 }`` in the sweep file, for a node
started with ``ray start --resources '{"RTX_4090": 8}'``, or ``"accelerator_type:A100" = 0.001``,
which Ray sets on nodes by their card); without, it takes any free card, and the row records
which (the card, driver and library versions are read on the worker that ran the point, never on
the driver).

The driver is the one writer of the ledger: rows come back as the tasks finish, and are appended
with the ledger's lock and atomic write (dry runs batched as the plain sweep batches them). A
worker that dies in the middle of a point (killed, its node lost, a segfault) has its point
retried by Ray, ``retries`` times; a point whose worker keeps dying is recorded as crashed with the
error. An OOM is data, as everywhere. A stopped driver cancels the cluster's tasks; ``--resume``
runs what the ledger does not hold.

Without an address the sweep starts a Ray instance on this machine for its own run (all its cores,
or ``--ray-cpus N``) and stops it at the end; ``--ray auto`` joins the cluster ``ray start`` runs on
this machine; ``--ray HOST:PORT`` (or ``ray://HOST:10001``) joins a remote one. Every node needs the
project installed (``pip install -e '.[ray]'`` and, for probes, ``'.[probe]'``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ledger.core.errors import Issue, UserError
from ledger.core.models import Gpu, Measurement


#: How to install Ray, as every message about it says.
RAY_EXTRA = "pip install -e '.[ray]'"
#: Times Ray runs a point again after its worker died in the middle of it.
DEFAULT_RETRIES = 2
#: Seconds the driver waits for a result before it looks at signals again.
POLL_S = 0.5


def require_ray():
    """Ray, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise UserError(Issue("--ray", "", f"needs Ray, an optional extra: {RAY_EXTRA}")) from None
    return ray


def reach(address: Optional[str], timeout_s: float = 10.0) -> None:
    """A HOST:PORT address answers on its port, or one line says it does not (Ray itself would
    retry a head that is not there for minutes). ``auto``, ``ray://`` addresses and none are
    left to Ray."""
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(Issue("--ray", address, "an address is HOST:PORT (the head's GCS port, 6379 by default), "
                              "ray://HOST:PORT or auto"))
    import socket

    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(Issue("--ray", address, f"no Ray head answers there ({exc.strerror or exc}); start one "
                              "with `ray start --head`, or give its address")) from None


@dataclass
class Cluster:
    """A connection to Ray and how the sweep's tasks ask it for resources."""

    address: Optional[str] = None
    cpus: Optional[int] = None
    retries: int = DEFAULT_RETRIES
    started: bool = False
    in_flight: int = 0
    _remote: dict = field(default_factory=dict)

    def connect(self) -> "Cluster":
        ray = require_ray()
        if ray.is_initialized():
            return self
        import logging

        kw = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        reach(self.address)
        try:
            if self.address:
                ray.init(address=self.address, **kw)
            else:  # this machine's own instance, without Ray's usage report
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                ray.init(num_cpus=self.cpus, **kw)
                self.started = True
        except Exception as exc:  # unreachable, refused (a missing auth token), a bad address: one line
            where = self.address or "this machine"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(Issue("--ray", self.address or "", f"cannot start or reach Ray on {where}: {first}")) from None
        return self

    def close(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False

    def describe(self) -> str:
        import ray

        total = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        return (f"{nodes} node{'s' * (nodes != 1)}, {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs")

    def _options(self, point, sweep) -> dict:
        opts: dict = {"max_retries": self.retries, "retry_exceptions": False, "num_cpus": 1}
        if sweep.device.split(":")[0] == "cuda":
            opts["num_gpus"] = 1
        if point.resources:
            opts["resources"] = dict(point.resources)
        return opts

    def submit(self, body: Callable, point, sweep):
        import ray

        if body.__name__ not in self._remote:  # exported to the cluster once, not once per point
            self._remote[body.__name__] = ray.remote(body)
        return self._remote[body.__name__].options(**self._options(point, sweep)).remote(point, sweep)

    def run_many(self, body: Callable, points: list, sweep, crashed: Callable[[Any, str], Measurement],
                 add: Callable[[Measurement, dict], None], on_result: Callable[[Any, dict], None]) -> None:
        """``body(point, sweep)`` as a task for every point; as each comes back, its rows go to
        ``add`` (the driver's one writer) and its result to ``on_result``. A point whose worker
        died more often than retried gets ``crashed(point, why)``'s row. Whatever stops this (a
        signal, an error) cancels the tasks still queued or running."""
        import ray

        refs = {self.submit(body, p, sweep): p for p in points}
        self.in_flight = len(refs)
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    p = refs.pop(ref)
                    self.in_flight = len(refs)
                    on_result(p, self._result(ref, p, crashed, add))
        finally:
            for ref in refs:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # already finished or gone with its node
                    pass

    def _result(self, ref, point, crashed: Callable, add: Callable) -> dict:
        import ray

        t0 = time.perf_counter()
        try:
            out = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the worker died more times than retried, or was cancelled
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            why = (f"its Ray worker died and the point was tried {self.retries + 1} times: "
                   f"{type(exc).__name__}: {first}"[:2000])
            add(crashed(point, why), {})
            return {"status": "crashed", "seconds": time.perf_counter() - t0, "step_s": None, "message": why,
                    "node": None}
        gpus = {k: Gpu.model_validate_json(v) for k, v in out["gpus"].items()}
        for text in out["rows"]:
            add(Measurement.model_validate_json(text), gpus)
        return out

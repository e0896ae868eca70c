"""Sweeps on Ray (probe_kit.cluster): a local cluster of 2 CPUs on this machine, started once for
the module with ``ray start --head --block`` (its processes in a group of their own, ended at
the end), dry runs of the tiny Llama as the points."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from ledger.storage import store
from probe_kit import run_sweep
from probe_kit.run_sweep import load_sweep

DRY = """
[sweep]
name = "d"
device = "dry"
[base]
model = "tiny-llama"
random_weights = true
seq_len = 64
response_len = 8
[axes]
rank = {ranks}
"""


def write(tmp_path: Path, ranks=(4, 8), extra: str = "") -> str:
    path = tmp_path / "sweep.toml"
    path.write_text(textwrap.dedent(DRY.format(ranks=list(ranks))) + textwrap.dedent(extra), encoding="utf-8")
    return str(path)


# -- without a cluster --------------------------------------------------------------------


def test_without_ray_the_flag_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    ledger = tmp_path / "d.json"
    assert run_sweep.main([write(tmp_path), "--ledger", str(ledger), "--ray", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--ray: needs Ray, an optional extra: pip install -e '.[ray]'"]
    assert not ledger.exists()


@pytest.mark.parametrize("args, message", [
    (["--ray-cpus", "2"], "--ray-cpus: only with --ray"),
    (["--retries", "1"], "--retries: only with --ray"),
    (["--ray", "auto", "--ray-cpus", "2"], "--ray-cpus: needs --ray without an address"),
    (["--ray", "--retries", "-1"], "--retries: must be 0 or more, got -1"),
    (["--write-every", "-1"], "--write-every: must be 0 or more seconds, got -1"),
])
def test_ray_flags_are_checked_before_anything_runs(tmp_path, capsys, args, message):
    ledger = tmp_path / "d.json"
    assert run_sweep.main([write(tmp_path), "--ledger", str(ledger), "--no-progress", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not ledger.exists()


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:{port}", "no Ray head answers there"),
    ("nonsense", "an address is HOST:PORT"),
])
def test_an_address_with_no_ray_head_is_one_line(tmp_path, capsys, address, message):
    pytest.importorskip("ray")  # the cluster's fixture reads Ray's settings again after this import
    with socket.socket() as s:  # a port bound by nobody's listener: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = address.format(port=port)
    t0 = time.monotonic()
    assert run_sweep.main([write(tmp_path), "--ledger", str(tmp_path / "d.json"), "--no-progress", "--ray", address]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"--ray:{address}: {message}") and time.monotonic() - t0 < 15


def test_points_name_their_card_and_the_resources_their_task_needs(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text(textwrap.dedent("""
        [sweep]
        device = "cuda"
        ray_resources = { lab = 1 }
        [base]
        model = "tiny-llama"
        random_weights = true
        [[points]]
        rank = 8
        gpu = "rtx-4090"
        ray_resources = { RTX_4090 = 1 }
        [[points]]
        rank = 8
        gpu = "rx-7900-xtx"
        [[points]]
        rank = 8
    """), encoding="utf-8")
    sweep = load_sweep(str(path))
    a, b, c = sweep.points
    assert (a.gpu, b.gpu, c.gpu) == ("rtx-4090", "rx-7900-xtx", None)
    assert a.resources == {"lab": 1, "RTX_4090": 1} and b.resources == c.resources == {"lab": 1}
    assert len({a.id, b.id, c.id}) == 3 and "rtx-4090" in a.id  # one point per card, each its own id
    cmd = run_sweep.probe_command(a, run_sweep.for_point(sweep, a), "L.json")
    assert cmd[cmd.index("--gpu") + 1] == "rtx-4090"
    assert "--gpu" not in run_sweep.probe_command(c, run_sweep.for_point(sweep, c), "L.json")


@pytest.mark.parametrize("extra, where", [
    ('[[points]]\nrank = 16\nray_resources = { GPU = 1 }\n', "points[0]:ray_resources: CPU and GPU are set"),
    ('[[points]]\nrank = 16\nray_resources = { lab = -1 }\n', "points[0]:ray_resources: must be a table"),
    ('[[points]]\nrank = 16\ngpu = "rtx-4090"\n', "points[0].gpu: a dry-run sweep has no card"),
])
def test_bad_point_options_are_one_located_line(tmp_path, capsys, extra, where):
    path = write(tmp_path, extra=extra)
    assert run_sweep.main([path, "--ledger", str(tmp_path / "d.json"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(path) and where in err[0], err


def test_a_probe_task_returns_the_rows_and_card_its_worker_recorded(tmp_path):
    """The body a Ray worker runs for a probe (here a CPU probe, no Ray): the probe in a fresh
    process into the worker's own ledger, its row handed back for the driver to write, with the
    worker's versions in it."""
    import torch

    from ledger.core.models import Measurement

    path = tmp_path / "cpu.toml"
    path.write_text('[sweep]\ndevice = "cpu"\ntimeout_s = 300\n[base]\nmodel = "tiny-llama"\nrandom_weights = true\n'
                    'seq_len = 64\nresponse_len = 8\nrank = 4\n', encoding="utf-8")
    sweep = load_sweep(str(path))
    out = run_sweep.probe_task(sweep.points[0], sweep)
    assert out["status"] == "ok" and out["gpus"] == {} and len(out["rows"]) == 1
    row = Measurement.model_validate_json(out["rows"][0])
    assert row.id == sweep.points[0].id and row.kind == "probe" and row.environment.torch == torch.__version__


def test_tasks_ask_ray_for_one_card_or_one_cpu_and_the_points_resources():
    from probe_kit.cluster import Cluster

    sweep = run_sweep.Sweep(path="s", name="s", device="cuda", timeout_s=1, gpu=None, host_ram_cap_gib=None, axes={},
                            base={}, resources={})
    point = run_sweep.Point(index=0, options={}, config=None, id="p", where="s", resources={"RTX_4090": 1})
    c = Cluster(retries=3)
    assert c._options(point, sweep) == {"max_retries": 3, "retry_exceptions": False, "num_cpus": 1, "num_gpus": 1,
                                        "resources": {"RTX_4090": 1}}
    dry = run_sweep.replace(sweep, device="dry")
    assert c._options(run_sweep.replace(point, resources={}), dry) == {"max_retries": 3, "retry_exceptions": False,
                                                                       "num_cpus": 1}


# -- on a local cluster -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A Ray head of 2 CPUs on this machine; its address. In-process drivers of the module share
    one connection to it (so its workers, torch imported, are reused from test to test)."""
    if importlib.util.find_spec("ray") is None:  # not imported yet: Ray reads its environment on import
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="vray-")  # short: Ray's socket paths have a length limit
    token = Path(temp, "token")
    token.write_text(secrets.token_hex(32), encoding="utf-8")
    # Loopback only, no usage report, and the cluster's own token (not ~/.ray's): for the head, this
    # process's driver and the drivers it starts.
    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    # A Ray imported earlier in this process (another test) read its settings then: read them again.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()

    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--port",
                             str(port), "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    from ray._private import ray_constants

    # This process imported Ray before the environment said loopback: tell its copy too.
    loopback = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        deadline = time.monotonic() + 90
        while True:  # the head's port open, then one connection (a connection to no head hangs)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or head.poll() is not None:
                    raise RuntimeError("the Ray head did not start") from None
                time.sleep(0.5)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        yield address
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = loopback
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        for pid in _processes(lambda cmd: temp.encode() in cmd):  # the cluster's own, in groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _normal(path: Path) -> dict:
    """A ledger's rows by id, less what differs between two runs of one point: the dry run's own
    timing and the process's memory growth, noted in its breakdown."""
    out = {}
    for m in store.load(path).measurements:
        doc = json.loads(m.model_dump_json())
        notes = []
        for note in doc["provenance"].get("notes", []):
            if note.startswith("Predicted under fake tensors") and "Breakdown: " in note:
                head, _, body = note.partition("Breakdown: ")
                breakdown = json.loads(body)
                for key in ("seconds", "rss_growth_mib"):
                    breakdown.pop(key, None)
                note = head + json.dumps(breakdown, sort_keys=True)
            notes.append(note)
        doc["provenance"]["notes"] = notes
        out[m.id] = doc
    return out


def _processes(match) -> list[int]:
    """PIDs of this machine's processes whose command line (bytes) ``match`` accepts."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if match(cmd):
                found.append(int(d.name))
    return found


def _ray_tasks(name: str) -> list[int]:
    """PIDs of this machine's Ray workers running a task of this name (Ray titles them ray::NAME)."""
    return _processes(lambda cmd: cmd.split(b"\0")[0].strip() == f"ray::{name}".encode())


def _kill_first_task(name: str, killed: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not killed:
        for pid in _ray_tasks(name):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            except ProcessLookupError:
                continue
        time.sleep(0.05)


def test_a_dry_sweep_on_ray_writes_the_rows_of_the_plain_sweep(tmp_path, cluster, capsys):
    """Rows made on the workers (their library versions) and written by the driver: the same rows
    as the plain sweep's; a point refused at run time is reported, the sweep goes on, and both exit 1."""
    path = write(tmp_path, ranks=(4, 8, 16), extra='[[points]]\nrank = 4\ntarget_modules = ["no_such_proj"]\n')
    plain, on_ray = tmp_path / "plain.json", tmp_path / "ray.json"
    assert run_sweep.main([path, "--ledger", str(plain), "--no-progress"]) == 1
    assert run_sweep.main([path, "--ledger", str(on_ray), "--no-progress", "--ray", cluster]) == 1
    out = capsys.readouterr()
    assert "on Ray (1 node, 2 CPUs, 0 GPUs)" in out.err and out.out.count("no_such_proj names no module") == 2
    a, b = _normal(plain), _normal(on_ray)
    assert len(a) == 3 and a == b
    assert run_sweep.main([path, "--ledger", str(on_ray), "--no-progress", "--ray", cluster, "--resume"]) == 1
    assert _normal(on_ray) == b  # --resume: nothing run twice


def test_a_worker_killed_mid_point_loses_nothing(tmp_path, cluster):
    """SIGKILL to the worker running a dry run: Ray runs the point again, and every point is
    recorded once, as ok."""
    path = write(tmp_path, ranks=(4, 8, 16))
    ledger = tmp_path / "d.json"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_first_task, args=("dry_task", killed))
    killer.start()
    try:
        rc = run_sweep.main([path, "--ledger", str(ledger), "--no-progress", "--ray", cluster, "--write-every", "0"])
    finally:
        killed.append(0)  # stops the killer if it found nothing
        killer.join()
    assert killed[0] != 0, "no worker was running a point to kill"
    rows = store.load(ledger).measurements
    assert rc == 0 and sorted(m.lora.rank for m in rows) == [4, 8, 16]
    assert all(m.outcome.status == "ok" for m in rows)


def test_a_point_whose_worker_keeps_dying_is_recorded_as_crashed(tmp_path, cluster, capsys):
    path = write(tmp_path, ranks=(4,))
    ledger = tmp_path / "d.json"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_first_task, args=("dry_task", killed))
    killer.start()
    try:
        rc = run_sweep.main([path, "--ledger", str(ledger), "--no-progress", "--ray", cluster, "--retries", "0"])
    finally:
        killed.append(0)
        killer.join()
    assert killed[0] != 0
    (row,) = store.load(ledger).measurements
    assert rc == 0 and row.outcome.status == "crashed"
    assert "its Ray worker died and the point was tried 1 times" in row.outcome.result_text
    assert "crashed (its Ray worker died" in capsys.readouterr().out


def test_a_killed_driver_rerun_with_resume_completes_without_duplicates(tmp_path, cluster):
    """The driver (this machine's sweep) killed outright after some rows: the rows written stay,
    and --resume runs the rest; every point once."""
    path = write(tmp_path, ranks=(4, 8, 16, 32, 64, 128))
    ledger = tmp_path / "d.json"
    argv = [sys.executable, "-m", "probe_kit.run_sweep", path, "--ledger", str(ledger), "--no-progress",
            "--ray", cluster, "--write-every", "0"]
    driver = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and driver.poll() is None:
        if ledger.exists() and len(store.load(ledger).measurements) >= 2:
            break
        time.sleep(0.1)
    driver.kill()
    driver.communicate()
    before = {m.id for m in store.load(ledger).measurements}
    assert 2 <= len(before) < 6, "the driver finished before it could be killed"
    done = subprocess.run(argv + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = [m.id for m in store.load(ledger).measurements]
    assert len(ids) == len(set(ids)) == 6 and before <= set(ids)
    assert f"{6 - len(before)} ok" in done.stderr.strip().splitlines()[-1]

"""Sweeps: points, shards, resume, crashed children, and the rank-ceiling bisection."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO
from ledger.storage import store
from probe_kit import run_sweep
from probe_kit.bisect import find_ceiling
from probe_kit.run_sweep import load_sweep, shard

SWEEP = """
[sweep]
name = "t"
device = "cpu"
timeout_s = 300

[base]
model = "tiny-llama"
random_weights = true
seq_len = 256
response_len = 16

[axes]
rank = [8, 16]
dropout = [0.0, 0.1]

[[points]]
rank = 32
dora = true
"""


def write(tmp_path: Path, text: str = SWEEP) -> str:
    path = tmp_path / "sweep.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_points_are_grid_plus_explicit_and_ids_are_stable(tmp_path):
    sweep = load_sweep(write(tmp_path))
    assert len(sweep.points) == 5
    assert [p.config.rank for p in sweep.points] == [8, 8, 16, 16, 32]
    assert load_sweep(write(tmp_path)).points[3].id == sweep.points[3].id


def test_shards_split_without_overlap():
    sweep = load_sweep(str(REPO / "examples" / "sweeps" / "program-rx-7900-xtx.toml"))
    parts = [shard(sweep.points, k, 4) for k in range(1, 5)]
    ids = [p.id for part in parts for p in part]
    assert sorted(ids) == sorted(p.id for p in sweep.points) and len(set(ids)) == len(ids)


def test_example_sweeps_reproduce_the_program_cross_gpu_sweep():
    points = [p for name in ("program-rx-7900-xtx", "program-rtx-3060-ti")
              for p in load_sweep(str(REPO / "examples" / "sweeps" / f"{name}.toml")).points]
    assert len(points) == 27
    legacy = [m for m in store.load(REPO / "ledger" / "vram.json").measurements
              if m.gpu in ("rx-7900-xtx", "rtx-3060-ti")]

    def key(quant, fixes, rank, dropout, dora, seq):
        return (quant, fixes, rank, round(dropout, 3), bool(dora), seq)

    want = sorted(key(m.quant, m.memory_fixes, m.lora.rank, m.lora.dropout, m.lora.dora, m.seq_len) for m in legacy)
    got = sorted(key(p.config.quant, "all" if len(p.config.fixes) == 4 else "none", p.config.rank, p.config.dropout,
                     p.config.dora, p.config.seq_len) for p in points)
    assert got == want


def test_bad_point_is_reported_before_anything_runs(tmp_path, capsys):
    path = write(tmp_path, SWEEP + "\n[[points]]\nrank = -4\n")
    assert run_sweep.main([path, "--ledger", str(tmp_path / "l.json")]) == 1
    assert capsys.readouterr().err.strip() == f"{path}:points[1]: --rank must be > 0, got -4"
    assert not (tmp_path / "l.json").exists()


def test_list_runs_nothing(tmp_path, capsys):
    assert run_sweep.main([write(tmp_path), "--list", "--shard", "2/2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and all(line.startswith("probe-cpu-") for line in out)


def test_run_resume_and_crash(tmp_path, monkeypatch):
    ledger = tmp_path / "l.json"
    path = write(tmp_path, SWEEP.replace("rank = [8, 16]", "rank = [8]").replace("dropout = [0.0, 0.1]",
                                                                                  "dropout = [0.0]"))
    # Point 2 dies of SIGSEGV in a real child process; the sweep records it and goes on.
    real = run_sweep.probe_command

    def command(point, sweep, ledger_path):
        if point.config.dora:
            return [sys.executable, "-c", "import os, signal, sys; sys.stderr.write('boom: illegal memory access');"
                                          "sys.stderr.flush(); os.kill(os.getpid(), signal.SIGSEGV)"]
        return real(point, sweep, ledger_path)

    monkeypatch.setattr(run_sweep, "probe_command", command)
    assert run_sweep.main([path, "--ledger", str(ledger), "--no-progress"]) == 0
    ms = {m.id: m for m in store.load(ledger).measurements}
    assert len(ms) == 2
    crashed = [m for m in ms.values() if m.outcome.status == "crashed"]
    assert len(crashed) == 1 and "SIGSEGV" in crashed[0].outcome.result_text
    assert "illegal memory access" in crashed[0].outcome.result_text
    before = ledger.read_bytes()
    assert run_sweep.main([path, "--ledger", str(ledger), "--resume", "--no-progress"]) == 0
    assert ledger.read_bytes() == before  # everything was done already


def test_timeout_is_a_crashed_record(tmp_path):
    ledger = tmp_path / "l.json"
    sweep = load_sweep(write(tmp_path))
    sweep.timeout_s = 0.5
    result = run_sweep.run_point(sweep.points[0], sweep, str(ledger))
    assert result.status == "crashed"
    (m,) = store.load(ledger).measurements
    assert m.outcome.status == "crashed" and "timed out" in m.outcome.result_text


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 16, 33])
def test_find_ceiling_is_exact_within_the_promised_probes(n):
    for ceiling in range(-1, n):
        points = list(range(n))
        asked = []

        def fits(p):
            asked.append(p)
            return p <= ceiling

        best, probes = find_ceiling(points, fits)
        assert best == (ceiling if ceiling >= 0 else None)
        assert probes == len(asked) <= math.ceil(math.log2(n)) + 1


@pytest.mark.parametrize("n", [1, 2, 3, 8, 33])
def test_confirm_first_takes_two_probes_when_the_prediction_is_right(n):
    for ceiling in range(-1, n):
        for start in range(n):
            asked = []

            def fits(p):
                asked.append(p)
                return p <= ceiling

            best, probes = find_ceiling(list(range(n)), fits, start)
            assert best == (ceiling if ceiling >= 0 else None)  # exact whatever the start
            assert probes == len(asked) == len(set(asked))  # no point probed twice
            if start == ceiling:
                assert probes <= 2
            assert probes <= math.ceil(math.log2(n)) + 3


def test_find_ceiling_end_to_end_on_cpu(tmp_path, capsys, monkeypatch):
    # A budget makes the ceiling real: ranks above it OOM in the tracker meter.
    text = SWEEP.split("[axes]")[0] + "[axes]\nrank = [4, 8, 16, 32, 64, 128, 256, 512]\n"
    path = write(tmp_path, text)
    sweep = load_sweep(path)
    from probe_kit.probe_vram import run_probe

    peaks = {p.config.rank: run_probe(p.config, device="cpu")[0].outcome.peak_allocated_mib
             for p in sweep.points if p.config.rank in (32, 64)}
    budget = (peaks[32] + peaks[64]) / 2  # 32 fits, 64 does not
    real = run_sweep.probe_command

    def command(point, sw, ledger_path):
        return real(point, sw, ledger_path) + ["--budget-mib", str(budget)]

    monkeypatch.setattr(run_sweep, "probe_command", command)
    assert run_sweep.main([path, "--ledger", str(tmp_path / "l.json"), "--find-ceiling", "rank",
                           "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "ceiling: rank 32 of [4, 8, 16, 32, 64, 128, 256, 512] (3 probes; plain bisection takes at most 4" in out
    assert len(store.load(tmp_path / "l.json").measurements) == 3
    # Confirm-first from a predicted ceiling: the prediction and the rank above it.
    assert run_sweep.main([path, "--ledger", str(tmp_path / "m.json"), "--find-ceiling", "rank", "--start-rank", "32",
                           "--no-progress"]) == 0
    assert "ceiling: rank 32 of [4, 8, 16, 32, 64, 128, 256, 512] (2 probes;" in capsys.readouterr().out


def test_running_again_without_resume_stops_at_once(tmp_path, capsys):
    ledger = tmp_path / "l.json"
    path = write(tmp_path, SWEEP.split("[axes]")[0] + "[axes]\nrank = [8]\n")
    assert run_sweep.main([path, "--ledger", str(ledger), "--no-progress"]) == 0
    before = ledger.read_bytes()
    capsys.readouterr()
    t0 = time.perf_counter()
    assert run_sweep.main([path, "--ledger", str(ledger), "--no-progress"]) == 1
    assert time.perf_counter() - t0 < 5  # nothing was probed
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{ledger}: 1 of 1 points are in this ledger already") and "--resume" in err
    assert ledger.read_bytes() == before


# A driver that runs the sweep with a slow child at one point, so a signal lands mid-point.
_SLOW_DRIVER = """
import sys, time
from probe_kit import run_sweep
real = run_sweep.probe_command
def command(point, sweep, ledger):
    if point.config.rank == SLOW_RANK:
        return [sys.executable, "-c", "import pathlib, time; pathlib.Path(MARKER).touch(); time.sleep(600)"]
    return real(point, sweep, ledger)
run_sweep.probe_command = command
sys.exit(run_sweep.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_point_stops_cleanly_and_resume_finishes(tmp_path, signame):
    # The sweep runs as a background job would: SIGINT ignored when it starts.
    ledger = tmp_path / "l.json"
    marker = tmp_path / "slow-started"
    path = write(tmp_path, SWEEP.split("[axes]")[0] + "[axes]\nrank = [8, 16]\n")
    driver = tmp_path / "driver.py"
    driver.write_text(_SLOW_DRIVER.replace("SLOW_RANK", "16").replace("MARKER", repr(str(marker))))
    proc = subprocess.Popen([sys.executable, str(driver), path, "--ledger", str(ledger), "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, signame), err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"run_sweep: stopped by {signame} during probe-cpu-4bit-r16-") and "--resume" in last
    ids = [m.id for m in store.load(ledger).measurements]
    assert len(ids) == 1 and "-r8-" in ids[0]  # the first point is kept; the stopped one is not recorded
    # --resume picks up: every point present once.
    assert run_sweep.main([path, "--ledger", str(ledger), "--resume", "--no-progress"]) == 0
    ids = [m.id for m in store.load(ledger).measurements]
    assert len(ids) == len(set(ids)) == 2
    assert all(m.outcome.status == "ok" for m in store.load(ledger).measurements)


def test_a_dry_sweep_stopped_mid_point_records_nothing(tmp_path, monkeypatch):
    """SIGINT or SIGTERM during an in-process dry run stops the sweep; the point is not recorded
    as a crash (a --resume then runs it)."""
    import signal as sig

    import probe_kit.dry_run as dry

    path = write(tmp_path, '[sweep]\nname = "d"\ndevice = "dry"\n[base]\nmodel = "tiny-llama"\nrandom_weights = true\n'
                           'seq_len = 64\nresponse_len = 8\n[axes]\nrank = [4]\n')
    sweep = load_sweep(path)

    def interrupted(*a, **k):
        raise run_sweep.SweepInterrupted(sig.SIGTERM)

    monkeypatch.setattr(dry, "predict", interrupted)
    ledger = tmp_path / "d.json"
    with pytest.raises(run_sweep.SweepInterrupted):
        run_sweep.run_dry_point(sweep.points[0], sweep, str(ledger))
    assert not ledger.exists()


def test_a_dry_sweep_records_rows_without_a_card(tmp_path):
    path = write(tmp_path, '[sweep]\nname = "d"\ndevice = "dry"\n[base]\nmodel = "tiny-llama"\nrandom_weights = true\n'
                           'seq_len = 64\nresponse_len = 8\n[axes]\nrank = [4, 8]\n')
    ledger = tmp_path / "d.json"
    assert run_sweep.main([path, "--ledger", str(ledger), "--no-progress"]) == 0
    rows = store.load(ledger).measurements
    assert [m.kind for m in rows] == ["dry_run", "dry_run"] and all(m.gpu is None for m in rows)
    assert all(m.id.startswith("dry-tiny-llama-4bit-r") for m in rows)
    assert run_sweep.main([path, "--ledger", str(ledger), "--resume", "--no-progress"]) == 0  # nothing to redo
    assert len(store.load(ledger).measurements) == 2


def test_a_dry_sweep_that_simulates_the_allocator_replaces_the_rows_recorded_without_it(tmp_path):
    body = ('[base]\nmodel = "tiny-llama"\nrandom_weights = true\nseq_len = 64\nresponse_len = 8\n'
            '[axes]\nrank = [4, 8]\n')
    plain = write(tmp_path, '[sweep]\nname = "d"\ndevice = "dry"\n' + body)
    ledger = tmp_path / "d.json"
    assert run_sweep.main([plain, "--ledger", str(ledger), "--no-progress"]) == 0
    before = store.load(ledger).measurements
    assert all(m.outcome.allocator is None for m in before)
    sim = tmp_path / "sim.toml"
    sim.write_text('[sweep]\nname = "d"\ndevice = "dry"\nsimulate_allocator = true\n' + body)
    assert run_sweep.main([str(sim), "--ledger", str(ledger), "--no-progress"]) == 0
    after = store.load(ledger).measurements
    assert [m.id for m in after] == [m.id for m in before]  # replaced in place, nothing duplicated
    for old, new in zip(before, after):
        a = new.outcome.allocator
        assert a is not None and a.conf is None and a.peak_reserved_mib >= a.peak_allocated_mib
        assert a.peak_allocated_mib == pytest.approx(old.outcome.peak_allocated_mib, abs=0.2)
        assert "probe_kit.allocator" in new.provenance.source
    assert run_sweep.main([str(sim), "--ledger", str(ledger), "--resume", "--no-progress"]) == 0  # nothing to redo
    assert store.load(ledger).measurements == after


def test_the_allocators_simulation_is_a_dry_sweeps_in_one_line(tmp_path, capsys):
    path = write(tmp_path, '[sweep]\nname = "p"\ndevice = "cpu"\nsimulate_allocator = true\n[base]\n'
                           'model = "tiny-llama"\nrandom_weights = true\n')
    assert run_sweep.main([path, "--ledger", str(tmp_path / "l.json"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}:sweep.simulate_allocator: simulates a dry run's allocations") and "\n" not in err
    assert not (tmp_path / "l.json").exists()


def test_a_dry_sweep_writes_its_rows_together_and_keeps_them_when_stopped(tmp_path, monkeypatch):
    """Rows are appended in batches (one rewrite of the ledger per batch, not per row); a sweep
    stopped by a signal still records every point that finished before it."""
    import signal as sig

    import probe_kit.dry_run as dry
    from ledger.storage import store as ledger_store

    path = write(tmp_path, '[sweep]\nname = "d"\ndevice = "dry"\n[base]\nmodel = "tiny-llama"\nrandom_weights = true\n'
                           'seq_len = 64\nresponse_len = 8\n[axes]\nrank = [4, 8, 16]\n')
    sweep = load_sweep(path)
    ledger = tmp_path / "d.json"
    writes = []
    real_append = ledger_store.append
    monkeypatch.setattr(ledger_store, "append", lambda *a, **k: writes.append(len(a[1])) or real_append(*a, **k))
    real_predict = dry.predict

    def predict(cfg, **kw):
        if cfg.rank == 16:
            raise run_sweep.SweepInterrupted(sig.SIGTERM)
        return real_predict(cfg, **kw)

    monkeypatch.setattr(dry, "predict", predict)
    rc = run_sweep.run_sweep(sweep, sweep.points, ledger=str(ledger), done={}, progress=False)
    assert rc == 128 + sig.SIGTERM
    assert writes == [2]  # the two finished points in one append, written as the signal stopped the sweep
    assert sorted(m.lora.rank for m in store.load(ledger).measurements) == [4, 8]


def test_dry_rows_leave_a_row_another_writer_recorded(tmp_path):
    """A batch holding a point another shard recorded meanwhile appends the others, and leaves
    that writer's row as it is."""
    path = write(tmp_path, '[sweep]\nname = "d"\ndevice = "dry"\n[base]\nmodel = "tiny-llama"\nrandom_weights = true\n'
                           'seq_len = 64\nresponse_len = 8\n[axes]\nrank = [4, 8]\n')
    sweep = load_sweep(path)
    ledger = str(tmp_path / "d.json")
    first = run_sweep.DryRows(ledger, every_s=3600)
    for p in sweep.points:
        run_sweep.run_dry_point(p, sweep, ledger, first)
    assert not Path(ledger).exists()  # nothing written before the batch is due
    theirs = first.pending[0].model_copy(update={"provenance": first.pending[0].provenance.model_copy(
        update={"notes": ["written by another shard"]})})
    store.append(ledger, [theirs], create=True)
    first.flush()
    rows = {m.id: m for m in store.load(ledger).measurements}
    assert len(rows) == 2 and rows[theirs.id].provenance.notes == ["written by another shard"]


def test_the_mixture_of_experts_example_sweep_loads():
    sweep = load_sweep(str(REPO / "examples" / "sweeps" / "moe-h200.toml"))
    assert sweep.device == "cuda" and len(sweep.points) == 7
    assert {p.config.model for p in sweep.points} == {"gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b"}
    assert all(p.config.optimizer == "adamw_torch" and p.config.fixes == [] for p in sweep.points)


def test_a_sweep_point_of_several_gpus_with_cpu_offload_keeps_it_in_its_config_id_and_flags(tmp_path):
    sweep = load_sweep(write(tmp_path, SWEEP + """
[[points]]
rank = 8
gpus = 2
strategy = "fsdp"
cpu_offload = true
optim = "adamw_torch"
"""))
    last = sweep.points[-1]
    assert last.config.cpu_offload and last.config.gpus == 2 and last.config.strategy == "fsdp"
    assert "--cpu-offload" in last.flags() and last.id not in {p.id for p in sweep.points[:-1]}
    assert "cpu_offload" not in sweep.points[0].config.key()  # off: as every earlier point's id had it

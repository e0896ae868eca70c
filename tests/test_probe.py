"""Probes on the CPU with tiny models built from configs (a Gemma 3 and a Llama)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ledger.storage import store
from ledger.core.models import Measurement
from probe_kit.probe_vram import main as probe_main
from probe_kit.probe_vram import run_probe
from probe_kit.recipe import ProbeConfig, RecipeError, parse_fixes

BASE = dict(model="tiny-llama", random_weights=True, seq_len=1024, response_len=32)


def peak(**kw) -> float:
    m, _ = run_probe(ProbeConfig(**{**BASE, **kw}), device="cpu")
    assert m.outcome.status == "ok", m.outcome
    return m.outcome.peak_allocated_mib


def test_probe_gives_a_complete_valid_measurement():
    m, gpu = run_probe(ProbeConfig(**BASE, rank=16, dropout=0.1), device="cpu")
    assert gpu is None
    again = Measurement.model_validate_json(m.model_dump_json(), strict=True)
    o = again.outcome
    assert o.status == "ok" and o.after_load_mib > 0 and o.pre_step_mib > o.after_load_mib
    assert o.peak_allocated_mib > o.pre_step_mib and o.step_s > 0 and o.peak_reserved_mib is None
    assert again.lora.rank == 16 and again.lora.dropout == 0.1 and again.memory_fixes == "all"
    assert again.logits_to_keep == 33 and again.seq_len == 1024
    env = again.environment
    assert env.torch and env.transformers and env.peft and env.bitsandbytes and env.meter == "tracker"


def test_peak_is_deterministic():
    assert peak(rank=16) == peak(rank=16)


def test_peak_rises_strictly_with_rank():
    peaks = [peak(rank=r) for r in (8, 32, 128)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_dropout_and_dora_add():
    base = peak(rank=16)
    assert peak(rank=16, dropout=0.1) > base
    assert peak(rank=16, dora=True) > base


def test_logits_to_keep_lowers_the_peak_on_a_large_vocab_model():
    cfg = dict(model="tiny-gemma3", rank=8, seq_len=512, response_len=32)
    with_fix = peak(**cfg)
    without = peak(**cfg, fixes=parse_fixes("chunked_mlp,save_on_cpu,bf16_lm_head"))
    assert with_fix < without / 2


def test_bf16_and_4bit_paths_run_on_cpu():
    assert peak(rank=8, quant="bf16") > 0
    assert peak(rank=8, model="tiny-gemma3", seq_len=256) > 0


def test_simulated_oom_is_a_structured_oom_record(tmp_path, capsys):
    ledger = tmp_path / "l.json"
    rc = probe_main(["--model", "tiny-llama", "--random-weights", "--rank", "16", "--seq-len", "1024",
                     "--response-len", "32", "--device", "cpu", "--budget-mib", "8", "--ledger", str(ledger), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (m,) = store.load(ledger).measurements
    assert m.id == doc["id"] and m.outcome.status == "oom" and m.outcome.peak_allocated_mib is None
    oom = m.outcome.oom
    assert oom.total_mib == 8.0 and oom.tried_mib > 0 and oom.free_mib < oom.tried_mib
    assert oom.max_allocated_mib <= 8.0 and m.provenance.simulated


def test_bad_input_is_one_line(capsys):
    assert probe_main(["--model", "tiny-llama", "--random-weights", "--rank", "0", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip() == "probe_vram: --rank must be > 0, got 0"
    assert probe_main(["--model", "nope.json", "--random-weights", "--rank", "8", "--device", "cpu"]) == 1
    assert "nope.json: no such config file" in capsys.readouterr().err
    assert probe_main(["--model", "tiny-llama", "--random-weights", "--rank", "8", "--fixes", "magic",
                       "--device", "cpu"]) == 1
    assert "unknown memory fix 'magic'" in capsys.readouterr().err


def test_checkpointing_must_be_active(monkeypatch):
    import probe_kit.recipe as recipe

    monkeypatch.setattr(recipe, "checkpointing_active", lambda model: False)
    with pytest.raises(RecipeError, match="gradient checkpointing is not active"):
        run_probe(ProbeConfig(**BASE, rank=8), device="cpu")


def test_cuda_device_without_a_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RecipeError, match="no CUDA or ROCm GPU is visible"):
        run_probe(ProbeConfig(**BASE, rank=8), device="cuda")


def test_json_stdout_is_one_document():
    out = subprocess.run([sys.executable, "-m", "probe_kit.probe_vram", "--model", "tiny-llama", "--random-weights",
                          "--rank", "8", "--seq-len", "128", "--response-len", "16", "--device", "cpu", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outcome"]["status"] == "ok"


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "sigint-ignored"])
def test_host_ram_cap_is_a_host_oom_record(background):
    # A background job (CI, nohup, `cmd &`) starts with SIGINT ignored: the cap must still stop the step.
    import signal

    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    out = subprocess.run([sys.executable, "-m", "probe_kit.probe_vram", "--model", "tiny-llama", "--random-weights",
                          "--rank", "8", "--seq-len", "128", "--response-len", "16", "--device", "cpu",
                          "--host-ram-cap-gib", "0.01", "--json"], capture_output=True, text=True, timeout=300,
                         preexec_fn=ignore)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["outcome"]["status"] == "host_oom" and "host RAM passed the cap" in doc["outcome"]["result_text"]
    assert "peak_allocated_mib" not in doc["outcome"]


def test_doctor_says_plainly_there_is_no_gpu():
    import torch

    out = subprocess.run([sys.executable, "-m", "ledger.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["libraries"]["torch"]["imports"] and doc["libraries"]["peft"]["version"]
    if not torch.cuda.is_available():
        assert doc["gpus"] == [] and any("no CUDA or ROCm GPU" in w for w in doc["warnings"])


def test_dropout_keeps_a_bool_mask_as_on_a_gpu():
    # On CUDA/ROCm F.dropout is the fused native_dropout: a 1-byte mask is kept for backward. The
    # CPU's own path keeps a mask in the input's dtype (2 bytes in bf16): the probe step uses the
    # GPU's, so CPU and dry-run figures charge dropout what a card does.
    import torch

    from probe_kit.meters import TrackerMeter
    from probe_kit.recipe import gpu_dropout

    original = torch.nn.functional.dropout
    x = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
    kept = {}
    for name, ctx in (("cpu", None), ("gpu", gpu_dropout())):
        with (ctx if ctx is not None else __import__("contextlib").nullcontext()):
            with TrackerMeter() as meter:
                y = torch.nn.functional.dropout(x, 0.1, True)
                kept[name] = meter.allocated_mib()
        del y
    assert kept["cpu"] == pytest.approx(4.0, abs=0.01)  # output 2 MiB + bf16 mask 2 MiB
    assert kept["gpu"] == pytest.approx(3.0, abs=0.01)  # output 2 MiB + bool mask 1 MiB
    assert torch.nn.functional.dropout is original  # restored after the step

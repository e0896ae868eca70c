"""GPU-only checks: what a real card must show. Skipped without a CUDA or ROCm GPU; the same code
paths run on the CPU in test_probe.py, test_meters.py and test_gpu_path.py (which simulates the
card's answers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, SMALL
from ledger.storage import store
from probe_kit.meters import MIB, AllocatorMeter, quant_state_tensors
from probe_kit.probe_vram import run_probe
from probe_kit.recipe import ProbeConfig, build_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]

TINY = dict(model="tiny-llama", random_weights=True, rank=16, seq_len=1024, response_len=32)


def test_allocator_meter_counts_a_known_allocation():
    meter = AllocatorMeter("cuda")
    base = meter.allocated_mib()
    meter.reset_peak()
    t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    assert meter.allocated_mib() - base == pytest.approx(64, abs=0.01)
    assert meter.peak_allocated_mib() >= base + 64 and meter.peak_reserved_mib() >= meter.peak_allocated_mib()
    del t


@pytest.mark.parametrize("quant", ["4bit", "bf16"])
def test_cuda_probe_agrees_with_the_tracker(quant):
    cfg = ProbeConfig(**TINY, quant=quant)
    gpu, card = run_probe(cfg, device="cuda")
    cpu, _ = run_probe(cfg, device="cpu")
    o, env = gpu.outcome, gpu.environment
    assert o.status == "ok" and o.peak_reserved_mib >= o.peak_allocated_mib and card is not None
    assert env.meter == "allocator" and env.device.startswith("cuda") and env.sdpa_backends
    assert o.free_at_start_mib is not None and o.outside_allocator_mib is not None
    # The tracker sees no cuBLAS workspaces (two handles: forward and autograd threads) and no
    # kernel temporaries: the gap is bounded by the recorded workspace sizes plus a small share.
    workspaces = 2 * ((env.cublas_workspace_mib or 8.1) + (env.cublaslt_workspace_mib or 0.0))
    gap = o.peak_allocated_mib - cpu.outcome.peak_allocated_mib
    assert -0.10 * cpu.outcome.peak_allocated_mib - 8 <= gap <= workspaces + 0.10 * cpu.outcome.peak_allocated_mib + 8


@pytest.mark.parametrize("fixes", [["fused_linear_ce"], ["activation_offloading"]])
def test_the_users_fixes_on_the_card_agree_with_their_cpu_stand_ins(fixes):
    """Liger's Triton kernels and TRL's streams run for real on the card; the CPU runs the same
    Python with them stood in. The gap is bounded as for the stock step (workspaces, kernels'
    temporaries), and each fix moves the card's peak the way it moves the CPU's."""
    pytest.importorskip("liger_kernel" if "fused_linear_ce" in fixes else "trl")
    base = dict(TINY, model="tiny-gemma3", quant="bf16", batch_size=2,
                gradient_checkpointing="activation_offloading" not in fixes)
    fixed, stock = ProbeConfig(**base, fixes=fixes), ProbeConfig(**base, fixes=[])
    gpu, _ = run_probe(fixed, device="cuda")
    cpu, _ = run_probe(fixed, device="cpu")
    gpu_stock, _ = run_probe(stock, device="cuda")
    cpu_stock, _ = run_probe(stock, device="cpu")
    o, env = gpu.outcome, gpu.environment
    assert o.status == "ok" and gpu.memory_fixes == fixes
    workspaces = 2 * ((env.cublas_workspace_mib or 8.1) + (env.cublaslt_workspace_mib or 0.0))
    gap = o.peak_allocated_mib - cpu.outcome.peak_allocated_mib
    assert -0.10 * cpu.outcome.peak_allocated_mib - 8 <= gap <= workspaces + 0.10 * cpu.outcome.peak_allocated_mib + 8
    saved_gpu = gpu_stock.outcome.peak_allocated_mib - o.peak_allocated_mib
    saved_cpu = cpu_stock.outcome.peak_allocated_mib - cpu.outcome.peak_allocated_mib
    assert saved_gpu == pytest.approx(saved_cpu, rel=0.15, abs=2)


def test_everything_is_on_the_device_quant_state_included():
    model = build_model(ProbeConfig(**TINY, quant="4bit"), torch.device("cuda"))
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for p in model.parameters() for t in quant_state_tensors(p)]
    assert tensors and all(t.device.type == "cuda" for t in tensors)


def test_a_forced_allocator_oom_is_an_oom_record():
    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + 48 * MIB) / total))
    try:
        m, _ = run_probe(ProbeConfig(**{**TINY, "seq_len": 8192, "response_len": 64}), device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert m.outcome.status == "oom" and m.outcome.peak_allocated_mib is None
    assert m.outcome.oom.tried_mib and m.outcome.oom.max_allocated_mib is not None


def test_a_probe_appends_to_a_ledger_that_already_has_the_card(tmp_path):
    from probe_kit.probe_vram import main

    ledger = tmp_path / "l.json"
    ledger.write_bytes(SMALL.read_bytes())
    name = torch.cuda.get_device_properties(0).name
    key = "this-card"
    lg = store.load(ledger)
    from ledger.core.models import Gpu

    lg.gpus[key] = Gpu(name=name, total_mib=1.0)  # an older entry for this card, other content
    store.save(lg, ledger)
    args = ["--model", "tiny-llama", "--random-weights", "--rank", "8", "--seq-len", "256", "--response-len", "16",
            "--device", "cuda", "--gpu", key, "--ledger", str(ledger)]
    assert main(args) == 0 and main(args + ["--rank", "16"]) == 0
    after = store.load(ledger)
    assert after.gpus[key].total_mib == 1.0 and sum(m.gpu == key for m in after.measurements) == 2


DEVICE_ASSERT = """
import sys, torch
from probe_kit import probe_vram, recipe
def step(*a, **k):
    torch.tensor([1.0], device="cuda")[torch.tensor([5], device="cuda")].item()  # device-side assert
recipe.step = step
sys.exit(probe_vram.main(sys.argv[1:]))
"""


def test_a_device_side_error_is_a_crashed_record_under_a_sweep(tmp_path):
    from probe_kit import run_sweep

    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text(textwrap.dedent("""
        [sweep]
        device = "cuda"
        timeout_s = 300
        [base]
        model = "tiny-llama"
        random_weights = true
        seq_len = 256
        response_len = 16
        [axes]
        rank = [8]
    """))
    sweep = run_sweep.load_sweep(str(sweep_file))
    driver = tmp_path / "driver.py"
    driver.write_text(DEVICE_ASSERT)
    ledger = tmp_path / "l.json"

    def command(point, sw, path):
        return [sys.executable, str(driver), *run_sweep.probe_command(point, sw, path)[3:]]

    result = run_sweep.run_point(sweep.points[0], sweep, str(ledger), command=command)
    assert result.status == "crashed", result
    (m,) = store.load(ledger).measurements
    assert m.outcome.status == "crashed" and m.gpu in store.load(ledger).gpus


def test_doctor_on_a_real_card():
    out = subprocess.run([sys.executable, "-m", "ledger.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    import json

    doc = json.loads(out.stdout)
    assert doc["gpus"] and all(g["pci_bus_id"] for g in doc["gpus"])


def test_preflight_on_the_card_trains_bit_for_bit_like_a_run_without(tmp_path):
    """The CUDA version of test_preflight's bit-identical check, with the allocator's peaks judged
    against the memory the card had free."""
    from test_preflight import trained

    plain = trained(tmp_path / "plain", device="cuda")
    again = trained(tmp_path / "again", device="cuda")
    if not all(torch.equal(plain[0][k], again[0][k]) for k in plain[0]):
        pytest.skip("two plain runs differ on this card (non-deterministic kernels): nothing to compare against")
    pre = trained(tmp_path / "pre", device="cuda", gpu=None)
    assert all(torch.equal(plain[0][k], pre[0][k]) for k in plain[0])
    for k in plain[1]:
        for name, t in plain[1][k].items():
            assert torch.equal(t, pre[1][k][name]), (k, name)
    assert torch.equal(plain[3], pre[3])
    r = pre[4].result
    assert r.meter == "allocator" and r.step.peak_reserved_mib >= r.step.peak_allocated_mib > 0
    assert r.verdict == "fits" and r.headroom_mib == pytest.approx(r.available_mib - r.step.peak_reserved_mib, abs=0.1)


@pytest.mark.parametrize("quant", ["4bit", "bf16"])
@pytest.mark.parametrize("model", ["tiny-qwen3moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_a_mixture_of_experts_steps_on_the_card_as_on_the_cpu(model, quant):
    """The fused experts' grouped matmul on the card: under stock 4-bit peft's k-bit preparation
    leaves them in fp32, which the card's grouped matmul must take (the CPU's does). The gap to
    the CPU tracker is bounded as for the dense step."""
    cfg = ProbeConfig(**dict(TINY, model=model, rank=8, seq_len=512), quant=quant, optimizer="adamw_torch")
    gpu, _ = run_probe(cfg, device="cuda")
    cpu, _ = run_probe(cfg, device="cpu")
    o, env = gpu.outcome, gpu.environment
    assert o.status == "ok", o.result_text
    workspaces = 2 * ((env.cublas_workspace_mib or 8.1) + (env.cublaslt_workspace_mib or 0.0))
    gap = o.peak_allocated_mib - cpu.outcome.peak_allocated_mib
    assert -0.10 * cpu.outcome.peak_allocated_mib - 8 <= gap <= workspaces + 0.10 * cpu.outcome.peak_allocated_mib + 8


@pytest.mark.parametrize("quant", ["bf16", "fp32"])
def test_full_fine_tuning_on_the_card_as_on_the_cpu(quant):
    """--method full on the card: bf16 weights, or fp32 master weights under CUDA's bf16 autocast."""
    cfg = ProbeConfig(model="tiny-llama", random_weights=True, method="full", quant=quant, seq_len=1024,
                      response_len=32, fixes=[], optimizer="adamw_torch")
    gpu, _ = run_probe(cfg, device="cuda")
    cpu, _ = run_probe(cfg, device="cpu")
    o, env = gpu.outcome, gpu.environment
    assert o.status == "ok" and o.pre_step_mib == pytest.approx(cpu.outcome.pre_step_mib, rel=0.02, abs=1)
    workspaces = 2 * ((env.cublas_workspace_mib or 8.1) + (env.cublaslt_workspace_mib or 0.0))
    gap = o.peak_allocated_mib - cpu.outcome.peak_allocated_mib
    assert -0.10 * cpu.outcome.peak_allocated_mib - 8 <= gap <= workspaces + 0.10 * cpu.outcome.peak_allocated_mib + 8


def test_the_allocators_model_replays_the_real_trace_to_its_peak_reserved():
    """A tiny probe's real step in a fresh process with the allocator's history recorded
    (``torch.cuda.memory._record_memory_history``): its allocations, frees and empty_cache calls
    (``probe_kit.allocator.trace_of_snapshot``) replayed through ``probe_kit.allocator`` give the
    peak reserved the real allocator's segment events give, to 0.5%."""
    script = textwrap.dedent('''
        import json, torch
        from probe_kit.probe_vram import run_probe
        from probe_kit.recipe import ProbeConfig
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        run_probe(ProbeConfig(model="tiny-llama", random_weights=True, rank=16, seq_len=1024, response_len=32,
                              quant="bf16"), device="cuda")
        snap = torch.cuda.memory._snapshot()
        events = [{"action": e["action"], "addr": e.get("addr", 0), "size": e["size"]} for e in snap["device_traces"][0]]
        print(json.dumps({"events": events, "reserved": torch.cuda.max_memory_reserved()}))
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    doc = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    from probe_kit.allocator import replay, trace_of_snapshot

    trace, real = trace_of_snapshot(doc["events"])
    assert real["unmatched_frees"] == 0 and real["peak_reserved"] >= doc["reserved"]
    sim = replay(trace)
    assert sim.peak_reserved == pytest.approx(real["peak_reserved"], rel=0.005)

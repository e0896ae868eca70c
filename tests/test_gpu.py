"""GPU-only checks: the allocator meter against the tracker on the same probe. Skipped without a
CUDA or ROCm GPU; the same code paths run on CPU in test_probe.py and test_meters.py."""

from __future__ import annotations

import pytest
import torch

from probe_kit.meters import MIB, AllocatorMeter
from probe_kit.probe_vram import run_probe
from probe_kit.recipe import ProbeConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]


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
    cfg = ProbeConfig(model="tiny-llama", random_weights=True, rank=16, seq_len=1024, response_len=32, quant=quant)
    gpu, _ = run_probe(cfg, device="cuda")
    cpu, _ = run_probe(cfg, device="cpu")
    assert gpu.outcome.status == "ok" and gpu.outcome.peak_reserved_mib >= gpu.outcome.peak_allocated_mib
    # The tracker sees no cuBLAS workspace or kernel temporaries: allow a small absolute gap.
    assert abs(gpu.outcome.peak_allocated_mib - cpu.outcome.peak_allocated_mib) < 0.25 * cpu.outcome.peak_allocated_mib + 16

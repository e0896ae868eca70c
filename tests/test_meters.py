"""The tracker meter against known allocations."""

from __future__ import annotations

import torch

from probe_kit.meters import MIB, TrackerMeter, quant_state_tensors, round_block


def test_known_allocation_is_counted_within_one_block():
    for n in (1, 511, 512, 4097, 10 * MIB + 3):
        m = TrackerMeter()
        with m:
            t = torch.empty(n, dtype=torch.uint8)
            assert abs(m.live_bytes - n) < 512
            assert m.live_bytes == round_block(n)
        del t


def test_views_count_once_and_frees_are_seen():
    m = TrackerMeter()
    with m:
        x = torch.empty(4 * MIB, dtype=torch.uint8)
        v1, v2 = x[:10], x.view(2, -1)
        assert m.live_bytes == 4 * MIB
        for _ in range(5):
            y = x + 1  # each new y frees the previous one
        assert m.peak_allocated_mib() == 12  # x, the old y and the new y at once
        del y, v1, v2, x
        z = torch.zeros(1)
        assert m.live_bytes == 512  # only z
    del z


def test_budget_raises_the_cuda_oom_error():
    m = TrackerMeter(budget_mib=1)
    try:
        with m:
            torch.empty(2 * MIB, dtype=torch.uint8)
    except torch.OutOfMemoryError as exc:
        assert "CUDA out of memory. Tried to allocate 2.00 MiB" in str(exc)
    else:
        raise AssertionError("no OOM")


def test_quant_state_tensors_are_found():
    import bitsandbytes as bnb

    w = torch.randn(128, 64, dtype=torch.bfloat16)
    p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True)._quantize("cpu")
    tensors = quant_state_tensors(p)
    assert len(tensors) >= 3  # absmax, code, and the nested state's absmax
    m = TrackerMeter()
    m.register_module(torch.nn.ParameterList([p]))
    assert m.live_bytes >= sum(round_block(t.untyped_storage().nbytes()) for t in tensors)

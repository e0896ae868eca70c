"""The OOM-message parser shared by the probe kit and log ingestion."""

from __future__ import annotations

import pytest

from ledger.intake.oom import parse_oom_message

CURRENT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 72.00 MiB. GPU 0 has a total capacity of "
    "7.65 GiB of which 66.00 MiB is free. Including non-PyTorch memory, this process has 7.57 GiB memory in use. "
    "Of the allocated memory 6.98 GiB is allocated by PyTorch, and 394.00 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def test_current_form():
    o = parse_oom_message(CURRENT)
    assert (o.tried_mib, o.total_mib, o.free_mib) == (72.0, pytest.approx(7.65 * 1024, abs=0.1), 66.0)
    assert o.in_use_mib == pytest.approx(7.57 * 1024, abs=0.1)
    assert o.allocated_mib == pytest.approx(6.98 * 1024, abs=0.1) and o.reserved_unallocated_mib == 394.0
    assert o.device == "GPU 0" and o.message.startswith("torch.OutOfMemoryError: CUDA out of memory")


def test_current_form_with_other_processes():
    text = CURRENT.replace("is free. Including", "is free. Process 4242 has 550.00 MiB memory in use. Process 77 "
                           "has 1.00 GiB memory in use. Including")
    assert parse_oom_message(text).other_processes_mib == 1574.0


def test_torch_2_1_typo_and_runtime_error_prefix():
    text = CURRENT.replace("total capacity", "total capacty").replace("torch.OutOfMemoryError:", "RuntimeError:")
    o = parse_oom_message(text)
    assert o.total_mib == pytest.approx(7833.6, abs=0.1) and o.free_mib == 66.0


def test_legacy_parenthesised_form():
    o = parse_oom_message(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
        "14.56 GiB already allocated; 8.75 MiB free; 14.74 GiB reserved in total by PyTorch) If reserved memory "
        "is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
    )
    assert o.tried_mib == 20.0 and o.total_mib == pytest.approx(15.78 * 1024, abs=0.1)
    assert o.allocated_mib == pytest.approx(14.56 * 1024, abs=0.1) and o.free_mib == 8.8
    assert o.reserved_mib == pytest.approx(14.74 * 1024, abs=0.1) and o.reserved_unallocated_mib is None


def test_hip_form_and_units():
    o = parse_oom_message("OutOfMemoryError: HIP out of memory. Tried to allocate 512.00 KiB. GPU 1 has a total "
                          "capacity of 23.98 GiB of which 0 bytes is free. Of the allocated memory 23.50 GiB is "
                          "allocated by PyTorch, and 2048 bytes is reserved by PyTorch but unallocated.")
    assert o.tried_mib == 0.5 and o.free_mib == 0.0 and o.device == "GPU 1"
    assert o.reserved_unallocated_mib == 0.0


def test_impossible_per_process_figure_is_flagged_not_trusted():
    text = CURRENT.replace("is free. Including", "is free. Process 1 has 99.00 GiB memory in use. Including")
    o = parse_oom_message(text)
    assert o.other_processes_mib is None and "other_processes_mib" in o.untrusted
    assert "99.00 GiB" in o.message


def test_not_an_oom():
    assert parse_oom_message("RuntimeError: CUDA error: an illegal memory access was encountered") is None

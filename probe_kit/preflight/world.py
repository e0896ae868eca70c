"""Preflight in a run on several GPUs (``torchrun`` / ``accelerate launch``: DDP, FSDP, DeepSpeed).

Every process runs the measured step on its own card (a distributed backward needs them all), and
the run fits only if every rank fits: each measurement is gathered from all ranks and judged as the
worst of them (an out-of-memory error on any rank is the run's; else the largest peak, against the
least memory any rank had available). Every rank reaches the same verdict, tries the same nearby
recipes and raises ``PreflightFailed`` together, so no rank trains while another has stopped.

What it cannot do: a rank that runs out of memory inside a collective (DDP's gradient all-reduce,
FSDP's all-gather) leaves the others waiting in it until the backend's timeout ends the run; an
out-of-memory error before or after the collectives is caught and gathered like any figure.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .step import Step


def world_of_run(trainer) -> tuple[int, Optional[str], bool]:
    """The run's GPUs (processes), how they split the model, as the trainer's accelerator was
    launched: ``ddp``, ``fsdp`` (FULL_SHARD, FSDP2's reshard after forward), ``fsdp-shard-grad-op``,
    ``zero2`` / ``zero3`` (DeepSpeed), and whether it offloads to the CPU (FSDP's ``cpu_offload``:
    FSDP2's ``CPUOffloadPolicy``, FSDP1's ``offload_params``; DeepSpeed's ``offload_optimizer`` /
    ``offload_param`` to the CPU or NVMe); (1, None, False) outside a distributed run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1, None, False
    n = dist.get_world_size()
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        zero = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}) or {}
        offload = any(str((zero.get(key) or {}).get("device", "none")).lower() in ("cpu", "nvme")
                      for key in ("offload_optimizer", "offload_param"))
        return n, f"zero{getattr(plugin, 'zero_stage', '?')}", offload
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        reshard = getattr(plugin, "reshard_after_forward", True)
        grad_op = reshard is False or "SHARD_GRAD_OP" in str(reshard) or "SHARD_GRAD_OP" in str(
            getattr(plugin, "sharding_strategy", ""))
        policy = getattr(plugin, "cpu_offload", None)
        offload = type(policy).__name__ == "CPUOffloadPolicy" or bool(getattr(policy, "offload_params", False))
        return n, "fsdp-shard-grad-op" if grad_op else "fsdp", offload
    return n, "ddp", False


def _gather(value) -> list:
    """Every rank's ``value`` (a picklable object), in rank order."""
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def worst_step(step: Step, world: int) -> tuple[Step, list[Optional[float]]]:
    """The run's step from every rank's: the first rank's out-of-memory error if any rank hit one,
    else the rank with the largest peak (reserved where the allocator reports it); with every
    rank's peak allocated, in rank order. One process: its own."""
    if world == 1:
        return step, [step.peak_allocated_mib]
    steps = _gather(dataclasses.replace(step, oom_text=(step.oom_text or "")[:4000] or None))
    peaks = [s.peak_allocated_mib for s in steps]
    failed = [(i, s) for i, s in enumerate(steps) if s.oom is not None]
    if failed:
        i, s = failed[0]
        return dataclasses.replace(s, oom=f"rank {i}: {s.oom}"), peaks

    def judged(s: Step) -> float:
        return s.peak_reserved_mib if s.peak_reserved_mib is not None else (s.peak_allocated_mib or 0.0)
    worst = max(steps, key=judged)
    slowest = max((s.step_s for s in steps if s.step_s is not None), default=None)
    return dataclasses.replace(worst, step_s=slowest), peaks


def least_available(available: Optional[float], source: str, world: int) -> tuple[Optional[float], str]:
    """The least any rank had available (each measures its own card), and where it came from."""
    if world == 1:
        return available, source
    found = _gather((available, source))
    known = [(a, s, i) for i, (a, s) in enumerate(found) if a is not None]
    if len(known) < len(found):
        return None, "a rank has no figure for what is available: pass gpu= or budget_mib="
    a, s, i = min(known)
    return a, f"rank {i}, the least of {world}: {s}"

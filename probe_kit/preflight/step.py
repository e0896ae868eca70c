"""The measured steady-state step on a batch (``preflight``)."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from ..meters import AllocatorMeter, TrackerMeter
from .state import _inner


# -- the measured step ---------------------------------------------------------------------------


@dataclass
class Step:
    """One measured steady-state step: peaks in MiB, or the OOM it hit."""

    peak_allocated_mib: Optional[float] = None
    peak_reserved_mib: Optional[float] = None
    static_mib: Optional[float] = None  # allocated when the measured micro-steps began (weights, optimizer state)
    step_s: Optional[float] = None
    oom: Optional[str] = None  # the out-of-memory message's first line
    oom_text: Optional[str] = field(default=None, repr=False)


def _is_oom(exc: BaseException) -> bool:
    from ledger.intake.oom import find_oom

    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and find_oom(str(exc)) is not None)


class _Meter:
    """The probe kit's meter for the model's device, started fresh for each measured step."""

    def __init__(self, device: torch.device, budget_mib: Optional[float]):
        self.device = device
        self.budget_mib = budget_mib
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def measure(self, model, trainer, inputs: dict) -> Iterator[Any]:
        if self.cuda:
            meter = AllocatorMeter(self.device)
            meter.reset_peak()
            try:
                yield meter
            finally:
                # Read by measure_step inside the block; reset again after it, so the run's own
                # peaks (the trainer's memory metrics, VramLedgerCallback) start from training.
                peaks = (meter.peak_allocated_mib(), meter.peak_reserved_mib())
                meter.reset_peak()
                meter.peak_allocated_mib = lambda: peaks[0]
                meter.peak_reserved_mib = lambda: peaks[1]
            return
        meter = TrackerMeter(self.budget_mib)
        meter.register_module(model)
        opt = trainer.optimizer
        if opt is not None:
            meter.register(t for s in _inner(opt).state.values() for t in s.values() if isinstance(t, torch.Tensor))
        meter.register(v for v in inputs.values() if isinstance(v, torch.Tensor))
        with meter:
            yield meter


def _micro_step(trainer, model, inputs: dict, micro_steps: int) -> None:
    num_items = None
    with contextlib.suppress(Exception):
        num_items = trainer._get_num_items_in_batch([inputs] * micro_steps, trainer.args.device)
    trainer.current_gradient_accumulation_steps = micro_steps
    for i in range(micro_steps):
        trainer.accelerator.gradient_state._set_sync_gradients(i == micro_steps - 1)
        sync = contextlib.nullcontext() if i == micro_steps - 1 else trainer.accelerator.no_sync(model)
        with sync:
            trainer.training_step(model, dict(inputs), num_items)
    if trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0:
        trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    model.zero_grad(set_to_none=True)


def measure_step(trainer, model, inputs: dict, meter: _Meter) -> Step:
    """The steady-state step on ``inputs``: an optimizer step to create the optimizer's state, then
    the accumulation the run does (at most two micro-steps: the second runs while the first's
    gradients are held) and an optimizer step, measured together. State is not restored here."""
    inputs = trainer._prepare_inputs(inputs)
    ga = max(1, min(int(trainer.args.gradient_accumulation_steps or 1), 2))
    out = Step()
    try:
        with meter.measure(model, trainer, inputs) as m:
            _micro_step(trainer, model, inputs, 1)
            out.static_mib = round(m.allocated_mib(), 3)
            t0 = time.perf_counter()
            _micro_step(trainer, model, inputs, ga)
            if meter.cuda:
                torch.cuda.synchronize(meter.device)
            out.step_s = round(time.perf_counter() - t0, 3)
        out.peak_allocated_mib = round(m.peak_allocated_mib(), 3)
        reserved = m.peak_reserved_mib()
        out.peak_reserved_mib = None if reserved is None else round(reserved, 3)
    except BaseException as exc:
        if not _is_oom(exc):
            raise
        out.oom_text = str(exc)
        out.oom = out.oom_text.splitlines()[0][:300] if out.oom_text else type(exc).__name__
        out.step_s = None
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if meter.cuda:
            torch.cuda.empty_cache()
    return out

"""Preflight: the run's own training step on its worst batch, before the first real step.

In a training script (transformers ``Trainer`` or TRL's ``SFTTrainer``):

    from probe_kit.preflight import Preflight
    trainer.add_callback(Preflight(trainer, gpu="RTX 4090"))
    trainer.train()          # stops in seconds with the nearest recipe that fits, or trains

What it does, at ``on_train_begin`` (optimizer, scheduler and gradient scaler made, model prepared):

1. **The worst batch.** The lengths of the training set's examples (``input_ids``; an example
   without them is collated alone to read its length), then the ``per_device_train_batch_size``
   longest collated by the trainer's own collator, so they are padded as the run pads them. That is
   the largest batch shape the run can meet: with the default random sampler a batch holding the
   longest example is padded to it; with ``group_by_length`` the longest examples are batched
   together; with packing every packed row is one length and the longest are the fullest. A dataset
   larger than ``max_scan`` examples has only its first ``max_scan`` scanned (the verdict line says
   so, and what the scan cost): the longest example may lie past them.
2. **The steady-state step on it**, with the trainer's own model, optimizer, gradient clipping and
   accumulation: one optimizer step first (so the optimizer's state exists, as from step 2 on),
   then ``min(gradient_accumulation_steps, 2)`` micro-steps (the second runs while the first's
   gradients are held, as accumulation does) and an optimizer step, measured with the probe kit's
   meters (``torch.cuda`` peaks on a GPU, the tracker meter on the CPU).
3. **Everything restored exactly**: trainable weights and buffers, gradients, the optimizer's and
   scheduler's state, the gradient scaler, every RNG (torch, CUDA, Python, NumPy): a run with
   preflight trains bit for bit like one without.
4. **One verdict line** with the headroom in MiB: the peak reserved against what the card had free
   when preflight started (plus what this process had already reserved) on a GPU; on the CPU the
   tracker's peak against ``budget_mib`` or the effective limit of ``gpu`` from the ledger's card
   table. ``fits`` leaves at least ``margin`` free (default 5% of what was available: room for
   the allocator's fragmentation over a long run and other processes); ``tight`` less; ``won't
   fit`` over, or an out-of-memory error during the step.
5. On **won't fit** it raises ``PreflightFailed`` before step 1, naming the nearest recipe that
   fits, each *measured* the same way: gradient checkpointing on (if it was off), a smaller
   micro-batch with more accumulation (the effective batch kept), a length cap; then the ledger's
   rank ceiling for the card when the ledger knows the model. And how long the run would have
   trained before dying at most (its steps × the measured step time).
6. With ``ledger=`` the measured step is appended to a ledger as a probe row (recipe read from the
   peft config and the trainer: batch size, optimizer, checkpointing), which the predictor leaves
   out of its batch-1, no-optimizer fits but publishes as evidence.

What it cannot see: the allocator's fragmentation after thousands of steps of varying shapes, other
processes that start on the card later, evaluation steps, and memory a callback or logger takes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from typing import Optional, Sequence

import torch
from transformers import TrainerCallback

from ledger.vocab.recipe import STRATEGIES

from ..meters import MIB
from .batches import DEFAULT_MAX_SCAN, WorstBatch, _train_data, find_worst_batch, shrink
from .ledger_view import _card, _ceiling_advice, _ledger_view, record
from .state import RunRecipe, _checkpointing, _to_cpu, _unwrap, checkpointing_on, read_recipe, restored
from .step import Step, _Meter, measure_step
from .verdict import DEFAULT_MARGIN, Alternative, PreflightFailed, PreflightResult, _verdict
from .world import least_available, world_of_run, worst_step

__all__ = ["DEFAULT_MARGIN", "DEFAULT_MAX_SCAN", "Preflight", "PreflightFailed", "PreflightResult", "Step",
           "WorstBatch", "find_worst_batch", "measure_step", "preflight", "read_recipe", "restored", "shrink"]


# -- the whole preflight ---------------------------------------------------------------------------


def _device_of(model) -> torch.device:
    p = next((p for p in model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _human(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def preflight(trainer, *, gpu: Optional[str] = None, budget_mib: Optional[float] = None,
              margin_mib: Optional[float] = None, max_scan: Optional[int] = DEFAULT_MAX_SCAN,
              ledger: Optional[str] = None, stop: Sequence[str] = ("won't fit",), stream=None,
              model=None) -> PreflightResult:
    """Measure the run's steady-state step on its worst batch and restore everything.

    ``gpu``: the card (any name ``vram cards`` lists) for the ledger's answer and, on the CPU, the
    limit to judge against; ``budget_mib``: judge against this many MiB instead (on the CPU the
    tracker meter raises an out-of-memory error above it); ``margin_mib``: what ``fits`` must leave
    free (default 5% of what is available); ``max_scan``: examples scanned for lengths (None: all);
    ``ledger``: append the measurement there; ``stop``: verdicts that raise ``PreflightFailed``.
    Returns the result; prints its report to ``stream`` (default stderr)."""
    model = model if model is not None else (getattr(trainer, "model_wrapped", None) or trainer.model)
    device = _device_of(model)
    standalone = trainer.optimizer is None
    if standalone:  # called before train(): the optimizer train() would make
        trainer.create_optimizer()
    try:
        with _as_train_would(trainer, model) if standalone else contextlib.nullcontext(), restored(trainer, model):
            return _preflight(trainer, model, device, gpu, budget_mib, margin_mib, max_scan, ledger, stop, stream)
    finally:
        if standalone:
            trainer.optimizer = None


def _as_train_would(trainer, model):
    """Before train(): gradient checkpointing switched on as train() switches it on from the
    arguments (``activation_checkpointing`` / ``gradient_checkpointing`` and their kwargs), and off
    again after."""
    args = trainer.args
    on = getattr(args, "activation_checkpointing", None)
    on = getattr(args, "gradient_checkpointing", False) if on is None else on
    if not on:
        return contextlib.nullcontext()
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    extra = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
    return checkpointing_on(_unwrap(model), kwargs, **extra)


def _preflight(trainer, model, device, gpu, budget_mib, margin_mib, max_scan, ledger, stop, stream) -> PreflightResult:
    dataset, collate = _train_data(trainer)
    recipe = read_recipe(trainer, model)
    worst = find_worst_batch(dataset, collate, recipe.batch_size, max_scan)
    recipe.batch_size = worst.batch_size
    world, strategy, offload = world_of_run(trainer)
    recipe.gpus, recipe.strategy, recipe.cpu_offload = world, strategy, offload
    card = _card(gpu, ledger)
    available, source, answer = None, "no card: pass gpu= or budget_mib=", None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        available = round((free + torch.cuda.memory_reserved(device)) / MIB, 1)
        source = "free on the card at preflight plus this process's cache"
    if card is not None:
        limit, lsource, answer = _ledger_view(card, recipe, worst.seq_len)
        if world > 1:  # the ledger's answer is one GPU's: a rank's is the dry run's (vram estimate --gpus N)
            flag = " --cpu-offload" if offload else ""
            answer = (f"a rank of {world} GPUs ({strategy}{', CPU offload' if offload else ''}): `vram estimate "
                      f"--gpus {world} --strategy {strategy}{flag}` answers it from a dry run of one rank")
        if device.type != "cuda" and limit is not None:
            available, source = limit, f"{card[0]}'s effective limit for peak allocated: {lsource}"
    if budget_mib is not None:
        available, source = float(budget_mib), f"budget_mib={budget_mib:g}"
    available, source = least_available(available, source, world)
    margin = None if available is None else (margin_mib if margin_mib is not None else round(DEFAULT_MARGIN * available, 1))
    # On the CPU the tracker raises an out-of-memory error above the budget; with several ranks one
    # raising mid-collective would leave the others waiting in it, so each measures its whole step
    # and the gathered peaks are judged against the budget instead.
    meter = _Meter(device, budget_mib if device.type != "cuda" and world == 1 else None)

    step, rank_peaks = worst_step(measure_step(trainer, model, worst.inputs, meter), world)
    verdict, headroom = _verdict(step, available, margin)
    result = PreflightResult(verdict=verdict, recipe=recipe.describe(worst.seq_len), worst=worst.describe(), step=step,
                             available_mib=available, available_source=source, margin_mib=margin,
                             headroom_mib=headroom, meter="allocator" if meter.cuda else "tracker",
                             ledger_answer=answer, world=world, strategy=strategy,
                             rank_peaks_mib=rank_peaks if world > 1 else [])
    if verdict == "won't fit":
        _nearest(result, trainer, model, worst, recipe, meter, available, margin, world)
        if result.alternative is None:
            result.advice = _ceiling_advice(card, recipe, worst.seq_len)
        steps = getattr(trainer.state, "max_steps", 0) or 0
        each = step.step_s or (result.alternative.step.step_s if result.alternative else None)
        if steps and each:
            result.time_at_risk = (f"stopped before step 1: the run planned {steps:,} optimizer steps; it would have died "
                                   f"when the worst batch came, after up to {_human(steps * each)} of training "
                                   f"({each:.2f} s a step as measured here)")
    if ledger and recipe.strategy is not None and recipe.strategy not in STRATEGIES:
        result.not_recorded = (f"DeepSpeed's {recipe.strategy} is no strategy the ledger names "
                               f"({', '.join(STRATEGIES)})")
    elif ledger and recipe.fixes is not None:
        result.recorded = record(ledger, recipe, worst, step, device, card[0] if card else None)
    elif ledger:
        result.not_recorded = ("Liger kernels beyond the fused loss are no recipe the ledger names (switch the others "
                               "off in liger_kernel_config to record it as fused_linear_ce)")
    print(result.report(), file=stream or sys.stderr, flush=True)
    if verdict in stop:
        raise PreflightFailed(result)
    return result


def _nearest(result: PreflightResult, trainer, model, worst: WorstBatch, recipe: RunRecipe, meter: _Meter,
             available: Optional[float], margin: Optional[float], world: int = 1) -> None:
    """Measure recipes near the run's, nearest first, and keep the first that fits: checkpointing on
    (if off), then smaller micro-batches with more accumulation (the effective batch kept), then
    micro-batch 1 with a length cap. On several GPUs each is judged as the worst rank's, so every
    rank keeps the same one."""
    if available is None:
        return
    opt = trainer.optimizer
    empty = copy.deepcopy(_to_cpu(opt.state_dict()))

    def attempt(changes: list[str], inputs: dict, ckpt: bool) -> bool:
        opt.load_state_dict(copy.deepcopy(empty))
        with _checkpointing(model, ckpt):
            s, _ = worst_step(measure_step(trainer, model, inputs, meter), world)
        v, room = _verdict(s, available, margin)
        alt = Alternative(changes, s, room)
        result.tried.append(alt)
        if v == "fits":
            result.alternative = alt
            return True
        return False

    ckpt = False
    if not recipe.checkpointing:
        if attempt(["gradient_checkpointing=True"], worst.inputs, True):
            return
        ckpt = True
    base = ["gradient_checkpointing=True"] if ckpt else []
    effective = worst.batch_size * recipe.accumulation
    b = worst.batch_size // 2
    while b >= 1:
        ga = math.ceil(effective / b)
        kept = "kept" if b * ga == effective else f"{b * ga} instead of {effective}"
        if attempt(base + [f"per_device_train_batch_size={b}", f"gradient_accumulation_steps={ga} "
                                                                f"(effective batch {kept})"],
                   shrink(worst.inputs, b, worst.seq_len), ckpt):
            return
        b //= 2
    ga = effective
    for frac in (0.75, 0.5, 0.25):
        cap = max(1, int(worst.seq_len * frac))
        if attempt(base + (["per_device_train_batch_size=1", f"gradient_accumulation_steps={ga}"]
                           if worst.batch_size > 1 else [])
                   + [f"max_length={cap} (truncates {worst.longer_than(cap):,} of the {worst.scanned:,} "
                      "examples scanned)"], shrink(worst.inputs, 1, cap), ckpt):
            return


class Preflight(TrainerCallback):
    """Runs ``preflight(trainer, ...)`` at train begin (every process measures its own card, and on
    several GPUs the run is judged as its worst rank: ``preflight.world``; the main one prints and
    records); raises ``PreflightFailed`` on every rank before the first step when the worst batch
    does not fit."""

    def __init__(self, trainer, **options):
        self.trainer = trainer
        self.options = options
        self.result: Optional[PreflightResult] = None

    def on_train_begin(self, args, state, control, **kwargs):
        options = dict(self.options)
        if not state.is_world_process_zero:
            # Every process runs the step (a distributed backward needs them all, and each measures
            # its own card); the main process alone prints and records.
            options.update(ledger=None, stream=_Quiet())
        self.result = preflight(self.trainer, **options)
        return control


class _Quiet:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

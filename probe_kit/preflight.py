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

import argparse
import contextlib
import copy
import dataclasses
import datetime as dt
import gc
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from transformers import TrainerCallback

from ledger.optimizers import STOCK_OPTIMIZER

from .meters import MIB, AllocatorMeter, TrackerMeter

DEFAULT_MAX_SCAN = 200_000
#: Share of the available memory a "fits" must leave free (fragmentation over a long run, other
#: processes): a policy, stated in every verdict line, not a measured figure.
DEFAULT_MARGIN = 0.05


class PreflightFailed(RuntimeError):
    """The run's worst batch does not fit: raised before the first training step."""

    def __init__(self, result: "PreflightResult"):
        super().__init__(result.report())
        self.result = result


# -- the worst batch -------------------------------------------------------------------------


@dataclass
class WorstBatch:
    """The largest batch shape the run can meet, collated as the trainer collates."""

    inputs: dict
    batch_size: int
    seq_len: int
    scanned: int
    total: Optional[int]
    scan_s: float
    lengths: list[int]  # every scanned example's length, longest first
    indices: list[int]  # the examples in the batch

    def describe(self) -> str:
        scope = (f"all {self.scanned:,} examples" if self.total is not None and self.scanned >= self.total
                 else f"the first {self.scanned:,} of {self.total:,} examples" if self.total is not None
                 else f"the first {self.scanned:,} examples")
        return f"{self.batch_size} × {self.seq_len} tokens (the longest of {scope}, scanned in {self.scan_s:.1f} s)"

    def longer_than(self, n: int) -> int:
        return sum(1 for x in self.lengths if x > n)


def _tokens(batch: Any) -> Optional[torch.Tensor]:
    """The collated batch's token tensor (``input_ids``, else its first 2-D tensor)."""
    if isinstance(batch, dict):
        t = batch.get("input_ids")
        if isinstance(t, torch.Tensor):
            return t
        return next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    return None


def _lengths(dataset, collate: Callable, n: int) -> list[int]:
    """Token counts of the first ``n`` examples: an Arrow ``input_ids`` column is measured without
    reading it into Python; an example with ``input_ids`` by their length; any other is collated
    alone (what the trainer's collator makes of it)."""
    data = getattr(dataset, "data", None)  # a datasets.Dataset's Arrow table
    if data is not None and "input_ids" in getattr(dataset, "column_names", ()) and \
            getattr(dataset, "_indices", None) is None:
        import pyarrow.compute as pc

        return pc.list_value_length(data.column("input_ids").slice(0, n)).to_pylist()
    out = []
    for i in range(n):
        ex = dataset[i]
        ids = ex.get("input_ids") if isinstance(ex, dict) else None
        if ids is not None and not isinstance(ids, str):
            out.append(len(ids))
            continue
        t = _tokens(collate([ex]))
        if t is None:
            raise ValueError("preflight: cannot tell an example's length (no input_ids after collation)")
        out.append(int(t.shape[-1]))
    return out


def _train_data(trainer) -> tuple[Any, Callable]:
    """The training set and collator as the trainer's dataloader sees them (unused columns removed)."""
    dataset, collate = trainer.train_dataset, trainer.data_collator
    if dataset is None:
        raise ValueError("preflight: the trainer has no train_dataset")
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return trainer._remove_unused_columns(dataset, description="training"), collate
    except ImportError:
        pass
    return dataset, trainer._get_collator_with_removed_columns(collate, description="training")


def find_worst_batch(dataset, collate: Callable, batch_size: int, max_scan: Optional[int] = DEFAULT_MAX_SCAN
                     ) -> WorstBatch:
    """The ``batch_size`` longest of the first ``max_scan`` examples (all with None), collated."""
    t0 = time.perf_counter()
    try:
        total: Optional[int] = len(dataset)
    except TypeError:
        total = None
    if total is None:  # an iterable dataset: the first max_scan examples
        items = []
        for ex in dataset:
            items.append(ex)
            if max_scan is not None and len(items) >= max_scan:
                break
        dataset = items
        n = len(items)
    else:
        n = total if max_scan is None else min(total, max_scan)
    if n == 0:
        raise ValueError("preflight: the training set is empty")
    lengths = _lengths(dataset, collate, n)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    take = order[:min(batch_size, n)]
    inputs = collate([dataset[i] for i in take])
    tokens = _tokens(inputs)
    if tokens is None:
        raise ValueError("preflight: the collator made no input_ids")
    return WorstBatch(inputs=dict(inputs), batch_size=int(tokens.shape[0]), seq_len=int(tokens.shape[-1]),
                      scanned=n, total=total, scan_s=time.perf_counter() - t0,
                      lengths=sorted(lengths, reverse=True), indices=take)


def shrink(inputs: dict, batch_size: int, seq_len: int) -> dict:
    """The batch cut to ``batch_size`` rows and ``seq_len`` positions (what a smaller micro-batch or
    a length cap makes of the worst batch: its longest rows, truncated)."""
    tokens = _tokens(inputs)
    full = tokens.shape[-1] if tokens is not None else None
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            v = v[:batch_size]
            if v.dim() >= 2 and full is not None and v.shape[1] == full:
                v = v[:, :seq_len]
            v = v.contiguous()
        out[k] = v
    return out


# -- the state a step changes, and its exact restoration ----------------------------------------


def _unwrap(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def restored(trainer, model) -> Iterator[None]:
    """Run a block, then put back everything a training step changes: trainable weights, buffers,
    gradients, the optimizer's and scheduler's state, the gradient scaler, the accelerator's
    gradient-sync flag and every RNG. Copies go to host memory (a LoRA adapter is small; a full
    fine-tune's trainable weights are copied whole)."""
    import numpy as np

    params = [p for p in model.parameters() if p.requires_grad]
    weights = [p.detach().to("cpu", copy=True) for p in params]
    buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
    grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]
    opt = trainer.optimizer
    opt_state = copy.deepcopy(_to_cpu(opt.state_dict())) if opt is not None else None
    step_count = getattr(_inner(opt), "_step_count", None) if opt is not None else None
    sched = trainer.lr_scheduler
    sched_state = copy.deepcopy(sched.state_dict()) if sched is not None else None
    scaler = getattr(trainer.accelerator, "scaler", None)
    scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    gstate = trainer.accelerator.gradient_state
    sync = gstate.sync_gradients
    missing = object()
    ga_steps = getattr(trainer, "current_gradient_accumulation_steps", missing)
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
           random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, w, g in zip(params, weights, grads):
                p.copy_(w.to(p.device))
                if g is not None:
                    p.grad = g.to(p.device)
            for b, w in buffers:
                b.copy_(w.to(b.device))
        if opt is not None:
            opt.load_state_dict(opt_state)
            if step_count is not None:
                _inner(opt)._step_count = step_count
        if sched is not None:
            sched.load_state_dict(sched_state)
        if scaler is not None:
            scaler.load_state_dict(scaler_state)
        gstate._set_sync_gradients(sync)
        if ga_steps is missing:
            with contextlib.suppress(AttributeError):
                del trainer.current_gradient_accumulation_steps
        else:
            trainer.current_gradient_accumulation_steps = ga_steps
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        random.setstate(rng[2])
        np.random.set_state(rng[3])


def _inner(opt):
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


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
    from ledger.oom import find_oom

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


# -- the verdict ---------------------------------------------------------------------------------


@dataclass
class Alternative:
    """A recipe near the run's, measured: what to change, and its step."""

    changes: list[str]
    step: Step
    headroom_mib: Optional[float]


@dataclass
class PreflightResult:
    """What preflight measured and concluded."""

    verdict: str  # fits | tight | won't fit | unknown
    recipe: str
    worst: str
    step: Step
    available_mib: Optional[float]
    available_source: str
    margin_mib: Optional[float]
    headroom_mib: Optional[float]
    meter: str
    ledger_answer: Optional[str] = None
    alternative: Optional[Alternative] = None
    tried: list[Alternative] = field(default_factory=list)
    advice: Optional[str] = None
    time_at_risk: Optional[str] = None
    recorded: Optional[str] = None

    def line(self) -> str:
        """One verdict line, with the headroom in MiB."""
        s = self.step
        peak = (f"peak {s.peak_reserved_mib:,.1f} MiB reserved ({s.peak_allocated_mib:,.1f} MiB allocated)"
                if s.peak_reserved_mib is not None else
                f"peak {s.peak_allocated_mib:,.1f} MiB allocated" if s.peak_allocated_mib is not None
                else f"out of memory ({s.oom})")
        room = (f", {self.headroom_mib:+,.1f} MiB headroom of {self.available_mib:,.1f} MiB "
                f"({self.available_source})" if self.headroom_mib is not None else
                f" ({self.available_source})")
        return f"preflight: {self.verdict.upper()}: {self.recipe}, worst batch {self.worst}: {peak}{room}"

    def report(self) -> str:
        lines = [self.line()]
        if self.margin_mib is not None and self.verdict in ("fits", "tight"):
            lines.append(f"  fits needs {self.margin_mib:,.1f} MiB left ({DEFAULT_MARGIN:.0%} of what was available, "
                         "for fragmentation over a long run and other processes)")
        if self.ledger_answer:
            lines.append(f"  ledger: {self.ledger_answer}")
        if self.verdict == "won't fit":
            if self.alternative is not None:
                a = self.alternative
                lines.append(f"  nearest recipe that fits (measured the same way): {', '.join(a.changes)}: "
                             f"peak {_peak_text(a.step)}, {a.headroom_mib:+,.1f} MiB headroom")
            else:
                tried = "; ".join(", ".join(a.changes) for a in self.tried) or "nothing smaller to try"
                lines.append(f"  no nearby recipe fits (tried: {tried})")
            if self.advice:
                lines.append(f"  {self.advice}")
            if self.time_at_risk:
                lines.append(f"  {self.time_at_risk}")
        if self.recorded:
            lines.append(f"  recorded as {self.recorded}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _peak_text(s: Step) -> str:
    if s.peak_reserved_mib is not None:
        return f"{s.peak_reserved_mib:,.1f} MiB reserved"
    return f"{s.peak_allocated_mib:,.1f} MiB allocated"


def _judged(s: Step) -> Optional[float]:
    """The figure an OOM is decided by: reserved where the allocator reports it."""
    return s.peak_reserved_mib if s.peak_reserved_mib is not None else s.peak_allocated_mib


def _verdict(s: Step, available: Optional[float], margin: Optional[float]) -> tuple[str, Optional[float]]:
    if s.oom is not None:
        return "won't fit", None
    if available is None:
        return "unknown", None
    headroom = round(available - _judged(s), 1)
    if headroom < 0:
        return "won't fit", headroom
    return ("fits" if headroom >= (margin or 0) else "tight"), headroom


# -- what the run is -----------------------------------------------------------------------------


@dataclass
class RunRecipe:
    """The run's recipe as preflight reads it off the trainer and the peft config."""

    model: Optional[str]
    quant: str
    rank: Optional[int]
    alpha: Optional[float]
    rslora: bool
    dropout: float
    dora: bool
    target_modules: list[str]
    batch_size: int
    accumulation: int
    checkpointing: bool
    optimizer: str

    def describe(self, seq_len: int) -> str:
        lora = (f"LoRA r{self.rank}" + (f" dropout {self.dropout:g}" if self.dropout else "")
                + (" DoRA" if self.dora else "")) if self.rank else "no LoRA"
        return (f"{self.model or 'the model'} {self.quant} {lora}, micro-batch {self.batch_size} × {seq_len} tokens"
                f" (accumulation {self.accumulation}), checkpointing {'on' if self.checkpointing else 'off'}, "
                f"{self.optimizer}")


def read_recipe(trainer, model) -> RunRecipe:
    base = _unwrap(model)
    peft_cfg = None
    cfgs = getattr(base, "peft_config", None)
    if isinstance(cfgs, dict) and cfgs:
        peft_cfg = cfgs.get(getattr(base, "active_adapter", "default")) or next(iter(cfgs.values()))
    if getattr(base, "is_loaded_in_4bit", False) or any(type(m).__name__ == "Linear4bit" for m in base.modules()):
        quant = "4bit"
    else:  # the frozen weights' dtype: bf16, fp16, fp32
        dtype = next((p.dtype for p in base.parameters() if not p.requires_grad), torch.float32)
        quant = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    config = getattr(base, "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or None
    targets = getattr(peft_cfg, "target_modules", None)
    ckpt = bool(getattr(trainer.args, "gradient_checkpointing", False)) or _checkpointing_on(base)
    return RunRecipe(
        model=name or getattr(config, "model_type", None), quant=quant,
        rank=getattr(peft_cfg, "r", None), alpha=getattr(peft_cfg, "lora_alpha", None),
        rslora=bool(getattr(peft_cfg, "use_rslora", False)), dropout=float(getattr(peft_cfg, "lora_dropout", 0) or 0),
        dora=bool(getattr(peft_cfg, "use_dora", False)),
        target_modules=sorted(targets) if isinstance(targets, (set, list, tuple)) else ([targets] if targets else []),
        batch_size=int(trainer.args.per_device_train_batch_size),
        accumulation=int(trainer.args.gradient_accumulation_steps or 1), checkpointing=ckpt,
        optimizer=str(getattr(trainer.args.optim, "value", trainer.args.optim)))


def _checkpointing_on(model) -> bool:
    for m in model.modules():
        if getattr(m, "is_gradient_checkpointing", False) or getattr(m, "gradient_checkpointing", False) is True:
            return True
    return False


@contextlib.contextmanager
def _checkpointing(model, on: bool) -> Iterator[bool]:
    """Gradient checkpointing switched on for the block (non-reentrant), off again after."""
    base = _unwrap(model)
    if not on or _checkpointing_on(base):
        yield False
        return
    target = base.get_base_model() if hasattr(base, "get_base_model") else base
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        off = target.activation_checkpointing_disable
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        off = target.gradient_checkpointing_disable
    try:
        yield True
    finally:
        off()


# -- the ledger: the card's limit, its answer, the record ---------------------------------------


def _card(gpu: Optional[str], ledger_path: Optional[str]):
    """(key, entry, ledger) for a card name, from the ledger given (else the bundled one) and the
    card table."""
    if gpu is None:
        return None
    from ledger import store
    from ledger.cards import require_card
    from ledger.paths import DEFAULT_LEDGER

    ledger = store.load_or_new(ledger_path) if ledger_path else store.load(DEFAULT_LEDGER)
    key, entry, _ = require_card(ledger, gpu, where="gpu=")
    return key, entry, ledger


def _ledger_view(card, recipe: RunRecipe, seq_len: int):
    """The predictor's limit for the card (allocated) and its answer for the recipe, where it models it."""
    from ledger.dry_runs import load_dry_runs
    from ledger.model_configs import model_name
    from ledger.predictor import Predictor
    from ledger.recipe import Recipe

    key, entry, ledger = card
    predictor = Predictor(ledger, load_dry_runs())
    low, _high, source = predictor.card_limit(key, entry, "real")
    answer = None
    if recipe.rank is None:
        answer = "no answer: the ledger models LoRA runs"
    elif not recipe.checkpointing:
        answer = ("no answer with gradient checkpointing off (its predictor models checkpointing on); this "
                  "measurement is the evidence")
    else:
        from ledger.optimizers import OPTIMIZERS

        q = Recipe(model=model_name(recipe.model), rank=recipe.rank, quant=recipe.quant, dropout=recipe.dropout > 0,
                   dora=recipe.dora, seq_len=seq_len, fixes="none", batch=recipe.batch_size,
                   optimizer=recipe.optimizer if recipe.optimizer in OPTIMIZERS else None)
        a = predictor.predict(q, key, entry=entry, run="real")
        if a.allocated is not None:
            answer = (f"{a.verdict} on {key}: a real run of {q.describe()} peaks at {a.allocated.mib:,.1f} MiB allocated "
                      f"({a.allocated.low_mib:,.1f}–{a.allocated.high_mib:,.1f} MiB), by {a.method}")
        else:
            answer = f"{a.verdict}: {a.why}"
    return low, source, answer


def _ceiling_advice(card, recipe: RunRecipe, seq_len: int) -> Optional[str]:
    """The ledger's largest LoRA rank that fits a real run of this recipe at this length on the card
    (``vram ceiling``), or the command that asks it when the ledger cannot say."""
    if card is None or recipe.rank is None:
        return None
    from ledger.dry_runs import load_dry_runs
    from ledger.model_configs import model_name
    from ledger.optimizers import OPTIMIZERS
    from ledger.predictor import Predictor
    from ledger.recipe import Recipe

    key, entry, ledger = card
    name = model_name(recipe.model) or "MODEL"
    q = Recipe(model=name, rank=recipe.rank, quant=recipe.quant, dropout=recipe.dropout > 0, dora=recipe.dora,
               seq_len=seq_len, fixes="none", batch=recipe.batch_size, checkpointing=recipe.checkpointing,
               optimizer=recipe.optimizer if recipe.optimizer in OPTIMIZERS else None)
    c = Predictor(ledger, load_dry_runs()).ceiling(q, key, entry=entry, run="real")
    if c.fits_rank is not None and c.fits_rank < recipe.rank:
        return (f"or a smaller rank: the ledger's largest that fits a real run of this recipe at {seq_len} tokens on "
                f"{key} is r{c.fits_rank} (`vram ceiling`, {c.ranks[0]['method'] if c.ranks else 'its predictor'})")
    return (f"or a smaller rank: `vram ceiling --model {name} --gpu {key} --seq-len {seq_len} --quant {recipe.quant} "
            f"--batch-size {recipe.batch_size} --real` asks the ledger's largest at this length on this card "
            f"(it says: {c.status if c.fits_rank is None else f'r{c.fits_rank}'})")


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)


def record(path: str, recipe: RunRecipe, worst: WorstBatch, step: Step, device: torch.device,
           gpu_key: Optional[str]) -> str:
    """Append the measured step to a ledger as a probe row; returns its id."""
    import hashlib
    import json

    from ledger import store
    from ledger.models import Lora, Measurement, Oom, Outcome, Provenance
    from ledger.oom import parse_oom_message

    from .probe_vram import environment

    cfg = {"recipe": dataclasses.asdict(recipe), "seq_len": worst.seq_len, "device": str(device)}
    digest = hashlib.sha256(json.dumps([cfg, step.peak_allocated_mib, str(dt.date.today())],
                                       sort_keys=True).encode()).hexdigest()[:8]
    mid = f"preflight-{gpu_key or device.type}-b{recipe.batch_size}-seq{worst.seq_len}-{digest}"
    status = "oom" if step.oom else "ok"
    oom = (parse_oom_message(step.oom_text or "") or Oom(message=step.oom_text or step.oom)) if step.oom else None
    outcome = Outcome(status=status, oom=oom,
                      pre_step_mib=None if step.oom else _mib(step.static_mib),
                      peak_allocated_mib=None if step.oom else _mib(step.peak_allocated_mib),
                      peak_reserved_mib=None if step.oom else _mib(step.peak_reserved_mib), step_s=step.step_s)
    lora = None if recipe.rank is None else Lora(
        rank=recipe.rank, alpha=float(recipe.alpha if recipe.alpha is not None else recipe.rank), rslora=recipe.rslora,
        dropout=recipe.dropout, dora=recipe.dora, target_modules=recipe.target_modules)
    m = Measurement(
        id=mid, kind="probe", gpu=gpu_key if device.type == "cuda" else None, model=recipe.model,
        quant=recipe.quant,
        lora=lora, seq_len=worst.seq_len, batch_size=recipe.batch_size, memory_fixes="none",
        optimizer=recipe.optimizer, gradient_checkpointing=recipe.checkpointing,
        config_text=json.dumps(cfg, sort_keys=True), outcome=outcome,
        environment=environment(device, "allocator" if device.type == "cuda" else "tracker"),
        provenance=Provenance(source="probe_kit.preflight (the run's own step on its worst batch)",
                              measured_on=dt.date.today(),
                              notes=["A steady-state training step: an optimizer step first, then "
                                     f"{min(recipe.accumulation, 2)} micro-step(s) and an optimizer step, measured."]
                              + ([] if device.type == "cuda" else
                                 ["Measured on the CPU by the tracker meter; no allocator cache, so no reserved figure."])),
    )
    card = None
    if device.type == "cuda" and gpu_key:
        from .probe_vram import card_entry

        card = card_entry(torch.cuda.get_device_properties(device), gpu_key, torch.version.hip, torch.__version__,
                          torch.version.cuda)
        m.gpu = card[0]
    store.append(path, [m], gpus_if_missing=dict([card]) if card else None, create=True)
    return mid


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


@contextlib.contextmanager
def _as_train_would(trainer, model) -> Iterator[None]:
    """Before train(): gradient checkpointing switched on as train() switches it on from the
    arguments (``activation_checkpointing`` / ``gradient_checkpointing`` and their kwargs), and off
    again after."""
    args = trainer.args
    on = getattr(args, "activation_checkpointing", None)
    on = getattr(args, "gradient_checkpointing", False) if on is None else on
    base = _unwrap(model)
    if not on or _checkpointing_on(base):
        yield
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    extra = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **extra)
        off = base.activation_checkpointing_disable
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        off = base.gradient_checkpointing_disable
    try:
        yield
    finally:
        off()


def _preflight(trainer, model, device, gpu, budget_mib, margin_mib, max_scan, ledger, stop, stream) -> PreflightResult:
    dataset, collate = _train_data(trainer)
    recipe = read_recipe(trainer, model)
    worst = find_worst_batch(dataset, collate, recipe.batch_size, max_scan)
    recipe.batch_size = worst.batch_size
    card = _card(gpu, ledger)
    available, source, answer = None, "no card: pass gpu= or budget_mib=", None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        available = round((free + torch.cuda.memory_reserved(device)) / MIB, 1)
        source = "free on the card at preflight plus this process's cache"
    if card is not None:
        limit, lsource, answer = _ledger_view(card, recipe, worst.seq_len)
        if device.type != "cuda" and limit is not None:
            available, source = limit, f"{card[0]}'s effective limit for peak allocated: {lsource}"
    if budget_mib is not None:
        available, source = float(budget_mib), f"budget_mib={budget_mib:g}"
    margin = None if available is None else (margin_mib if margin_mib is not None else round(DEFAULT_MARGIN * available, 1))
    meter = _Meter(device, budget_mib if device.type != "cuda" else None)

    step = measure_step(trainer, model, worst.inputs, meter)
    verdict, headroom = _verdict(step, available, margin)
    result = PreflightResult(verdict=verdict, recipe=recipe.describe(worst.seq_len), worst=worst.describe(), step=step,
                             available_mib=available, available_source=source, margin_mib=margin,
                             headroom_mib=headroom, meter="allocator" if meter.cuda else "tracker",
                             ledger_answer=answer)
    if verdict == "won't fit":
        _nearest(result, trainer, model, worst, recipe, meter, available, margin)
        if result.alternative is None:
            result.advice = _ceiling_advice(card, recipe, worst.seq_len)
        steps = getattr(trainer.state, "max_steps", 0) or 0
        each = step.step_s or (result.alternative.step.step_s if result.alternative else None)
        if steps and each:
            result.time_at_risk = (f"stopped before step 1: the run planned {steps:,} optimizer steps; it would have died "
                                   f"when the worst batch came, after up to {_human(steps * each)} of training "
                                   f"({each:.2f} s a step as measured here)")
    if ledger:
        result.recorded = record(ledger, recipe, worst, step, device, card[0] if card else None)
    print(result.report(), file=stream or sys.stderr, flush=True)
    if verdict in stop:
        raise PreflightFailed(result)
    return result


def _nearest(result: PreflightResult, trainer, model, worst: WorstBatch, recipe: RunRecipe, meter: _Meter,
             available: Optional[float], margin: Optional[float]) -> None:
    """Measure recipes near the run's, nearest first, and keep the first that fits: checkpointing on
    (if off), then smaller micro-batches with more accumulation (the effective batch kept), then
    micro-batch 1 with a length cap."""
    if available is None:
        return
    opt = trainer.optimizer
    empty = copy.deepcopy(_to_cpu(opt.state_dict()))

    def attempt(changes: list[str], inputs: dict, ckpt: bool) -> bool:
        opt.load_state_dict(copy.deepcopy(empty))
        with _checkpointing(model, ckpt):
            s = measure_step(trainer, model, inputs, meter)
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
        if attempt(base + ([f"per_device_train_batch_size=1", f"gradient_accumulation_steps={ga}"]
                           if worst.batch_size > 1 else [])
                   + [f"max_length={cap} (truncates {worst.longer_than(cap):,} of the {worst.scanned:,} "
                      "examples scanned)"], shrink(worst.inputs, 1, cap), ckpt):
            return


class Preflight(TrainerCallback):
    """Runs ``preflight(trainer, ...)`` at train begin (every process measures its own card; the
    main one prints and records); raises ``PreflightFailed`` before the first step when the worst
    batch does not fit."""

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


# -- command line ------------------------------------------------------------------------------------


def read_examples(path: str, limit: Optional[int] = None) -> list[dict]:
    """Rows of a .jsonl or .parquet file (a ``text`` or ``messages`` column)."""
    import json
    from pathlib import Path

    from .recipe import RecipeError

    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    else:
        rows = []
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise RecipeError(f"{path}:{n}: invalid JSON: {exc}") from None
                if limit is not None and len(rows) >= limit:
                    break
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not ({"text", "messages"} & row.keys()):
            raise RecipeError(f"{path}:{n}: a row needs a 'text' or 'messages' column")
    if not rows:
        raise RecipeError(f"{path}: no rows")
    return rows


def tokenize(rows: list[dict], tokenizer, max_length: Optional[int]) -> list[dict]:
    out = []
    for row in rows:
        if "messages" in row and row["messages"] is not None:
            ids = tokenizer.apply_chat_template(row["messages"], tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        else:
            ids = tokenizer(row["text"])["input_ids"]
        if max_length:
            ids = ids[:max_length]
        out.append({"input_ids": list(ids)})
    return out


def build_parser() -> argparse.ArgumentParser:
    from .probe_vram import add_recipe_options

    p = argparse.ArgumentParser(
        prog="python -m probe_kit.preflight",
        description="Before training: the recipe's steady-state step (forward, backward, optimizer) on the "
                    "dataset's worst batch, with a verdict against the card.")
    add_recipe_options(p)
    for action in p._actions:  # the data decides the lengths; a stock run has none of the program's fixes
        if action.dest in ("seq_len", "response_len", "logits_to_keep"):
            action.help = argparse.SUPPRESS
        elif action.dest == "fixes":
            action.default = "none"
            action.help = ("memory fixes: none (stock, the default), all, or a comma list of chunked_mlp, save_on_cpu, "
                           "bf16_lm_head, logits_to_keep")
        elif action.dest == "batch_size":
            action.help = "per-device micro-batch (default 1)"
        elif action.dest == "optim":
            action.help = f"the optimizer, by its TrainingArguments name (default {STOCK_OPTIMIZER}, as a stock Trainer)"
    p.add_argument("--data", required=True, help="a .jsonl or .parquet file with a 'text' or 'messages' column")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the model's folder)")
    p.add_argument("--max-length", type=int, help="truncate examples to this many tokens, as the run does")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu", help="the card (a name `vram cards` lists): the ledger's answer, and the limit on the CPU")
    p.add_argument("--budget-mib", type=float, help="judge against this many MiB (on the CPU: a simulated OOM above it)")
    p.add_argument("--max-scan", type=int, default=DEFAULT_MAX_SCAN, help="examples scanned for lengths (default %(default)s)")
    p.add_argument("--ledger", help="append the measurement to this ledger")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    return p


def _tokenizer_for(args):
    from pathlib import Path

    from transformers import AutoTokenizer

    from .recipe import RecipeError

    where = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    if where is None:
        raise RecipeError(f"{args.model}: no tokenizer to read the data with: pass --tokenizer DIR "
                          "(a folder with tokenizer.json, as the model's repository has it)")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{where}: cannot load a tokenizer: {str(exc).splitlines()[0]}") from None


def run(args: argparse.Namespace) -> PreflightResult:
    """The command: the probe kit's recipe model, a Trainer over the tokenised file, preflight."""
    import json
    import tempfile

    from transformers import Trainer, TrainingArguments

    from .probe_vram import config_from_args
    from .recipe import RecipeError, build_model, prepare

    if args.batch_size <= 0 or args.grad_accum <= 0:
        raise RecipeError("--batch-size and --grad-accum must be > 0")
    optim = args.optim or STOCK_OPTIMIZER
    args.optim = None  # the Trainer steps it; the probe config only builds the model and adapter
    cfg = config_from_args(args)
    unsupported = [f for f in cfg.fixes if f in ("save_on_cpu", "logits_to_keep")]
    if unsupported:
        raise RecipeError(f"--fixes {unsupported[0]}: the probe applies it inside its own step, which a Trainer "
                          "does not run (chunked_mlp and bf16_lm_head are model changes and work here)")
    device = torch.device(args.device)
    tokenizer = _tokenizer_for(args)
    rows = tokenize(read_examples(args.data, None), tokenizer, args.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    torch.manual_seed(cfg.seed)
    model = prepare(build_model(cfg, device), cfg)

    def collate(examples):
        n = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), n), pad, dtype=torch.long)
        mask = torch.zeros((len(examples), n), dtype=torch.long)
        for i, e in enumerate(examples):
            ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[i, :len(e["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size,
                                  gradient_accumulation_steps=args.grad_accum, optim=optim, report_to=[],
                                  gradient_checkpointing=False, use_cpu=device.type == "cpu",
                                  remove_unused_columns=False, save_strategy="no", logging_strategy="no")
        trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate)
        result = preflight(trainer, gpu=args.gpu, budget_mib=args.budget_mib, max_scan=args.max_scan,
                           ledger=args.ledger, stop=(), stream=sys.stdout if not args.json else sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    return result


def main(argv=None) -> int:
    from ledger.errors import LedgerError, UserError

    from .recipe import RecipeError

    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except (RecipeError, UserError, LedgerError, ValueError) as exc:
        print(f"preflight: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 3 if result.verdict == "won't fit" else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a training step changes, and its exact restoration; the run's recipe as read off the
trainer and the peft config (``preflight``)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


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
    #: "lora" (a peft adapter) or "full" (no adapter, every weight trained: full fine-tuning).
    method: str = "lora"
    #: The memory fixes the run's arguments switch on, as the ledger names them (``fused_linear_ce``:
    #: Liger's fused loss alone; ``activation_offloading``: TRL's); None when the run has a setting
    #: the ledger has no name for (Liger's other kernels), so its step is not a recipe it can record.
    fixes: Optional[list[str]] = dataclasses.field(default_factory=list)
    #: Processes (GPUs) of a distributed run and how they split the model (``preflight.world``).
    gpus: int = 1
    strategy: Optional[str] = None
    cpu_offload: bool = False

    def describe(self, seq_len: int) -> str:
        lora = ("full fine-tuning (every weight trained)" if self.method == "full" else
                (f"LoRA r{self.rank}" + (f" dropout {self.dropout:g}" if self.dropout else "")
                 + (" DoRA" if self.dora else "")) if self.rank else "no LoRA")
        fixes = ("Liger kernels beyond the fused loss (no recipe the ledger names)" if self.fixes is None
                 else f"memory fixes {', '.join(self.fixes) or 'none'}")
        return (f"{self.model or 'the model'} {self.quant} {lora}, micro-batch {self.batch_size} × {seq_len} tokens"
                f" (accumulation {self.accumulation}), checkpointing {'on' if self.checkpointing else 'off'}, "
                f"{self.optimizer}, {fixes}"
                + (f", on each of {self.gpus} GPUs ({self.strategy}" + (", CPU offload" if self.cpu_offload else "")
                   + ")" if self.gpus > 1 else ""))


def read_recipe(trainer, model) -> RunRecipe:
    base = _unwrap(model)
    peft_cfg = None
    cfgs = getattr(base, "peft_config", None)
    if isinstance(cfgs, dict) and cfgs:
        peft_cfg = cfgs.get(getattr(base, "active_adapter", "default")) or next(iter(cfgs.values()))
    params = list(base.parameters())
    # No adapter and every weight trainable: full fine-tuning (its weights' dtype is its precision).
    full = peft_cfg is None and bool(params) and all(p.requires_grad for p in params)
    if getattr(base, "is_loaded_in_4bit", False) or any(type(m).__name__ == "Linear4bit" for m in base.modules()):
        quant = "4bit"
    else:  # the frozen weights' dtype (a full fine-tune's trained ones): bf16, fp16, fp32
        dtype = next((p.dtype for p in params if full or not p.requires_grad), torch.float32)
        quant = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    config = getattr(base, "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or None
    targets = getattr(peft_cfg, "target_modules", None)
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else ([targets] if targets else [])
    targets += expert_targets(getattr(peft_cfg, "target_parameters", None))
    ckpt = bool(getattr(trainer.args, "gradient_checkpointing", False)) or _checkpointing_on(base)
    return RunRecipe(
        model=name or getattr(config, "model_type", None), quant=quant,
        rank=getattr(peft_cfg, "r", None), alpha=getattr(peft_cfg, "lora_alpha", None),
        rslora=bool(getattr(peft_cfg, "use_rslora", False)), dropout=float(getattr(peft_cfg, "lora_dropout", 0) or 0),
        dora=bool(getattr(peft_cfg, "use_dora", False)),
        target_modules=targets,
        batch_size=int(trainer.args.per_device_train_batch_size),
        accumulation=int(trainer.args.gradient_accumulation_steps or 1), checkpointing=ckpt,
        optimizer=str(getattr(trainer.args.optim, "value", trainer.args.optim)), fixes=run_fixes(trainer.args, base),
        method="full" if full else "lora")


def expert_targets(parameters) -> list[str]:
    """A mixture of experts' fused expert weights in peft's ``target_parameters``
    ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj') as the projections the ledger names:
    gate_up_proj is gate_proj and up_proj."""
    names = {str(p).rsplit(".", 1)[-1] for p in (parameters or ())}
    return ((["gate_proj", "up_proj"] if "gate_up_proj" in names else [])
            + (["down_proj"] if "down_proj" in names else []))


def run_fixes(args, base) -> Optional[list[str]]:
    """The memory fixes a run's arguments switch on, as the ledger names them: TRL's
    ``activation_offloading``; ``use_liger_kernel`` with only the fused linear cross-entropy on
    (``liger_kernel_config``, over the defaults of Liger's function for the model type) is
    ``fused_linear_ce``; any other Liger kernel on makes the recipe one the ledger has no name for
    (None)."""
    from ledger.vocab.recipe import FIX_NAMES

    fixes = []
    if getattr(args, "use_liger_kernel", False):
        try:
            import inspect

            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except ImportError:
            return None
        config = getattr(args, "liger_kernel_config", None) or {}
        apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(getattr(getattr(base, "config", None), "model_type", None))
        if apply is None:
            return None
        on = {name for name, param in inspect.signature(apply).parameters.items()
              if isinstance(param.default, bool) and config.get(name, param.default)}
        if on - {"fused_linear_cross_entropy"}:
            return None
        if on:
            fixes.append("fused_linear_ce")
    if getattr(args, "activation_offloading", False):
        fixes.append("activation_offloading")
    return [f for f in FIX_NAMES if f in fixes]


def _checkpointing_on(model) -> bool:
    for m in model.modules():
        if getattr(m, "is_gradient_checkpointing", False) or getattr(m, "gradient_checkpointing", False) is True:
            return True
    return False


@contextlib.contextmanager
def checkpointing_on(module, kwargs: Optional[dict] = None, **extra) -> Iterator[bool]:
    """Gradient checkpointing switched on in ``module`` for the block (``kwargs`` for
    torch.utils.checkpoint, ``extra`` for transformers' call), off again after; nothing when it is on
    already. Yields whether it switched it on."""
    if _checkpointing_on(module):
        yield False
        return
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **extra)
        off = module.activation_checkpointing_disable
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        off = module.gradient_checkpointing_disable
    try:
        yield True
    finally:
        off()


def _checkpointing(model, on: bool):
    """Gradient checkpointing on (non-reentrant) for a measured alternative, when ``on``."""
    if not on:
        return contextlib.nullcontext(False)
    base = _unwrap(model)
    return checkpointing_on(base.get_base_model() if hasattr(base, "get_base_model") else base,
                            {"use_reentrant": False})

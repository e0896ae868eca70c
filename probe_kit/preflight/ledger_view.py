"""The ledger's side of a preflight: the card's limit, its answer for the run's recipe, its ceiling,
and the record of the measured step (``preflight``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Optional

import torch

from .batches import WorstBatch
from .state import RunRecipe
from .step import Step


# -- the ledger: the card's limit, its answer, the record ---------------------------------------


def _card(gpu: Optional[str], ledger_path: Optional[str]):
    """(key, entry, ledger) for a card name, from the ledger given (else the bundled one) and the
    card table."""
    if gpu is None:
        return None
    from ledger.storage import store
    from ledger.vocab.cards import require_card
    from ledger.core.paths import DEFAULT_LEDGER

    ledger = store.load_or_new(ledger_path) if ledger_path else store.load(DEFAULT_LEDGER)
    key, entry, _ = require_card(ledger, gpu, where="gpu=")
    return key, entry, ledger


def _ledger_view(card, recipe: RunRecipe, seq_len: int):
    """The predictor's limit for the card (allocated) and its answer for the recipe, where it models it."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.vocab.model_configs import model_name
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    key, entry, ledger = card
    predictor = Predictor(ledger, load_dry_runs())
    low, _high, source = predictor.card_limit(key, entry, "real")
    answer = None
    if recipe.method == "full" and recipe.quant in ("bf16", "fp32") and recipe.fixes is not None:
        from ledger.vocab.optimizers import OPTIMIZERS
        from ledger.vocab.recipe import full_recipe

        q = full_recipe(model=model_name(recipe.model), quant=recipe.quant, seq_len=seq_len, fixes=_fixes(recipe),
                        batch=recipe.batch_size, checkpointing=recipe.checkpointing,
                        optimizer=recipe.optimizer if recipe.optimizer in OPTIMIZERS else None)
        a = predictor.predict(q, key, entry=entry, run="real")
        answer = (f"{a.verdict} on {key}: a real run of {q.describe()} peaks at {a.allocated.mib:,.1f} MiB allocated "
                  f"({a.allocated.low_mib:,.1f}–{a.allocated.high_mib:,.1f} MiB), by {a.method}"
                  if a.allocated is not None else f"{a.verdict}: {a.why}")
    elif recipe.method == "full":
        answer = (f"no answer: full fine-tuning in {recipe.quant} is no recipe the ledger answers (bf16 or fp32 "
                  "master weights)" if recipe.fixes is not None else
                  "no answer: Liger kernels beyond the fused loss are no recipe the ledger names")
    elif recipe.rank is None:
        answer = "no answer: the ledger models LoRA runs and full fine-tuning"
    elif not recipe.checkpointing:
        answer = ("no answer with gradient checkpointing off (its predictor models checkpointing on); this "
                  "measurement is the evidence")
    elif recipe.fixes is None:
        answer = "no answer: Liger kernels beyond the fused loss are no recipe the ledger names"
    else:
        from ledger.vocab.optimizers import OPTIMIZERS

        q = Recipe(model=model_name(recipe.model), rank=recipe.rank, quant=recipe.quant, dropout=recipe.dropout > 0,
                   dora=recipe.dora, seq_len=seq_len, fixes=_fixes(recipe), batch=recipe.batch_size,
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
    if card is None or recipe.fixes is None:
        return None
    if recipe.method == "full":
        from ledger.vocab.model_configs import model_name

        return (f"or a shorter sequence: `vram ceiling --model {model_name(recipe.model) or 'MODEL'} --gpu {card[0]} "
                f"--method full --quant {recipe.quant}` answers the longest that fits full fine-tuning on this card")
    if recipe.rank is None:
        return None
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.vocab.model_configs import model_name
    from ledger.vocab.optimizers import OPTIMIZERS
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    key, entry, ledger = card
    name = model_name(recipe.model) or "MODEL"
    q = Recipe(model=name, rank=recipe.rank, quant=recipe.quant, dropout=recipe.dropout > 0, dora=recipe.dora,
               seq_len=seq_len, fixes=_fixes(recipe), batch=recipe.batch_size, checkpointing=recipe.checkpointing,
               optimizer=recipe.optimizer if recipe.optimizer in OPTIMIZERS else None)
    c = Predictor(ledger, load_dry_runs()).ceiling(q, key, entry=entry, run="real")
    if c.fits_rank is not None and c.fits_rank < recipe.rank:
        return (f"or a smaller rank: the ledger's largest that fits a real run of this recipe at {seq_len} tokens on "
                f"{key} is r{c.fits_rank} (`vram ceiling`, {c.ranks[0]['method'] if c.ranks else 'its predictor'})")
    return (f"or a smaller rank: `vram ceiling --model {name} --gpu {key} --seq-len {seq_len} --quant {recipe.quant} "
            f"--batch-size {recipe.batch_size}` asks the ledger's largest at this length on this card "
            f"(it says: {c.status if c.fits_rank is None else f'r{c.fits_rank}'})")


def _fixes(recipe: RunRecipe) -> str:
    """The run's memory fixes as the ledger keys them ('none', or the comma list)."""
    from ledger.vocab.recipe import fixes_key, fixes_value

    return fixes_key(fixes_value(recipe.fixes or []))


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)


def record(path: str, recipe: RunRecipe, worst: WorstBatch, step: Step, device: torch.device,
           gpu_key: Optional[str]) -> str:
    """Append the measured step to a ledger as a probe row; returns its id."""
    import hashlib
    import json

    from ledger.storage import store
    from ledger.core.models import Lora, Measurement, Oom, Outcome, Provenance
    from ledger.vocab.recipe import fixes_value
    from ledger.intake.oom import parse_oom_message

    from ..probe_vram import environment

    cfg = {"recipe": dataclasses.asdict(recipe), "seq_len": worst.seq_len, "device": str(device)}
    digest = hashlib.sha256(json.dumps([cfg, step.peak_allocated_mib, str(dt.date.today())],
                                       sort_keys=True).encode()).hexdigest()[:8]
    world = (f"-{recipe.gpus}gpus-{recipe.strategy}" + ("-offload" if recipe.cpu_offload else "")
             if recipe.gpus > 1 else "")
    mid = f"preflight-{gpu_key or device.type}-b{recipe.batch_size}-seq{worst.seq_len}{world}-{digest}"
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
        lora=lora, seq_len=worst.seq_len, batch_size=recipe.batch_size, memory_fixes=fixes_value(recipe.fixes or []),
        optimizer=recipe.optimizer, gradient_checkpointing=recipe.checkpointing,
        finetune="full" if recipe.method == "full" else None,
        world_size=recipe.gpus if recipe.gpus > 1 else None, strategy=recipe.strategy if recipe.gpus > 1 else None,
        cpu_offload=True if recipe.gpus > 1 and recipe.cpu_offload else None,
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
        from ..probe_vram import card_entry

        card = card_entry(torch.cuda.get_device_properties(device), gpu_key, torch.version.hip, torch.__version__,
                          torch.version.cuda)
        m.gpu = card[0]
    store.append(path, [m], gpus_if_missing=dict([card]) if card else None, create=True)
    return mid

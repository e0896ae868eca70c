"""The estimators against this project's dry runs, where no card has measured the recipe: the
mixtures of experts (Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B; ``moe_board``) and full
fine-tuning (``full_board``). The ledger holds no measured row of either, so the reference is
this project's answer from its committed dry runs (the real transformers classes under fake
tensors, checked against the real CPU step to 1% on tiny configs of each family), not a
measurement: each board says how far each estimator's terms are from that step, in its own
slices, and is never mixed into the measured scoreboard.

The MoE recipes are the fit grid's stock ones: LoRA on every projection (attention and the fused
experts), gradient checkpointing, micro-batch 1, a training run with AdamW's state, 4-bit and
bf16, every length and rank the committed rows hold. The full fine-tuning recipes are the grid's
too: every weight trained, bf16 weights or fp32 master weights, a training run with AdamW's step,
stock, every model and length the committed rows hold. Each estimator's figure is compared with the
project's figure of the quantity it claims to predict, on ``REFERENCE_CARD`` (the card the
reserved figure and canifinetune's overhead need): peak allocated, or peak reserved (allocated
times the card's reserved/allocated ratio, as ``vram estimate`` gives it). No torch.

Past one card (``world_board``): Unsloth Studio's multi-GPU rule (each GPU past the first adds 85%
of its memory to one pool its one-GPU estimate must fit in) against the answer for one rank of
the same run under FSDP, from the committed dry runs of that rank (``ledger.answer.worlds``).
"""

from __future__ import annotations

import statistics
from typing import Iterable, Optional

from ledger.core.models import Measurement
from ledger.vocab.cards import resolve_card
from ledger.vocab.model_configs import load_arch, model_name
from ledger.vocab.recipe import Recipe, full_recipe, full_recipe_of, recipe_of
from .estimators import ESTIMATORS, MIB, Estimator

REFERENCE_CARD = "h100-80gb"
#: The optimizer the stock recipe's training run steps (what the fit table's stock cells judge).
OPTIMIZER = "adamw_torch"


def moe_recipes(dry_runs: Iterable[Measurement]) -> list[Recipe]:
    """The stock recipes of the committed dry runs of mixture-of-experts models, once each, in order."""
    seen: dict[tuple, Recipe] = {}
    for m in dry_runs:
        arch = load_arch(m.model) if m.model else None
        if not arch or not arch.experts or m.outcome.status != "ok":
            continue
        r = recipe_of(m)
        if r is None or r.fixes != "none" or not r.checkpointing or r.batch != 1 or r.dropout or r.dora \
                or r.seq_len is None:
            continue
        key = (model_name(m.model), r.quant, r.rank, r.seq_len)
        seen.setdefault(key, Recipe(model=model_name(m.model), quant=r.quant, rank=r.rank, seq_len=r.seq_len,
                                    fixes="none", optimizer=OPTIMIZER))
    return [seen[k] for k in sorted(seen)]


def full_recipes(dry_runs: Iterable[Measurement]) -> list[Recipe]:
    """The stock full fine-tuning recipes of the committed dry runs (a training run with AdamW's
    step, checkpointing on, micro-batch 1), once each, in order."""
    seen: dict[tuple, Recipe] = {}
    for m in dry_runs:
        r = full_recipe_of(m)
        if (r is None or m.kind != "dry_run" or m.outcome.status != "ok" or r.fixes != "none" or not r.checkpointing
                or r.batch != 1 or r.optimizer != OPTIMIZER or r.seq_len is None):
            continue
        key = (model_name(m.model), r.quant, r.seq_len)
        seen.setdefault(key, full_recipe(model=model_name(m.model), quant=r.quant, seq_len=r.seq_len, fixes="none",
                                         optimizer=OPTIMIZER))
    return [seen[k] for k in sorted(seen)]


def size_band(model: str) -> str:
    """A model's size band, a slice of the full fine-tuning board."""
    arch = load_arch(model)
    b = arch.total_params / 1e9 if arch else 0.0
    return "under 5B" if b < 5 else "5-15B" if b < 15 else "15B and up"


def moe_board(predictor, estimators: Optional[list[Estimator]] = None, card: str = REFERENCE_CARD) -> dict:
    """Each estimator's MoE figures against the project's dry-run answers (see the module
    docstring): per estimator its rows, the median |error| and signed error, and slices by model
    and quant; and against any measured MoE row."""
    def moe(m: Measurement, arch) -> Optional[Recipe]:
        return recipe_of(m) if arch.experts else None
    return _board(predictor, moe_recipes(predictor.dry), estimators, card,
                  {"model": lambda r: r.model, "quant": lambda r: r.quant}, measured_recipe=moe)


def full_board(predictor, estimators: Optional[list[Estimator]] = None, card: str = REFERENCE_CARD) -> dict:
    """Each estimator's full fine-tuning figures against the project's dry-run answers (see the
    module docstring), with slices by precision and by model size."""
    return _board(predictor, full_recipes(predictor.fit.dry_source), estimators, card,
                  {"quant": lambda r: r.quant, "size": lambda r: size_band(r.model)}, measured_recipe=lambda m, arch: full_recipe_of(m) if m.finetune == "full" else None)


def measured_rows(ledger, recipe_of_row) -> list[tuple]:
    """The ledger's measured rows of a kind (``recipe_of_row`` reads a row's recipe, None for
    another kind) that an estimator can be asked about: (row, recipe, arch), each read once."""
    out = []
    archs: dict = {}
    for m in ledger.measurements:
        if m.kind not in ("probe", "real") or m.outcome.status != "ok" or not m.gpu or not m.model:
            continue
        if m.model not in archs:
            archs[m.model] = load_arch(m.model)
        arch = archs[m.model]
        r = recipe_of_row(m, arch) if arch is not None else None
        if r is not None and r.seq_len:
            out.append((m, r, arch))
    return out


def measured_scores(ledger, est: Estimator, rows: list[tuple]) -> list[dict]:
    """An estimator against measured rows (``measured_rows``): each row's quantity the estimator
    claims, on the row's card."""
    out = []
    for m, r, arch in rows:
        ref = m.outcome.peak_reserved_mib if est.predicts == "reserved" else m.outcome.peak_allocated_mib
        if not ref:
            continue
        gpu = ledger.gpus.get(m.gpu)
        e = est.estimate(arch, r, gpu_total_mib=gpu.total_mib if gpu else None)
        if e is None:
            continue
        mib = e.bytes / MIB
        out.append({"id": m.id, "gpu": m.gpu, "measured_mib": round(ref, 1), "estimate_mib": round(mib, 1),
                    "error_pct": round((mib - ref) / ref * 100, 2)})
    return out


def _board(predictor, recipes: list[Recipe], estimators: Optional[list[Estimator]], card: str, slices: dict,
           measured_recipe=None) -> dict:
    estimators = ESTIMATORS if estimators is None else estimators
    found = resolve_card(predictor.ledger, card)
    if found is None:
        raise ValueError(f"unknown card {card!r}")
    card, entry, _ = found
    rows = []
    for recipe in recipes:
        answer = predictor.predict(recipe, card, entry=entry, run="real")
        if answer.method != "dry run" or answer.real_allocated is None:
            continue
        rows.append((recipe, {"allocated": answer.real_allocated.mib,
                              "reserved": answer.reserved.mib if answer.reserved else None}))
    total = entry.total_mib
    kind_rows = measured_rows(predictor.ledger, measured_recipe) if measured_recipe else []
    out = []
    for est in estimators:
        scored = []
        available = getattr(est, "available", lambda: True)()
        for recipe, reference in rows if available else []:
            e = est.estimate(load_arch(recipe.model), recipe, gpu_total_mib=total)
            ref = reference.get(est.predicts)
            if e is None or not ref:
                continue
            mib = e.bytes / MIB
            scored.append({"model": recipe.model, "quant": recipe.quant,
                           "rank": None if recipe.method == "full" else recipe.rank, "seq_len": recipe.seq_len,
                           **{key: of(recipe) for key, of in slices.items() if key not in ("model", "quant")},
                           "reference_mib": round(ref, 1), "estimate_mib": round(mib, 1),
                           "error_pct": round((mib - ref) / ref * 100, 2)})
        errors = [r["error_pct"] for r in scored]
        measured = measured_scores(predictor.ledger, est, kind_rows) if available else []
        out.append({"name": est.name, "predicts": est.predicts, "available": available, "n": len(scored),
                    "measured": measured,
                    "measured_median_abs_err_pct": round(statistics.median(abs(r["error_pct"]) for r in measured), 2)
                    if measured else None,
                    "median_abs_err_pct": round(statistics.median(abs(e) for e in errors), 2) if errors else None,
                    "median_signed_err_pct": round(statistics.median(errors), 2) if errors else None,
                    "slices": {key: _medians(scored, key) for key in slices}, "rows": scored})
    return {"reference_card": card, "optimizer": OPTIMIZER, "recipes": len(rows), "estimators": out}


def _medians(scored: list[dict], key: str) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for r in scored:
        groups.setdefault(str(r[key]), []).append(abs(r["error_pct"]))
    return {k: {"n": len(v), "median_abs_err_pct": round(statistics.median(v), 2)} for k, v in sorted(groups.items())}


#: Unsloth Studio's multi-GPU rule: each GPU past the first adds this share of its free memory to
#: the one pool its one-GPU estimate must fit in (its VRAM_ESTIMATION.md, "Multi-GPU Overhead").
UNSLOTH_SHARE = 0.85
#: The card and length the several-GPU board asks at (two to eight RTX 4090s: the box FSDP-QLoRA
#: made popular).
WORLD_CARD, WORLD_LEN = "rtx-4090", 2048


def unsloth_pool(arch, recipe: Recipe, card_mib: Optional[float]) -> Optional[dict]:
    """Unsloth Studio's answer for N GPUs, as a comparison: its one-GPU estimate (reserved, its own
    defaults), the pool of N cards by its 85% rule, its share a GPU, and whether it says fits."""
    from .estimators import UnslothStudio

    est = UnslothStudio().estimate(arch, recipe.replace(gpus=1, strategy=None))
    if est is None:
        return None
    pool = 1 + UNSLOTH_SHARE * (recipe.gpus - 1)
    return {"estimate_mib": est.mib, "share_mib": round(est.mib / pool, 1),
            "pool_mib": round(card_mib * pool, 1) if card_mib else None,
            "verdict": ("fits" if est.mib <= card_mib * pool else "won't fit") if card_mib else None,
            "rule": f"each GPU past the first adds {UNSLOTH_SHARE:.0%} of its memory to one pool (Unsloth Studio)"}


def world_board(predictor, rows: list[Measurement], card: str = WORLD_CARD, seq_len: int = WORLD_LEN) -> Optional[dict]:
    """Unsloth Studio's 85% rule against one rank's answer under FSDP: every committed several-GPU
    recipe at ``seq_len`` tokens (QLoRA at rank 16; full fine-tuning in bf16) on N of ``card``: its
    share a GPU against the rank's predicted peak allocated, and the verdicts side by side (None
    without such rows)."""
    from ledger.answer.worlds import world_table
    from ledger.vocab.recipe import capacity_mib

    found = resolve_card(predictor.ledger, card)
    if found is None:
        raise ValueError(f"unknown card {card!r}")
    card, entry, _ = found
    usable = capacity_mib(entry)
    out = []
    for c in world_table(predictor, rows, [card], {card: entry}):
        if c.seq_len != seq_len or c.mib is None:
            continue
        recipe = (full_recipe(model=c.model, quant=c.quant, seq_len=c.seq_len, fixes="none", gpus=c.gpus,
                              strategy=c.strategy) if c.method == "full" else
                  Recipe(model=c.model, rank=16, quant=c.quant, seq_len=c.seq_len, fixes="none", gpus=c.gpus,
                         strategy=c.strategy))
        u = unsloth_pool(load_arch(c.model), recipe, usable)
        if u is None:
            continue
        out.append({"model": c.model, "method": c.method, "gpus": c.gpus, "strategy": c.strategy,
                    "unsloth_mib": round(u["estimate_mib"], 1), "unsloth_share_mib": u["share_mib"],
                    "unsloth_verdict": u["verdict"], "per_gpu_mib": c.mib, "verdict": c.verdict,
                    "share_err_pct": round((u["share_mib"] - c.mib) / c.mib * 100, 1)})
    if not out:
        return None
    errs = [r["share_err_pct"] for r in out]
    return {"card": card, "seq_len": seq_len, "share": UNSLOTH_SHARE, "rows": out,
            "median_signed_err_pct": round(statistics.median(errs), 1),
            "median_abs_err_pct": round(statistics.median(abs(e) for e in errs), 1),
            "below": sum(e < 0 for e in errs),
            "optimistic": [f"{r['model']} x{r['gpus']}" for r in out
                           if r["unsloth_verdict"] == "fits" and r["verdict"] == "won't fit"]}

"""Self-consistency: every answer at or above the project's own dry run of the same recipe.

The answering commands (``vram estimate``, ``ceiling``, ``predict``, ``fit`` and the site's cells)
answer most recipes from dry-run rows of other ranks and lengths, derived. Whatever the derivation,
an answer's interval top must not fall below what the dry run of that very recipe computes,
calibrated as the commands calibrate it (the card's remainder added): a "fits" below it is the
costliest bug this project can have.

``sample_recipes`` draws random recipes (a fixed seed); ``check`` answers each as the commands do
(``ledger.answer.predictor.Predictor.predict`` on a card, a training run, the dry runs an answer lacks
computed first as ``vram estimate`` computes them: ranks 8 and 64 at its length) and runs the dry
run of the recipe itself (with its optimizer's step), and returns one ``Check`` per recipe.
``tests/test_self_consistency.py`` samples tiny configs of three families;
``benchmarks/self_consistency.py`` the shipped models.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass
from typing import Iterable, Optional

from ledger.vocab.optimizers import OPTIMIZERS
from ledger.vocab.recipe import Recipe

#: The recipes' memory settings: stock, the settings users set, and the program's preset.
FIXES = ("none", "none", "none", "fused_linear_ce", "activation_offloading", "all")


@dataclass
class Check:
    recipe: Recipe
    answer_mib: Optional[float]  # the answer's figure (a training run's peak allocated)
    answer_top_mib: Optional[float]  # its interval's top
    verdict: str
    method: Optional[str]
    dry_mib: Optional[float]  # the dry run of the recipe itself, plus the card's remainder

    @property
    def gap(self) -> Optional[float]:
        """(dry run - answer's top) / answer's top: above 0, the answer is below its own dry run."""
        if self.answer_top_mib is None or self.dry_mib is None:
            return None
        return (self.dry_mib - self.answer_top_mib) / self.answer_top_mib

    @property
    def below(self) -> bool:
        return self.gap is not None and self.gap > 0


def sample_recipes(models: Iterable[str], n: int, seed: int = 0, max_tokens: int = 8192,
                   lengths: Optional[Iterable[int]] = None, per_group: int = 1) -> list[Recipe]:
    """``n`` random recipes over ``models``: rank 8-512, a length (from ``lengths``, else 256 up to
    the model's context and ``max_tokens`` tokens a micro-batch), both quants, every optimizer,
    micro-batch 1-8, checkpointing on and off, dropout, DoRA (never on a mixture of experts' fused
    experts, which peft adapts without either), the stock recipe, the settings users
    set and the program's preset (its response span 64 tokens), LoRA on the 7 projections.
    ``per_group``: recipes drawn for each group drawn (model, quant, dropout, DoRA, length, fixes,
    micro-batch, checkpointing), each with its own rank and optimizer: the dry runs a group's
    answers rest on (ranks 8 and 64) are then shared by that many recipes."""
    from ledger.vocab.adapter import experts_adapted
    from ledger.vocab.model_configs import max_length

    rng = random.Random(seed)
    models = list(models)
    lengths = sorted(lengths) if lengths is not None else None
    out = []
    while len(out) < n:
        model = rng.choice(models)
        batch = rng.choice((1, 1, 1, 2, 4, 8))
        longest = min(max_length(model) or 4096, max_tokens // batch)
        choices = [s for s in (lengths or (256, 512, 1024, 2048, 4096, 8192)) if s <= longest]
        if not choices:
            continue
        fixes, seq = rng.choice(FIXES), rng.choice(choices)
        quant, dropout, dora = rng.choice(("4bit", "bf16")), rng.random() < 0.2, rng.random() < 0.15
        if experts_adapted(model):  # peft adapts a mixture of experts' fused experts without either
            dropout = dora = False
        checkpointing = fixes == "all" or rng.random() < 0.75
        for _ in range(min(per_group, n - len(out))):
            out.append(Recipe(model=model, rank=rng.choice((8, 16, 24, 40, 64, 96, 128, 200, 256, 320, 432, 512)),
                              quant=quant, dropout=dropout, dora=dora,
                              seq_len=seq, fixes=fixes, response_len=min(64, seq - 1) if fixes == "all" else None,
                              optimizer=rng.choice(OPTIMIZERS), batch=batch, checkpointing=checkpointing))
    return out


def _config(recipe: Recipe, rank: Optional[int] = None, optimizer: Optional[str] = None):
    from .recipe import ProbeConfig, parse_fixes

    return ProbeConfig(model=recipe.model, rank=rank or recipe.rank, quant=recipe.quant,
                       dropout=0.1 if recipe.dropout else 0.0, dora=recipe.dora, seq_len=recipe.seq_len,
                       response_len=recipe.response_len or min(64, recipe.seq_len - 1),
                       fixes=parse_fixes(recipe.fixes),
                       random_weights=True, batch_size=recipe.batch, gradient_checkpointing=recipe.checkpointing,
                       target_modules=list(recipe.targets),
                       optimizer=optimizer)


def _dry_row(cfg):
    from .dry_run import measurement, predict

    with contextlib.redirect_stdout(sys.stderr):
        outcome, breakdown = predict(cfg)
    return measurement(cfg, outcome, breakdown, None, None)


def dry_row(cfg):
    """The dry run of a probe configuration as a ledger row (a function of its own, for a process pool)."""
    return _dry_row(cfg)


def check(ledger, dry_rows: list, recipes: list[Recipe], gpu: str = "rtx-4090", entry=None,
          progress=None, runner=map) -> list[Check]:
    """Each recipe answered as the commands answer it, against its own dry run (see the module).
    ``runner``: a ``map`` that runs ``dry_row`` over configurations (a process pool's, to use
    every core), in order."""
    from ledger.answer.predictor import Predictor
    from ledger.fit.response_span import answerable, fewer_targets

    rows = list(dry_rows)
    predictor = Predictor(ledger, rows)
    # The dry runs the answers lack, computed first as `vram estimate` computes them.
    needed = {}
    for r in recipes:
        one, _ = answerable(fewer_targets(r.replace(optimizer=None))[0])
        if one is None or predictor.table.raw(one.replace(rank=8))[0] is not None:
            continue
        for rank in (8, 64):
            cfg = _config(one, rank)
            needed[(cfg.model, rank, cfg.quant, cfg.dropout, cfg.dora, cfg.seq_len, tuple(cfg.fixes), cfg.batch_size,
                    cfg.gradient_checkpointing)] = cfg
    cfgs = list(needed.values()) + [_config(r, optimizer=r.optimizer) for r in recipes]
    made = []
    for row in runner(dry_row, cfgs):
        made.append(row)
        if progress:
            progress()
    rows += made[:len(needed)]
    predictor = Predictor(ledger, rows)
    out = []
    for r, dry in zip(recipes, made[len(needed):]):
        answer = predictor.predict(r, gpu, entry=entry, run="real")
        iv = answer.real_allocated
        rem = predictor.remainder(gpu, entry.vendor if entry else None)[0] or 0.0
        peak = dry.outcome.peak_allocated_mib
        out.append(Check(r, None if iv is None else iv.mib, None if iv is None else iv.high_mib, answer.verdict,
                         answer.method, None if peak is None else peak + rem))
    return out

"""One rank of a multi-GPU run (``--gpus N --strategy S``): its dry-run points, its verdicts by
LoRA rank, and the fit table's several-GPU cells.

A rank's step is not one GPU's: FSDP shards the weights, gradients and optimizer state and gathers
a unit at a time, DDP keeps everything whole and adds gradient buckets. No one-GPU row answers it,
so every answer rests on a dry run of that very world (``probe_kit.distributed``: fake tensors,
torch's fake process group), calibrated as any dry run is (the card's remainder and interval) and
judged per GPU. Between two LoRA ranks a rank's step is affine in the rank (qwen2.5-0.5b under
FSDP on 2 GPUs, 1,024 tokens, AdamW: 3.234 MiB per rank from rank 8 to 64, 64 to 128 and 128 to
256 alike), so two dry runs of a length answer every rank there.

The shipped grid (``world_grid_points``) has the models that do not fit one listed card whole:
QLoRA of the 70B/72B models and the mixtures of experts, full fine-tuning of 7-14B models, each
under FSDP on 2, 4 and 8 GPUs, a training run with AdamW, stock, micro-batch 1.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from ledger.core.models import Measurement
from ledger.vocab.model_configs import model_name
from ledger.vocab.optimizers import STOCK_OPTIMIZER
from ledger.vocab.recipe import Recipe, full_recipe, full_recipe_of, recipe_of

from .fits import MAX_RANK, STEP, cell_label, full_point, lora_point, model_lengths

#: The ranks a per-GPU rank ceiling is dry-run at; every rank between and past is derived.
CEILING_RANKS = (8, 64)

#: The shipped grid's worlds: FSDP2 ``fully_shard`` (FULL_SHARD, as accelerate's FSDP plugin
#: launches it) on 2, 4 and 8 GPUs. DDP shards nothing (a rank holds at least one GPU's step) and
#: SHARD_GRAD_OP keeps the gathered weights: both are answered by the commands, not the tables.
WORLD_GPUS = (2, 4, 8)
WORLD_STRATEGY = "fsdp"
WORLD_LENGTHS = (512, 2048, 4096, 8192, 16384)
#: QLoRA (stock, plain adapter) of the models no listed card holds at useful lengths.
WORLD_LORA_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "llama-3.3-70b", "qwen2.5-72b")
#: Full fine-tuning (bf16 weights, AdamW in bf16) of the models one card cannot train whole.
WORLD_FULL_MODELS = ("qwen2.5-7b", "llama-3.1-8b", "qwen2.5-14b")
#: The cards fits.md and fits.html list several-GPU rows for (the ones people put two to eight
#: of in a box or a node); a model's page and the picker have every common card.
WORLD_PAGE_CARDS = ("rtx-3090", "rtx-4090", "rtx-6000-ada", "a100-80gb", "h100-80gb")


def rank_point(recipe: Recipe, model_rows: str, run: str) -> dict:
    """The dry-run point of one rank: the recipe at its own rank, the world, and for a training
    run the optimizer's step (its state is what FSDP shards: part of the step, not a term after)."""
    point = (full_point(recipe, model_rows) if recipe.method == "full"
             else {**lora_point(recipe, model_rows), "rank": recipe.rank})
    point.update(gpus=recipe.gpus, strategy=recipe.strategy)
    if recipe.cpu_offload:
        point["cpu_offload"] = True
    if run == "real":
        point["optim"] = recipe.optimizer or STOCK_OPTIMIZER
    return point


def world_recipes(model: str, gpus: int, strategy: str = WORLD_STRATEGY) -> list[Recipe]:
    """The shipped grid's recipes of one model and world (rank left at 16 for a LoRA recipe: each
    length is dry-run at ``CEILING_RANKS``)."""
    lengths = model_lengths(model, WORLD_LENGTHS)
    if model in WORLD_FULL_MODELS:
        return [full_recipe(model=model, quant="bf16", seq_len=s, fixes="none", gpus=gpus, strategy=strategy)
                for s in lengths]
    return [Recipe(model=model, quant="4bit", fixes="none", seq_len=s, gpus=gpus, strategy=strategy)
            for s in lengths]


def world_grid_points() -> list[dict]:
    """The shipped grid's several-GPU dry runs (sweep points): each model's recipes in each world,
    a LoRA length at both ``CEILING_RANKS``, a training run with AdamW's step."""
    out = []
    for model in WORLD_LORA_MODELS + WORLD_FULL_MODELS:
        for gpus in WORLD_GPUS:
            for r in world_recipes(model, gpus):
                if r.method == "full":
                    out.append(rank_point(r, model, "real"))
                else:
                    out += [rank_point(r.replace(rank=k), model, "real") for k in CEILING_RANKS]
    return out


def rank_rows(rows: list[Measurement]) -> dict[Recipe, Measurement]:
    """The dry-run rows of a rank of several GPUs, by their recipe (optimizer included): the newest
    of each."""
    out = {}
    for m in rows:
        if m.kind != "dry_run" or (m.world_size or 1) == 1:
            continue
        r = full_recipe_of(m) if m.finetune == "full" else recipe_of(m)
        if r is not None:
            out[r.replace(model=model_name(r.model))] = m
    return out


class RankJudge(NamedTuple):
    """A world's per-GPU answer at any LoRA rank of one length, from its dry runs at two ranks."""

    at: Callable[[int], object]  # rank -> Answer (``Predictor.judge_dry``)
    mib_per_rank: float
    first: int
    second: int


def rank_judge(predictor, recipe: Recipe, low: Measurement, high: Measurement, gpu: Optional[str], entry, *,
               margin_mib: float = 0.0, budget_mib: Optional[float] = None) -> RankJudge:
    """The per-GPU answer at any rank, from the rank's dry runs at two ranks (``low``, ``high``):
    between them a figure is bounded by them (the step is affine and grows with the rank); past the
    second it is extrapolated, the derivation's error widening its interval."""
    a, b = low.lora.rank, high.lora.rank
    pa, pb = low.outcome.peak_allocated_mib, high.outcome.peak_allocated_mib
    slope = (pb - pa) / (b - a)

    def at(rank: int):
        return predictor.judge_dry(recipe.replace(rank=rank), pa + slope * (rank - a), gpu, entry=entry,
                                   margin_mib=margin_mib, budget_mib=budget_mib, derived=rank > b)
    return RankJudge(at, slope, a, b)


def ceiling(judge: RankJudge, step: int = STEP, max_rank: int = MAX_RANK) -> tuple[Optional[int], Optional[int]]:
    """The largest rank (a multiple of ``step`` up to ``max_rank``) whose verdict is "fits", and the
    largest at worst "tight": by bisection, a verdict only ever worsening as the rank grows."""
    def last(ok: Callable[[str], bool]) -> Optional[int]:
        lo, hi = 0, max_rank // step  # ranks lo*step is known ok (0: none), hi*step not yet known
        if not ok(judge.at(step).verdict):
            return None
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(judge.at(mid * step).verdict):
                lo = mid
            else:
                hi = mid - 1
        return lo * step
    return last(lambda v: v == "fits"), last(lambda v: v != "won't fit")


class WorldCell(NamedTuple):
    """One cell of the several-GPU table: a model on N of a card under a strategy, at one length.
    LoRA (QLoRA, stock, plain adapter): the largest rank per GPU that fits and that is at worst
    tight. Full fine-tuning (bf16): the per-GPU verdict and figure. A training run with AdamW."""

    model: str
    gpus: int
    strategy: str
    gpu: str
    method: str  # lora | full
    quant: str
    seq_len: int
    fits_rank: Optional[int]
    tight_rank: Optional[int]
    verdict: str  # LoRA: at rank 16; full: the step's
    mib: Optional[float]  # per GPU, at rank 16 for LoRA
    high_mib: Optional[float]
    dry_runs: tuple[str, ...]

    label: str  # LoRA: the ceiling as the fit table writes one; full: the verdict


def _label(fits: Optional[int], tight: Optional[int], verdict: str) -> str:
    return cell_label("unknown" if fits is None and verdict == "unknown" else "ok", fits, tight, False)


#: The rank a LoRA cell's verdict and figure are given at (the rank most recipes start from).
CELL_RANK = 16


def world_table(predictor, rows: list[Measurement], gpus: list[str], cards: dict) -> list[WorldCell]:
    """The several-GPU cells of the shipped grid's models and worlds on ``gpus`` (keys of ``cards``,
    the card entries), where the dry runs are there (a missing row leaves its cells out)."""
    found = rank_rows(rows)
    out = []
    optim = STOCK_OPTIMIZER
    for model in WORLD_LORA_MODELS + WORLD_FULL_MODELS:
        for n in WORLD_GPUS:
            for r in world_recipes(model, n):
                if r.method == "full":
                    row = found.get(r.replace(optimizer=optim, response_len=_response(r)))
                    if row is None:
                        continue
                    for gpu in gpus:
                        out.append(_full_cell(predictor, r, row, gpu, cards.get(gpu)))
                    continue
                pair = [found.get(r.replace(rank=k, optimizer=optim, response_len=_response(r)))
                        for k in CEILING_RANKS]
                if None in pair:
                    continue
                for gpu in gpus:
                    out.append(_lora_cell(predictor, r, pair, gpu, cards.get(gpu)))
    return raise_shorter(out)


def raise_shorter(cells: list[WorldCell]) -> list[WorldCell]:
    """What fits a longer sequence fits a shorter one: a LoRA cell's ceilings are raised to those
    of the same model, world and card at a longer length, and say "≥" (as the fit table's do)."""
    rows: dict[tuple, list[int]] = {}
    for i, c in enumerate(cells):
        if c.method == "lora":
            rows.setdefault((c.model, c.gpus, c.strategy, c.gpu, c.quant), []).append(i)
    for at in rows.values():
        best_fits, best_tight = None, None
        for i in sorted(at, key=lambda i: -cells[i].seq_len):
            c = cells[i]
            fits = max(x for x in (c.fits_rank, best_fits) if x is not None) if (c.fits_rank or best_fits) else None
            tight = max(x for x in (c.tight_rank, best_tight) if x is not None) if (c.tight_rank or best_tight) \
                else None
            if (fits, tight) != (c.fits_rank, c.tight_rank):
                status = "unknown" if fits is None and c.verdict == "unknown" else "ok"
                cells[i] = c._replace(fits_rank=fits, tight_rank=tight,
                                      label=cell_label(status, fits, tight, fits is not None))
            best_fits, best_tight = fits, tight
    return cells


def _response(r: Recipe) -> int:
    return lora_point(r, r.model)["response_len"]


def _lora_cell(predictor, r: Recipe, pair: list[Measurement], gpu: str, entry) -> WorldCell:
    ids = tuple(m.id for m in pair)
    base = (r.model, r.gpus, r.strategy, gpu, "lora", r.quant, r.seq_len)
    if any(m.outcome.status != "ok" or m.outcome.peak_allocated_mib is None for m in pair):
        oom = all(m.outcome.status in ("ok", "oom") for m in pair)
        verdict = "won't fit" if oom else "unknown"
        return WorldCell(*base, None, None, verdict, None, None, ids, _label(None, None, verdict))
    judge = rank_judge(predictor, r.replace(optimizer=STOCK_OPTIMIZER), pair[0], pair[1], gpu, entry)
    fits, tight = ceiling(judge)
    at = judge.at(CELL_RANK)
    iv = at.probe_allocated
    return WorldCell(*base, fits, tight, at.verdict, iv.mib, iv.high_mib, ids, _label(fits, tight, at.verdict))


def _full_cell(predictor, r: Recipe, row: Measurement, gpu: str, entry) -> WorldCell:
    base = (r.model, r.gpus, r.strategy, gpu, "full", r.quant, r.seq_len, None, None)
    o = row.outcome
    if o.status != "ok" or o.peak_allocated_mib is None:
        verdict = "won't fit" if o.status == "oom" else "unknown"
        return WorldCell(*base, verdict, None, None, (row.id,), verdict)
    a = predictor.judge_dry(r.replace(optimizer=STOCK_OPTIMIZER), o.peak_allocated_mib, gpu, entry=entry)
    return WorldCell(*base, a.verdict, a.probe_allocated.mib, a.probe_allocated.high_mib, (row.id,), a.verdict)

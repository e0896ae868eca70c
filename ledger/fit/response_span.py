"""The probe-to-real step and the response-span rules, in one place.

A probe keeps the fp32 logits of the response span it computes the loss on (with the
logits_to_keep fix); a real run's peak does not follow them. So a real run's peak is the probe's
*core* (its peak less those logits) x (1 - the calibrated over-estimate), and a recipe that keeps
logits for more positions than the probes behind its figure needs at least their fp32 logits
more, at most the whole logits chain."""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import Optional

from ledger.vocab.adapter import ALL_LINEAR, arch_of, trainable_shape_counts
from ledger.core import ends
from ledger.core.answers import Interval, around, interval, scale, shift
from .calibration import LOGIT_BYTES, kept_positions, kept_positions_of, logits_mib
from .ledger_fit import LedgerFit
from ledger.vocab.optimizers import STOCK_OPTIMIZER, state_bytes, transient_bytes
from ledger.vocab.recipe import Recipe

#: Bytes per vocabulary entry of one response position along the whole logits chain (bf16 logits,
#: their fp32 copy, log-softmax, its gradient): the top of what a longer response span can add.
LOGIT_CHAIN_BYTES = 14


def recipe_keep(recipe: Recipe) -> Optional[int]:
    """Positions a recipe keeps logits for (None: unknown, or the logits_to_keep fix is off)."""
    return kept_positions_of(recipe.fixes, None, recipe.response_len)


class ProbeToReal:
    """The span rules and the probe-to-real step on one ledger's fits."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit

    def _evidence_keep(self, evidence: list[str]) -> tuple[bool, Optional[int]]:
        """(any probe among the evidence, the fewest positions they kept logits for - None when
        one of them does not say)."""
        rows = [m for m in map(self.fit.by_id.get, evidence) if m is not None and m.kind == "probe"]
        keeps = [kept_positions(m) for m in rows]
        return bool(rows), (None if not rows or None in keeps else min(keeps))

    def figure_keep(self, recipe: Recipe, evidence: list[str]) -> Optional[int]:
        """Positions the lm_head kept logits for in a probe figure: its evidence probes' fewest (each
        must be known), the recipe's own when the figure was raised to it (``_longer_span``) or has no
        probe behind it."""
        has_rows, keep = self._evidence_keep(evidence)
        own = recipe_keep(recipe)
        if not has_rows:
            return own
        if keep is not None and own is not None and own > keep:
            return own
        return keep

    def longer_span(self, recipe: Recipe, probe: Optional[Interval], evidence: list[str]):
        """A recipe that keeps logits for more response positions than the probes behind its figure
        needs more: at least their fp32 logits (vocabulary x 4 bytes per position, what the RTX 3070 Ti
        probes moved by between 73 and 319 kept positions), at most the whole logits chain
        (vocabulary x 14 bytes: bf16 logits, their fp32 copy, log-softmax and its gradient)."""
        own = recipe_keep(recipe)
        _, keep = self._evidence_keep(evidence)
        if probe is None or own is None or keep is None or own <= keep:
            return probe, ""
        low = logits_mib(recipe.model, own - keep)
        if low is None:
            return probe, ""
        high = low * LOGIT_CHAIN_BYTES / LOGIT_BYTES
        top = None if probe.high_mib is None else round(probe.high_mib + high, 1)
        return (shift(probe, low).model_copy(update={"high_mib": top}),
                f"the recipe keeps logits for {own - keep} more response positions than the probes behind it: "
                f"+{low:.1f} MiB (their fp32 logits) to +{high:.1f} MiB (the whole logits chain)")

    def probe_to_real(self, probe: Interval, recipe: Recipe, evidence: list[str]) -> tuple[Interval, str]:
        """A real run's peak from a probe figure: its core (less the kept logits a real run does not
        follow, see ``ledger.fit.calibration``) x (1 - the calibrated over-estimate), with the text saying so."""
        o = self.fit.over
        keep = self.figure_keep(recipe, evidence)
        off = o.logits_off_mib(recipe.model, keep)
        core = shift(probe, -off)
        real = scale(core, 1 - o.pct / 100, 1 - o.high_pct / 100, 1 - o.low_pct / 100)
        logits = (f"(probe - {off:.1f} MiB of fp32 logits for {min(keep, o.keep_max)} kept positions)" if off else
                  "probe (kept logits unknown: nothing subtracted)")
        return real, (f"real run = {logits} x (1 - {o.pct}%), the median over-estimate of the anchors "
                      f"({', '.join(a.probe for a in o.anchors)}) on the probe's core, interval from every pair "
                      f"({o.low_pct}–{o.high_pct}%)")


#: A training run's steady-state step against the higher of the one-step probe of its recipe and
#: the optimizer step's floor (``step_floor_mib``), plus the state ``ledger.vocab.optimizers`` computes:
#: the largest |difference| measured, % of the steady state (``python benchmarks/steady_state.py``:
#: dry runs of qwen2.5-0.5b and llama-3.2-1b, 4-bit and bf16, ranks 8 and 512;
#: ``tests/test_recipe_axes.py`` checks it on the real step of tiny configs; on an H200,
#: ``benchmarks/optimizer_step.py`` found torch's foreach AdamW step at the weights, the
#: adapter, its gradients, one temporary the size of the adapter and the state, within 53 MiB of
#: 6,497 and 133 MiB of 35,755). Far inside every answer's interval (the dry run's own width).
STEADY_STATE_ERR_PCT = 0.07


def steady_state_text(fixes: str, calibrated: frozenset) -> str:
    """How a training run's figure is made for a recipe whose memory fixes no probe/real pair measured."""
    pairs = (f"the probe/real pairs measured memory fixes {', '.join(sorted(calibrated))} only, so their "
             "over-estimate is not applied" if calibrated else "no probe/real pairs to calibrate against")
    return (f"a training run's step = the higher of the one-step probe and the optimizer's step (the weights, "
            f"the adapter's gradients, the step's temporaries), + the optimizer's state it keeps across steps "
            f"(dry runs of the steady state matched that within {STEADY_STATE_ERR_PCT}%); {pairs} to memory "
            f"fixes {fixes}")


_arch = arch_of


@lru_cache(maxsize=65536)
def adapter_state(model: str, rank: int, targets: tuple[str, ...], dora: bool, optimizer: str):
    """(the state ``optimizer`` keeps for the adapter, the adapter's trainable parameters), or None
    without a config for the model (made once per recipe: ceilings ask it rank by rank)."""
    arch = _arch(model)
    if arch is None:
        return None
    shapes = trainable_shape_counts(arch, rank, targets, dora)
    return state_bytes(optimizer, shapes), sum(prod(s) * k for s, k in shapes.items())


def state_mib(model: str, rank: int, targets: tuple[str, ...], dora: bool, optimizer: str) -> Optional[float]:
    """MiB of the state ``optimizer`` keeps on the card for the adapter (None: no config for the model)."""
    found = adapter_state(model, rank, targets, dora, optimizer)
    return None if found is None else found[0].device_mib


@lru_cache(maxsize=65536)
def transient_mib(model: str, rank: int, targets: tuple[str, ...], dora: bool, optimizer: str) -> Optional[float]:
    """MiB the optimizer's step holds for a moment beyond its state (``ledger.vocab.optimizers.transient_bytes``);
    None without a config for the model."""
    arch = _arch(model)
    if arch is None:
        return None
    return transient_bytes(optimizer, trainable_shape_counts(arch, rank, targets, dora)) / 2**20


def step_floor_mib(table, recipe: Recipe, optimizer: str) -> Optional[float]:
    """The least a training run's step holds besides the optimizer's state, as the dry runs give
    it (raw, before a card's remainder): the weights and the adapter before the step, its
    gradients, and the optimizer step's transient. None where the dry-run rows or the config do
    not say. ``table``: a ``ledger.fit.dry_table.DryTable``."""
    end = table.end_figure(recipe) if recipe.model and recipe.rank else None
    extra = transient_mib(recipe.model, recipe.rank, recipe.targets, recipe.dora, optimizer) if end else None
    return None if end is None or extra is None else end(recipe.rank) + extra


def floored(real: Optional[Interval], floor_mib: Optional[float], width: float) -> tuple[Optional[Interval], str]:
    """A training run's figure never below the optimizer step's floor (``step_floor_mib`` plus the
    card's remainder, with the derived dry run's width): each end the higher of the two."""
    if real is None or floor_mib is None:
        return real, ""
    floor = around(floor_mib, width)  # each end as ``ledger.core.ends.floored`` makes it
    low = None if real.low_mib is None else ends.at_least(real.low_mib, ends.lower(floor_mib, width))
    high = None if real.high_mib is None else ends.at_least(real.high_mib, ends.upper(floor_mib, width))
    mib = None if real.mib is None else ends.at_least(real.mib, floor.mib)
    if (real.mib, real.low_mib, real.high_mib) == (mib, low, high):
        return real, ""
    return interval(mib, low, high), (
        f"the optimizer's step holds more than the step before it: the weights, the adapter and its gradients, "
        f"and the step's temporaries, {floor.mib:.1f} MiB (±{width:.2%}) before the state")


def state_growth(recipe: Recipe, measured_rank: Optional[int]) -> tuple[float, str]:
    """For a recipe whose real run is its probe through the pairs' over-estimate with no optimizer
    named: the state ``STOCK_OPTIMIZER`` (the most any listed optimizer keeps on the card) adds past
    the largest rank the pairs measured, whose runs' own state is inside the over-estimate. (MiB, text);
    0 at or below that rank. Leans high when those runs kept less state (an 8-bit optimizer)."""
    grown = growth_mib(recipe.model, recipe.rank, recipe.targets, recipe.dora, measured_rank)
    if not grown:
        return 0.0, ""
    return grown, (f"plus {grown:.1f} MiB: {STOCK_OPTIMIZER}'s state at rank {recipe.rank} over rank {measured_rank}, "
                   f"the largest the probe/real pairs measured (their runs' own optimizer state is inside the "
                   f"over-estimate; this leans high if they kept less)")


def growth_mib(model: Optional[str], rank: Optional[int], targets: tuple[str, ...], dora: bool,
               measured_rank: Optional[int]) -> float:
    """``state_growth``'s figure alone (the fit table asks it per rank)."""
    if not measured_rank or not model or not rank or rank <= measured_rank:
        return 0.0
    top = state_mib(model, rank, targets, dora, STOCK_OPTIMIZER)
    base = state_mib(model, measured_rank, targets, dora, STOCK_OPTIMIZER)
    return 0.0 if top is None or base is None else top - base


def with_optimizer_state(real: Optional[Interval], recipe: Recipe, optimizer: str, text: str,
                         from_real_runs: bool = True) -> tuple[Optional[Interval], str]:
    """A real run's figure plus the state ``optimizer`` keeps across steps for the adapter's
    trainable tensors (``ledger.vocab.optimizers``; exact from the model's config and the recipe's target
    modules). The rows record no optimizer: whatever state their runs held on the card
    is inside the figures they give, so adding the whole state to a figure made from real runs
    (``from_real_runs``) leans high by at most that; added to a one-step probe's figure it is the
    steady state (``STEADY_STATE_ERR_PCT``). Paged state is named, not added (the allocator does
    not count it)."""
    found = adapter_state(recipe.model, recipe.rank, recipe.targets, recipe.dora, optimizer) if recipe.model else None
    if found is None:
        return real, f"{text}; the {optimizer} state is not counted: no config for {recipe.model or 'the model'}"
    state, n = found
    note = f"plus the optimizer's state, {state.describe()} for the adapter's {n:,} trainable parameters" + (
        " (the real runs record no optimizer: their own state, if any, is inside the figure, so this leans high)"
        if from_real_runs else "")
    if real is None:
        return None, f"{text}; {note}"
    return shift(real, state.device_mib), f"{text}; {note}"


#: The largest |difference| between a dry run of B sequences of L tokens and one of a single
#: sequence of B x L tokens, without memory fixes (``python benchmarks/batch_as_length.py``: 4-bit
#: and bf16 dry runs of qwen2.5-0.5b, llama-3.2-1b, gemma-3-1b-it and qwen2.5-1.5b at B = 2, 4, 8;
#: the single sequence was the higher every time, by 0.01-0.21%).
BATCH_AS_LENGTH_ERR = 0.0021
#: The same without gradient checkpointing (``python benchmarks/batch_as_length.py
#: --no-gradient-checkpointing``: the same models and batches; the single sequence was the higher
#: every time, by 0.00-0.01% for Qwen2.5 and Llama 3.2 and up to 4.20% for Gemma 3, whose sliding
#: layers hold a window of each sequence: one long sequence is an upper bound there).
BATCH_AS_LENGTH_ERR_NO_CKPT = 0.042
#: Memory fixes that work per token, not per sequence, so a micro-batch is answered as one longer
#: sequence with them too: (fixes, checkpointing) -> the largest |difference| ``python
#: benchmarks/batch_as_length.py --fixes F [--no-gradient-checkpointing]`` found (the same models
#: and batches). Liger's fused loss chunks the batch's tokens as one sequence's: the single sequence
#: was never below the batch, at most 3.02% above with checkpointing and 7.09% without, both for
#: Gemma 3's sliding layers (0.00-0.11% for Qwen2.5 and Llama 3.2). TRL's offloading: 0.00-0.21%
#: above with checkpointing; without it 0.23% below once (Gemma 3 bf16, 2 x 1,024), else above by at
#: most 0.16%. Any other fixes, or two of these together (not measured), leave a batch unknown.
BATCH_AS_LENGTH_ERR_FIXES: dict[tuple[str, bool], float] = {
    ("fused_linear_ce", True): 0.0302, ("fused_linear_ce", False): 0.0709,
    ("activation_offloading", True): 0.0021, ("activation_offloading", False): 0.0023,
}


def batch_err(recipe: Recipe) -> float:
    """The width answering a micro-batch as one longer sequence adds to the interval (0 at batch 1,
    and for a batch answered by dry runs of that batch itself)."""
    if recipe.batch == 1:
        return 0.0
    if recipe.fixes != "none":
        return BATCH_AS_LENGTH_ERR_FIXES.get((recipe.fixes, recipe.checkpointing), 0.0)
    return BATCH_AS_LENGTH_ERR if recipe.checkpointing else BATCH_AS_LENGTH_ERR_NO_CKPT


def answerable(recipe: Recipe) -> tuple[Optional[Recipe], str]:
    """The recipe as the fits answer it, or why they cannot. Gradient checkpointing off: only by
    dry runs of it (``Predictor.predict``: every probe and real run has it on; the dry-run table
    keeps such rows apart). A micro-batch of B sequences of L tokens: as the one sequence of B x L
    tokens whose step holds the same memory (the activations, logits and loss are linear in batch x
    length, with checkpointing or without; the weights, adapter and optimizer state are there once),
    measured on dry runs (``batch_err``: ``BATCH_AS_LENGTH_ERR``, ``BATCH_AS_LENGTH_ERR_NO_CKPT``,
    and for Liger's fused loss or TRL's offloading alone ``BATCH_AS_LENGTH_ERR_FIXES``); with any of
    the program's memory fixes that does not hold (the chunked MLP and the kept logits work per
    sequence: up to 52% apart on Gemma 3), so the batch stays as asked, for dry runs of that very
    micro-batch (``DryTable`` keeps each micro-batch's rows apart; no measured row answers it).
    Returns (the recipe to answer, what was done) or (None, why not)."""
    if recipe.batch == 1:
        return recipe, ""
    if recipe.fixes != "none" and (recipe.fixes, recipe.checkpointing) not in BATCH_AS_LENGTH_ERR_FIXES:
        return recipe, (f"micro-batch {recipe.batch} x {recipe.seq_len} tokens with memory fixes {recipe.fixes}: only "
                        f"dry runs of that micro-batch answer it (the program's chunked MLP and kept logits work per "
                        "sequence, so a batch is not one longer sequence there; every measured row is of one sequence)")
    if recipe.seq_len is None:
        return None, f"micro-batch {recipe.batch} needs the sequence length"
    tokens = recipe.batch * recipe.seq_len
    one = recipe.replace(batch=1, seq_len=tokens,
                  response_len=None if recipe.response_len is None else recipe.batch * recipe.response_len)
    how = "with checkpointing" if recipe.checkpointing else "without checkpointing, the single sequence never below"
    return one, (f"micro-batch {recipe.batch} x {recipe.seq_len} tokens (every sequence padded to the longest) answered "
                 f"as one sequence of {tokens} tokens (activations are linear in batch x length; {how}: "
                 f"the two agree within {batch_err(recipe):.2%} on dry runs, added to the interval)")


def fewer_targets(recipe: Recipe) -> tuple[Recipe, str]:
    """LoRA on fewer projections than the 7 every row and dry run trains: answered by the same recipe
    on all 7, an upper bound (fewer adapters keep fewer weights, gradients, optimizer state and
    activations), so it can say "fits" but never "won't fit". Returns (the recipe on all 7, the note)."""
    if recipe.targets == ALL_LINEAR:
        return recipe, ""
    return (recipe.replace(targets=ALL_LINEAR),
            f"LoRA on {','.join(recipe.targets)} answered by the same recipe on all 7 projections, an upper bound "
            "(fewer adapters: less of their weights, gradients and activations; `python -m probe_kit.dry_run "
            "--target-modules ...` gives its own figure)")


def upper_bound(iv: Optional[Interval]) -> Optional[Interval]:
    """An interval that is only an upper bound: no lower end."""
    return None if iv is None else interval(iv.mib, None, iv.high_mib)

"""The probe-to-real step and the response-span rules, in one place.

A probe keeps the fp32 logits of the response span it computes the loss on (with the
logits_to_keep fix); a real run's peak does not follow them. So a real run's peak is the probe's
*core* (its peak less those logits) x (1 - the calibrated over-estimate), and a recipe that keeps
logits for more positions than the probes behind its figure needs at least their fp32 logits
more, at most the whole logits chain."""

from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import Optional

from .adapter import ALL_LINEAR, trainable_shapes
from .answers import Interval, interval, scale, shift
from .calibration import LOGIT_BYTES, kept_positions, kept_positions_of, logits_mib
from .ledger_fit import LedgerFit
from .model_configs import load_arch
from .optimizers import state_bytes
from .recipe import Recipe

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
        follow, see ``ledger.calibration``) x (1 - the calibrated over-estimate), with the text saying so."""
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


def with_optimizer_state(real: Optional[Interval], recipe: Recipe, optimizer: str, text: str
                         ) -> tuple[Optional[Interval], str]:
    """A real run's figure plus the state ``optimizer`` keeps across steps for the adapter's
    trainable tensors (``ledger.optimizers``; exact from the model's config and the recipe's target
    modules). The rows record no optimizer: whatever state their runs held on the card
    is inside the figures they give, so adding the whole state leans high by at most that. Paged
    state is named, not added (the allocator does not count it)."""
    arch = load_arch(recipe.model) if recipe.model else None
    if arch is None:
        return real, f"{text}; the {optimizer} state is not counted: no config for {recipe.model or 'the model'}"
    shapes = trainable_shapes(arch, recipe.rank, recipe.targets, recipe.dora)
    state = state_bytes(optimizer, shapes)
    n = sum(prod(s) for s in shapes)
    note = (f"plus the optimizer's state, {state.describe()} for the adapter's {n:,} trainable parameters "
            "(the rows record no optimizer: their runs' own state, if any, is inside the figure, so this leans high)")
    if real is None:
        return None, f"{text}; {note}"
    return shift(real, state.device_mib), f"{text}; {note}"


#: The largest |difference| between a dry run of B sequences of L tokens and one of a single
#: sequence of B x L tokens, without memory fixes (``python benchmarks/batch_as_length.py``: 4-bit
#: and bf16 dry runs of qwen2.5-0.5b, llama-3.2-1b, gemma-3-1b-it and qwen2.5-1.5b at B = 2, 4, 8;
#: the single sequence was the higher every time, by 0.01-0.21%).
BATCH_AS_LENGTH_ERR = 0.0021


def answerable(recipe: Recipe) -> tuple[Optional[Recipe], str]:
    """The recipe as the fits answer it, or why they cannot. Gradient checkpointing off: not at all
    (every row and dry run has it on). A micro-batch of B sequences of L tokens: as the one sequence
    of B x L tokens whose step holds the same memory (with checkpointing the activations, logits and
    loss are linear in batch x length; the weights, adapter and optimizer state are there once),
    measured on dry runs (``BATCH_AS_LENGTH_ERR``); with any of the program's memory fixes that does
    not hold (the chunked MLP and the kept logits work per sequence: up to 52% apart on Gemma 3), so
    it is not derived. Returns (the recipe at batch 1, what was done) or (None, why not)."""
    if not recipe.checkpointing:
        return None, ("gradient checkpointing off: every row and dry run the predictor reads has it on, and without "
                      "it every layer's activations are kept; dry-run this recipe with `python -m probe_kit.dry_run "
                      "... --no-gradient-checkpointing` (minutes on a CPU)")
    if recipe.batch == 1:
        return recipe, ""
    if recipe.fixes != "none":
        return None, (f"micro-batch {recipe.batch} with memory fixes {recipe.fixes}: a batch is answered as one "
                      "longer sequence only without fixes (the chunked MLP and the kept logits work per sequence)")
    if recipe.seq_len is None:
        return None, f"micro-batch {recipe.batch} needs the sequence length"
    tokens = recipe.batch * recipe.seq_len
    one = replace(recipe, batch=1, seq_len=tokens,
                  response_len=None if recipe.response_len is None else recipe.batch * recipe.response_len)
    return one, (f"micro-batch {recipe.batch} x {recipe.seq_len} tokens (every sequence padded to the longest) answered "
                 f"as one sequence of {tokens} tokens (activations are linear in batch x length with checkpointing; "
                 f"the two agree within {BATCH_AS_LENGTH_ERR:.2%} on dry runs, added to the interval)")


def fewer_targets(recipe: Recipe) -> tuple[Recipe, str]:
    """LoRA on fewer projections than the 7 every row and dry run trains: answered by the same recipe
    on all 7, an upper bound (fewer adapters keep fewer weights, gradients, optimizer state and
    activations), so it can say "fits" but never "won't fit". Returns (the recipe on all 7, the note)."""
    if recipe.targets == ALL_LINEAR:
        return recipe, ""
    return (replace(recipe, targets=ALL_LINEAR),
            f"LoRA on {','.join(recipe.targets)} answered by the same recipe on all 7 projections, an upper bound "
            "(fewer adapters: less of their weights, gradients and activations; `python -m probe_kit.dry_run "
            "--target-modules ...` gives its own figure)")


def upper_bound(iv: Optional[Interval]) -> Optional[Interval]:
    """An interval that is only an upper bound: no lower end."""
    return None if iv is None else interval(iv.mib, None, iv.high_mib)

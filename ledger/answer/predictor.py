"""One answer to "will this recipe fit on this card, and what will it peak at?". Pure: no torch.

This module is the combiner: it asks the rungs (``ledger.answer.rungs``) in order, applies the
response-span rule and the probe-to-real step (``ledger.fit.response_span``), dominance and measured
failures (``ledger.fit.dominance``), judges against the card's limit (``ledger.fit.limits``) and returns
one ``ledger.core.answers.Answer``. The ceiling search (``ledger.answer.ceilings``) asks it rank by rank.

Every command that answers it (``vram ceiling``, ``vram predict``, ``vram estimate``, ``vram fit``,
the dry run's ``--find-ceiling``) and the site call :class:`Predictor`.

**The evidence ladder.** For a recipe (model, quant, rank, dropout, DoRA, sequence length, memory
fixes) on a card, the first rung that has data answers; each rung down has a wider interval:

1. ``measured real run``: real runs of this recipe on this card (their longest example is the
   probe's they were paired with when the run does not record it) - the real peak itself.
2. ``measured probe``: a probe of this recipe on this card; a real run's peak is the probe's core
   (less the fp32 logits of the response span it kept, which a real run's peak does not follow)
   times the calibrated probe-to-real factor (interval: the range of every probe/real pair).
3. ``interpolated``: this card's probes of the same model, quant, dropout, DoRA and fixes, affine
   in rank (and linear in sequence length between two probed lengths); interval: the largest
   held-out error of that interpolation over the ledger's probes.
4. ``dry run``: rows of the GPU-free dry run (``ledger/dry-runs.json``) of the same recipe, affine in
   rank, plus the card's remainder (what fake tensors cannot see: workspaces, allocator and
   context differences) fitted from pairs of measured probes and dry runs on the same card (else
   the same vendor, else all); interval: the largest leave-one-out error of that fit.
5. ``transferred``: another card's probes of the same group, shifted by how the cards differ on
   shared rows; interval: the largest held-out error of such transfers.

Then **dominance**: a longer sequence, dropout, DoRA or a larger rank never needs less memory, so a
row of a harder recipe that fit caps the interval's top, and one of an easier recipe that ran out
of memory raises its bottom.

**The limit** is the card's effective limit for peak allocated (``calibration.limits``: the largest
peak that fit and the smallest that did not), real runs' own when judging a real run. A card with
no ledger rows gets one from the card table (``ledger/cards.json``): its usable memory less the
CUDA context, over the reserved/allocated ratio, both as measured on the ledger's cards.

**The verdict** leans safe: ``fits`` when the interval's top is at most the limit's low end minus
the margin; ``won't fit`` when its bottom is over the limit's high end; ``tight`` between;
``unknown`` (and why) without a prediction or a limit.
"""

from __future__ import annotations

import datetime as dt
from functools import cached_property
from typing import Iterable, Optional

from . import ceilings
from ledger.vocab.adapter import ALL_LINEAR
from ledger.core.answers import (
    Answer,
    CeilingAnswer,
    Interval,
    Run,
    Verdict,
    around,
    decide,
    interval,
    scale,
    shift,
    verdict_for,
    widen,
)
from ledger.fit.dominance import Dominance
from ledger.fit.dry_calibration import DryCalibration, simulated_reserved
from ledger.fit.dry_table import DryTable
from ledger.fit.ledger_fit import LedgerFit
from ledger.fit.limits import CardLimits
from ledger.vocab.model_configs import model_name
from ledger.core.models import Gpu, Ledger, Measurement
from ledger.vocab.recipe import Recipe
from ledger.fit.response_span import (
    ProbeToReal,
    answerable,
    batch_err,
    fewer_targets,
    floored,
    state_growth,
    state_mib,
    steady_state_text,
    step_floor_mib,
    upper_bound,
    with_optimizer_state,
)
from .full_ft import FullAnswers
from .rungs import CalibratedDryRun, MeasuredRealRun, probe_ladder


class Predictor:
    """Holds one ledger's fits; ask it many questions. ``dry_runs``: dry-run rows (kind dry_run,
    no card), e.g. ``ledger/dry-runs.json``; ``as_of``/``exclude`` limit the rows it may use.
    Its parts: ``fit`` (the rows and shared fits), ``table`` (the dry-run table), ``dry_cal``
    (the dry run's calibration), ``limits`` (card limits), ``span`` (the probe-to-real step),
    ``dominance``; ``ladder`` is the probe's rungs in order."""

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement] = (), as_of: Optional[dt.date] = None,
                 exclude: Iterable[str] = (), base: Optional["Predictor"] = None):
        """``base``: a predictor of the same ledger and dry runs with fewer rows excluded (leave-one-out
        asks one per row); what does not depend on the extra rows is shared with it."""
        rows = dry_runs if isinstance(dry_runs, list) else list(dry_runs)
        self.fit = LedgerFit(ledger, rows, as_of, exclude, base=base.fit if base else None)
        self.ledger, self.ms, self.dry, self.over = ledger, self.fit.ms, self.fit.dry, self.fit.over
        # The dry-run table is a function of the dry-run rows alone (a fit started from the base's
        # rows keeps their very list while none of them is left out).
        same_dry = base is not None and (self.dry is base.dry or [d.id for d in base.dry] == [d.id for d in self.dry])
        self.table = base.table if same_dry else DryTable(self.dry)
        self.dry_cal = DryCalibration(self.fit, self.table)
        self.limits = CardLimits(self.fit, base.limits if base else None)
        self.span = ProbeToReal(self.fit)
        self.dominance = Dominance(self.fit, base.dominance if base else None)
        self.ladder = probe_ladder(self.fit, self.dry_cal)
        self.dry_rung = next(r for r in self.ladder if isinstance(r, CalibratedDryRun))
        self.real_rung = MeasuredRealRun(self.fit)
        #: Full fine-tuning's answers (``full_ft``): its own dry runs, none of the LoRA ladder.
        self.full = FullAnswers(self, rows, base.full.table if same_dry else None)
        self.subceilings: dict = {}
        #: The fit table's dry-run ceilings by judged recipe, card, budget and widening (a micro-batch
        #: of B x L tokens and one of B' x L' with the same total are one question).
        self.dry_ceilings: dict = {}
        #: The fit table's intervals by rank, per recipe and remainder, and the dry-run figure and
        #: optimizer state by rank they share (``rank_judge``).
        self.rank_bounds: dict = {}
        #: ``predict``'s answers before the optimizer, widenings and limit, by recipe of one
        #: sequence, card, vendor and run (``_core``): a micro-batch of B sequences of L tokens and
        #: a recipe of B x L tokens share one, and so do every optimizer's.
        self.cores: dict = {}
        # What other parts ask of a predictor, by the names they know.
        self.card_limit, self.reserved_ratio = self.limits.card_limit, self.limits.reserved_ratio
        self.free_for_pytorch = self.limits.free_for_pytorch
        self.remainder, self.dry_raw, self.dry_exact = self.dry_cal.remainder, self.table.raw, self.table.exact
        self.probe_to_real = self.span.probe_to_real

    def warm(self, cards: dict[str, Optional[Gpu]]) -> None:
        """Compute now, once, the shared fits every fit table reads (a build then forks its workers,
        which inherit them instead of each computing them again): the dry run's leave-one-out and
        derivation widths, the probe/real pairs' reach, and each card's remainder and limits."""
        self.dry_cal.width_fraction(False), self.dry_cal.width_fraction(True)
        self.over.fixes, self.over.max_rank
        for key, entry in cards.items():
            entry = entry or self.ledger.gpus.get(key)
            self.remainder(key, entry.vendor if entry else None)
            for run in ("probe", "real"):
                self.card_limit(key, entry, run)

    @property
    def dry_loo(self) -> dict:
        return self.dry_cal.loo

    @property
    def dry_derivation(self) -> dict:
        return self.table.derivation

    @cached_property
    def dry_fitted_on(self) -> list[str]:
        return self.dry_cal.fitted_on

    def probe_figure(self, recipe: Recipe, gpu: str, vendor: Optional[str]) -> tuple[Optional[Interval], str, str, list[str]]:
        """(interval, method, method text, evidence ids) for a one-step probe's peak allocated: the
        first rung of the ladder that answers. Without gradient checkpointing, or at a micro-batch
        above 1 (the preset's, which is not one longer sequence), only the dry run's: every measured
        row has checkpointing on and one sequence."""
        if not recipe.checkpointing or recipe.batch != 1 or recipe.targets != ALL_LINEAR:
            found = self.dry_rung.evidence(recipe, gpu, vendor)
            if found is not None:
                return found.interval, found.method, found.text, list(found.ids)
            what = ("gradient checkpointing off" if not recipe.checkpointing else f"micro-batch {recipe.batch}"
                    if recipe.batch != 1 else f"LoRA on {','.join(recipe.targets)}")
            return None, "", (f"{what}: no dry run of it near this recipe (every measured row has checkpointing on and "
                              "one sequence); without --no-compute the answer dry-runs it"), []
        for rung in self.ladder:
            found = rung.evidence(recipe, gpu, vendor)
            if found is not None:
                return found.interval, found.method, found.text, list(found.ids)
        return None, "", "no probe, real run or dry run of this recipe near it in the ledger", []

    def has_target_rows(self, recipe: Recipe) -> bool:
        """Whether dry runs of LoRA on the recipe's own projections reach it (its micro-batch
        answered as ``answerable`` answers it)."""
        one, _ = answerable(recipe.replace(optimizer=None))
        return one is not None and one.model is not None and self.table.raw(one.replace(rank=8))[0] is not None

    def resolve_model(self, recipe: Recipe, gpu: str) -> Recipe:
        """A recipe that names no model: the one model this card's probes (else all probes) are of."""
        if recipe.model is None:
            probes = self.fit.peaks.probes
            models = sorted({m.model for m in probes if m.gpu == gpu and m.model} or {m.model for m in probes if m.model})
            if len(models) == 1:
                recipe = recipe.replace(model=models[0])
        return recipe

    def unknown(self, recipe: Recipe, gpu: str, entry: Optional[Gpu], run: Run, why: str) -> Answer:
        """The answer "unknown" for a recipe the predictor does not derive, with why."""
        low, high, lsrc = self.card_limit(gpu, entry or self.ledger.gpus.get(gpu), run)
        return Answer(gpu=gpu, card_source="ledger" if gpu in self.ledger.gpus else "card table",
                      recipe=recipe.memory_fields(), run=run, probe_allocated=None, real_allocated=None, reserved=None,
                      method=None, method_text=why, evidence=[], limit_low_mib=low, limit_high_mib=high,
                      limit_source=lsrc, margin_mib=0.0, verdict="unknown", why=why)

    def dry_answer(self, recipe: Recipe) -> Optional[Answer]:
        """The calibrated dry run's answer with no card (what ``vram estimate`` gives without --gpu),
        a micro-batch answered as ``predict`` answers it; None when no dry run is near."""
        one, how = answerable(recipe)
        raw, ids = self.dry_raw(one) if one is not None else (None, [])
        if raw is None:
            return None
        answer = self.judge_dry(one, raw, derived=not self.dry_exact(one) or one is not recipe)
        answer.evidence = ids
        if how:
            answer.method_text = f"{how}; {answer.method_text}"
            answer.probe_allocated = widen(answer.probe_allocated, batch_err(recipe))
        return answer

    def predict(self, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
                margin_mib: float = 0.0, budget_mib: Optional[float] = None) -> Answer:
        """The answer for a recipe on a card (a ledger key, or a card-table entry given as ``entry``)."""
        return self._judged(recipe, gpu, entry, run, margin_mib, budget_mib, True)

    def verdict(self, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
                margin_mib: float = 0.0, budget_mib: Optional[float] = None
                ) -> tuple[Verdict, Optional[float], Optional[float]]:
        """``predict``'s verdict and the limit it judged against (low, high), made the same way
        without the rest of the answer (its texts, reserved figure, recipe and evidence): what a
        ceiling's scan needs rank by rank (the fit table's ladder asks some 17,000 of these)."""
        return self._judged(recipe, gpu, entry, run, margin_mib, budget_mib, False)

    def _judged(self, recipe: Recipe, gpu: str, entry: Optional[Gpu], run: Run, margin_mib: float,
                budget_mib: Optional[float], full: bool):
        """``predict`` (``full``) or ``verdict``: one derivation, the texts and the answer made
        only for the first."""
        if recipe.method == "full":
            return self.full.judged(recipe, gpu, entry, run, margin_mib, budget_mib, full)
        asked = recipe
        optimizer = recipe.optimizer  # the rows record none: its state is added to a real run below
        recipe = self.resolve_model(recipe, gpu)
        if recipe.targets == ALL_LINEAR or not self.has_target_rows(recipe):
            # LoRA on fewer projections without dry runs of them: the all-7 figure, an upper bound
            recipe, targets_text = fewer_targets(recipe)
        else:  # answered by those dry runs alone (every measured row trains all 7)
            targets_text = ""
        if optimizer is not None:
            recipe = recipe.replace(optimizer=None)
        one, batch_text = answerable(recipe)
        if one is None:
            if full:
                return self.unknown(asked, gpu, entry, run, batch_text)
            return ("unknown", *self.card_limit(gpu, entry or self.ledger.gpus.get(gpu), run)[:2])
        own_batch = one.batch != 1  # answered by dry runs of that very micro-batch alone
        recipe = one
        entry = entry or self.ledger.gpus.get(gpu)
        if recipe.model and gpu in self.ledger.gpus:
            known = self.fit.models_named.get(model_name(recipe.model))
            if known:
                recipe = recipe.replace(model=known)
        key = (recipe, gpu, entry.vendor if entry else None, run)
        found = self.cores.get(key)
        if found is None:
            found = self.cores[key] = self._core(*key)
        probe, method, text, evidence, real, basis = found
        if run == "real" and optimizer and basis == "calibrated" and real is not None and probe is not None:
            # A named optimizer's run is its steady state: the pairs' over-estimate (their runs held
            # their own optimizer's state) never takes it below its one-step probe.
            real = interval(*(None if r is None or q is None else max(r, q) for r, q in
                              ((real.mib, probe.mib), (real.low_mib, probe.low_mib), (real.high_mib, probe.high_mib))))
        if run == "real" and optimizer and real is not None:
            floor = step_floor_mib(self.table, recipe.replace(targets=asked.targets), optimizer)
            if floor is not None:
                rem = self.remainder(gpu, entry.vendor if entry else None)[0] or 0.0
                real, how = floored(real, floor + rem, self.dry_cal.width_fraction(True, recipe))
                if how and full:
                    text = f"{text}; {how}"
        if run == "real":
            if optimizer and full:
                real, text = with_optimizer_state(real, recipe.replace(targets=asked.targets), optimizer, text,
                                                  from_real_runs=basis != "steady state")
            elif optimizer:  # with_optimizer_state's figure alone
                state = state_mib(recipe.model, recipe.rank, asked.targets, recipe.dora, optimizer) \
                    if recipe.model else None
                real = real if real is None or state is None else shift(real, state)
            elif real is not None and basis == "calibrated":
                grown, how = state_growth(recipe.replace(targets=asked.targets), self.over.max_rank)
                if grown:
                    real, text = shift(real, grown), f"{text}; {how}"
        if batch_text:
            probe, real = widen(probe, batch_err(asked)), widen(real, batch_err(asked))
            text = f"{batch_text}; {text}"
        if targets_text:
            probe, real = upper_bound(probe), upper_bound(real)
            text = f"{targets_text}; {text}"
        judged = real if run == "real" else probe
        if budget_mib is not None:
            low, high, lsrc = budget_mib, budget_mib, f"--budget-mib {budget_mib}"
        else:
            low, high, lsrc = self.card_limit(gpu, entry, run)
        if full:
            verdict, why = decide(judged, low, high, margin_mib)
        else:
            verdict = verdict_for(None if judged is None else judged.low_mib,
                                  None if judged is None else judged.high_mib, low, high, margin_mib)
        if targets_text and verdict == "tight":  # an upper bound over the limit says nothing of the recipe
            verdict = "unknown"
            if full:
                why = (f"{why}; but that is an upper bound for LoRA on {','.join(asked.targets)}: only a dry run "
                       "of it can say (python -m probe_kit.dry_run --target-modules ...)")
        # A measured failure on the card is one under any budget below the card's limit too.
        # (not for fewer targets than the rows trained: their failure says nothing of an easier recipe)
        failed = self.dominance.measured_failure(recipe, gpu, run) if recipe.targets == ALL_LINEAR and recipe.checkpointing and (
            budget_mib is None or (
            budget_mib <= (self.card_limit(gpu, entry, run)[0] or float("inf")))) else None
        if not full:
            return ("won't fit" if failed is not None else verdict), low, high
        if judged is None and own_batch:
            why = f"no prediction: {batch_text}, and none of it near this recipe has been computed"
        evidence = list(evidence)
        if failed is not None and verdict != "won't fit":
            fid, fstatus = failed
            verdict, why = "won't fit", (f"{fid}, this recipe or an easier one, was measured on {gpu} and ran "
                                         f"{'out of memory' if fstatus == 'oom' else 'past the card (spilled)'}")
            if fid not in evidence:
                evidence = [*evidence, fid]
        if batch_text or targets_text:
            recipe = asked.replace(model=recipe.model)
        elif optimizer is not None:
            recipe = recipe.replace(optimizer=optimizer)
        reserved = self._reserved(judged, recipe, gpu, run == "probe" and not batch_text and not targets_text)
        return Answer(gpu=gpu, card_source="budget" if budget_mib is not None else (
                          "ledger" if gpu in self.ledger.gpus else "card table"),
                      recipe=recipe.memory_fields(), run=run,
                      probe_allocated=probe, real_allocated=real, reserved=reserved, method=method or None,
                      method_text=text, evidence=evidence, limit_low_mib=low, limit_high_mib=high, limit_source=lsrc,
                      margin_mib=margin_mib, verdict=verdict, why=why)

    def _reserved(self, judged: Optional[Interval], recipe: Recipe, gpu: str, own: bool) -> Optional[Interval]:
        """Peak reserved for a predicted peak allocated: where ``own`` (a probe's step of this very
        recipe) and its committed dry-run row has the allocator simulated, that simulation with the
        rest of the figure (the card's remainder) held through the step
        (``ledger.fit.dry_calibration.simulated_reserved``); else the card's reserved/allocated ratio."""
        if judged is None:
            return None
        sim = self.table.simulated(recipe) if own else None
        if sim is not None:
            ends = [None if v is None else round(simulated_reserved(sim, v), 1)
                    for v in (judged.mib, judged.low_mib, judged.high_mib)]
            return interval(*ends)
        ratio = self.reserved_ratio(gpu)
        return None if ratio is None else scale(judged, ratio[0], ratio[1], ratio[2])

    def _core(self, recipe: Recipe, gpu: str, vendor: Optional[str], run: Run) -> tuple:
        """What ``predict`` answers a recipe of one sequence (its micro-batch and fewer targets
        already made one, its optimizer taken off) on a card of ``vendor``, before the optimizer's
        state, the widenings and the card's limit: (probe interval, method, text, evidence ids,
        real-run interval, its basis), the last two None for a probe."""
        probe, method, text, evidence = self.probe_figure(recipe, gpu, vendor)
        if method != "dry run":
            probe, span_text = self.span.longer_span(recipe, probe, evidence)
            text = f"{text}; {span_text}" if span_text else text
        # Measured rows all have checkpointing on: none bounds a recipe without it.
        probe, dom_ids, dom_text = (self.dominance.clamp(recipe, gpu, "probe", probe)
                                    if recipe.checkpointing and recipe.batch == 1 and recipe.targets == ALL_LINEAR
                                    else (probe, [], ""))
        if dom_text:
            text = f"{text}; {dom_text}" if text else dom_text
            evidence += [i for i in dom_ids if i not in evidence]
            method = method or "bounded by measured rows"
        real = basis = None
        if run == "real":
            real, method, text, evidence, basis = self._real(recipe, gpu, probe, method, text, evidence)
        return probe, method, text, tuple(evidence), real, basis

    def _real(self, recipe: Recipe, gpu: str, probe: Optional[Interval], method: str, text: str, evidence: list[str]):
        """A real run's figure: measured real runs of the recipe, else the probe's through the
        probe-to-real step, bounded by the card's real runs; with its basis: "measured", "calibrated"
        (the pairs' over-estimate, whose runs hold their own optimizer state) or "steady state" (the
        probe, to which the optimizer's state is added)."""
        found = self.real_rung.evidence(recipe, gpu) if recipe.checkpointing and recipe.targets == ALL_LINEAR else None
        if found is not None:
            return found.interval, found.method, found.text, list(found.ids), "measured"
        real = None
        basis = "calibrated" if self.calibrated_real(recipe) else "steady state"
        if probe is not None and basis == "calibrated":
            real, how = self.probe_to_real(probe, recipe, evidence)
            text = f"{text}; {how}"
        elif probe is not None:
            real = probe
            text += "; " + steady_state_text(recipe.fixes, self.over.fixes)
        real, ids, dom = (self.dominance.clamp(recipe, gpu, "real", real)
                          if recipe.checkpointing and recipe.targets == ALL_LINEAR else (real, [], ""))
        if dom:
            text = f"{text}; {dom}" if text else dom
            evidence = evidence + [i for i in ids if i not in evidence]
        return real, method, text, evidence, basis

    def calibrated_real(self, recipe: Recipe) -> bool:
        """Whether a real run of this recipe is its probe through the over-estimate the probe/real
        pairs measured (their memory fixes), rather than the steady state (probe + the state)."""
        return self.over.pct is not None and recipe.fixes in self.over.fixes

    def judge_dry(self, recipe: Recipe, raw_mib: float, gpu: Optional[str] = None, *, entry: Optional[Gpu] = None,
                  margin_mib: float = 0.0, budget_mib: Optional[float] = None, derived: bool = False) -> Answer:
        """The answer for a dry run just computed (``raw_mib``: its peak with PyTorch's default
        workspaces, as the committed rows are): plus the card's remainder (all cards' without a
        card), with the leave-one-out interval, judged against the card's limit or the budget."""
        entry = entry or (self.ledger.gpus.get(gpu) if gpu else None)
        rem, scope = self.remainder(gpu or "", entry.vendor if entry else None)
        if rem is None:
            rem, scope = 0.0, "no remainder fitted (no measured probe has a dry run)"
        width, wtext = self.dry_cal.width(recipe, derived)
        iv = around(raw_mib + rem, width)
        text = (f"dry run {raw_mib:.1f} MiB + remainder {rem:+.1f} MiB fitted on {scope}; interval {wtext}"
                + self.dry_cal.family_note(recipe))
        if budget_mib is not None:
            low, high, lsrc, source = budget_mib, budget_mib, f"--budget-mib {budget_mib}", "budget"
        elif gpu:
            (low, high, lsrc), source = self.card_limit(gpu, entry, "probe"), (
                "ledger" if gpu in self.ledger.gpus else "card table")
        else:
            low, high, lsrc, source = None, None, "no card or budget given", "budget"
        ratio = self.reserved_ratio(gpu or "")
        verdict, why = decide(iv, low, high, margin_mib)
        return Answer(gpu=gpu or "", card_source=source, recipe=recipe.memory_fields(), run="probe", probe_allocated=iv,
                      real_allocated=None, reserved=scale(iv, *ratio) if ratio else None, method="dry run",
                      method_text=text, evidence=[], limit_low_mib=low, limit_high_mib=high, limit_source=lsrc,
                      margin_mib=margin_mib, verdict=verdict, why=why)

    def ceiling(self, recipe: Recipe, gpu: str, **kw) -> CeilingAnswer:
        """The largest rank whose verdict is "fits", and the largest that is "tight" (``ledger.answer.ceilings``)."""
        return ceilings.search(self, recipe, gpu, **kw)

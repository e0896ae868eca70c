"""Full fine-tuning's answer: every weight trained, no adapter, in bf16 weights (gradients and
optimizer state in the parameters' dtype) or fp32 master weights under bf16 autocast. Pure: no torch.

One derivation, asked through ``Predictor.predict`` / ``Predictor.verdict`` like every other answer:

1. a measured row of this very recipe on this card (a training run with the same optimizer for a
   training run, a probe for a probe), its peak itself;
2. else the dry run of this recipe (``ledger.fit.full_table``): for a training run, the dry run of
   its steady state, the second step with the optimizer's state made and stepped (the optimizer
   is in the step, not added after it: weights, gradients, state and the step's temporaries are
   what the real code allocates); at a length between two dry-run lengths, their chord, which is
   at or above the step (its peak is convex in the length); plus the card's remainder and its
   leave-one-out interval, as a LoRA recipe's dry run gets them (``ledger.fit.dry_calibration``:
   what fake tensors cannot see on the card, measured on its probes).

Nothing of the LoRA ladder (probes of an adapter, the probe-to-real pairs, rank interpolation,
dominance between adapters) answers a full fine-tune: none of those rows trains the same weights.
"""

from __future__ import annotations

from functools import cached_property
from typing import Optional

from ledger.core.answers import Answer, Run, decide, interval, around, scale, verdict_for
from ledger.core.models import Gpu
from ledger.fit.full_table import FullTable, full_key, row_key
from ledger.fit.peaks import one_gpu
from ledger.vocab.optimizers import STOCK_OPTIMIZER
from ledger.vocab.recipe import Recipe


def optimizer_of(recipe: Recipe, run: Run) -> Optional[str]:
    """The optimizer whose step is in the figure: a training run's (AdamW unless named; a full
    fine-tune has no measured runs to hold it), none for a one-step probe."""
    return (recipe.optimizer or STOCK_OPTIMIZER) if run == "real" else None


class FullAnswers:
    """Full fine-tuning answers over one predictor's rows: its dry-run rows (``rows``), its
    ledger's measured full fine-tuning rows, its remainders, widths, limits and reserved ratios."""

    def __init__(self, predictor, rows: list, table: Optional[FullTable] = None):
        """``table``: the same dry-run rows' table, shared (a held-out predictor's)."""
        self.p = predictor
        self.table = table if table is not None else FullTable(rows)

    @cached_property
    def measured(self) -> dict:
        """Measured rows of full fine-tuning by (card, kind, recipe key, length): (peak or None for
        an OOM, id)."""
        found: dict = {}
        for m in self.p.ledger.measurements:
            if (m.finetune != "full" or m.kind not in ("probe", "real") or not m.gpu or not m.seq_len or not one_gpu(m)
                    or m.outcome.status not in ("ok", "oom") or m.id in self.p.fit.exclude
                    or (self.p.fit.as_of is not None and m.provenance.measured_on is not None
                        and m.provenance.measured_on > self.p.fit.as_of)):
                continue
            peak = m.outcome.peak_allocated_mib if m.outcome.status == "ok" else None
            if m.outcome.status == "ok" and peak is None:
                continue
            key = (m.gpu, m.kind, row_key(m), m.seq_len)
            old = found.get(key)
            if old is None or (old[0] is not None and (peak is None or peak > old[0])):
                found[key] = (peak, m.id)
        return found

    def figure(self, recipe: Recipe, gpu: str, vendor: Optional[str], run: Run):
        """(interval or None, method, text, evidence ids, failed): the step's peak allocated on the
        card; ``failed`` when a measured OOM or a dry run past any device says it cannot run."""
        optimizer = optimizer_of(recipe, run)
        kind = "real" if run == "real" else "probe"
        hit = self.measured.get((gpu, kind, full_key(recipe, optimizer if run == "real" else None), recipe.seq_len))
        what = (f"a training run with {optimizer}'s step" if run == "real" else "a one-step probe (no optimizer step)")
        if hit is not None:
            peak, rid = hit
            if peak is None:
                return None, f"measured {kind if kind == 'probe' else 'real run'}", (
                    f"{rid}, this very recipe, ran out of memory on {gpu}"), [rid], True
            return (interval(peak, peak, peak), "measured real run" if kind == "real" else "measured probe",
                    f"{rid}: {what} of this very recipe measured on {gpu}, {peak} MiB", [rid], False)
        fig = self.table.figure(recipe, optimizer)
        if fig is None:
            return None, "", (f"full fine-tuning: no dry run of {what} of this recipe at {recipe.seq_len} tokens "
                              "(without --no-compute the answer dry-runs it)"), [], False
        if fig.mib is None:
            return None, "dry run", (f"full fine-tuning: the dry run {fig.ids[0]} of this recipe at that length or a "
                                     "shorter one needs more than any device holds"), list(fig.ids), True
        rem, scope = self.p.remainder(gpu, vendor)
        if rem is None:
            rem, scope = 0.0, "no remainder fitted (no measured probe has a dry run)"
        width, wtext = self.p.dry_cal.width(None, False)
        read = ("its dry run" if fig.how == "dry run" else
                "the chord of its dry runs at the lengths either side (the peak is convex in the length: the "
                "chord is at or above it)")
        step = ("the steady state: the second step, with the optimizer's state made and stepped" if run == "real"
                else "forward and backward, no optimizer step")
        text = (f"full fine-tuning (every weight trained), {what}: {read} {fig.mib:.1f} MiB ({step}) + remainder "
                f"{rem:+.1f} MiB fitted on {scope}; interval {wtext}"
                + self.p.dry_cal.family_note(recipe))
        return around(fig.mib + rem, width), "dry run", text, list(fig.ids), False

    def cell(self, recipe: Recipe, gpu: str, entry: Optional[Gpu], run: Run, margin_mib: float = 0.0,
             budget_mib: Optional[float] = None) -> tuple:
        """The judged figure without the ``Answer`` around it (the fit table asks some 7,000):
        (interval or None, method, text, evidence ids, verdict, limit low, limit high, its source)."""
        entry = entry or self.p.ledger.gpus.get(gpu)
        recipe = self.p.resolve_model(recipe, gpu)
        fig, method, text, ids, failed = self.figure(recipe, gpu, entry.vendor if entry else None, run)
        if budget_mib is not None:
            low, high, lsrc = budget_mib, budget_mib, f"--budget-mib {budget_mib}"
        else:
            low, high, lsrc = self.p.card_limit(gpu, entry, run)
        verdict = "won't fit" if failed else verdict_for(None if fig is None else fig.low_mib,
                                                         None if fig is None else fig.high_mib, low, high, margin_mib)
        return fig, method, text, ids, verdict, low, high, lsrc

    def judged(self, recipe: Recipe, gpu: str, entry: Optional[Gpu], run: Run, margin_mib: float,
               budget_mib: Optional[float], full: bool):
        """``Predictor._judged`` for a full fine-tune: the whole ``Answer`` (``full``) or the verdict
        and the limit it was judged against."""
        fig, method, text, ids, verdict, low, high, lsrc = self.cell(recipe, gpu, entry, run, margin_mib, budget_mib)
        if not full:
            return verdict, low, high
        # The words of the verdict ``cell`` made (``decide`` applies the same rule), or why there is none.
        why = text if fig is None else decide(fig, low, high, margin_mib)[1]
        ratio = self.p.reserved_ratio(gpu)
        reserved = None if fig is None or ratio is None else scale(fig, ratio[0], ratio[1], ratio[2])
        shown = self.p.resolve_model(recipe, gpu).replace(optimizer=optimizer_of(recipe, run))
        return Answer(gpu=gpu, card_source="budget" if budget_mib is not None else (
                          "ledger" if gpu in self.p.ledger.gpus else "card table"),
                      recipe=shown.memory_fields(), run=run, probe_allocated=fig if run == "probe" else None,
                      real_allocated=fig if run == "real" else None, reserved=reserved, method=method or None,
                      method_text=text, evidence=ids, limit_low_mib=low, limit_high_mib=high, limit_source=lsrc,
                      margin_mib=margin_mib, verdict=verdict, why=why)

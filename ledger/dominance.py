"""Dominance between recipes, measured on one card: a longer sequence, dropout, DoRA or a larger
rank never needs less memory. A row of a harder recipe that fit caps an interval's top; one of an
easier recipe that did not fit raises its bottom; and a recipe whose own run, or an easier one's,
ran out of memory on the card will not fit, whatever an interval says."""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Optional

from .answers import Interval, Run, interval
from .calibration import _exceeded_peak, kept_positions
from .peaks import ok_peak
from .ledger_fit import LedgerFit
from .model_configs import model_name
from .models import Measurement
from .recipe import Recipe
from .response_span import recipe_keep


def real_need(m: Measurement) -> Optional[float]:
    """What a real run that ran out of memory needed at least (None: the message does not say)."""
    o = m.outcome
    if o.oom is None:
        return None
    if o.oom.max_allocated_mib is not None:
        return o.oom.max_allocated_mib
    if o.oom.allocated_mib is not None:
        return o.oom.allocated_mib + (o.oom.tried_mib or 0.0)
    return None


class Dominance:
    """The rows that bound other recipes on one ledger, by card, kind, model, quant and fixes."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit

    def clamp(self, recipe: Recipe, gpu: str, run: Run, iv: Optional[Interval]) -> tuple[Optional[Interval], list[str], str]:
        """Clamp an interval by rows of harder recipes that fit (top) and easier ones that did not
        (bottom), on this card and of this kind."""
        cap = floor = None
        cap_id = floor_id = None
        if recipe.seq_len is not None:
            own = recipe_keep(recipe) if run == "probe" else None
            for r, status, peak, need, mid, keep in self._rows.get((gpu, run, model_name(recipe.model),
                                                                             recipe.quant, recipe.fixes), ()):
                # A probe that kept logits for fewer (or unknown) positions than the recipe is not harder.
                longer = own is None or (keep is not None and keep >= own)
                if status == "ok" and longer and (r.rank >= recipe.rank and r.seq_len >= recipe.seq_len
                                                  and r.dropout >= recipe.dropout and r.dora >= recipe.dora):
                    if cap is None or peak < cap:
                        cap, cap_id = peak, mid
                elif status != "ok" and need is not None and (r.rank <= recipe.rank and r.seq_len <= recipe.seq_len
                                                             and r.dropout <= recipe.dropout and r.dora <= recipe.dora):
                    if floor is None or need > floor:
                        floor, floor_id = need, mid
        notes, ids = [], []
        if cap is not None:
            ids.append(cap_id)
            notes.append(f"at most {cap} MiB: {cap_id}, a harder or equal recipe, fit")
        if floor is not None:
            ids.append(floor_id)
            notes.append(f"at least {floor} MiB: {floor_id}, an easier or equal recipe, did not fit")
        if iv is None:
            if cap is None and floor is None:
                return None, [], ""
            return interval(cap if cap is not None else floor, floor, cap), ids, "; ".join(notes)
        low, high, mib = iv.low_mib, iv.high_mib, iv.mib
        if cap is not None:
            high = cap if high is None else min(high, cap)
            mib = None if mib is None else min(mib, cap)
            low = None if low is None else min(low, cap)
        if floor is not None:
            low = floor if low is None else max(low, floor)
            mib = None if mib is None else max(mib, floor)
            if high is not None and high < low:
                high = low
        return interval(mib, low, high), ids, "; ".join(notes)

    @cached_property
    def _rows(self) -> dict[tuple, list]:
        """Rows that bound others, by (card, kind, model, quant, fixes): (recipe, status, ok peak,
        what an OOM needed at least, id, kept logit positions)."""
        out: dict[tuple, list] = defaultdict(list)
        for m in self.fit.ms:
            if m.kind not in ("probe", "real") or m.lora is None or not m.gpu:
                continue
            r = self.fit.recipe_for(m)
            if r is None or r.seq_len is None:
                continue
            status = m.outcome.status
            if status == "ok" and ok_peak(m) is not None:
                out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                    (r, "ok", ok_peak(m), None, m.id, kept_positions(m)))
            elif status in ("oom", "spilled"):
                need = _exceeded_peak(m, self.fit.peaks) if m.kind == "probe" else real_need(m)
                if need is not None:
                    out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                        (r, status, None, need, m.id, kept_positions(m)))
        return dict(out)

    def measured_failure(self, recipe: Recipe, gpu: str, run: Run) -> Optional[tuple[str, str]]:
        """(id, status) of a row of this run's kind on this card whose recipe is this one or an
        easier one (rank, length, dropout, DoRA all at most this recipe's, no more kept logits)
        and that ran out of memory or spilled: measured, so the recipe will not fit whatever an
        interval says. (A probe's OOM says nothing sure of a real run, which peaks lower.)"""
        if recipe.seq_len is None:
            return None
        own = recipe_keep(recipe) if run == "probe" else None
        for r, status, mid, keep in self._failure_rows.get((gpu, run, model_name(recipe.model), recipe.quant,
                                                            recipe.fixes), ()):
            more_logits = own is not None and keep is not None and keep > own
            if (r.rank <= recipe.rank and r.seq_len <= recipe.seq_len and r.dropout <= recipe.dropout
                    and r.dora <= recipe.dora and not more_logits):
                return mid, status
        return None

    @cached_property
    def _failure_rows(self) -> dict[tuple, list]:
        """Rows that ran out of memory or spilled, by (card, kind, model, quant, fixes): (recipe,
        status, id, kept logit positions)."""
        out: dict[tuple, list] = defaultdict(list)
        for m in self.fit.ms:
            if m.kind not in ("probe", "real") or m.lora is None or not m.gpu or m.outcome.status not in ("oom", "spilled"):
                continue
            r = self.fit.recipe_for(m)
            if r is not None and r.seq_len is not None:
                out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                    (r, m.outcome.status, m.id, kept_positions(m)))
        return dict(out)

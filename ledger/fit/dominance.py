"""Dominance between recipes, measured on one card: a longer sequence, dropout, DoRA or a larger
rank never needs less memory. A row of a harder recipe that fit caps an interval's top; one of an
easier recipe that did not fit raises its bottom; and a recipe whose own run, or an easier one's,
ran out of memory on the card will not fit, whatever an interval says."""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Optional

from ledger.core.answers import Interval, Run, interval
from .calibration import _exceeded_peak, kept_positions
from .peaks import ok_peak
from .ledger_fit import LedgerFit
from ledger.vocab.model_configs import model_name
from ledger.core.models import Measurement
from ledger.vocab.recipe import Recipe, fixes_key, group_key
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
    """The rows that bound other recipes on one ledger, by card, kind, model, quant and fixes.
    ``base``: the same ledger's dominance with fewer rows excluded (leave-one-out); a key's rows are
    then the base's less the rows left out, with what an OOM needed read from this fit's peaks and
    the real runs whose longest example this fit reads otherwise made again."""

    def __init__(self, fit: LedgerFit, base: Optional["Dominance"] = None):
        self.fit = fit
        self.base = base if base is not None and fit.base is base.fit else None
        self._keys: dict[tuple, list] = {}
        self._fail_keys: dict[tuple, list] = {}
        self._by_id: dict[tuple, dict[str, tuple]] = {}

    def clamp(self, recipe: Recipe, gpu: str, run: Run, iv: Optional[Interval]) -> tuple[Optional[Interval], list[str], str]:
        """Clamp an interval by rows of harder recipes that fit (top) and easier ones that did not
        (bottom), on this card and of this kind."""
        cap = floor = None
        cap_id = floor_id = None
        if recipe.seq_len is not None:
            own = recipe_keep(recipe) if run == "probe" else None
            for r, status, peak, need, mid, keep in self.rows((gpu, run, model_name(recipe.model),
                                                               recipe.quant, recipe.fixes)):
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
        """Every key's bounding rows (``rows``), for a whole view of them."""
        return {k: v for k in self._positions() if (v := self.rows(k))}

    def rows(self, key: tuple) -> list:
        """Rows that bound others of one (card, kind, model, quant, fixes): (recipe, status, ok
        peak, what an OOM needed at least, id, kept logit positions), in ledger order."""
        if key not in self._keys:
            if self.base is not None:  # the base's entries, but for those this fit reads otherwise
                done = self.base._entries_by_id(key)
                changed = self.fit.changed_reals()
                peaks = self.fit.peaks
                # What an OOM probe needed is its peak model's figure: the base's where this fit's
                # model answers its cell as the base's does.
                as_base = self.base.fit.peaks is peaks.root
                entries = [self._entry(m) if m.id in changed or (
                    m.kind == "probe" and m.outcome.status == "oom"
                    and not (as_base and peaks.answers_as_root(m.gpu, group_key(m)))) else done.get(m.id)
                           for _, m in self._positions().get(key, ())]
            else:
                entries = [self._entry(m) for _, m in self._positions().get(key, ())]
            self._keys[key] = [e for e in entries if e is not None]
        return self._keys[key]

    def _entries_by_id(self, key: tuple) -> dict[str, tuple]:
        """``rows(key)`` by id (a fit started from this one reuses them)."""
        if key not in self._by_id:
            self._by_id[key] = {e[4]: e for e in self.rows(key)}
        return self._by_id[key]

    def _entry(self, m: Measurement) -> Optional[tuple]:
        r = self.fit.recipe_for(m)
        if r is None or r.seq_len is None:
            return None
        status = m.outcome.status
        if status == "ok" and ok_peak(m) is not None:
            return (r, "ok", ok_peak(m), None, m.id, kept_positions(m))
        if status in ("oom", "spilled"):
            need = _exceeded_peak(m, self.fit.peaks) if m.kind == "probe" else real_need(m)
            if need is not None:
                return (r, status, None, need, m.id, kept_positions(m))
        return None

    def _positions(self) -> dict[tuple, list[tuple[int, Measurement]]]:
        """The rows that may bound others, by key, as (position in the ledger, row)."""
        if "_pos" not in self.__dict__:
            if self.base is not None:
                # The base's rows less the ones this fit leaves out: only the keys that hold one change.
                extra = self.fit.exclude - self.base.fit.exclude
                pos = dict(self.base._positions())
                key_of = self.base._key_of()
                for k in {key_of[i] for i in extra if i in key_of}:
                    pos[k] = [(i, m) for i, m in pos[k] if m.id not in extra]
                self.__dict__["_pos"] = pos
            else:
                out: dict[tuple, list] = defaultdict(list)
                for i, m in enumerate(self.fit.ms):
                    if m.kind not in ("probe", "real") or m.lora is None or not m.gpu:
                        continue
                    out[(m.gpu, m.kind, model_name(m.model), m.quant or "4bit", _fixes(m))].append((i, m))
                self.__dict__["_pos"] = dict(out)
        return self.__dict__["_pos"]

    def _key_of(self) -> dict[str, tuple]:
        """Each row's key in ``_positions``, by id."""
        if "_ids_key" not in self.__dict__:
            self.__dict__["_ids_key"] = {m.id: k for k, rows in self._positions().items() for _, m in rows}
        return self.__dict__["_ids_key"]

    def _failure_entries(self, key: tuple) -> list:
        """The rows of ``key`` that ran out of memory or spilled, as (recipe, status, id, kept
        positions). A real run that records no longest example (and pairs with no probe) failed
        on some example of its corpus: it bounds the recipes at least as long as the longest
        example any real run of the same key on the card trained (the worst case it could have
        met, if its corpus was no longer than theirs: the program's runs share one corpus)."""
        if key not in self._fail_keys:
            out = []
            rows = self._positions().get(key, ())
            longest = None
            for _, m in rows:
                if m.outcome.status not in ("oom", "spilled"):
                    continue
                r = self.fit.recipe_for(m)
                if r is not None and r.seq_len is None and m.kind == "real":
                    if longest is None:
                        longest = max((x.seq_len for x in (self.fit.recipe_for(m2) for _, m2 in rows)
                                       if x is not None and x.seq_len), default=0)
                    r = r.replace(seq_len=longest) if longest else None
                if r is not None and r.seq_len is not None:
                    out.append((r, m.outcome.status, m.id, kept_positions(m)))
            self._fail_keys[key] = out
        return self._fail_keys[key]

    def measured_failure(self, recipe: Recipe, gpu: str, run: Run) -> Optional[tuple[str, str]]:
        """(id, status) of a row of this run's kind on this card whose recipe is this one or an
        easier one (rank, length, dropout, DoRA all at most this recipe's, no more kept logits)
        and that ran out of memory or spilled: measured, so the recipe will not fit whatever an
        interval says. (A probe's OOM says nothing sure of a real run, which peaks lower.)"""
        if recipe.seq_len is None:
            return None
        own = recipe_keep(recipe) if run == "probe" else None
        for r, status, mid, keep in self._failure_entries((gpu, run, model_name(recipe.model), recipe.quant,
                                                           recipe.fixes)):
            more_logits = own is not None and keep is not None and keep > own
            if (r.rank <= recipe.rank and r.seq_len <= recipe.seq_len and r.dropout <= recipe.dropout
                    and r.dora <= recipe.dora and not more_logits):
                return mid, status
        return None


def _fixes(m: Measurement) -> str:
    return fixes_key(m.memory_fixes)

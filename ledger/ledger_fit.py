"""One ledger's rows as a predictor may use them (on or before a date, less excluded rows), with
the fits every rung of the ladder shares: the peak model, the card limits' rows, the probe/real
over-estimate, and how wide each rung's interval is on this ledger."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from functools import cached_property
from operator import is_
from typing import Iterable, NamedTuple, Optional

from .calibration import LimitRows, Overestimate, key_pairs, overestimate, pair_rows, sorted_pairs
from .peaks import PeakModel, before, dry_readable, ok_peak, probes
from .model_configs import model_name
from .models import Ledger, Measurement
from .recipe import GroupKey, Recipe, group_key, recipe_key, recipe_of, seq_len_of


def m_group(m: Measurement) -> GroupKey:
    return group_key(m)


class HeldOutErrors(NamedTuple):
    """An ok probe's held-out relative errors (None where the rung does not ask it or the model
    without the probe has no answer), and whether each read the pooled slope."""

    interpolated: Optional[float]
    interpolated_slope: bool
    transferred: Optional[float]
    transferred_slope: bool


RUNGS = ("interpolated", "transferred")


def _widest(errors: Iterable[HeldOutErrors]) -> dict[str, Optional[float]]:
    """The widths from every ok probe's held-out errors (``LedgerFit._held_out_errors``)."""
    found: dict[str, list[float]] = {rung: [] for rung in RUNGS}
    for e in errors:
        for rung in RUNGS:
            if getattr(e, rung) is not None:
                found[rung].append(getattr(e, rung))
    return {**{rung: max(found[rung], default=None) for rung in RUNGS},
            **{f"{rung}_n": len(found[rung]) for rung in RUNGS}}


def _same_rows(a: list, b: list) -> bool:
    """Whether two lists hold the very same row objects, in the same order."""
    return a is b or (len(a) == len(b) and all(map(is_, a, b)))


class LedgerFit:
    """The rows (``ms``: measured; ``dry``: dry runs of a recipe that ran) and their shared fits."""

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement] = (), as_of: Optional[dt.date] = None,
                 exclude: Iterable[str] = (), base: Optional["LedgerFit"] = None):
        self.ledger = ledger
        self.exclude = set(exclude)
        self.as_of = as_of
        shared = base is not None and base.shares(ledger, as_of, self.exclude)
        # A fit started from another keeps the other's rows less the extra ones left out.
        self.ms = ([m for m in base.ms if m.id not in self.exclude] if shared
                   else before(ledger.measurements, as_of, self.exclude))
        # Dry runs are computations, not observations: any of them could have been run on any date,
        # so only the measured rows their remainder is fitted on are limited to ``as_of``. A fit
        # started from another of the very same dry-run rows (leave-one-out asks one per row) keeps
        # the other's, less the extra ones left out.
        self.dry_source = dry_runs
        if shared and _same_rows(base.dry_source, dry_runs):
            extra = self.exclude - base.exclude
            self.dry = [m for m in base.dry if m.id not in extra] if extra & base.dry_ids else base.dry
        else:
            self.dry = [m for m in dry_runs if m.id not in self.exclude
                        and m.kind == "dry_run" and m.lora is not None and m.outcome.status == "ok"
                        and m.outcome.peak_allocated_mib is not None and m.seq_len and dry_readable(m)]
        # ``base``: the same ledger's fit with fewer rows excluded (leave-one-out): its peak model is
        # shared less the extra rows (the same figures as a fresh one, at the cost of their groups).
        self.base = base if base is not None and base.shares(ledger, as_of, self.exclude) else None
        self.peaks = self.base.peaks.without(self.exclude - self.base.exclude) if self.base else PeakModel(self.ms)
        if self.base is not None:
            self.limit_rows = self.base.limit_rows
            # (the rows the limits rest on are the first fit's: every row left out since is removed)
            self.lims = self.limit_rows.limits(ledger, self.peaks, frozenset(self.exclude))
        else:
            self.limit_rows = LimitRows(self.ms)
            self.lims = self.limit_rows.limits(ledger, self.peaks)
        self.pair_rows, self.pairs_by_key = self._pairs()
        self.pairs = sorted_pairs(self.pairs_by_key.values())
        self.over: Overestimate = overestimate(self.ms, self.pairs)

    def _pairs(self) -> tuple[dict, dict]:
        """The rows of each recipe key pairs are made of, and its pairs: the base's, with the keys of
        the rows it excludes besides made again."""
        if self.base is None:
            rows = pair_rows(self.ms)
            return rows, {k: key_pairs(k, ps, rs) for k, (ps, rs) in rows.items()}
        extra = self.exclude - self.base.exclude
        touched = {recipe_key(m) for m in self.base.removed(extra)}
        rows, by_key = dict(self.base.pair_rows), dict(self.base.pairs_by_key)
        for k in touched & rows.keys():
            ps, rs = ([m for m in lst if m.id not in extra] for lst in rows[k])
            rows[k] = (ps, rs)
            by_key[k] = key_pairs(k, ps, rs)
        return rows, by_key

    def removed(self, ids: Iterable[str]) -> list[Measurement]:
        """This fit's rows among ``ids`` (the rows a fit started from this one leaves out)."""
        return [self.by_id[i] for i in ids if i in self.by_id]

    def shares(self, ledger: Ledger, as_of: Optional[dt.date], exclude: set) -> bool:
        """Whether a fit of ``ledger`` as of ``as_of`` less ``exclude`` may start from this one."""
        return ledger is self.ledger and as_of == self.as_of and self.exclude <= exclude

    @cached_property
    def widths(self) -> dict[str, Optional[float]]:
        """Largest held-out relative error of each rung (fractions), from the ledger's own probes."""
        base = self.base
        if base is None:
            return _widest(self._held_out_errors.values())
        gone = [m for m in base.removed(self.exclude - base.exclude) if ok_peak(m) is not None and m.kind == "probe"]
        if not gone:
            return base.widths  # the peak model reads ok probes alone: without them it is the same
        if base.base is not None:  # a fit started from a fit started from another: every probe asked again
            return _widest(self._held_out_errors.values())
        return self._widths_from_base()

    @cached_property
    def _held_out_errors(self) -> dict[str, HeldOutErrors]:
        """Each ok probe's held-out errors, by id, in the ledger's order."""
        return {m.id: self._errors(m) for m in probes(self.ms) if ok_peak(m) is not None}

    def _errors(self, m: Measurement) -> HeldOutErrors:
        """An ok probe's held-out errors: this fit's model without the probe, and without its
        card's rows of the group, asked about it."""
        peak = ok_peak(m)
        group = m_group(m)
        interp = transfer = None
        interp_slope = transfer_slope = False
        # The model without this probe, asked about it: its card's other rows of the group.
        kept, answered, pred = self.peaks.own_held_out(m, m.lora.rank)
        if kept:
            if not answered:  # one rank left: that model's pooled slope is needed, so fit it
                interp_slope = True
                pred, _ = self.peaks.without((m.id,)).predict(m.gpu, group, m.lora.rank)
            if pred is not None:
                interp = abs(pred - peak) / peak
        # Removing the probe changes its own card's rows alone: the other cards' are the model's.
        if any(g != m.gpu for g in self.peaks.by_group.get(group, ())):
            # The same model without any row of this card and group: the others' rows, shifted.
            answered, pred = self.peaks.transfer_held_out(m.gpu, group, m.lora.rank)
            if not answered:  # that model needs its pooled slope: fit it
                transfer_slope = True
                # (the full fit's rows of the cell: the ones this fit left out are out already)
                alone = self.peaks.without((m.id, *(self.base or self)._cell_ids.get((m.gpu, group), ())))
                pred, _ = alone.predict(m.gpu, group, m.lora.rank)
            if pred is not None:
                transfer = abs(pred - peak) / peak
        return HeldOutErrors(interp, interp_slope, transfer, transfer_slope)

    def _widths_from_base(self) -> dict[str, Optional[float]]:
        """``widths`` of a fit less some ok probes, from its base's errors: only the probes whose
        answers read what the left-out rows changed (``PeakModel.held_out_changes``: their cells,
        their groups' rows on other cards and the shifts to them, the pooled slope) are asked again;
        every other probe's errors are the base's."""
        base = self.base
        moved, slope_moved = self.peaks.held_out_changes()
        by_cell = base._probes_by_cell
        ask = {i for key in moved for i in by_cell.get(key, ())}
        if slope_moved:
            ask.update(base._slope_readers)
        gone = self.exclude - base.exclude
        errors = {i: self._errors(base.by_id[i]) for i in ask - gone}
        was = base._held_out_errors
        widest, counts = {}, {}
        for rung in RUNGS:
            asked = [getattr(e, rung) for e in errors.values() if getattr(e, rung) is not None]
            # The largest of the base's errors this fit keeps as they are.
            kept = next((value for value, i in base._errors_ordered[rung] if i not in errors and i not in gone), None)
            widest[rung] = max([*asked, *([kept] if kept is not None else [])], default=None)
            dropped = sum(1 for i in errors.keys() | (gone & was.keys()) if getattr(was[i], rung) is not None)
            counts[f"{rung}_n"] = base.widths[f"{rung}_n"] - dropped + len(asked)
        return {**widest, **counts}

    @cached_property
    def _probes_by_cell(self) -> dict[tuple, list[str]]:
        """(card, group) -> the ids of this fit's ok probes in it."""
        out: dict[tuple, list[str]] = {}
        for i in self._held_out_errors:
            m = self.by_id[i]
            out.setdefault((m.gpu, m_group(m)), []).append(i)
        return out

    @cached_property
    def _slope_readers(self) -> list[str]:
        """The ok probes whose held-out errors read the pooled slope (a cell or group with one rank left)."""
        return [i for i, e in self._held_out_errors.items() if e.interpolated_slope or e.transferred_slope]

    @cached_property
    def _errors_ordered(self) -> dict[str, list[tuple[float, str]]]:
        """Each rung's held-out errors, largest first, with the probe's id."""
        errors = self._held_out_errors
        return {rung: sorted(((getattr(e, rung), i) for i, e in errors.items() if getattr(e, rung) is not None),
                             reverse=True) for rung in RUNGS}

    @cached_property
    def _cell_ids(self) -> dict[tuple, list[str]]:
        """(card, group) -> the id of every row of this fit in it."""
        out: dict[tuple, list[str]] = {}
        for x in self.ms:
            out.setdefault((x.gpu, m_group(x)), []).append(x.id)
        return out

    @cached_property
    def real_seq(self) -> dict[str, int]:
        """A real run's longest example: its own, else that of the probe it was paired with (the
        probe measured the worst case of the corpus the run trained on)."""
        if self.base is not None:
            return self._real_seq_from_base()[0]
        out = {}
        for p in self.pairs:
            for rid in p.reals:
                if p.probe_seq_len:
                    out.setdefault(rid, p.probe_seq_len)
        for m in self.ms:
            if m.kind == "real" and seq_len_of(m):
                out[m.id] = seq_len_of(m)
        return out

    def _real_seq_from_base(self) -> tuple[dict[str, int], set[str]]:
        """``real_seq`` from the base's: a real run pairs only within its recipe key, so only the real
        runs of the keys this fit re-paired (and the rows it leaves out) can differ. Also the ids
        whose value differs from the base's."""
        if "_derived_seq" not in self.__dict__:
            base = self.base.real_seq
            out = dict(base)
            extra = self.exclude - self.base.exclude
            for i in extra:
                out.pop(i, None)
            touched = {recipe_key(m) for m in self.base.removed(extra)} & self.pair_rows.keys()
            reals = [m for k in touched for m in self.base.pair_rows[k][1]]
            for m in reals:
                out.pop(m.id, None)
            for k in touched:
                for p in sorted(self.pairs_by_key[k], key=lambda x: (x.on or "", x.probe)):
                    for rid in p.reals:
                        if p.probe_seq_len:
                            out.setdefault(rid, p.probe_seq_len)
            for m in reals:
                if m.id not in extra and seq_len_of(m):
                    out[m.id] = seq_len_of(m)
            changed = {m.id for m in reals if out.get(m.id) != base.get(m.id)}
            self.__dict__["_derived_seq"] = (out, changed)
        return self.__dict__["_derived_seq"]

    def changed_reals(self) -> set[str]:
        """Real runs (kept) whose longest example differs from the base fit's (empty without a base)."""
        return self._real_seq_from_base()[1] - self.exclude if self.base is not None else set()

    def reals_on(self, gpu: str) -> list[Measurement]:
        """This fit's real runs on a card, in ledger order."""
        if "_reals_on" not in self.__dict__:
            if self.base is not None:
                extra = self.exclude - self.base.exclude
                self.__dict__["_reals_on"] = {g: [m for m in rs if m.id not in extra]
                                               for g, rs in self.base._reals_index().items()}
            else:
                self._reals_index()
        return self.__dict__["_reals_on"].get(gpu, [])

    def _reals_index(self) -> dict[str, list[Measurement]]:
        if "_reals_on" not in self.__dict__:
            index: dict[str, list[Measurement]] = {}
            for m in self.ms:
                if m.kind == "real" and m.gpu:
                    index.setdefault(m.gpu, []).append(m)
            self.__dict__["_reals_on"] = index
        return self.__dict__["_reals_on"]

    def recipe_for(self, m: Measurement) -> Optional[Recipe]:
        """A row's recipe, a real run's longest example filled in from the probe it was paired with."""
        r = recipe_of(m)
        if r is not None and r.seq_len is None and m.kind == "real" and m.id in self.real_seq:
            r = r.replace(seq_len=self.real_seq[m.id])
        return r

    @cached_property
    def models_named(self) -> dict[Optional[str], str]:
        """The ledger's own spelling of each model, by short name (the first in sort order)."""
        if self.base is not None:
            gone = Counter(m.model for m in self.base.removed(self.exclude - self.base.exclude) if m.model)
            if all(self.base.spellings[s] > n for s, n in gone.items()):
                return self.base.models_named  # every spelling is still in the ledger: the same answer
        names: dict[Optional[str], set[str]] = {}
        for m in self.ms:
            if m.model:
                names.setdefault(model_name(m.model), set()).add(m.model)
        return {k: sorted(v)[0] for k, v in names.items()}

    @cached_property
    def spellings(self) -> Counter:
        """How many rows spell each model name as they do."""
        return Counter(m.model for m in self.ms if m.model)

    @cached_property
    def dry_ids(self) -> set[str]:
        return {m.id for m in self.dry}

    @cached_property
    def by_id(self) -> dict[str, Measurement]:
        return {m.id: m for m in self.ms}

    def vendor(self, gpu: Optional[str]) -> Optional[str]:
        g = self.ledger.gpus.get(gpu or "")
        return g.vendor if g else None

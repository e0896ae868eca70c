"""One ledger's rows as a predictor may use them (on or before a date, less excluded rows), with
the fits every rung of the ladder shares: the peak model, the card limits' rows, the probe/real
over-estimate, and how wide each rung's interval is on this ledger."""

from __future__ import annotations

import datetime as dt
from bisect import insort
from collections import Counter
from collections.abc import Mapping
from functools import cached_property
from operator import is_
from typing import Iterable, Iterator, NamedTuple, Optional

from .calibration import (
    Limit,
    LimitRows,
    Overestimate,
    key_pairs,
    overestimate,
    pair_order,
    pair_rows,
    sorted_pairs,
)
from .peaks import PeakModel, before, dry_readable, ok_peak, probes
from ledger.vocab.model_configs import model_name
from ledger.core.models import Ledger, Measurement
from ledger.vocab.recipe import GroupKey, Recipe, group_key, recipe_key, recipe_of, seq_len_of


def m_group(m: Measurement) -> GroupKey:
    return group_key(m)


#: The rungs whose interval widths come from held-out errors of the ledger's own probes.
RUNGS = ("interpolated", "transferred")


class HeldOutError(NamedTuple):
    """An ok probe's held-out relative error on one rung (None where the rung does not ask it or
    the model without the probe has no answer), and whether it read the pooled slope."""

    error: Optional[float]
    slope: bool


def _widest(errors: Iterable[HeldOutError]) -> tuple[Optional[float], int]:
    """A rung's width (the largest held-out error) and how many probes gave one."""
    found = [e.error for e in errors if e.error is not None]
    return max(found, default=None), len(found)


class _RowsLess(Mapping):
    """A fit's rows by id less some ids, without copying them."""

    def __init__(self, rows: Mapping[str, Measurement], gone: frozenset):
        self._rows, self._gone = rows, gone

    def __getitem__(self, key: str) -> Measurement:
        if key in self._gone:
            raise KeyError(key)
        return self._rows[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._rows if k not in self._gone)

    def __len__(self) -> int:
        return len(self._rows) - sum(1 for k in self._gone if k in self._rows)


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
        self.ms = base._less(self.exclude - base.exclude) if shared else before(ledger.measurements, as_of, self.exclude)
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
        # The rows the limits rest on are the first fit's: every row left out since is removed.
        # Each card's limit is made when first asked (a held-out answer asks its own card's alone).
        self.limit_rows = self.base.limit_rows if self.base is not None else LimitRows(self.ms)
        self._limits: dict[tuple[str, str], Optional[Limit]] = {}
        self.pair_rows, self.pairs_by_key, changed = self._pairs()
        self.over: Overestimate
        if self.base is None:
            self.pairs = sorted_pairs(self.pairs_by_key.values())
            self.over = overestimate(self.ms, self.pairs)
        elif not changed:  # no pair changed: the base's pairs and their over-estimate
            self.pairs, self.over = self.base.pairs, self.base.over
        else:  # the base's pairs, in order, with the changed keys' swapped
            gone = {id(p) for k in changed for p in self.base.pairs_by_key[k]}
            self.pairs = [p for p in self.base.pairs if id(p) not in gone]
            for k in changed:
                for p in self.pairs_by_key[k]:
                    insort(self.pairs, p, key=pair_order)
            self.over = overestimate(self.ms, self.pairs)
        # Per rung (``RUNGS``), made when first read: the width and its probes, each ok probe's
        # held-out error, the probes whose error read the pooled slope, the errors largest first.
        self._widths: dict[str, tuple[Optional[float], int]] = {}
        self._held_out_by_rung: dict[str, dict[str, HeldOutError]] = {}
        self._readers: dict[str, list[str]] = {}
        self._ordered: dict[str, list[tuple[float, str]]] = {}

    def limit(self, gpu: str, kind: str = "probe") -> Optional[Limit]:
        """One of the ledger's cards' limits from one kind of row (None where it has no such row)."""
        key = (gpu, kind)
        if key not in self._limits:
            removed = frozenset(self.exclude) if self.base is not None else frozenset()
            self._limits[key] = self.limit_rows.limit(self.ledger, self.peaks, gpu, kind, removed)
        return self._limits[key]

    @cached_property
    def lims(self) -> list[Limit]:
        """Every card's limits, probe then real, in the ledger's order of cards."""
        return [lim for gpu in self.ledger.gpus for kind in ("probe", "real") if (lim := self.limit(gpu, kind)) is not None]

    def _pairs(self) -> tuple[dict, dict, list]:
        """The rows of each recipe key pairs are made of, its pairs, and the keys whose pairs differ
        from the base's: the base's, with the keys of the rows it excludes besides made again."""
        if self.base is None:
            rows = pair_rows(self.ms)
            return rows, {k: key_pairs(k, ps, rs) for k, (ps, rs) in rows.items()}, []
        extra = self.exclude - self.base.exclude
        touched = {recipe_key(m) for m in self.base.removed(extra)}
        rows, by_key = dict(self.base.pair_rows), dict(self.base.pairs_by_key)
        changed = []
        for k in touched & rows.keys():
            ps, rs = ([m for m in lst if m.id not in extra] for lst in rows[k])
            rows[k] = (ps, rs)
            made = key_pairs(k, ps, rs)
            if made != by_key[k]:
                by_key[k] = made
                changed.append(k)
        return rows, by_key, changed

    def removed(self, ids: Iterable[str]) -> list[Measurement]:
        """This fit's rows among ``ids`` (the rows a fit started from this one leaves out)."""
        return [self.by_id[i] for i in ids if i in self.by_id]

    def shares(self, ledger: Ledger, as_of: Optional[dt.date], exclude: set) -> bool:
        """Whether a fit of ``ledger`` as of ``as_of`` less ``exclude`` may start from this one."""
        return ledger is self.ledger and as_of == self.as_of and self.exclude <= exclude

    @property
    def widths(self) -> dict[str, Optional[float]]:
        """Largest held-out relative error of each rung (fractions), from the ledger's own probes,
        and how many probes each rests on (``<rung>_n``)."""
        return {**{rung: self.width(rung) for rung in RUNGS}, **{f"{rung}_n": self.width_n(rung) for rung in RUNGS}}

    def width(self, rung: str) -> Optional[float]:
        """A rung's width: its largest held-out relative error over the ledger's ok probes (a fraction)."""
        return self._width(rung)[0]

    def width_n(self, rung: str) -> int:
        """How many ok probes a rung's width rests on."""
        return self._width(rung)[1]

    def _width(self, rung: str) -> tuple[Optional[float], int]:
        """(width, probes) of one rung, computed when first asked: an answer reads one rung's
        width, and a fit left without a row (held-out scoring makes one per row) often never asks
        the other's."""
        if rung not in self._widths:
            self._widths[rung] = self._width_of(rung)
        return self._widths[rung]

    def _width_of(self, rung: str) -> tuple[Optional[float], int]:
        base = self.base
        if base is None:
            return _widest(self._held_out(rung).values())
        gone = [m for m in base.removed(self.exclude - base.exclude) if ok_peak(m) is not None and m.kind == "probe"]
        if not gone:
            return base._width(rung)  # the peak model reads ok probes alone: without them it is the same
        if base.base is not None:  # a fit started from a fit started from another: every probe asked again
            return _widest(self._held_out(rung).values())
        return self._width_from_base(rung, gone)

    def _held_out(self, rung: str) -> dict[str, HeldOutError]:
        """Each ok probe's held-out error on a rung, by id, in the ledger's order."""
        if rung not in self._held_out_by_rung:
            ask = self._error_on(rung)
            self._held_out_by_rung[rung] = {m.id: ask(m) for m in self._ok_probes}
        return self._held_out_by_rung[rung]

    @cached_property
    def _ok_probes(self) -> list[Measurement]:
        """This fit's probes with an ok peak (the ones the widths are measured on), in order."""
        return [m for m in probes(self.ms) if ok_peak(m) is not None]

    def _error_on(self, rung: str):
        """The function giving an ok probe's held-out error on ``rung``."""
        return self._interpolated_error if rung == "interpolated" else self._transferred_error

    def _interpolated_error(self, m: Measurement) -> HeldOutError:
        """An ok probe's held-out error on its own card: this fit's model without the probe, asked
        about it from its card's other rows of the group."""
        peak = ok_peak(m)
        kept, answered, pred = self.peaks.own_held_out(m, m.lora.rank)
        if not kept:
            return HeldOutError(None, False)
        if not answered:  # one rank left: that model's pooled slope is needed, so fit it
            pred, _ = self.peaks.without((m.id,)).predict(m.gpu, m_group(m), m.lora.rank)
        return HeldOutError(None if pred is None else abs(pred - peak) / peak, not answered)

    def _transferred_error(self, m: Measurement) -> HeldOutError:
        """An ok probe's held-out error from the other cards: this fit's model without any row of
        the probe's card and group (the others' rows, shifted), asked about it."""
        peak = ok_peak(m)
        group = m_group(m)
        # Removing the probe changes its own card's rows alone: the other cards' are the model's.
        if not any(g != m.gpu for g in self.peaks.by_group.get(group, ())):
            return HeldOutError(None, False)
        answered, pred = self.peaks.transfer_held_out(m.gpu, group, m.lora.rank)
        if not answered:  # that model needs its pooled slope: fit it
            # (the full fit's rows of the cell: the ones this fit left out are out already)
            alone = self.peaks.without((m.id, *(self.base or self)._cell_ids.get((m.gpu, group), ())))
            pred, _ = alone.predict(m.gpu, group, m.lora.rank)
        return HeldOutError(None if pred is None else abs(pred - peak) / peak, not answered)

    def _width_from_base(self, rung: str, gone: list[Measurement]) -> tuple[Optional[float], int]:
        """A rung's width for a fit less some ok probes, from its base's errors: only the probes
        whose answers read what the left-out rows changed are asked again; every other probe's
        error is the base's. On its own card a probe's answer reads its cell's rows (changed only
        in the cells of the probes left out) and, where one rank is left, the pooled slope; from
        the other cards it reads the group's rows there and the shifts over them
        (``PeakModel.held_out_changes``) and, where they have one rank, the pooled slope."""
        base = self.base
        by_cell = base._probes_by_cell
        if rung == "interpolated":
            moved, slope_moved = {(m.gpu, m_group(m)) for m in gone}, self.peaks.slope_moved()
        else:
            moved, slope_moved = self.peaks.held_out_changes()
        ask = {i for key in moved for i in by_cell.get(key, ())}
        if slope_moved:
            ask.update(base._slope_readers(rung))
        left_out = self.exclude - base.exclude
        error = self._error_on(rung)
        errors = {i: error(base.by_id[i]) for i in ask - left_out}
        was = base._held_out(rung)
        asked = [e.error for e in errors.values() if e.error is not None]
        # The largest of the base's errors this fit keeps as they are.
        kept = next((value for value, i in base._errors_ordered(rung) if i not in errors and i not in left_out), None)
        dropped = sum(1 for i in errors.keys() | (left_out & was.keys()) if was[i].error is not None)
        return (max([*asked, *([kept] if kept is not None else [])], default=None),
                base._width(rung)[1] - dropped + len(asked))

    @cached_property
    def _probes_by_cell(self) -> dict[tuple, list[str]]:
        """(card, group) -> the ids of this fit's ok probes in it."""
        out: dict[tuple, list[str]] = {}
        for m in self._ok_probes:
            out.setdefault((m.gpu, m_group(m)), []).append(m.id)
        return out

    def _slope_readers(self, rung: str) -> list[str]:
        """The ok probes whose held-out error on a rung read the pooled slope (a cell or group with one rank left)."""
        if rung not in self._readers:
            self._readers[rung] = [i for i, e in self._held_out(rung).items() if e.slope]
        return self._readers[rung]

    def _errors_ordered(self, rung: str) -> list[tuple[float, str]]:
        """A rung's held-out errors, largest first, with the probe's id."""
        if rung not in self._ordered:
            self._ordered[rung] = sorted(((e.error, i) for i, e in self._held_out(rung).items()
                                          if e.error is not None), reverse=True)
        return self._ordered[rung]

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
                for p in sorted(self.pairs_by_key[k], key=pair_order):
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
    def by_id(self) -> Mapping[str, Measurement]:
        """This fit's rows by id (a fit started from another: the other's, less the rows it leaves out)."""
        if self.base is not None:
            return _RowsLess(self.base.by_id, frozenset(self.exclude - self.base.exclude))
        return {m.id: m for m in self.ms}

    @cached_property
    def _position(self) -> dict[str, int]:
        """Each row's position in ``ms``, by id."""
        return {m.id: i for i, m in enumerate(self.ms)}

    def _less(self, ids: set[str]) -> list[Measurement]:
        """``ms`` less the rows ``ids``, in order (leave-one-out makes one such list per row: the
        runs between the rows left out are sliced, not filtered row by row)."""
        at = self._position
        out: list[Measurement] = []
        start = 0
        for cut in sorted(at[i] for i in ids if i in at):
            out += self.ms[start:cut]
            start = cut + 1
        out += self.ms[start:]
        return out

    def vendor(self, gpu: Optional[str]) -> Optional[str]:
        g = self.ledger.gpus.get(gpu or "")
        return g.vendor if g else None

"""The measured peaks of configurations: which rows are probes that fit, the ledger as it stood on
a date, and the peak model (a probe's peak allocated for a card, a recipe group and a rank, affine
in rank within a group, shifted from other cards by their median difference on shared rows)."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from bisect import bisect_left, bisect_right, insort
from typing import Iterable, Optional

from .model_configs import model_name
from .models import Measurement
from .recipe import fixes_key, group_key, seq_len_of

# -- rows ------------------------------------------------------------------------------------


def ok_peak(m: Measurement) -> Optional[float]:
    o = m.outcome
    return o.peak_allocated_mib if o.status == "ok" and o.peak_allocated_mib is not None else None


def probes(ms: Iterable[Measurement]) -> list[Measurement]:
    return [m for m in ms if m.kind == "probe" and m.lora is not None and m.gpu]


def date_of(m) -> dt.date:
    return m.provenance.measured_on or dt.date.min


def modelled(m: Measurement) -> bool:
    """Whether the fits can read a row: micro-batch 1, gradient checkpointing on, and for a probe or
    dry run no optimizer step inside the measured step (what probes, dry runs and the program's runs
    are). A row outside that, such as a preflight of a batch of 4 with its AdamW step, stays in the
    ledger as evidence and on the site, but is no point of the peak model, the pairs, the card
    limits or the dry-run table."""
    return ((m.batch_size or 1) == 1 and m.gradient_checkpointing is not False
            and (m.optimizer is None or m.kind == "real"))


def dry_readable(m: Measurement) -> bool:
    """Whether the dry-run table can read a dry-run row: no optimizer step, with gradient
    checkpointing on or off and any micro-batch (the table keeps each apart: ``DryTable.table``)."""
    return m.optimizer is None


def before(ms: list[Measurement], as_of: Optional[dt.date], exclude: Iterable[str] = ()) -> list[Measurement]:
    """The ledger as it stood on a date, less some rows (prospective or held-out fits), and less
    the rows the fits cannot read (``modelled``)."""
    drop = set(exclude)
    return [m for m in ms if m.id not in drop and modelled(m) and (
        as_of is None or m.provenance.measured_on is None or m.provenance.measured_on <= as_of)]


# -- peaks of configurations --------------------------------------------------------------------


def _best(rows: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """A cell's points, one per rank: the highest (peak, id) of each (repeats of a rank are one point)."""
    cell: dict[float, tuple[float, str]] = {}
    for rank, peak, i in rows:
        if rank not in cell or (peak, i) > cell[rank]:
            cell[rank] = (peak, i)
    return [(x, y, i) for x, (y, i) in sorted(cell.items())]


def fit_slope(points: list[tuple[float, float]]) -> Optional[float]:
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def rank_slope(ms: list[Measurement], gpu: Optional[str] = None, quant: Optional[str] = None) -> Optional[float]:
    """MiB per rank unit: the pooled within-group slope of ok probes (each group centred)."""
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for m in probes(ms):
        if (gpu is None or m.gpu == gpu) and (quant is None or m.quant == quant) and ok_peak(m) is not None:
            groups[(m.gpu, *group_key(m))].append((float(m.lora.rank), ok_peak(m)))
    sxy = sxx = 0.0
    for pts in groups.values():
        if len({x for x, _ in pts}) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    return sxy / sxx if sxx else None


def _term(key: tuple, pts: list[tuple[float, float, str, int]]) -> Optional[tuple]:
    """One group's share of the pooled slope, as rank_slope adds it (None under two ranks)."""
    if len({x for x, *_ in pts}) < 2:
        return None
    mx = sum(x for x, *_ in pts) / len(pts)
    my = sum(y for _, y, *_ in pts) / len(pts)
    return (pts[0][3], key[0], key[2], sum((x - mx) * (y - my) for x, y, *_ in pts),
            sum((x - mx) ** 2 for x, *_ in pts))


def _from_rows(rows: list[tuple[float, float, str]], rank: int, pooled,
               slope: Optional[float] = None) -> tuple[Optional[float], list[str]]:
    """A group's figure at a rank from its rows on a card (own or borrowed): between the measured
    neighbours, else along the rows' slope (``pooled()``'s where they have one rank; ``slope``, if
    given, is that slope already known)."""
    pts = [(x, y) for x, y, _ in rows]
    if slope is None:
        slope = fit_slope(pts) if len({x for x, _ in pts}) >= 2 else pooled()
    if slope is None:
        return None, []
    near = min(rows, key=lambda r: (abs(r[0] - rank), -r[1]))
    if len({x for x, _ in pts}) >= 2:
        lo = [r for r in rows if r[0] <= rank]
        hi = [r for r in rows if r[0] >= rank]
        if lo and hi:  # interpolate between the measured neighbours
            a = max(lo, key=lambda r: (r[0], r[1]))
            b = min(hi, key=lambda r: (r[0], -r[1]))
            if a[0] == b[0]:
                return max(r[1] for r in rows if r[0] == rank), [r[2] for r in rows if r[0] == rank]
            y = a[1] + (b[1] - a[1]) * (rank - a[0]) / (b[0] - a[0])
            return round(y, 1), [a[2], b[2]]
    return round(near[1] + slope * (rank - near[0]), 1), [near[2]]


def _median_less(ordered: list[float], gone: list[float]) -> float:
    """``statistics.median`` of ``ordered`` (sorted) less one of each of ``gone`` (values it holds),
    0.0 when nothing is left: the two middle values found by bisection, the list not copied."""
    n = len(ordered) - len(gone)
    if n <= 0:
        return 0.0
    if not gone:
        return statistics.median(ordered)
    out = sorted(gone)

    def nth(k: int) -> float:
        # The smallest value with more than k of what is left at or below it.
        lo, hi = 0, len(ordered) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            v = ordered[mid]
            if bisect_right(ordered, v) - bisect_right(out, v) > k:
                hi = mid
            else:
                lo = mid + 1
        return ordered[lo]

    if n % 2:
        return nth(n // 2)
    return (nth(n // 2 - 1) + nth(n // 2)) / 2


class PeakModel:
    """Predicts a probe's peak allocated for (card, group, rank) from ok probes.

    ``without(ids)`` is the model fitted on the same rows less some (leave-one-out, held-out
    widths): it shares every group the removed rows are not in and recomputes the rest, so the
    answers are those of ``PeakModel([m for m in ms if m.id not in ids])`` at the cost of the groups
    touched, not of the ledger."""

    def __init__(self, ms: list[Measurement]):
        self._root: Optional["PeakModel"] = None
        self._excluded: frozenset = frozenset()
        self._ms: Optional[list[Measurement]] = list(ms)
        self._probes: Optional[list[Measurement]] = probes(self._ms)
        # Per group and card, the ok probes as (rank, peak, id); per fixes key, the probed lengths.
        self._cells: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
        self._seq_rows: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        self._cell_of: dict[str, tuple] = {}
        self._seq_of: dict[str, tuple] = {}
        self._seqs: Optional[dict[tuple, set]] = defaultdict(set)
        for m in self._probes:
            seq = seq_len_of(m)
            if seq:
                key = (m.gpu, m.model, m.quant, fixes_key(m.memory_fixes))
                self._seqs[key].add(seq)
                self._seq_rows[key].append((m.id, seq))
                self._seq_of[m.id] = key
            peak = ok_peak(m)
            if peak is not None:
                key = (group_key(m), m.gpu)
                self._cells[key].append((float(m.lora.rank), peak, m.id))
                self._cell_of[m.id] = key
        self.by_group: dict[tuple, dict[str, list[tuple[float, float, str]]]] = defaultdict(dict)
        for (group, gpu), rows in self._cells.items():
            self.by_group[group][gpu] = _best(rows)
        # Held-out answers shared by this model and every model made from it (``own_held_out``,
        # ``transfer_held_out``), keyed by all they read.
        self._held: dict[tuple, tuple] = {}
        self._reset()

    def _reset(self) -> None:
        self._slopes: dict = {}
        self._cache: dict = {}
        self._observed: Optional[dict] = None
        self._offsets: dict = {}

    @property
    def ms(self) -> list[Measurement]:
        if self._ms is None:
            self._ms = [m for m in self._root._ms if m.id not in self._excluded]
        return self._ms

    @property
    def probes(self) -> list[Measurement]:
        if self._probes is None:
            self._probes = [m for m in self._root._probes if m.id not in self._excluded]
        return self._probes

    def without(self, ids) -> "PeakModel":
        """This model less the rows ``ids`` (see the class docstring)."""
        root = self.root
        excluded = self._excluded | frozenset(ids)
        view = object.__new__(PeakModel)
        view._root, view._excluded, view._ms, view._probes = root, excluded, None, None
        cells = {root._cell_of[i] for i in excluded if i in root._cell_of}
        view.by_group = defaultdict(dict, root.by_group)
        for group, gpu in cells:
            rows = [r for r in root._cells[(group, gpu)] if r[2] not in excluded]
            by_gpu = {g: v for g, v in view.by_group[group].items() if g != gpu}
            if rows:
                by_gpu[gpu] = _best(rows)
            if by_gpu:
                view.by_group[group] = by_gpu
            else:
                del view.by_group[group]
        view._seqs = None  # made when asked (``seqs``)
        view._touched = {group for group, _ in cells}
        view._reset()
        return view

    @property
    def seqs(self) -> dict[tuple, set]:
        """(card, model, quant, fixes key) -> the lengths of its probes."""
        if self._seqs is None:
            root, excluded = self._root, self._excluded
            seqs = defaultdict(set, root._seqs)
            for key in {root._seq_of[i] for i in excluded if i in root._seq_of}:
                left = {s for i, s in root._seq_rows[key] if i not in excluded}
                if left:
                    seqs[key] = left
                else:
                    del seqs[key]
            self._seqs = seqs
        return self._seqs

    def lengths(self, gpu: str, group: tuple) -> list[int]:
        """The lengths this card has ok probes of in the groups that differ from ``group`` by their
        sequence length alone, sorted."""
        if "lengths" not in self._offsets:
            index: dict[tuple, set] = defaultdict(set)
            for g, by in self.by_group.items():
                if g.seq_len:
                    for card in by:
                        index[(card, g._replace(seq_len=None))].add(g.seq_len)
            self._offsets["lengths"] = {k: sorted(v) for k, v in index.items()}
        return self._offsets["lengths"].get((gpu, group._replace(seq_len=None)), [])

    def model_lengths(self, gpu: str, model: Optional[str], quant: str, fixes: str) -> set[int]:
        """The lengths this card has ok probes of for a model (by short name), quant and fixes."""
        if "model_lengths" not in self._offsets:
            index: dict[tuple, set] = defaultdict(set)
            for g, by in self.by_group.items():
                if g.seq_len:
                    for card in by:
                        index[(card, model_name(g.model), g.quant, g.fixes)].add(g.seq_len)
            self._offsets["model_lengths"] = dict(index)
        return self._offsets["model_lengths"].get((gpu, model_name(model), quant, fixes), set())

    def observed(self, gpu: str, group: tuple) -> dict[int, Measurement]:
        """Probes of this card and group that ran to an outcome (ok, oom or spilled), by rank."""
        if self._root is not None:
            out = self._root.observed(gpu, group)
            if any(m.id in self._excluded for m in out.values()):  # a removed row may hide another
                out = {}
                for m in self._root._observed_rows.get((gpu, group), []):
                    if m.id not in self._excluded:
                        out[m.lora.rank] = m
            return out
        if self._observed is None:
            self._observed = defaultdict(dict)
            self._observed_rows: dict[tuple, list[Measurement]] = defaultdict(list)
            for m in self.probes:
                if m.outcome.status in ("ok", "oom", "spilled"):
                    self._observed[(m.gpu, group_key(m))][m.lora.rank] = m
                    self._observed_rows[(m.gpu, group_key(m))].append(m)
        return self._observed.get((gpu, group), {})

    def offset(self, gpu: str, other: str) -> float:
        """Median difference of this card's peaks over another's at the same group and rank
        (allocator and library versions differ a little); 0 when they share no row."""
        if (gpu, other) not in self._offsets:
            diffs = self._diff_list(gpu, other)
            self._offsets[(gpu, other)] = statistics.median(diffs) if diffs else 0.0
        return self._offsets[(gpu, other)]

    def _diff_list(self, gpu: str, other: str) -> list[float]:
        """This model's differences of the two cards' peaks at shared group and rank, sorted: the
        root's, a view's made from them with the groups it changed swapped."""
        if self._root is None:
            return self._sorted_diffs(gpu, other)
        key = ("list", gpu, other)
        if key not in self._offsets:
            root = self._root
            changed = [(root._diffs(g, gpu, other), self._diffs(g, gpu, other)) for g in self._touched]
            if all(was == now for was, now in changed):  # the root's list itself (a held-out shift reads it)
                diffs = root._sorted_diffs(gpu, other)
            else:
                diffs = list(root._sorted_diffs(gpu, other))
                for was, now in changed:
                    for d in was:
                        del diffs[bisect_left(diffs, d)]
                    for d in now:
                        insort(diffs, d)
            self._offsets[key] = diffs
        return self._offsets[key]

    def own_held_out(self, m: Measurement, rank: int) -> tuple[bool, bool, Optional[float]]:
        """(the card keeps rows of the group, answered, figure) of ``self.without([m.id]).predict(m.gpu,
        group, rank)`` without making that model: its card's other rows of the group. Not answered
        (False) where they have one rank (that model's pooled slope would be needed). It reads the
        cell's rows alone: where this model left none of them out, the answer is the root's, made
        once for every held-out model that asks it."""
        root = self.root
        cell = (group_key(m), m.gpu)
        if cell not in self._cells_left_out():
            key = ("own", m.id, rank)
            found = root._held.get(key)
            if found is None:
                found = root._held[key] = root._own_held_out(cell, frozenset((m.id,)), rank)
            return found
        return root._own_held_out(cell, self._excluded | {m.id}, rank)

    def _own_held_out(self, cell: tuple, gone: frozenset, rank: int) -> tuple[bool, bool, Optional[float]]:
        rows = _best([r for r in self._cells.get(cell, ()) if r[2] not in gone])
        if not rows:
            return False, True, None
        if len(rows) < 2:
            return True, False, None
        return True, True, _from_rows(rows, rank, None)[0]

    def _cells_left_out(self) -> set:
        """The (group, card) cells holding a row this model leaves out."""
        if self._root is None:
            return set()
        if "cells left out" not in self._offsets:
            cell_of = self._root._cell_of
            self._offsets["cells left out"] = {cell_of[i] for i in self._excluded if i in cell_of}
        return self._offsets["cells left out"]

    def transfer_held_out(self, gpu: str, group: tuple, rank: int) -> tuple[bool, Optional[float]]:
        """(answered, figure) of ``self.without(every row of this card and group).predict(gpu, group,
        rank)``: the other cards' rows of the group, shifted by the offsets that model has, without
        making it (the held-out widths ask this once per probe). Not answered (False) where that
        model would need its pooled slope (the borrowed rows have one rank)."""
        rows_by_gpu = {g: r for g, r in self.by_group.get(group, {}).items() if g != gpu}
        if not rows_by_gpu:
            return True, None
        root = self.root
        own_rows = self._root is None or group not in self._touched  # this model's rows of the group are the root's
        shifts = tuple(self._shift_less_cell(gpu, other, group, own_rows) for other in sorted(rows_by_gpu))
        # The figure reads the group's rows and the shifts alone: where this model's rows of the
        # group are the root's, an answer the root made for the same shifts is this one.
        key = ("transfer", gpu, group, rank, shifts) if own_rows else None
        found = root._held.get(key) if key is not None else None
        if found is None:
            # The shifted rows and their slope, the same for every rank this model asks of the cell.
            cell = self._offsets.get(("transfer rows", gpu, group))
            if cell is None:
                rows = []
                for other, shift in zip(sorted(rows_by_gpu), shifts):
                    rows += [(x, round(y + shift, 1), i) for x, y, i in rows_by_gpu[other]]
                slope = fit_slope([(x, y) for x, y, _ in rows]) if len({x for x, _, _ in rows}) >= 2 else None
                cell = self._offsets[("transfer rows", gpu, group)] = (rows, slope)
            rows, slope = cell
            found = (False, None) if slope is None else (True, _from_rows(rows, rank, None, slope)[0])
            if key is not None:
                root._held[key] = found
        return found

    def held_out_changes(self) -> tuple[set, bool]:
        """What this view changed of what the held-out answers of its probes read, against its
        root: the (card, group) cells whose answers may differ (``own_held_out`` reads the probe's
        cell; ``transfer_held_out`` the group's rows on the other cards and the shifts over them: so
        every cell of a group holding a row this view leaves out, and a cell whose shift over
        another card moved), and whether the pooled slope's terms changed (what an answer from one
        rank falls back on). A probe outside both is answered as the root answers it."""
        root = self._root
        if root is None:
            return set(), False
        moved = {(gpu, group) for group in self._touched for gpu in root.by_group.get(group, ())}
        for (gpu, other), groups in root._pair_groups().items():
            if self._diff_list(gpu, other) is root._diff_list(gpu, other):
                continue
            for group in groups:
                if group not in self._touched and (gpu, group) not in moved and \
                        self._shift_less_cell(gpu, other, group, True) != root._shift_less_cell(gpu, other, group, True):
                    moved.add((gpu, group))
        return moved, self.slope_moved()

    def slope_moved(self) -> bool:
        """Whether this view changed the pooled slope's terms (what an answer from one rank falls back on)."""
        return self._root is not None and self._slope_terms() is not self._root._slope_terms()

    def _pair_groups(self) -> dict[tuple, list[tuple]]:
        """(card, another card) -> the groups with rows on both (a transfer to the first card in
        such a group reads the shift over the second)."""
        if "pair groups" not in self._offsets:
            index: dict[tuple, list[tuple]] = defaultdict(list)
            for group, by in self.by_group.items():
                for gpu in by:
                    for other in by:
                        if other != gpu:
                            index[(gpu, other)].append(group)
            self._offsets["pair groups"] = dict(index)
        return self._offsets["pair groups"]

    def _shift_less_cell(self, gpu: str, other: str, group: tuple, own_rows: bool) -> float:
        """The median difference of ``gpu`` over ``other`` less ``gpu``'s cell of ``group`` (the
        shift a held-out transfer applies): the root's where this model's differences of the two
        cards and its rows of the group are the root's."""
        root = self.root
        diffs = self._diff_list(gpu, other)
        key = ("shift", gpu, other, group)
        if not own_rows or diffs is not root._diff_list(gpu, other):
            # This model's own (every probe of the cell asks it).
            if key not in self._offsets:
                self._offsets[key] = _median_less(diffs, self._diffs(group, gpu, other))
            return self._offsets[key]
        found = root._held.get(key)
        if found is None:
            found = root._held[key] = _median_less(diffs, root._diffs(group, gpu, other))
        return found

    def _diffs(self, group: tuple, gpu: str, other: str) -> list[float]:
        rows = self.by_group.get(group, {})
        mine = {x: y for x, y, _ in rows.get(gpu, [])}
        return [mine[x] - y for x, y, _ in rows.get(other, []) if x in mine]

    def _sorted_diffs(self, gpu: str, other: str) -> list[float]:
        key = ("sorted", gpu, other)
        if key not in self._offsets:
            self._offsets[key] = sorted(d for group in self.by_group for d in self._diffs(group, gpu, other))
        return self._offsets[key]

    def slope(self, gpu: str, quant: Optional[str]) -> Optional[float]:
        """MiB per rank: ``rank_slope`` of this card and quant, else of the quant, else of all."""
        if (gpu, quant) not in self._slopes:
            self._slopes[(gpu, quant)] = (self._pooled(gpu, quant) or self._pooled(None, quant)
                                          or self._pooled(None, None))
        return self._slopes[(gpu, quant)]

    def _pooled(self, gpu: Optional[str], quant: Optional[str]) -> Optional[float]:
        """``rank_slope(self.ms, gpu, quant)``, from each group's sums (the root's, those of the groups
        a view changed recomputed), added in the order rank_slope meets the groups."""
        terms = self._slope_terms()
        sxy = sxx = 0.0
        for pos, g, q, gxy, gxx in terms:
            if (gpu is None or g == gpu) and (quant is None or q == quant):
                sxy += gxy
                sxx += gxx
        return sxy / sxx if sxx else None

    def _slope_terms(self) -> list[tuple]:
        """(first position, card, quant, sxy, sxx) of each group with two ranks, in order."""
        if "terms" in self._slopes:
            return self._slopes["terms"]
        root = self.root
        if root is self:
            self._points: dict[tuple, list[tuple[float, float, str, int]]] = defaultdict(list)
            for pos, m in enumerate(self.probes):
                if ok_peak(m) is not None:
                    self._points[(m.gpu, *group_key(m))].append((float(m.lora.rank), ok_peak(m), m.id, pos))
            self._terms = {k: _term(k, pts) for k, pts in self._points.items()}
            self._point_keys: dict[tuple, list[tuple]] = defaultdict(list)  # a group's keys (one per card)
            self._point_ids = {k: frozenset(p[2] for p in pts) for k, pts in self._points.items()}
            for k in self._points:
                self._point_keys[tuple(k[1:])].append(k)
            terms = [t for t in self._terms.values() if t is not None]
        else:
            root_terms = root._slope_terms()
            changed = {}
            for group in self._touched:
                for k in root._point_keys.get(tuple(group), ()):
                    gone = root._point_ids[k] & self._excluded
                    if gone:
                        term = root._term_less(k, gone)
                        if term != root._terms[k]:
                            changed[k] = term
            if changed:
                terms = sorted((t for t in {**root._terms, **changed}.values() if t is not None), key=lambda t: t[0])
            else:  # the root's list itself: its slopes are this model's (``predict``)
                terms = root_terms
        self._slopes["terms"] = terms
        return terms

    def _term_less(self, k: tuple, gone: frozenset) -> Optional[tuple]:
        """A root's group term less some of its points, made once for every view that leaves them out."""
        key = ("term", k, gone)
        if key not in self._held:
            self._held[key] = _term(k, [p for p in self._points[k] if p[2] not in gone])
        return self._held[key]

    def _reads_roots(self, gpu: str, group: tuple) -> bool:
        """Whether this view's answer for a group it did not change is the root's: it reads the
        group's rows (the root's), the offsets of ``gpu`` over the cards it borrows from and the
        pooled slope, and each of those is the root's."""
        rows_by_gpu = self.by_group.get(group)
        if not rows_by_gpu:
            return True
        if len(rows_by_gpu.get(gpu, ())) >= 2:  # the card's own rows alone
            return True
        root = self._root
        if self.slope_moved():
            return False
        return gpu in rows_by_gpu or all(self._diff_list(gpu, o) is root._diff_list(gpu, o) for o in rows_by_gpu)

    @property
    def root(self) -> "PeakModel":
        """The model this one was made from by ``without`` (itself, if it was fitted on its rows)."""
        return self._root or self

    def answers_as_root(self, gpu: str, group: tuple) -> bool:
        """Whether ``predict(gpu, group, rank)`` is the root's at every rank."""
        return self._root is None or (group not in self._touched and self._reads_roots(gpu, group))

    def predict(self, gpu: str, group: tuple, rank: int) -> tuple[Optional[float], list[str]]:
        """(predicted peak, ids of the rows it rests on); (None, []) when unknown."""
        key = (gpu, group, rank)
        if key not in self._cache:
            if self._root is not None and group not in self._touched and self._reads_roots(gpu, group):
                # A group this view did not change, answered from what the root's answer reads.
                self._cache[key] = self._root.predict(gpu, group, rank)
            else:
                self._cache[key] = self._predict(gpu, group, rank)
        return self._cache[key]

    def _predict(self, gpu: str, group: tuple, rank: int) -> tuple[Optional[float], list[str]]:
        rows_by_gpu = self.by_group.get(group)
        if not rows_by_gpu:
            return None, []
        rows = rows_by_gpu.get(gpu)
        if not rows:  # borrow other cards' rows, shifted by how this card differs from them
            rows = []
            for other in sorted(rows_by_gpu):
                shift = self.offset(gpu, other)
                rows += [(x, round(y + shift, 1), i) for x, y, i in rows_by_gpu[other]]
        return _from_rows(rows, rank, lambda: self.slope(gpu, group[1]))

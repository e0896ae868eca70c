"""The peak model's held-out views: the model fitted on the same rows less some, made at the cost
of what the left-out rows touch rather than of the whole ledger (leave-one-out asks one per row,
the held-out widths one per probe).

**The invariant** (stated here once; ``tests/test_peaks.py`` holds every view to it on random
ledgers, and ``ledger.fit.ledger_fit.LedgerFit`` keeps it for the fits made from a base): a view
``model.without(ids)`` answers every question exactly as ``PeakModel([m for m in ms if m.id not in
ids])``, a fresh fit without those rows, would. A view shares its root's groups that no left-out
row is in, its root's sorted differences between cards (with the changed groups' swapped), its
root's pooled-slope terms (with the changed groups' remade), and the held-out answers every view
of the root asks alike (``_held``, keyed by everything they read).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from typing import Optional

from ledger.core.models import Measurement
from ledger.vocab.recipe import group_key

from .peak_rows import _best, _from_rows, _median_less, _term, fit_slope


class HeldOutViews:
    """A ``PeakModel``'s views less some rows and the held-out answers read off them without making
    a view (``own_held_out``, ``transfer_held_out``). Mixed into ``PeakModel``: it reads the model's
    cells (``_cells``, ``_cell_of``, ``by_group``), its differences (``_diffs``, ``_sorted_diffs``)
    and its caches (``_offsets``, ``_slopes``, ``_held``)."""

    @property
    def root(self) -> "HeldOutViews":
        """The model this one was made from by ``without`` (itself, if it was fitted on its rows)."""
        return self._root or self

    def without(self, ids) -> "HeldOutViews":
        """This model less the rows ``ids`` (see the class docstring)."""
        root = self.root
        excluded = self._excluded | frozenset(ids)
        view = object.__new__(type(self))
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

    def answers_as_root(self, gpu: str, group: tuple) -> bool:
        """Whether ``predict(gpu, group, rank)`` is the root's at every rank."""
        return self._root is None or (group not in self._touched and self._reads_roots(gpu, group))

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

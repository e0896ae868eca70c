"""The measured peaks of configurations: which rows are probes that fit, the ledger as it stood on
a date, and the peak model (a probe's peak allocated for a card, a recipe group and a rank, affine
in rank within a group, shifted from other cards by their median difference on shared rows)."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

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


def before(ms: list[Measurement], as_of: Optional[dt.date], exclude: Iterable[str] = ()) -> list[Measurement]:
    """The ledger as it stood on a date, less some rows (prospective or held-out fits)."""
    drop = set(exclude)
    return [m for m in ms if m.id not in drop and (as_of is None or m.provenance.measured_on is None
                                                    or m.provenance.measured_on <= as_of)]


# -- peaks of configurations --------------------------------------------------------------------


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


@dataclass
class PeakModel:
    """Predicts a probe's peak allocated for (card, group, rank) from ok probes."""

    ms: list[Measurement]

    def __post_init__(self) -> None:
        # Per group and card, the highest ok peak at each rank (repeats of a rank are one point).
        best: dict[tuple, dict[float, tuple[float, str]]] = defaultdict(dict)
        self.seqs: dict[tuple, set] = defaultdict(set)
        self.probes = probes(self.ms)
        for m in self.probes:
            if seq_len_of(m):
                self.seqs[(m.gpu, m.model, m.quant, fixes_key(m.memory_fixes))].add(seq_len_of(m))
            peak = ok_peak(m)
            if peak is not None:
                cell = best[(group_key(m), m.gpu)]
                rank = float(m.lora.rank)
                if rank not in cell or (peak, m.id) > cell[rank]:
                    cell[rank] = (peak, m.id)
        self.by_group: dict[tuple, dict[str, list[tuple[float, float, str]]]] = defaultdict(dict)
        for (group, gpu), cell in best.items():
            self.by_group[group][gpu] = [(x, y, i) for x, (y, i) in sorted(cell.items())]
        self._slopes: dict = {}
        self._cache: dict = {}
        self._observed: Optional[dict] = None
        self._offsets: dict = {}

    def observed(self, gpu: str, group: tuple) -> dict[int, Measurement]:
        """Probes of this card and group that ran to an outcome (ok, oom or spilled), by rank."""
        if self._observed is None:
            self._observed = defaultdict(dict)
            for m in self.probes:
                if m.outcome.status in ("ok", "oom", "spilled"):
                    self._observed[(m.gpu, group_key(m))][m.lora.rank] = m
        return self._observed.get((gpu, group), {})

    def offset(self, gpu: str, other: str) -> float:
        """Median difference of this card's peaks over another's at the same group and rank
        (allocator and library versions differ a little); 0 when they share no row."""
        if (gpu, other) in self._offsets:
            return self._offsets[(gpu, other)]
        diffs = []
        for rows in self.by_group.values():
            mine = {x: y for x, y, _ in rows.get(gpu, [])}
            for x, y, _ in rows.get(other, []):
                if x in mine:
                    diffs.append(mine[x] - y)
        self._offsets[(gpu, other)] = statistics.median(diffs) if diffs else 0.0
        return self._offsets[(gpu, other)]

    def slope(self, gpu: str, quant: Optional[str]) -> Optional[float]:
        if (gpu, quant) not in self._slopes:
            self._slopes[(gpu, quant)] = (rank_slope(self.ms, gpu, quant) or rank_slope(self.ms, None, quant)
                                          or rank_slope(self.ms))
        return self._slopes[(gpu, quant)]

    def predict(self, gpu: str, group: tuple, rank: int) -> tuple[Optional[float], list[str]]:
        """(predicted peak, ids of the rows it rests on); (None, []) when unknown."""
        key = (gpu, group, rank)
        if key not in self._cache:
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
        pts = [(x, y) for x, y, _ in rows]
        slope = fit_slope(pts) if len({x for x, _ in pts}) >= 2 else self.slope(gpu, group[1])
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

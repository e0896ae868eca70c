"""The arithmetic of a peak model's rows, shared by the fit (``peaks``) and its held-out views
(``held_out_views``): a cell's points one per rank, the least-squares slope, one group's share of
the pooled slope, a figure at a rank from a cell's rows, and a median less some values."""

from __future__ import annotations

import statistics
from bisect import bisect_right
from typing import Optional



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

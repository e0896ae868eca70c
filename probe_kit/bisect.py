"""The ceiling search both the sweep (real probes) and the dry run (fake tensors) use: the largest
point that fits in a list sorted by a monotone axis, confirm-first from a predicted start, else
bisection. No torch, no I/O: it only asks ``fits``."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

T = TypeVar("T")


def find_ceiling(points: Sequence[T], fits: Callable[[T], bool], start: Optional[int] = None) -> tuple[Optional[T], int]:
    """The largest point that fits, in points sorted by rank (monotone: a larger rank never uses
    less), and how many probes it took. With ``start`` (the index of the predicted ceiling), confirm
    first: probe it and the point above (2 probes when the prediction is right), then bisect only
    what the two left open. Plain bisection takes at most ceil(log2(len + 1)) <= ceil(log2(len)) + 1."""
    lo, hi, probes = -1, len(points), 0  # invariant: points[lo] fits (or lo = -1); points[hi] does not
    if start is not None and 0 <= start < len(points):
        probes += 1
        if fits(points[start]):
            lo = start
            if start + 1 < len(points):
                probes += 1
                if fits(points[start + 1]):
                    lo = start + 1
                else:
                    hi = start + 1
        else:
            hi = start
            if start > 0:
                probes += 1
                if fits(points[start - 1]):
                    lo = start - 1
                else:
                    hi = start - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes += 1
        if fits(points[mid]):
            lo = mid
        else:
            hi = mid
    return (points[lo] if lo >= 0 else None), probes

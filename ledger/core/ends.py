"""The arithmetic of an interval's ends, written once: every step an answer's figure passes through
(an interval around a figure, a shift, a factor, a floor, a widening), on one figure or on an array
of figures alike. ``Predictor.predict`` makes its ``Interval``s with these (``ledger.core.answers``:
``around``, ``shift``, ``scale``, ``widen``; ``ledger.fit.response_span``: the probe-to-real step,
the optimizer step's floor), and the fit table's fast path applies the same functions to arrays of
ranks (``ledger.answer.verdicts.judged_ends``): one derivation, vectorised, never re-derived.

Each result is rounded to 0.1 MiB as an ``Interval`` keeps its figures: ``round`` on a figure,
``round1`` (the same rounding, exactly) on an array.
"""

from __future__ import annotations

import numpy as np


def r1(x):
    """``round(x, 1)``, on a figure or (exactly as Python rounds each value) on an array."""
    return round1(x) if isinstance(x, np.ndarray) else round(x, 1)


def lower(x, width: float):
    """The low end ``width`` (a fraction) below ``x``."""
    return r1(x * (1 - width))


def upper(x, width: float):
    """The high end ``width`` (a fraction) above ``x``."""
    return r1(x * (1 + width))


def plus(x, mib):
    """``x`` shifted by ``mib``."""
    return r1(x + mib)


def times(x, factor):
    """``x`` times ``factor``."""
    return r1(x * factor)


def at_least(x, floor):
    """The higher of ``x`` and ``floor``; on arrays, an end that is nan (no figure) stays nan and a
    floor that is nan (none) leaves the end as it is."""
    if isinstance(x, np.ndarray) or isinstance(floor, np.ndarray):
        return np.where(np.isnan(x), x, np.fmax(x, floor))
    return max(x, floor)


def around(mib, width: float) -> tuple:
    """(low, high) ``width`` around ``mib``."""
    return lower(mib, width), upper(mib, width)


def calibrated(low, high, off, low_factor, high_factor) -> tuple:
    """A real run's ends from a probe's: its core (less ``off``, the kept logits a real run does not
    follow) times 1 - the over-estimate, each end by its own factor (``ProbeToReal.probe_to_real``)."""
    return times(plus(low, -off), low_factor), times(plus(high, -off), high_factor)


def floored(low, high, floor, width: float) -> tuple:
    """Each end the higher of it and the floor's interval (the optimizer step's floor,
    ``response_span.floored``)."""
    return at_least(low, lower(floor, width)), at_least(high, upper(floor, width))


def shifted(low, high, mib) -> tuple:
    """Both ends moved by ``mib`` (the optimizer's state)."""
    return plus(low, mib), plus(high, mib)


def widened(low, high, width: float) -> tuple:
    """Each end moved out by ``width`` (a fraction of it): a derived answer's widening."""
    return lower(low, width), upper(high, width)


def round1(x: np.ndarray) -> np.ndarray:
    """``round(v, 1)`` of each value, as Python rounds it (to the nearest tenth of the value's
    exact binary figure, ties to even): ``rint(10 v) / 10`` wherever 10 v is not within a
    millionth of a half (there the product's own rounding cannot change the tenth), and for the
    values that are (a remainder that is the median of two tenths puts a whole column there) the
    same rule in integers on each value's exact binary figure (``_round1_exact``). Exact for values
    below 2^33 / 10 (8.6e8) in size, where the product 10 v is within a millionth of the exact one
    (a MiB figure is far below)."""
    y = x * 10
    out = np.rint(y) / 10
    near = np.abs(y - np.floor(y) - 0.5) < 1e-6
    if near.any():
        flat, source = out.reshape(-1), x.reshape(-1)
        at = np.flatnonzero(near)
        flat[at] = _round1_exact(source[at])
    return out


def _round1_exact(v: np.ndarray) -> np.ndarray:
    """``round(v, 1)`` of each value, exactly: v is M x 2^-s for integers M (|M| < 2^53) and s,
    so 10 v lies k + r / 2^s above the integer k, and the tenth is k or k + 1 by comparing the
    remainder r with half of 2^s (ties to the even k); the tenth is then k / 10 correctly rounded,
    which is the double ``round`` gives (the nearest to the decimal it rounds to). A value whose s
    is outside 1..62 (below 2^-10 or above 2^52 in size) or whose k is past 2^53 goes to ``round``."""
    mant, exp = np.frexp(v)  # v = mant x 2^exp, 1/2 <= |mant| < 1
    shift = 53 - exp.astype(np.int64)
    ok = (shift >= 1) & (shift <= 62)
    s = np.where(ok, shift, 1)
    ten = np.abs(np.ldexp(mant, 53)).astype(np.int64) * 10  # < 10 x 2^53 < 2^57
    k = np.right_shift(ten, s)
    r = ten - np.left_shift(k, s)
    half = np.left_shift(np.int64(1), s - 1)
    k = k + ((r > half) | ((r == half) & (k % 2 == 1)))
    ok &= k < 2**53
    out = np.copysign(k / 10, v)
    for i in np.flatnonzero(~ok):
        out[i] = round(float(v[i]), 1)
    return out

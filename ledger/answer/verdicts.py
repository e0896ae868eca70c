"""A recipe's judged interval from its dry-run figure, the one derivation both ``Predictor.predict``
and the fit table's fast path (``rank_judge``) follow, and the verdict read off it.

``predict`` makes a training run's figure from a dry run in steps, each in the module that owns it:
the interval around the figure plus the card's remainder (``dry_calibration``), the probe-to-real
step where the probe/real pairs measured the recipe's fixes (``ProbeToReal.probe_to_real``), the
optimizer step's floor (``response_span.floored``), the optimizer's state
(``response_span.with_optimizer_state``), the widening of a derived answer (``answers.widen``). Each
step's arithmetic is one function of ``ledger.core.ends``. ``judged_ends`` applies those same
functions, in the same order, to one figure or to arrays of figures (a recipe at every rank of a
scan, every recipe of a fit-table row at once): the fast path vectorises the derivation and never
re-derives it. ``tests/test_predictor.py`` compares every cell of the fit table with ``vram
ceiling``'s scan, which asks ``predict`` itself; the verdict is ``answers.verdict_for``'s.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ledger.core import ends
from ledger.core.answers import verdict_for


def judged_ends(mib, width, wide: float, floor, add, over: Optional[tuple] = None, off=0.0, widened=0.0) -> tuple:
    """(low, high) of a recipe's judged interval from its dry-run figure ``mib`` (plus the card's
    remainder), on figures or arrays alike: ``width`` around it (the table's width: narrow at a rank
    dry-run exactly, ``wide`` at a derived one); through the pairs' over-estimate (``over``: the low
    and high factors, ``off`` the kept logits) where a calibrated real run is asked; each end at
    least the optimizer step's ``floor`` (None, or nan in an array, where there is none) with the
    derived width; plus ``add`` (the optimizer's state, 0 without); widened by ``widened``."""
    low, high = ends.around(mib, width)
    if over is not None:
        low, high = ends.calibrated(low, high, off, over[0], over[1])
    if floor is not None:
        low, high = ends.floored(low, high, floor, wide)
    low, high = ends.shifted(low, high, add)
    if np.any(widened):
        low, high = ends.widened(low, high, widened)
    return low, high


def verdict(low: Optional[float], high: Optional[float], limit_low: Optional[float], limit_high: Optional[float],
            margin_mib: float = 0.0) -> str:
    """The verdict of a judged interval against a card's limit: ``answers.verdict_for``'s rule
    (what ``predict`` judges with, and what the fast path's bisection over rising ends finds:
    "fits" while the top is at most the limit's low end, the scan stopped once the bottom is over
    its high end)."""
    return verdict_for(low, high, limit_low, limit_high, margin_mib)

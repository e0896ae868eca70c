"""Held-out answers: the one predictor fitted without one row, asked about that row. Leave-one-out
(``calibration_report``) and the scoreboard (``scoreboard``) ask the same questions of the same rows;
within ``shared_held_out()`` (the site build) each is computed once, and every predictor fitted
without a row starts from the one fitted on all of them (``Predictor(base=...)``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

from .answers import Answer, Run
from .models import Ledger, Measurement
from .predictor import Predictor
from .recipe import Recipe


class HeldOut:
    """Answers of predictors of ``ledger`` (less ``outside``) fitted without one row each."""

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement] = (), outside: Iterable[str] = ()):
        self.ledger, self.dry_runs, self.outside = ledger, list(dry_runs), list(outside)
        self.base = Predictor(ledger, self.dry_runs, exclude=self.outside)
        self._answers: dict[tuple, Answer] = {}

    def answer(self, m: Measurement, recipe: Recipe, run: Run = "probe") -> Answer:
        """The answer for ``recipe`` on the row's card from a predictor fitted without the row."""
        key = (m.id, recipe, run)
        if key not in self._answers:
            p = Predictor(self.ledger, self.dry_runs, exclude=[*self.outside, m.id], base=self.base)
            self._answers[key] = p.predict(recipe, m.gpu, run=run)
        return self._answers[key]


_SHARED: Optional[dict] = None


@contextmanager
def shared_held_out() -> Iterator[None]:
    """Within this block ``held_out`` hands every caller asking of the same ledger, dry runs and
    excluded rows the same ``HeldOut``, so its answers are computed once. The ledger must not change."""
    global _SHARED
    outer = _SHARED
    if outer is None:
        _SHARED = {}
    try:
        yield
    finally:
        if outer is None:
            _SHARED = None


def held_out(ledger: Ledger, dry_runs: Iterable[Measurement] = (), outside: Iterable[str] = ()) -> HeldOut:
    dry_runs, outside = list(dry_runs), list(outside)
    if _SHARED is None:
        return HeldOut(ledger, dry_runs, outside)
    key = (id(ledger), tuple(d.id for d in dry_runs), tuple(outside))
    hit = _SHARED.get(key)
    if hit is None or hit.ledger is not ledger:
        hit = _SHARED[key] = HeldOut(ledger, dry_runs, outside)
    return hit

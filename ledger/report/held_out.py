"""The predictors a build shares, and held-out answers: the one predictor fitted without one row,
asked about that row. The calibration report, the scoreboard and the fit table each need the
predictor of the whole ledger, and leave-one-out (``calibration_report``) and the scoreboard
(``scoreboard``) ask the same held-out questions of the same rows; within ``shared_held_out()``
(the site build) each predictor and each answer is computed once, and every predictor fitted
without a row starts from the one fitted on all of them (``Predictor(base=...)``)."""

from __future__ import annotations

import datetime as dt
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

from ledger.core.answers import Answer, Run
from ledger.core.models import Ledger, Measurement
from ledger.answer.predictor import Predictor
from ledger.vocab.recipe import Recipe


class HeldOut:
    """Answers of predictors of ``ledger`` (less ``outside``) fitted without one row each."""

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement] = (), outside: Iterable[str] = ()):
        self.ledger, self.dry_runs, self.outside = ledger, list(dry_runs), list(outside)
        self.base = shared_predictor(ledger, self.dry_runs, exclude=self.outside)
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


def _shared(kind: str, ledger: Ledger, dry_runs: list[Measurement], extra: tuple, make):
    if _SHARED is None:
        return make()
    key = (kind, id(ledger), tuple(d.id for d in dry_runs), extra)
    hit = _SHARED.get(key)
    if hit is None or hit[0] is not ledger:
        hit = _SHARED[key] = (ledger, make())  # the ledger is held, so its id is not reused meanwhile
    return hit[1]


def held_out(ledger: Ledger, dry_runs: Iterable[Measurement] = (), outside: Iterable[str] = ()) -> HeldOut:
    """The held-out answers of ``ledger`` less ``outside`` (one shared object within ``shared_held_out``)."""
    dry_runs, outside = list(dry_runs), list(outside)
    return _shared("held out", ledger, dry_runs, tuple(outside), lambda: HeldOut(ledger, dry_runs, outside))


def shared_predictor(ledger: Ledger, dry_runs: Iterable[Measurement] = (), as_of: Optional[dt.date] = None,
                     exclude: Iterable[str] = ()) -> Predictor:
    """``Predictor(ledger, dry_runs, as_of, exclude)``, one shared object within ``shared_held_out``."""
    dry_runs, exclude = list(dry_runs), sorted(set(exclude))
    return _shared("predictor", ledger, dry_runs, (as_of, tuple(exclude)),
                   lambda: Predictor(ledger, dry_runs, as_of=as_of, exclude=exclude))

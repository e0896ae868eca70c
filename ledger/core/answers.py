"""The one typed answer to "will it fit?" and its parts: intervals in MiB, the verdict rule.
Every rung, the combiner, the ceiling search and every command speak these types."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from . import ends
from .results import maker

Verdict = Literal["fits", "tight", "won't fit", "unknown"]
Run = Literal["probe", "real"]
METHODS = ("measured real run", "measured probe", "interpolated", "dry run", "transferred",
           "bounded by measured rows")


class Interval(BaseModel):
    """A predicted figure in MiB: the point and the interval around it (None: no bound that side)."""

    model_config = ConfigDict(extra="forbid")
    mib: Optional[float]
    low_mib: Optional[float]
    high_mib: Optional[float]


_interval = maker(Interval)


def interval(mib: Optional[float], low: Optional[float], high: Optional[float]) -> Interval:
    """An interval of figures this project computed, each rounded to 0.1 MiB (made without
    re-validating: a ceiling's scan makes tens of thousands of these)."""
    r = lambda x: None if x is None else float(round(x, 1))  # noqa: E731
    return _interval({"mib": r(mib), "low_mib": r(low), "high_mib": r(high)})


def around(mib: float, width: float) -> Interval:
    """``mib`` with a relative interval of +-``width`` (a fraction); each step's arithmetic here is
    ``ledger.core.ends``', which the fit table's fast path applies to arrays."""
    return interval(mib, *ends.around(mib, width))


def shift(iv: Interval, mib: float) -> Interval:
    return interval(*(None if v is None else ends.plus(v, mib) for v in (iv.mib, iv.low_mib, iv.high_mib)))


def widen(iv: Optional[Interval], width: float) -> Optional[Interval]:
    """The interval with each end moved out by ``width`` (a fraction of it)."""
    if iv is None:
        return None
    return interval(iv.mib, None if iv.low_mib is None else ends.lower(iv.low_mib, width),
                    None if iv.high_mib is None else ends.upper(iv.high_mib, width))


def scale(iv: Interval, factor: float, low_factor: float, high_factor: float) -> Interval:
    return interval(None if iv.mib is None else ends.times(iv.mib, factor),
                    None if iv.low_mib is None else ends.times(iv.low_mib, low_factor),
                    None if iv.high_mib is None else ends.times(iv.high_mib, high_factor))


class Answer(BaseModel):
    """The one typed answer: peaks (allocated and reserved, probe and real, each an interval), the
    method and evidence, the limit it was judged against, and the verdict."""

    model_config = ConfigDict(extra="forbid")
    gpu: str
    card_source: Literal["ledger", "card table", "budget"]
    recipe: dict
    run: Run
    probe_allocated: Optional[Interval]
    real_allocated: Optional[Interval]
    reserved: Optional[Interval]
    method: Optional[str]
    method_text: str
    evidence: list[str]
    limit_low_mib: Optional[float]
    limit_high_mib: Optional[float]
    limit_source: str
    margin_mib: float
    verdict: Verdict
    why: str

    @property
    def allocated(self) -> Optional[Interval]:
        """The judged figure: the real run's for a real run, else the probe's."""
        return self.real_allocated if self.run == "real" else self.probe_allocated


class CeilingAnswer(BaseModel):
    """The largest rank that fits and that is tight, with the answers at the ranks searched."""

    model_config = ConfigDict(extra="forbid")
    gpu: str
    run: Run
    seq_len: Optional[int]
    fits_rank: Optional[int]
    tight_rank: Optional[int]
    status: Literal["ok", "none-fits", "unknown"]
    step: int
    max_rank: int
    at_least: bool
    note: str
    limit_low_mib: Optional[float]
    limit_high_mib: Optional[float]
    margin_mib: float
    ranks: list[dict]


class LengthCeiling(BaseModel):
    """The longest sequence (a multiple of a step) that fits and that is tight at one rank, with
    the answers at the lengths where the verdict changes."""

    model_config = ConfigDict(extra="forbid")
    gpu: str
    run: Run
    rank: int
    fits_len: Optional[int]
    tight_len: Optional[int]
    status: Literal["ok", "none-fits", "unknown"]
    step: int
    max_len: int
    at_least: bool
    #: The shortest length searched with no answer above the last answered one (no dry-run rows
    #: reach it yet), or None.
    unknown_from: Optional[int]
    note: str
    limit_low_mib: Optional[float]
    limit_high_mib: Optional[float]
    margin_mib: float
    lengths: list[dict]


def verdict_for(bottom: Optional[float], top: Optional[float], low: Optional[float], high: Optional[float],
                margin: float) -> Verdict:
    """The verdict alone for a predicted interval (bottom, top) against a limit (low, high): the
    rule ``decide`` explains."""
    if top is None and bottom is None:
        return "unknown"
    if low is None:
        return "unknown"
    if top is not None and top <= low - margin:
        return "fits"
    if bottom is not None and bottom > (high if high is not None else low) - margin:
        return "won't fit"
    return "tight"


def decide(iv: Optional[Interval], low: Optional[float], high: Optional[float], margin: float) -> tuple[Verdict, str]:
    """The verdict for a predicted interval against a limit interval, leaning safe."""
    verdict = verdict_for(None if iv is None else iv.low_mib, None if iv is None else iv.high_mib, low, high, margin)
    if iv is None or (iv.high_mib is None and iv.low_mib is None):
        return verdict, "no prediction: nothing measured or dry-run near this recipe"
    if verdict == "unknown":
        return verdict, "no limit known for this card: give --budget-mib"
    top = iv.high_mib
    if verdict == "fits":
        return "fits", (f"the interval's top, {top} MiB, is at most the limit's low end {low} MiB"
                        + (f" less the {margin} MiB margin" if margin else ""))
    if verdict == "won't fit":
        return "won't fit", (f"even the interval's bottom, {iv.low_mib} MiB, is over the limit's high end "
                             f"{high if high is not None else low} MiB" + (f" less the {margin} MiB margin" if margin else ""))
    if top is None:
        return "tight", f"only a lower bound is known ({iv.low_mib} MiB), under the limit's high end {high} MiB"
    span = f"the interval {iv.low_mib}–{top} MiB" if iv.low_mib is not None else f"the figure's upper bound {top} MiB"
    return "tight", (f"{span} reaches past the limit's low end {low} MiB"
                     + (f" less the {margin} MiB margin" if margin else ""))

"""What preflight concluded: the verdict against what was available, and the report (``preflight``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .step import Step

#: Share of the available memory a "fits" must leave free (fragmentation over a long run, other
#: processes): a policy, stated in every verdict line, not a measured figure.
DEFAULT_MARGIN = 0.05


# -- the verdict ---------------------------------------------------------------------------------


@dataclass
class Alternative:
    """A recipe near the run's, measured: what to change, and its step."""

    changes: list[str]
    step: Step
    headroom_mib: Optional[float]


@dataclass
class PreflightResult:
    """What preflight measured and concluded."""

    verdict: str  # fits | tight | won't fit | unknown
    recipe: str
    worst: str
    step: Step
    available_mib: Optional[float]
    available_source: str
    margin_mib: Optional[float]
    headroom_mib: Optional[float]
    meter: str
    ledger_answer: Optional[str] = None
    alternative: Optional[Alternative] = None
    tried: list[Alternative] = field(default_factory=list)
    advice: Optional[str] = None
    time_at_risk: Optional[str] = None
    recorded: Optional[str] = None
    #: Why a measurement asked to be recorded was not (a recipe the ledger has no name for).
    not_recorded: Optional[str] = None
    #: A run on several GPUs: its processes, their strategy, and every rank's peak allocated (the
    #: step judged is the worst rank's).
    world: int = 1
    strategy: Optional[str] = None
    rank_peaks_mib: list = field(default_factory=list)

    def line(self) -> str:
        """One verdict line, with the headroom in MiB."""
        s = self.step
        peak = (f"peak {s.peak_reserved_mib:,.1f} MiB reserved ({s.peak_allocated_mib:,.1f} MiB allocated)"
                if s.peak_reserved_mib is not None else
                f"peak {s.peak_allocated_mib:,.1f} MiB allocated" if s.peak_allocated_mib is not None
                else f"out of memory ({s.oom})")
        room = (f", {self.headroom_mib:+,.1f} MiB headroom of {self.available_mib:,.1f} MiB "
                f"({self.available_source})" if self.headroom_mib is not None else
                f" ({self.available_source})")
        return f"preflight: {self.verdict.upper()}: {self.recipe}, worst batch {self.worst}: {peak}{room}"

    def report(self) -> str:
        lines = [self.line()]
        if self.margin_mib is not None and self.verdict in ("fits", "tight"):
            lines.append(f"  fits needs {self.margin_mib:,.1f} MiB left ({DEFAULT_MARGIN:.0%} of what was available, "
                         "for fragmentation over a long run and other processes)")
        if self.world > 1:
            peaks = ", ".join("OOM" if p is None else f"{p:,.1f}" for p in self.rank_peaks_mib)
            lines.append(f"  judged as the worst of {self.world} ranks ({self.strategy}); each rank's peak allocated: "
                         f"{peaks} MiB")
        if self.ledger_answer:
            lines.append(f"  ledger: {self.ledger_answer}")
        if self.verdict == "won't fit":
            if self.alternative is not None:
                a = self.alternative
                lines.append(f"  nearest recipe that fits (measured the same way): {', '.join(a.changes)}: "
                             f"peak {_peak_text(a.step)}, {a.headroom_mib:+,.1f} MiB headroom")
            else:
                tried = "; ".join(", ".join(a.changes) for a in self.tried) or "nothing smaller to try"
                lines.append(f"  no nearby recipe fits (tried: {tried})")
            if self.advice:
                lines.append(f"  {self.advice}")
            if self.time_at_risk:
                lines.append(f"  {self.time_at_risk}")
        if self.recorded:
            lines.append(f"  recorded as {self.recorded}")
        if self.not_recorded:
            lines.append(f"  not recorded: {self.not_recorded}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _peak_text(s: Step) -> str:
    if s.peak_reserved_mib is not None:
        return f"{s.peak_reserved_mib:,.1f} MiB reserved"
    return f"{s.peak_allocated_mib:,.1f} MiB allocated"


def _judged(s: Step) -> Optional[float]:
    """The figure an OOM is decided by: reserved where the allocator reports it."""
    return s.peak_reserved_mib if s.peak_reserved_mib is not None else s.peak_allocated_mib


def _verdict(s: Step, available: Optional[float], margin: Optional[float]) -> tuple[str, Optional[float]]:
    if s.oom is not None:
        return "won't fit", None
    if available is None:
        return "unknown", None
    headroom = round(available - _judged(s), 1)
    if headroom < 0:
        return "won't fit", headroom
    return ("fits" if headroom >= (margin or 0) else "tight"), headroom




class PreflightFailed(RuntimeError):
    """The run's worst batch does not fit: raised before the first training step."""

    def __init__(self, result: "PreflightResult"):
        super().__init__(result.report())
        self.result = result

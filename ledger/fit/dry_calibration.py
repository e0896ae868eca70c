"""The dry run, calibrated: what fake tensors cannot see (workspaces, allocator and context
differences) fitted as a remainder from pairs of measured probes and dry runs of the same recipe,
per card, else per vendor, else over all cards, with its leave-one-out error as the interval."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from functools import cached_property
from typing import Optional

from ledger.core.answers import Interval, around
from .peaks import probes, ok_peak
from .dry_table import DryTable, kind_of
from .ledger_fit import LedgerFit
from ledger.vocab.model_configs import model_name
from ledger.core.models import Measurement, SimulatedAllocator
from ledger.vocab.recipe import Recipe, fixes_key


def median_without(values: list[float], drop: list[float]) -> float:
    """``statistics.median`` of sorted ``values`` less one occurrence of each of ``drop`` (sorted,
    each in ``values``), without copying the list: a leave-one-out median in O(log n)."""
    gone, last, count = [], None, 0
    for v in drop:
        count = count + 1 if v == last else 0
        gone.append(bisect_left(values, v) + count)
        last = v
    gone.sort()

    def kth(k: int) -> float:
        j = k
        for g in gone:
            if g <= j:
                j += 1
        return values[j]

    n = len(values) - len(gone)
    if n % 2:
        return kth(n // 2)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2


def simulated_reserved(sim: SimulatedAllocator, allocated_mib: float) -> float:
    """The peak reserved of a step predicted to peak at ``allocated_mib`` allocated, from its dry
    run's simulation (``outcome.allocator``: nothing held): what the prediction holds beyond the
    simulation's own peak allocated (a card's remainder) is held through the step. A block above
    10 MiB gets a segment of its own, its size rounded up to 2 MiB, so the step's other blocks are
    placed as they were (but for what fits the under-2-MiB tail of that segment) and the peak grows
    by that segment; below 10 MiB, a 20 MiB segment the step's blocks may share (within 20 MiB).
    Memory the tracker over-counted (a negative remainder) is taken off as it is.
    ``tests/test_allocator.py`` checks this against the replay with the block held."""
    held_mib = allocated_mib - sim.peak_allocated_mib
    if held_mib <= 0:
        return sim.peak_reserved_mib + held_mib
    return sim.peak_reserved_mib + math.ceil(held_mib / 2) * 2


class DryCalibration:
    """The remainder and width a dry run is calibrated with on one ledger."""

    def __init__(self, fit: LedgerFit, table: DryTable):
        self.fit = fit
        self.table = table
        self._remainders: dict = {}
        self._scopes: dict = {}
        self._fractions: dict = {}

    @cached_property
    def pairs(self) -> list[tuple[Measurement, float, float]]:
        """(measured ok probe, its peak, the dry run of the same recipe) for every probe that has one."""
        return [(m, peak, d.outcome.peak_allocated_mib) for m, peak, d in self.pair_rows]

    @cached_property
    def pair_rows(self) -> list[tuple[Measurement, float, Measurement]]:
        """``pairs`` with the dry-run row itself (its simulated allocator, ``outcome.allocator``)."""
        index: dict[tuple, Measurement] = {}
        for d in self.fit.dry:
            if d.gradient_checkpointing is False:  # the probes all have it on
                continue
            index[(model_name(d.model), d.quant, d.lora.rank, bool(d.lora.dropout), bool(d.lora.dora), d.seq_len,
                   d.response_len, fixes_key(d.memory_fixes))] = d
        out = []
        for m in probes(self.fit.ms):
            peak = ok_peak(m)
            if peak is None or not m.seq_len or not m.response_len:
                continue
            key = (model_name(m.model), m.quant, m.lora.rank, bool(m.lora.dropout), bool(m.lora.dora), m.seq_len,
                   m.response_len, fixes_key(m.memory_fixes))
            if key in index:
                out.append((m, peak, index[key]))
        return out

    def remainder(self, gpu: str, vendor: Optional[str], leave_out: str = "") -> tuple[Optional[float], str]:
        """MiB to add to a dry run for this card: the median of measured - dry run over the card's
        pairs (at least two), else its vendor's, else all pairs."""
        key = (gpu, vendor, leave_out)
        if key not in self._remainders:
            self._remainders[key] = self._remainder(gpu, vendor, leave_out)
        return self._remainders[key]

    def _remainder(self, gpu: str, vendor: Optional[str], leave_out: str) -> tuple[Optional[float], str]:
        left = self._differences_of.get(leave_out, [])  # the pairs left out, as (card, difference)
        for scope, ok in ((gpu, lambda g: g == gpu),
                          (f"{vendor} cards", lambda g: bool(vendor) and self.fit.vendor(g) == vendor),
                          ("all cards", lambda g: True)):
            key = ("card", gpu) if scope == gpu else ("vendor", vendor) if scope != "all cards" else ("all",)
            diffs = self._sorted_differences(key, ok)
            drop = sorted(x for g, x in left if ok(g))
            n = len(diffs) - len(drop)
            if n >= 2:
                return median_without(diffs, drop), f"{scope} ({n} pairs)"
        return None, "no measured probe has a dry run"

    def _sorted_differences(self, key: tuple, ok) -> list[float]:
        """measured - dry run over the pairs of a scope, sorted (computed once per scope; a card's
        from its own pairs, not a pass over every pair per card: a build asks all 38 cards')."""
        if key not in self._scopes:
            if key[0] == "card":
                self._scopes[key] = sorted(self._differences_by_card.get(key[1], ()))
            else:
                self._scopes[key] = sorted(p - d for m, p, d in self.pairs if ok(m.gpu))
        return self._scopes[key]

    @cached_property
    def _differences_by_card(self) -> dict[str, list[float]]:
        """measured - dry run of each card's pairs, in the pairs' order."""
        out: dict[str, list[float]] = {}
        for m, p, d in self.pairs:
            out.setdefault(m.gpu, []).append(p - d)
        return out

    @cached_property
    def _differences_of(self) -> dict[str, list[tuple[str, float]]]:
        out: dict[str, list[tuple[str, float]]] = {}
        for m, p, d in self.pairs:
            out.setdefault(m.id, []).append((m.gpu, p - d))
        return out

    @cached_property
    def loo(self) -> dict:
        """Leave-one-out errors of the calibrated dry run over its pairs (signed %, by row); where
        the dry run's row has the allocator simulated, the peak reserved that gives with the
        card's leave-one-out remainder held (``simulated_reserved``)."""
        rows = []
        for m, peak, d in self.pair_rows:
            dry = d.outcome.peak_allocated_mib
            rem, _ = self.remainder(m.gpu, self.fit.vendor(m.gpu), leave_out=m.id)
            if rem is None:
                continue
            sim = d.outcome.allocator
            rows.append({"id": m.id, "gpu": m.gpu, "measured_mib": peak, "dry_run_mib": round(dry, 1),
                         "predicted_mib": round(dry + rem, 1), "error_pct": round((dry + rem - peak) / peak * 100, 2),
                         "simulated_reserved_mib": None if sim is None else round(simulated_reserved(sim, dry + rem), 1)})
        errs = [abs(r["error_pct"]) for r in rows]
        return {"rows": rows, "n": len(rows), "median_abs_err_pct": round(statistics.median(errs), 2) if errs else None,
                "max_abs_err_pct": round(max(errs), 2) if errs else None}

    def width_fraction(self, derived: bool, recipe: Optional[Recipe] = None) -> float:
        """The interval's half-width, as a fraction (``width``'s figure, remembered per kind of
        derivation)."""
        key = (derived, kind_of(recipe) if derived and recipe is not None else None)
        if key not in self._fractions:
            self._fractions[key] = self.width(recipe if derived else None, derived)[0]
        return self._fractions[key]

    def width(self, recipe: Optional[Recipe], derived: bool) -> tuple[float, str]:
        width = (self.loo["max_abs_err_pct"] or 0.0) / 100
        text = f"±{width * 100:.2f}% (the largest leave-one-out error over {self.loo['n']} measured probes)"
        extra, n, kind = self.table.derivation_pct(recipe) if derived else (None, 0, None)
        if extra:
            width += extra / 100
            of = f"the {n} dry runs of its kind ({kind})" if kind else f"the {n} dry runs"
            text = (f"±{width * 100:.2f}%: {text[1:]} + {extra:.2f}% (the largest error of deriving, from the "
                    f"others, {of} the grid does not need; this figure is derived, not dry-run itself)")
        return width, text

    def calibrated(self, recipe: Recipe, gpu: str, vendor: Optional[str]) -> Optional[tuple[Interval, list[str], str]]:
        raw, ids = self.table.raw(recipe)
        if raw is None:
            return None
        rem, scope = self.remainder(gpu, vendor)
        if rem is None:
            rem, scope = 0.0, "no remainder fitted (no measured probe has a dry run): raw dry run"
        width, wtext = self.width(recipe, not self.table.exact(recipe))
        mib = raw + rem
        text = (f"dry run {raw:.1f} MiB + remainder {rem:+.1f} MiB fitted on {scope}; interval {wtext}"
                + self.family_note(recipe))
        return around(mib, width), ids, text

    @cached_property
    def fitted_on(self) -> list[str]:
        """Models whose measured probes the dry run's remainder is fitted on."""
        return sorted({model_name(m.model) for m, _, _ in self.pairs})

    def family_note(self, recipe: Recipe) -> str:
        """Says so when the remainder and its error come from another model's measured rows."""
        fitted = self.fitted_on
        if not fitted or model_name(recipe.model) in fitted:
            return ""
        return (f"; the remainder and its error are measured on {', '.join(fitted)} only, not on "
                f"{model_name(recipe.model)}")

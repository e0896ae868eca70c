"""Each card's effective limit for peak allocated: measured on the ledger's cards (the largest peak
that fit and the smallest that did not, ``ledger.fit.calibration.limits``), derived for a card of the
card table (its usable memory less the CUDA context, over the reserved/allocated ratio, both
measured on the ledger's cards), and the reserved/allocated ratio a peak reserved is scaled by."""

from __future__ import annotations

import statistics
from functools import cached_property
from typing import Literal, Optional

from .calibration import Limit
from ledger.vocab.cards import UNIFIED_NOTE, MPS_WORKING_SET, derives_usable, is_mac, mps_working_set_mib, usable_ratio
from .ledger_fit import LedgerFit
from ledger.core.models import Gpu
from ledger.vocab.recipe import capacity_mib

Run = Literal["probe", "real"]


class CardLimits:
    """The limits of one ledger's cards, and of the card table's by derivation."""

    def __init__(self, fit: LedgerFit, base: Optional["CardLimits"] = None):
        """``base``: the limits of the fit ``fit`` was started from (leave-one-out), whose
        reserved/allocated ratios this one shares where the rows it leaves out do not enter them."""
        self.fit = fit
        self.base = base if base is not None and fit.base is not None and fit.base is base.fit else None
        self._limits: dict = {}
        self._ratios: dict = {}

    def card_limit(self, gpu: str, entry: Optional[Gpu], run: Run) -> tuple[Optional[float], Optional[float], str]:
        """(low, high, where from) of the effective limit for peak allocated."""
        key = (gpu, None if entry is None else (entry.name, entry.total_mib, entry.usable_gib_torch), run)
        if key not in self._limits:
            self._limits[key] = self._card_limit(gpu, entry, run)
        return self._limits[key]

    def _card_limit(self, gpu: str, entry: Optional[Gpu], run: Run) -> tuple[Optional[float], Optional[float], str]:
        lim: Optional[Limit] = None
        if gpu in self.fit.ledger.gpus:
            lim = (self.fit.limit(gpu, "real") if run == "real" else None) or self.fit.limit(gpu, "probe")
        if lim is not None and lim.low_mib is not None:
            return lim.low_mib, lim.high_mib, (f"{gpu}'s {lim.kind} limit: largest peak that fit {lim.low_mib} MiB "
                                               f"({lim.fit_id}), smallest that did not {lim.high_mib} MiB "
                                               f"({lim.exceeded_id or 'the card'})")
        if is_mac(entry) and entry.total_mib:
            return self._mac_limit(entry)
        usable = capacity_mib(entry)
        if usable is None:
            return None, None, "no limit known for this card: give --budget-mib"
        d = self.derive_rule()
        if d is None:
            return None, None, f"no measured card to derive {gpu}'s limit from: give --budget-mib"
        low_usable, high_usable, basis = _usable(entry, usable)
        low = (low_usable - d["context_high_mib"]) / d["ratio_high"]
        high = (high_usable - d["context_low_mib"]) / d["ratio_low"]
        return round(low, 1), round(min(high, high_usable), 1), (
            f"{basis} less the CUDA context ({d['context_low_mib']:.0f}–{d['context_high_mib']:.0f} MiB), over "
            f"reserved/allocated ({d['ratio_low']:.3f}–{d['ratio_high']:.3f}), as measured on "
            f"{', '.join(self.overheads['cards'])}")

    def free_for_pytorch(self, gpu: str, entry: Optional[Gpu]) -> tuple[Optional[float], Optional[float], str]:
        """(low, high, where from) of the memory a card leaves PyTorch's caching allocator: its
        usable memory (the card table's, or derived from its total) less the CUDA context measured
        on the ledger's cards (``derive_rule``): what a simulated OOM point is judged against. None
        ends on a Mac (the MPS allocator is not the CUDA one) or where nothing pins them."""
        if is_mac(entry):
            return None, None, f"{gpu} is a Mac: the MPS allocator is not CUDA's caching allocator"
        usable = capacity_mib(entry)
        d = self.derive_rule()
        if usable is None or d is None:
            return None, None, (f"no usable memory known for {gpu}" if usable is None
                                else "no measured card pins the CUDA context")
        low_usable, high_usable, basis = _usable(entry, usable)
        return (round(low_usable - d["context_high_mib"], 1), round(high_usable - d["context_low_mib"], 1),
                f"{basis} less the CUDA context ({d['context_low_mib']:.0f}–{d['context_high_mib']:.0f} MiB, as "
                f"measured on {', '.join(self.overheads['cards'])})")

    def _mac_limit(self, entry: Gpu) -> tuple[Optional[float], Optional[float], str]:
        """A Mac: Metal's recommended working set (``MPS_WORKING_SET`` of its unified memory), over
        the reserved/allocated ratio measured on the ledger's cards (the MPS allocator caches in
        heaps too; not measured on a Mac), with no CUDA context."""
        low_set, high_set = mps_working_set_mib(entry)
        d = self.derive_rule()
        low, high = (low_set / d["ratio_high"], high_set / d["ratio_low"]) if d else (low_set, high_set)
        ratio = (f", over reserved/allocated ({d['ratio_low']:.3f}–{d['ratio_high']:.3f}) as measured on "
                 f"{', '.join(self.overheads['cards'])}" if d else "")
        return round(low, 1), round(high, 1), (
            f"Metal's recommended working set, {low_set:g}–{high_set:g} MiB of {entry.total_mib:g} MiB "
            f"({MPS_WORKING_SET[0]:.0%}–{MPS_WORKING_SET[1]:.0%}; --budget-mib with torch.mps.recommended_max_memory() "
            f"for your Mac's own){ratio}; {UNIFIED_NOTE}")

    @cached_property
    def overheads(self) -> dict:
        """Per measured card with both limit ends: the context (usable - limit x reserved ratio)."""
        ctx, ratios, cards = [], [], []
        by_card, _, _ = (self.base or self)._ratio_rows  # (the base's less the rows this fit leaves out)
        gone = self._gone
        for lim in self.fit.lims:
            # Only cards whose limit is pinned by an out-of-memory probe close above a fit (within 5%):
            # a card that never ran out of memory says nothing about where its limit is.
            exceeded = self.fit.by_id.get(lim.exceeded_id)
            if (lim.kind != "probe" or lim.low_mib is None or lim.high_mib is None or exceeded is None
                    or exceeded.outcome.status != "oom" or lim.high_mib - lim.low_mib > 0.05 * lim.high_mib):
                continue
            usable = capacity_mib(self.fit.ledger.gpus.get(lim.gpu))
            # The card's ok probes' reserved / allocated (``_ratio_rows``).
            rs = [r for i, r in by_card.get(lim.gpu, ()) if i not in gone]
            if usable is None or not rs:
                continue
            ratio = statistics.median(rs)
            ctx += [usable - lim.high_mib * ratio, usable - lim.low_mib * ratio]
            ratios.append(ratio)
            cards.append(lim.gpu)
        return {"context": ctx, "ratio": ratios, "cards": cards}

    @cached_property
    def _rule(self) -> Optional[dict]:
        fit = self.overheads
        if not fit["context"]:
            return None
        rule = usable_ratio()
        return {"usable_low": rule.low, "usable_high": rule.high, "context_low_mib": min(fit["context"]),
                "context_high_mib": max(fit["context"]), "ratio_low": min(fit["ratio"]),
                "ratio_high": max(fit["ratio"])}

    def derive_rule(self) -> Optional[dict]:
        """What derives a card's limit from its usable memory (``_card_limit``), and its usable
        memory from its nvidia-smi total alone, as figures a page can apply to a total it is given:
        usable = total x usable_low..usable_high; limit = (usable - the context) / reserved over
        allocated, the low end from the largest context and ratio. None when no measured card pins
        them."""
        return self._rule

    def reserved_ratio(self, gpu: str) -> Optional[tuple[float, float, float]]:
        """(median, min, max) of peak reserved / peak allocated over the card's ok probes, else
        every card's; None when no probe has both."""
        if gpu not in self._ratios:
            if self._as_base(gpu):
                self._ratios[gpu] = self.base.reserved_ratio(gpu)
            else:  # the ratios of the base's probes less the ones left out: the same, in the same order
                by_card, every, _ = (self.base or self)._ratio_rows
                gone = self._gone
                rs = [r for i, r in by_card.get(gpu, ()) if i not in gone] or [r for i, r in every if i not in gone]
                self._ratios[gpu] = (statistics.median(rs), min(rs), max(rs)) if rs else None
        return self._ratios[gpu]

    def has_own_ratio(self, gpu: str) -> bool:
        """Whether ``reserved_ratio`` reads the card's own probes (else every card's)."""
        by_card, _, _ = (self.base or self)._ratio_rows
        gone = self._gone
        return any(i not in gone for i, _ in by_card.get(gpu, ()))

    def largest_ratio(self) -> Optional[tuple[float, str]]:
        """The largest peak reserved / peak allocated of the ledger's ok probes, with its row's id;
        None when no probe has both."""
        _, every, _ = self._ratio_rows
        if not every:
            return None
        rid, ratio = max(every, key=lambda row: row[1])
        return ratio, rid

    @cached_property
    def _ratio_rows(self) -> tuple[dict[Optional[str], list[tuple[str, float]]], list[tuple[str, float]], dict]:
        """Each ok probe's reserved / allocated as (id, ratio), by card and all together, in the
        probes' order; and each one's card by id."""
        by_card: dict[Optional[str], list[tuple[str, float]]] = {}
        every, card_of = [], {}
        for m in self.fit.peaks.probes:
            o = m.outcome
            if o.status == "ok" and o.peak_allocated_mib and o.peak_reserved_mib:  # both peaks the ratio reads
                row = (m.id, o.peak_reserved_mib / o.peak_allocated_mib)
                by_card.setdefault(m.gpu, []).append(row)
                every.append(row)
                card_of[m.id] = m.gpu
        return by_card, every, card_of

    def _as_base(self, gpu: str) -> bool:
        """Whether the card's ratio is the base's: none of the rows this fit leaves out besides
        the base's enters it (not a probe the ratios read; or only other cards' while this card
        has probes of its own, so the pooled ratio is not the one read)."""
        if self.base is None:
            return False
        by_card, _, card_of = self.base._ratio_rows
        gone = [card_of[i] for i in self._gone if i in card_of]
        return not gone or (gpu not in gone and gpu in by_card)

    @cached_property
    def _gone(self) -> set:
        """The rows this fit leaves out besides its base's."""
        return self.fit.exclude - self.base.fit.exclude if self.base else set()


def _usable(entry: Gpu, usable: float) -> tuple[float, float, str]:
    """(low, high, where from) of a card's usable memory: the card table's figure, or derived from
    its total (``usable_ratio``) where the table has only that."""
    if derives_usable(entry):
        rule = usable_ratio()
        low, high = rule.usable_mib(entry.total_mib)
        return low, high, f"{low}–{high} MiB usable ({entry.total_mib:g} MiB total; {rule.describe()})"
    return usable, usable, f"{usable} MiB usable (card table)"

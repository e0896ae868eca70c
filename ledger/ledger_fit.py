"""One ledger's rows as a predictor may use them (on or before a date, less excluded rows), with
the fits every rung of the ladder shares: the peak model, the card limits' rows, the probe/real
over-estimate, and how wide each rung's interval is on this ledger."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from functools import cached_property
from typing import Iterable, Optional

from .calibration import Overestimate, limits, overestimate, pairs
from .peaks import PeakModel, probes, before, ok_peak
from .model_configs import model_name
from .models import Ledger, Measurement
from .recipe import GroupKey, Recipe, group_key, recipe_of, seq_len_of


def m_group(m: Measurement) -> GroupKey:
    return group_key(m)


class LedgerFit:
    """The rows (``ms``: measured; ``dry``: dry runs of a recipe that ran) and their shared fits."""

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement] = (), as_of: Optional[dt.date] = None,
                 exclude: Iterable[str] = ()):
        self.ledger = ledger
        self.exclude = set(exclude)
        self.ms = before(ledger.measurements, as_of, self.exclude)
        # Dry runs are computations, not observations: any of them could have been run on any date,
        # so only the measured rows their remainder is fitted on are limited to ``as_of``.
        self.dry = [m for m in dry_runs if m.id not in self.exclude
                    and m.kind == "dry_run" and m.lora is not None and m.outcome.status == "ok"
                    and m.outcome.peak_allocated_mib is not None and m.seq_len]
        self.peaks = PeakModel(self.ms)
        self.lims = limits(ledger, self.ms, self.peaks)
        self.over: Overestimate = overestimate(self.ms)

    @cached_property
    def widths(self) -> dict[str, Optional[float]]:
        """Largest held-out relative error of each rung (fractions), from the ledger's own probes."""
        interp, transfer = [], []
        same_cell: dict[tuple, list[str]] = {}  # (card, group) -> every row's id
        for x in self.ms:
            same_cell.setdefault((x.gpu, m_group(x)), []).append(x.id)
        for m in probes(self.ms):
            peak = ok_peak(m)
            if peak is None:
                continue
            pm = self.peaks.without((m.id,))
            rows = pm.by_group.get(m_group(m), {})
            if rows.get(m.gpu):
                pred, _ = pm.predict(m.gpu, m_group(m), m.lora.rank)
                if pred is not None:
                    interp.append(abs(pred - peak) / peak)
            others = {g: r for g, r in rows.items() if g != m.gpu}
            if others:
                alone = self.peaks.without((m.id, *same_cell[(m.gpu, m_group(m))]))
                pred, _ = alone.predict(m.gpu, m_group(m), m.lora.rank)
                if pred is not None:
                    transfer.append(abs(pred - peak) / peak)
        return {"interpolated": max(interp) if interp else None, "transferred": max(transfer) if transfer else None,
                "interpolated_n": len(interp), "transferred_n": len(transfer)}

    @cached_property
    def real_seq(self) -> dict[str, int]:
        """A real run's longest example: its own, else that of the probe it was paired with (the
        probe measured the worst case of the corpus the run trained on)."""
        out = {}
        for p in pairs(self.ms):
            for rid in p.reals:
                if p.probe_seq_len:
                    out.setdefault(rid, p.probe_seq_len)
        for m in self.ms:
            if m.kind == "real" and seq_len_of(m):
                out[m.id] = seq_len_of(m)
        return out

    def recipe_for(self, m: Measurement) -> Optional[Recipe]:
        """A row's recipe, a real run's longest example filled in from the probe it was paired with."""
        r = recipe_of(m)
        if r is not None and r.seq_len is None and m.kind == "real" and m.id in self.real_seq:
            r = replace(r, seq_len=self.real_seq[m.id])
        return r

    @cached_property
    def models_named(self) -> dict[Optional[str], str]:
        """The ledger's own spelling of each model, by short name (the first in sort order)."""
        names: dict[Optional[str], set[str]] = {}
        for m in self.ms:
            if m.model:
                names.setdefault(model_name(m.model), set()).add(m.model)
        return {k: sorted(v)[0] for k, v in names.items()}

    @cached_property
    def by_id(self) -> dict[str, Measurement]:
        return {m.id: m for m in self.ms}

    def vendor(self, gpu: Optional[str]) -> Optional[str]:
        g = self.ledger.gpus.get(gpu or "")
        return g.vendor if g else None

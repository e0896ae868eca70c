"""The evidence ladder: one small part per rung, each with one method, ``evidence(recipe, gpu,
vendor)``, that answers with an interval, the rows it rests on and a sentence saying how, or
passes (None). The combiner (``ledger.answer.predictor``) asks them in order, most trusted first; each
rung down has a wider interval, every width measured held out on the ledger.

A real run's peak: ``MeasuredRealRun``, else the probe ladder's figure through the probe-to-real
step (``ledger.fit.response_span``). A probe's peak: ``MeasuredProbe``, ``InterpolatedOnCard``,
``CalibratedDryRun``, ``TransferredFromCard``.

A new rung is a class here with ``evidence`` and a place in ``probe_ladder``; a new recipe axis is a
field of ``ledger.vocab.recipe.Recipe`` and a term in the rungs whose rows can tell it apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ledger.core.answers import Interval, around, interval
from ledger.fit.calibration import _exceeded_peak
from ledger.fit.peaks import ok_peak
from ledger.fit.dry_calibration import DryCalibration
from ledger.fit.ledger_fit import LedgerFit
from ledger.vocab.model_configs import model_name
from ledger.vocab.recipe import Recipe


@dataclass(frozen=True)
class Evidence:
    """What one rung found: the interval (MiB), the method's name, how it was found, the rows."""

    interval: Interval
    method: str
    text: str
    ids: list[str]


class MeasuredRealRun:
    """Real runs of this very recipe on this card: the real peak itself (their range)."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit
        self._by_gpu: dict[str, dict[Recipe, list]] = {}

    def _runs(self, gpu: str) -> dict[Recipe, list]:
        """The card's ok / oom real runs by their recipe (its model by short name, any response
        length), in ledger order: made once per card (a ceiling's scan asks every rank)."""
        found = self._by_gpu.get(gpu)
        if found is None:
            found = self._by_gpu[gpu] = {}
            for m in self.fit.reals_on(gpu):
                if m.outcome.status in ("ok", "oom"):
                    r = self.fit.recipe_for(m)
                    if r is not None:
                        found.setdefault(r.replace(response_len=None, model=model_name(r.model)), []).append(m)
        return found

    def evidence(self, recipe: Recipe, gpu: str, vendor: Optional[str] = None) -> Optional[Evidence]:
        same = self._runs(gpu).get(recipe.replace(response_len=None, model=model_name(recipe.model)), [])
        fits = [m for m in same if ok_peak(m) is not None]
        if not fits:
            return None
        peaks = [ok_peak(m) for m in fits]
        return Evidence(interval(max(peaks), min(peaks), max(peaks)), "measured real run",
                        f"{len(fits)} real runs of this recipe peaked at {min(peaks)}–{max(peaks)} MiB",
                        [m.id for m in fits])


class MeasuredProbe:
    """A probe of this very recipe on this card: its peak, or what it needed at least (an OOM)."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit

    def evidence(self, recipe: Recipe, gpu: str, vendor: Optional[str] = None) -> Optional[Evidence]:
        obs = self.fit.peaks.observed(gpu, recipe.group()).get(recipe.rank)
        if obs is None:
            return None
        if obs.outcome.status == "ok":
            p = ok_peak(obs)
            return Evidence(interval(p, p, p), "measured probe", f"probe {obs.id} measured {p} MiB", [obs.id])
        need = _exceeded_peak(obs, self.fit.peaks)
        return Evidence(interval(need, need, None), "measured probe",
                        f"probe {obs.id} ran out of memory ({obs.outcome.status}); it needed at least {need} MiB",
                        [obs.id])


class InterpolatedOnCard:
    """This card's probes of the same model, quant, dropout, DoRA and fixes: affine in rank at the
    recipe's length, else linear in length between two probed lengths."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit

    def evidence(self, recipe: Recipe, gpu: str, vendor: Optional[str] = None) -> Optional[Evidence]:
        group = recipe.group()
        if self.fit.peaks.by_group.get(group, {}).get(gpu):
            pred, ids = self.fit.peaks.predict(gpu, group, recipe.rank)
            w = self.fit.width("interpolated") or self.fit.width("transferred") or 0.0
            if pred is not None:
                return Evidence(around(pred, w), "interpolated",
                                f"affine in rank over this card's probes of the same recipe; ±{w * 100:.2f}% (largest "
                                f"held-out error over {self.fit.width_n('interpolated')} probes)", ids)
        return self._in_length(recipe, gpu)

    def _in_length(self, recipe: Recipe, gpu: str) -> Optional[Evidence]:
        if recipe.seq_len is None:
            return None
        peaks = self.fit.peaks
        seqs = peaks.lengths(gpu, recipe.group())
        lower = [s for s in seqs if s < recipe.seq_len]
        upper = [s for s in seqs if s > recipe.seq_len]
        if not lower or not upper:
            return None
        s1, s2 = lower[-1], upper[0]
        y1, i1 = peaks.predict(gpu, recipe.replace(seq_len=s1).group(), recipe.rank)
        y2, i2 = peaks.predict(gpu, recipe.replace(seq_len=s2).group(), recipe.rank)
        if y1 is None or y2 is None:
            return None
        y = y1 + (y2 - y1) * (recipe.seq_len - s1) / (s2 - s1)
        w = self.fit.width("interpolated") or 0.0
        return Evidence(interval(y, min(y1, y) * (1 - w), max(y2, y) * (1 + w)), "interpolated",
                        f"linear in length between this card's probes at {s1} and {s2} tokens (a longer sequence "
                        f"never needs less); ±{w * 100:.2f}%", i1 + i2)


class CalibratedDryRun:
    """The dry-run table's figure for the recipe plus the card's remainder (``ledger.fit.dry_calibration``)."""

    def __init__(self, calibration: DryCalibration):
        self.calibration = calibration

    def evidence(self, recipe: Recipe, gpu: str, vendor: Optional[str] = None) -> Optional[Evidence]:
        found = self.calibration.calibrated(recipe, gpu, vendor)
        if found is None:
            return None
        iv, ids, text = found
        return Evidence(iv, "dry run", text, ids)


class TransferredFromCard:
    """Another card's probes of the same recipe, shifted by how the cards differ on shared rows."""

    def __init__(self, fit: LedgerFit):
        self.fit = fit

    def evidence(self, recipe: Recipe, gpu: str, vendor: Optional[str] = None) -> Optional[Evidence]:
        group = recipe.group()
        if not self.fit.peaks.by_group.get(group):
            return None
        pred, ids = self.fit.peaks.predict(gpu, group, recipe.rank)
        w = self.fit.width("transferred") or self.fit.width("interpolated") or 0.0
        if pred is None:
            return None
        return Evidence(around(pred, w), "transferred",
                        f"another card's probes of the same recipe, shifted by the cards' median difference on shared "
                        f"rows; ±{w * 100:.2f}% (largest held-out error of such transfers)", ids)


def probe_ladder(fit: LedgerFit, calibration: DryCalibration) -> list:
    """The rungs a probe's figure is asked of, most trusted first."""
    return [MeasuredProbe(fit), InterpolatedOnCard(fit), CalibratedDryRun(calibration), TransferredFromCard(fit)]

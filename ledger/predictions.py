"""Prospective predictions: scored when a matching real run lands in the ledger."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Optional

from .errors import Issue, UserError
from .models import Ledger, Lora, Measurement, Prediction, PredictionScore, Provenance
from .recipe import GroupKey, RecipeKey, capacity_mib, fixes_key, recipe_key, seq_len_of


def _same(a, b) -> bool:
    return a is None or b is None or a == b


def matches(pred: Prediction, m: Measurement, *, needs_allocated: bool = True) -> bool:
    """A real run with the predicted recipe (fields the prediction leaves open match anything)
    that ran; with ``needs_allocated``, one that reports the peak allocated a prediction is of."""
    if m.kind != "real" or m.outcome.status != "ok":
        return False
    if needs_allocated and m.outcome.peak_allocated_mib is None:
        return False
    if not (_same(pred.gpu, m.gpu) and _same(pred.model, m.model) and _same(pred.quant, m.quant)):
        return False
    if pred.lora is not None:
        if m.lora is None or m.lora.rank != pred.lora.rank:
            return False
        if bool(pred.lora.dropout) != bool(m.lora.dropout) or bool(pred.lora.dora) != bool(m.lora.dora):
            return False
    seq_m, seq_p = seq_len_of(m), seq_len_of(pred)
    if seq_m is not None and seq_p is not None and seq_m != seq_p:
        return False
    if pred.made_on and m.provenance.measured_on and m.provenance.measured_on < pred.made_on:
        return False  # a run before the prediction cannot score it
    return True


def score(pred: Prediction, m: Measurement) -> PredictionScore:
    actual = m.outcome.peak_allocated_mib
    return PredictionScore(measurement=m.id, actual_peak_mib=actual,
                           error_pct=round((pred.predicted_peak_mib - actual) / actual * 100, 2))


@dataclass
class ScoreReport:
    """What scoring found: predictions scored, and predictions a matching run could not score
    (with why), so a user hears about them instead of finding them open."""

    scored: list[str] = field(default_factory=list)
    unscorable: list[str] = field(default_factory=list)


def score_predictions(ledger: Ledger) -> ScoreReport:
    """Score every open prediction that now has a matching real run (the earliest one)."""
    report = ScoreReport()
    scored = report.scored
    for i, pred in enumerate(ledger.predictions):
        if pred.score is not None:
            continue
        candidates = [m for m in ledger.measurements if matches(pred, m)]
        if not candidates:
            other = [m for m in ledger.measurements if matches(pred, m, needs_allocated=False)]
            for m in other:
                what = ("peak reserved only" if m.outcome.peak_reserved_mib is not None else
                        "a peak delta only" if m.outcome.peak_delta_mib is not None else "no peak")
                report.unscorable.append(f"prediction {pred.id} matches {m.id}, which reports {what}: a prediction "
                                         "is of peak allocated, so it stays open")
            continue
        first: Optional[Measurement] = min(
            candidates, key=lambda m: (m.provenance.measured_on is None, m.provenance.measured_on or 0, m.id))
        ledger.predictions[i] = pred.model_copy(update={"score": score(pred, first)})
        scored.append(pred.id)
    return report


def make_prediction(ledger: Ledger, *, gpu: str, rank: int, made_on: dt.date, quant: str = "4bit",
                    model: Optional[str] = None, alpha: Optional[float] = None, rslora: bool = False,
                    dropout: float = 0.0, dora: bool = False, seq_len: Optional[int] = None, fixes="all",
                    probe_id: Optional[str] = None, pid: Optional[str] = None) -> tuple[Prediction, float, list[str]]:
    """A prediction of a real run's peak from the rows measured before ``made_on``: the named
    probe, else the latest probe of the same recipe, else the peak model, times the calibrated
    probe-to-real factor. Returns (prediction, the probe figure it started from, its basis).
    Raises UserError when the ledger cannot say."""
    from .calibration import (PeakModel, before, calibration_hash, limit_for, limits, ok_peak, overestimate,
                              predict_real)

    ms = before(ledger.measurements, made_on)
    fixes_text = fixes_key(fixes)
    if probe_id:
        probe = next((m for m in ms if m.id == probe_id), None)
        if probe is None or ok_peak(probe) is None:
            raise UserError(Issue("--probe", "", f"no ok probe {probe_id!r} in the ledger"))
        probe_mib, basis = ok_peak(probe), [probe.id]
    else:
        want = RecipeKey(gpu, None, quant, rank, dropout > 0, dora, fixes_text)
        same = [m for m in ms if m.kind == "probe" and m.lora and ok_peak(m) is not None
                and (seq_len is None or m.seq_len == seq_len)
                and recipe_key(m).without_model() == want and (model is None or m.model == model)]
        if same:
            probe = max(same, key=lambda m: (m.provenance.measured_on or dt.date.min, m.id))
            probe_mib, basis = ok_peak(probe), [probe.id]
        else:
            if seq_len is None:
                raise UserError(Issue("--seq-len", "", "no matching probe: give --seq-len (or --probe)"))
            models = sorted({m.model for m in ms if m.kind == "probe" and m.gpu == gpu and m.model})
            group = GroupKey(model or (models[0] if len(models) == 1 else None), quant, seq_len, dropout > 0, dora,
                             fixes_text)
            probe_mib, basis = PeakModel(ms).predict(gpu, group, rank)
            if probe_mib is None:
                raise UserError(Issue("predict", "", "unknown: no probes near this configuration in the ledger"))
    over = overestimate(ms)
    if over.pct is None:
        raise UserError(Issue("predict", "", "no probe/real pairs in the ledger to calibrate the probe against"))
    pr = predict_real(probe_mib, over)
    pid = pid or f"pred-{gpu}-r{rank}{'-drop' if dropout else ''}{'-dora' if dora else ''}-{made_on.isoformat()}"
    lims = limits(ledger, ms)
    lim = limit_for(lims, gpu, "real") or limit_for(lims, gpu, "probe")
    verdict = card_verdict(pr["low_mib"], pr["high_mib"], lim.low_mib if lim else None,
                           lim.high_mib if lim else None, capacity_mib(ledger.gpus.get(gpu)))
    pred = Prediction(
        id=pid, gpu=gpu, model=model, quant=quant,
        lora=Lora(rank=rank, alpha=alpha, rslora=rslora or None, dropout=dropout, dora=dora or None),
        seq_len=seq_len, memory_fixes=fixes, made_on=made_on, predicted_peak_mib=pr["predicted_mib"],
        interval_low_mib=pr["low_mib"], interval_high_mib=pr["high_mib"], basis=list(basis),
        method=(f"probe peak {probe_mib} MiB x (1 - {over.pct}%): the median over-estimate of the anchors "
                f"({', '.join(a.probe for a in over.anchors)}); interval from every pair ({over.low_pct}–"
                f"{over.high_pct}%)"),
        calibration_hash=calibration_hash(ms),
        provenance=Provenance(source="vram predict", measured_on=made_on, notes=[verdict]),
    )
    return pred, probe_mib, list(basis)


def card_verdict(low_mib: Optional[float], high_mib: Optional[float], limit_low_mib: Optional[float],
                 limit_high_mib: Optional[float], capacity: Optional[float]) -> str:
    """What a predicted interval means on the card, leaning safe: 'fits' only when its top is
    under the largest peak known to fit there; 'will not fit' when its bottom is over the
    smallest that did not (or over the card's capacity); 'tight' between; 'unknown' without a
    limit."""
    if low_mib is None or high_mib is None:
        return "Verdict: unknown (no interval)."
    over = limit_high_mib if limit_high_mib is not None else capacity
    if over is not None and low_mib > over:
        return (f"Verdict: will not fit: even the low end, {low_mib} MiB, is over "
                + (f"the smallest peak that did not fit there ({limit_high_mib} MiB)." if limit_high_mib is not None
                   else f"the card's {capacity} MiB."))
    if limit_low_mib is None:
        return "Verdict: unknown: no peak is known to fit this card."
    if high_mib <= limit_low_mib:
        return f"Verdict: fits: the interval's top, {high_mib} MiB, is under the largest peak known to fit ({limit_low_mib} MiB)."
    return (f"Verdict: tight: the interval {low_mib}–{high_mib} MiB reaches past the largest peak known to fit "
            f"({limit_low_mib} MiB).")

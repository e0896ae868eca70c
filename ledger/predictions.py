"""Prospective predictions: scored when a matching real run lands in the ledger."""

from __future__ import annotations

from typing import Optional

from .models import Ledger, Measurement, Prediction, PredictionScore
from .recipe import seq_len_of


def _same(a, b) -> bool:
    return a is None or b is None or a == b


def matches(pred: Prediction, m: Measurement) -> bool:
    """A real run with the predicted recipe (fields the prediction leaves open match anything)."""
    if m.kind != "real" or m.outcome.status != "ok" or m.outcome.peak_allocated_mib is None:
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


def score_predictions(ledger: Ledger) -> list[str]:
    """Score every open prediction that now has a matching real run (the earliest one).
    Returns the ids of the predictions scored."""
    scored = []
    for i, pred in enumerate(ledger.predictions):
        if pred.score is not None:
            continue
        candidates = [m for m in ledger.measurements if matches(pred, m)]
        if not candidates:
            continue
        first: Optional[Measurement] = min(
            candidates, key=lambda m: (m.provenance.measured_on is None, m.provenance.measured_on or 0, m.id))
        ledger.predictions[i] = pred.model_copy(update={"score": score(pred, first)})
        scored.append(pred.id)
    return scored

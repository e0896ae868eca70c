"""Prospective predictions: scored when a matching real run lands in the ledger."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Optional

from ledger.vocab.adapter import ALL_LINEAR
from ledger.core.errors import Issue, UserError
from ledger.core.models import Ledger, Lora, Measurement, Prediction, PredictionScore, Provenance
from ledger.vocab.recipe import seq_len_of


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
    if (pred.finetune == "full") != (m.finetune == "full"):  # a full fine-tune scores only its own kind
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


def make_prediction(ledger: Ledger, predictor, *, gpu: str, recipe, made_on: dt.date, alpha: Optional[float] = None,
                    rslora: bool = False, dropout: float = 0.0, fixes="all",
                    pid: Optional[str] = None, entry=None) -> tuple[Prediction, object]:
    """A prediction of a real run's peak: the predictor's answer (``ledger.answer.predictor``, fitted on
    the rows measured on or before ``made_on``) for a real run of ``recipe`` on ``gpu``. Returns
    (prediction, answer). Dry-run rows the answer rests on are copied into the prediction
    (``dry_run_rows``), so the ledger holds its whole basis. Raises UserError when the ledger
    cannot say."""
    from ledger.fit.calibration import calibration_hash

    answer = predictor.predict(recipe, gpu, entry=entry, run="real")
    real = answer.real_allocated
    if real is None or real.mib is None:
        raise UserError(Issue("predict", "", f"unknown: {answer.method_text or answer.why}"))
    ids = {m.id for m in ledger.measurements}
    full = recipe.method == "full"
    dry = {d.id: d for d in (predictor.fit.dry_source if full else predictor.dry)}
    carried = [dry[i] for i in answer.evidence if i not in ids and i in dry]
    missing = [i for i in answer.evidence if i not in ids and i not in dry]
    if missing:
        raise UserError(Issue("predict", "", f"the answer cites rows neither the ledger nor the dry runs hold: "
                              f"{', '.join(missing)}"))
    pid = pid or (f"pred-{gpu}-" + ("full" if full else f"r{recipe.rank}") + f"{'-drop' if recipe.dropout else ''}"
                  f"{'-dora' if recipe.dora else ''}-{made_on.isoformat()}")
    pred = Prediction(
        id=pid, gpu=gpu, model=recipe.model, quant=recipe.quant, finetune="full" if full else None,
        lora=None if full else Lora(rank=recipe.rank, alpha=alpha, rslora=rslora or None, dropout=dropout,
                                    dora=recipe.dora or None,
                                    target_modules=list(recipe.targets) if recipe.targets != ALL_LINEAR else None),
        seq_len=recipe.seq_len, response_len=recipe.response_len, memory_fixes=fixes, optimizer=recipe.optimizer,
        batch_size=recipe.batch if recipe.batch != 1 else None,
        made_on=made_on,
        predicted_peak_mib=real.mib,
        interval_low_mib=real.low_mib, interval_high_mib=real.high_mib, basis=list(answer.evidence),
        dry_run_rows=carried,
        method=f"{answer.method}: {answer.method_text}",
        calibration_hash=calibration_hash(predictor.ms),
        provenance=Provenance(source="vram predict", measured_on=made_on,
                              notes=[f"Verdict: {answer.verdict}: {answer.why} ({answer.limit_source})."]),
    )
    return pred, answer

"""The calibration as ``vram calibrate`` and the site report it: the fits of ``ledger.fit.calibration``
(pairs, over-estimate, costs, limits), the predictor's ceilings, and the leave-one-out scores,
which ask the predictor fitted without each row. It sits above the predictor; the fits it reports
sit below."""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import asdict, fields
from typing import Iterable, Optional

from ledger.fit.calibration import (
    calibration_hash,
    costs,
    kept_positions,
    key_pairs,
    overestimate,
    pair_rows,
    predict_real,
    sorted_pairs,
)
from ledger.fit.peaks import date_of, probes, ok_peak
from ledger.answer.ceilings import ceiling_table
from ledger.core.models import Ledger, Measurement
from .held_out import held_out, shared_predictor
from ledger.vocab.recipe import recipe_of
from ledger.vocab.recipe import recipe_key, row_keys_cached


# -- leave-one-out --------------------------------------------------------------------------------


def loo(ledger: Ledger, ms: list[Measurement], dry_runs: Iterable[Measurement] = ()) -> dict:
    """Held-out scores: each probe's verdict (the one predictor, ``ledger.answer.predictor``, fitted
    without it) and each real run's peak from its probe and the over-estimate, refit without it."""
    rows = []
    correct = total = unaddressed = tight = costly = 0
    dry_runs = list(dry_runs)
    kept = {x.id for x in ms}
    outside = [x.id for x in ledger.measurements if x.id not in kept]
    answers = held_out(ledger, dry_runs, outside)
    for m in probes(ms):
        if m.outcome.status not in ("ok", "oom") or recipe_of(m) is None:
            continue
        a = answers.answer(m, recipe_of(m))
        actual = m.outcome.status == "ok"
        fig = a.probe_allocated
        rows.append({"id": m.id, "verdict": a.verdict, "method": a.method, "predicted_mib": fig.mib if fig else None,
                     "high_mib": fig.high_mib if fig else None, "fits_actual": actual,
                     "limit": [a.limit_low_mib, a.limit_high_mib]})
        if a.verdict == "unknown":
            unaddressed += 1
        elif a.verdict == "tight":
            tight += 1
        else:
            total += 1
            correct += int((a.verdict == "fits") == actual)
            costly += int(a.verdict == "fits" and not actual)
    errors = []
    real_rows = []
    same_key: dict[tuple, list[Measurement]] = {}
    for p in probes(ms):
        if ok_peak(p) is not None:
            same_key.setdefault(recipe_key(p), []).append(p)
    key_rows = pair_rows(ms)
    by_key = {k: key_pairs(k, ps, rs) for k, (ps, rs) in key_rows.items()}
    for r in ms:
        if r.kind != "real" or ok_peak(r) is None or r.lora is None:
            continue
        same = same_key.get(recipe_key(r))
        if not same:
            continue
        prior = [p for p in same if date_of(p) <= date_of(r)]
        probe = max(prior, key=lambda p: (date_of(p), p.id)) if prior else min(same, key=lambda p: (date_of(p), p.id))
        # The over-estimate refit without the run: only its own key's pairs change.
        k = recipe_key(r)
        ps, rs = key_rows.get(k, ([], []))
        without = {**by_key, k: key_pairs(k, ps, [x for x in rs if x.id != r.id])}
        over = overestimate([], sorted_pairs(without.values()))
        pr = predict_real(ok_peak(probe), over, probe.model, kept_positions(probe))
        if pr["predicted_mib"] is None:
            continue
        err = (pr["predicted_mib"] - ok_peak(r)) / ok_peak(r) * 100
        errors.append(abs(err))
        real_rows.append({"id": r.id, "probe": probe.id, "predicted_mib": pr["predicted_mib"],
                          "actual_mib": ok_peak(r), "error_pct": round(err, 2)})
    return {
        "verdict_correct": correct, "verdict_total": total, "verdict_unaddressed": unaddressed,
        "verdict_tight": tight, "verdict_costly": costly,
        "verdict_pct": round(correct / total * 100, 1) if total else None,
        "real_median_abs_err_pct": round(statistics.median(errors), 2) if errors else None,
        "real_n": len(errors), "verdicts": rows, "reals": real_rows,
    }


_PLAIN = (str, int, float, bool, type(None))


def _record(obj) -> dict:
    """``dataclasses.asdict`` of a report's record, its common case first: fields of plain values
    and lists of them are copied as they are (asdict copies each item of each list: a pair of a
    large ledger lists thousands of real runs); anything else is asdict's."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if type(value) is list:
            if not all(type(x) in _PLAIN for x in value):
                return asdict(obj)
            value = list(value)
        elif type(value) not in _PLAIN:
            return asdict(obj)
        out[f.name] = value
    return out


@row_keys_cached()
def calibrate(ledger: Ledger, *, as_of: Optional[dt.date] = None, exclude: Iterable[str] = (),
              with_loo: bool = True, with_ceilings: bool = False, dry_runs: Iterable[Measurement] = ()) -> dict:
    """Everything ``vram calibrate --json`` prints (and, for the site, the ceiling table)."""
    dry_runs = list(dry_runs)
    predictor = shared_predictor(ledger, dry_runs, as_of=as_of, exclude=exclude)
    fit = predictor.fit  # the rows as of the date less the excluded, and their fits
    ms, over, peaks, lims = fit.ms, fit.over, fit.peaks, fit.lims
    extra = {"ceilings": ceiling_table(predictor)} if with_ceilings else {}
    return {**extra,
        "as_of": as_of.isoformat() if as_of else None,
        "excluded": sorted(exclude),
        "calibration_hash": calibration_hash(ms),
        "anchors": [_record(a) for a in over.anchors],
        "pairs": [_record(p) for p in over.pairs],
        "overestimate_pct": {"median": over.pct, "low": over.low_pct, "high": over.high_pct,
                             "kept_positions_max": over.keep_max},
        "costs": costs(ms, peaks),
        "limits": [_record(lim) for lim in lims],
        "loo": loo(ledger, ms, dry_runs) if with_loo else None,
    }

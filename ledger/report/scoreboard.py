"""The scoreboard: every addressable measurement scored by every estimator (``ledger.report.estimators``)
and by this project's own answer (the one predictor, held out: a row never predicts itself) and
the dry run as the command line applies it; medians overall and per slice, and the fit / no-fit
confusion at each card's capacity."""

from __future__ import annotations

import statistics
from typing import Iterable, Optional

import numpy as np

from .estimators import ESTIMATORS, MIB, Canifinetune, Estimate, Estimator, scored_recipe
from ledger.vocab.model_configs import Arch, load_arch
from ledger.core.models import Ledger, Measurement
from ledger.fit.peaks import modelled
from .held_out import held_out, shared_predictor
from ledger.vocab.recipe import Recipe, capacity_mib, row_keys_cached


# -- this project --------------------------------------------------------------------------------


class VramLedger(Estimator):
    """This project's answer (``ledger.answer.predictor``), held out: each row is predicted by a predictor
    fitted without it, and its verdict (fits / tight / won't fit / unknown) is the one
    ``vram ceiling`` and ``vram predict`` give."""

    name = "vram-ledger"
    predicts = "allocated"
    leaves_out = ("configurations far from any probe, real run or dry run (it says unknown instead), and what one "
                  "forward+backward does not see in a long run: allocator fragmentation and optimizer state.")

    def __init__(self, dry_runs: Iterable[Measurement] = ()):
        self.dry_runs = list(dry_runs)
        self._held: Optional[tuple[Ledger, object]] = None

    def _answers(self, ledger: Ledger):
        if self._held is None or self._held[0] is not ledger:
            self._held = (ledger, held_out(ledger, self.dry_runs))
        return self._held[1]

    def answer(self, ledger: Ledger, m: Measurement):
        if m.lora is None or not m.gpu:
            return None
        # A real run's longest example, from its pairing, is a fact of the row (read on the full ledger).
        recipe = self._answers(ledger).base.fit.recipe_for(m)
        if recipe is None or recipe.seq_len is None:
            return None
        return self._answers(ledger).answer(m, recipe, run="real" if m.kind == "real" else "probe")

    def estimate(self, arch, recipe, gpu_total_mib=None):
        return None  # needs a ledger row's context: see answer and vram estimate


class DryRunRows(Estimator):
    """The dry run as the command line answers it: the committed dry-run row of the measured row's
    recipe (``ledger/dry-runs.json``) plus the card's remainder fitted without the row."""

    name = "dry-run"
    predicts = "allocated"
    leaves_out = ("what a one-step probe's tracker cannot see beyond the fitted remainder: a long run's "
                  "fragmentation and optimizer state.")

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement]):
        self.by_id = {r["id"]: r["predicted_mib"] for r in shared_predictor(ledger, dry_runs).dry_loo["rows"]}

    def predict_row(self, m: Measurement) -> Optional[float]:
        return self.by_id.get(m.id)

    def estimate(self, arch, recipe, gpu_total_mib=None):
        return None


class AllocatorSim(DryRunRows):
    """The allocator simulated: the committed dry-run row of the measured row's recipe replayed
    through the caching allocator's model (``outcome.allocator``, PyTorch's defaults) with the
    card's remainder fitted without the row held through the step; scored on the rows that
    measured a peak reserved."""

    name = "allocator-sim"
    predicts = "reserved"
    leaves_out = ("other streams, CUDA graphs and memory outside the caching allocator (the CUDA context); the "
                  "memory free when the probe ran, which shapes a small card's cache (its OOM path releases it).")

    def __init__(self, ledger: Ledger, dry_runs: Iterable[Measurement]):
        reserved = {m.id for m in ledger.measurements if m.outcome.peak_reserved_mib is not None}
        self.by_id = {r["id"]: r["simulated_reserved_mib"] for r in shared_predictor(ledger, dry_runs).dry_loo["rows"]
                      if r.get("simulated_reserved_mib") is not None and r["id"] in reserved}


#: The project's own held-out predictions refit once per row: above this size they are skipped.
HELD_OUT_LIMIT = 1000



# -- scoring ---------------------------------------------------------------------------------------


def _measured(m: Measurement, predicts: str) -> tuple[Optional[float], str]:
    o = m.outcome
    if predicts == "reserved" and o.peak_reserved_mib is not None:
        return o.peak_reserved_mib, "reserved"
    if o.peak_allocated_mib is not None:
        return o.peak_allocated_mib, "allocated"
    return None, ""


def _card_mib(ledger: Ledger, gpu: Optional[str]) -> Optional[float]:
    return capacity_mib(ledger.gpus.get(gpu)) if gpu else None


def _seq_bucket(seq: int) -> str:
    for edge in (2048, 4096, 8192, 16384):
        if seq <= edge:
            return f"<= {edge}"
    return "> 16384"


def _slice_keys(m: Measurement, r: Recipe) -> dict[str, str]:
    return {"seq_len": _seq_bucket(r.seq_len), "rank": str(r.rank), "dropout": "yes" if r.dropout else "no",
            "dora": "yes" if r.dora else "no", "fixes": _fixes_slice(r.fixes), "kind": m.kind, "gpu": m.gpu or "",
            "quant": r.quant}


def _fixes_slice(fixes: str) -> str:
    """The scoreboard's fixes slice: all, none, or custom for any other set; a row that does not say
    is the program's recipe, all."""
    return "all" if fixes == "?" else fixes if fixes in ("all", "none") else "custom"


@row_keys_cached()
def scoreboard(ledger: Ledger, estimators: Optional[list[Estimator]] = None, keep_rows: int = 2000,
               dry_runs: Iterable[Measurement] = ()) -> dict:
    """Every addressable measurement scored by every estimator: medians overall and per slice, and
    the fit / no-fit confusion at each card's capacity. Per-row detail is kept up to ``keep_rows``
    rows (every row is in the ledger)."""
    if estimators is None:
        dry_runs = list(dry_runs) + [m for m in ledger.measurements if m.kind == "dry_run"]
        estimators = [*ESTIMATORS, VramLedger(dry_runs)]
        for dry in (DryRunRows(ledger, dry_runs), AllocatorSim(ledger, dry_runs)):
            if dry.by_id:
                estimators.append(dry)
    arch_cache: dict[Optional[str], Optional[Arch]] = {}
    cards = {key: _card_mib(ledger, key) for key in ledger.gpus}
    addressable = []
    for m in ledger.measurements:
        if m.kind not in ("probe", "real") or m.outcome.status not in ("ok", "oom", "spilled"):
            continue
        r = scored_recipe(m)
        if r is None:
            continue
        if m.model not in arch_cache:
            arch_cache[m.model] = load_arch(m.model) if m.model else None
        arch = arch_cache[m.model]
        if arch is None:
            continue
        addressable.append((m, r, arch, cards.get(m.gpu), _slice_keys(m, r)))
    out: dict = {"addressable": len(addressable), "estimators": [], "fit_rule": (
        "an estimate fits when it is at most the card's capacity as torch reports it (its total where that is "
        "unknown); vram-ledger's own verdict is the one vram ceiling and vram predict give (ledger.predictor, "
        "fitted without the row scored): 'fits' only when the predicted interval's top is under the low end of the "
        "card's effective limit, and 'tight' or 'won't fit' count as not fitting; the costly mistake is 'fits' for "
        "a row that ran out of memory")}
    keep = len(addressable) <= keep_rows
    # What every estimator's scoring reads of a row, made once: its outcome, its measured figure
    # for each quantity an estimator predicts, and its slices (as codes, for the medians per slice).
    oks = [m.outcome.status == "ok" for m, *_ in addressable]
    measured_as = {q: [_measured(m, q) if ok else (None, None) for (m, *_), ok in zip(addressable, oks)]
                   for q in {est.predicts for est in estimators}}
    slice_names = list(addressable[0][4]) if addressable else []
    slice_labels: dict[str, list] = {}
    slice_codes: dict[str, np.ndarray] = {}
    for k in slice_names:
        labels: dict = {}
        slice_codes[k] = np.array([labels.setdefault(a[4][k], len(labels)) for a in addressable], dtype=np.int64)
        slice_labels[k] = list(labels)
    # Above ``keep_rows`` rows an estimator that answers from the recipe alone is scored on arrays:
    # each distinct question asked once, its answer spread over the rows asking it.
    questions = _questions(addressable) if not keep else None
    for est in estimators:
        entry = {"name": est.name, "predicts": est.predicts, "leaves_out": est.leaves_out,
                 "available": not (isinstance(est, Canifinetune) and not est.available()), "skipped": None}
        ours, dry = isinstance(est, VramLedger), isinstance(est, DryRunRows)
        if ours and len(ledger.measurements) > HELD_OUT_LIMIT:
            entry.update(skipped=f"held-out scoring refits once per row; skipped above {HELD_OUT_LIMIT} rows",
                         n=0, median_abs_err_pct=None, median_signed_err_pct=None, slices={}, confusion=None, rows=[],
                         rows_kept=False)
            out["estimators"].append(entry)
            continue
        if questions is not None and not (ours or dry):
            entry.update(_scored_on_arrays(est, addressable, questions, oks, measured_as[est.predicts],
                                           slice_codes, slice_labels))
            out["estimators"].append(entry)
            continue
        cache: dict[tuple, tuple[Optional[Estimate], Optional[float]]] = {}
        rows, errors, scored = [], [], []
        confusion = {"fits_and_fit": 0, "fits_but_oom": 0, "oom_but_fit": 0, "oom_and_oom": 0}
        measured_of = measured_as[est.predicts]
        for i, (m, r, arch, card, slices) in enumerate(addressable):
            answer = None
            if ours:
                answer = est.answer(ledger, m) if modelled(m) else None
                fig = answer.allocated if answer else None
                pred = fig.mib if fig is not None else None
                e = None if pred is None else Estimate(est.name, pred * MIB, est.predicts,
                                                       low_bytes=(fig.low_mib or 0) * MIB or None,
                                                       high_bytes=(fig.high_mib or 0) * MIB or None)
                estimate_mib = None if e is None else e.mib
            elif dry:
                pred = est.predict_row(m)
                e = None if pred is None else Estimate(est.name, pred * MIB, est.predicts)
                estimate_mib = None if e is None else e.mib
            else:
                key = _question(r, arch, card)
                found = cache.get(key)
                if found is None:
                    e = est.estimate(arch, r, card)
                    found = cache[key] = (e, None if e is None else e.mib)
                e, estimate_mib = found
            if e is None:
                continue
            ok = oks[i]
            measured, quantity = measured_of[i]
            err = round((estimate_mib - measured) / measured * 100, 1) if measured else None
            if ours:
                # This project's verdict, as `vram ceiling` gives it (an OOM is decided by reserved
                # memory and the card's effective limit, not by its capacity).
                fits = None if answer is None or answer.verdict == "unknown" else answer.verdict == "fits"
            else:
                fits = (estimate_mib <= card) if card else None
            if err is not None:
                errors.append(err)
                scored.append(i)
            if fits is not None:
                key = ("fits_and_fit" if ok else "fits_but_oom") if fits else ("oom_but_fit" if ok else "oom_and_oom")
                confusion[key] += 1
            if keep:
                rows.append({"id": m.id, "estimate_mib": estimate_mib,
                             "low_mib": round(e.low_bytes / MIB, 1) if e.low_bytes else None,
                             "high_mib": round(e.high_bytes / MIB, 1) if e.high_bytes else None,
                             "measured_mib": measured, "measured_quantity": quantity,
                             "allocated_mib": m.outcome.peak_allocated_mib, "reserved_mib": m.outcome.peak_reserved_mib,
                             "status": m.outcome.status, "slices": slices, "error_pct": err,
                             "fits_predicted": fits, "fits_actual": ok,
                             **({"verdict": answer.verdict} if answer is not None else {})})
        entry.update(
            n=len(errors),
            median_abs_err_pct=round(statistics.median(abs(x) for x in errors), 1) if errors else None,
            median_signed_err_pct=round(statistics.median(errors), 1) if errors else None,
            slices=_slice_medians(errors, scored, slice_codes, slice_labels),
            confusion=confusion, rows=rows, rows_kept=keep,
        )
        out["estimators"].append(entry)
    return out


def _question(r: Recipe, arch: Arch, card: Optional[float]) -> tuple:
    """What an estimator answering from the recipe alone is asked of a row (its answer's key)."""
    return (arch.name, r.quant, r.rank, r.seq_len, r.dropout_rate, r.dora, r.batch, card)


def _questions(addressable: list) -> tuple[list[int], np.ndarray]:
    """The distinct questions of the rows (the position of the first row asking each) and each
    row's question as an index into them."""
    code_of: dict[tuple, int] = {}
    firsts: list[int] = []
    codes: list[int] = []
    for i, (_, r, arch, card, _) in enumerate(addressable):
        q = _question(r, arch, card)
        c = code_of.get(q)
        if c is None:
            c = code_of[q] = len(firsts)
            firsts.append(i)
        codes.append(c)
    return firsts, np.array(codes, dtype=np.int64)


def _scored_on_arrays(est: Estimator, addressable: list, questions: tuple[list[int], np.ndarray], oks: list[bool],
                      measured: list[tuple], slice_codes: dict[str, np.ndarray], slice_labels: dict[str, list]) -> dict:
    """An analytic estimator's scores, rows not kept: what the per-row loop gives (each question
    asked of its first row's recipe, the same float arithmetic, Python's ``round`` on each error),
    computed over arrays."""
    firsts, codes = questions
    nan = float("nan")
    answers = []
    for i in firsts:
        _, r, arch, card, _ = addressable[i]
        e = est.estimate(arch, r, card)
        answers.append(nan if e is None else e.mib)
    estimate = np.array(answers, dtype=float)[codes]
    has = ~np.isnan(estimate)
    figure = np.array([nan if v is None else v for v, _ in measured], dtype=float)
    scored_at = np.flatnonzero(has & ~np.isnan(figure) & (figure != 0))
    with np.errstate(invalid="ignore", divide="ignore"):
        raw = (estimate[scored_at] - figure[scored_at]) / figure[scored_at] * 100
    errors = [round(x, 1) for x in raw.tolist()]
    card = np.array([c if c else nan for *_, c, _ in addressable], dtype=float)  # none, or 0: not judged
    judged = has & ~np.isnan(card)
    fits = np.zeros(len(estimate), dtype=bool)
    fits[judged] = estimate[judged] <= card[judged]
    ok = np.array(oks, dtype=bool)
    confusion = {"fits_and_fit": int(np.sum(judged & fits & ok)), "fits_but_oom": int(np.sum(judged & fits & ~ok)),
                 "oom_but_fit": int(np.sum(judged & ~fits & ok)), "oom_and_oom": int(np.sum(judged & ~fits & ~ok))}
    scored = scored_at.tolist()
    return dict(n=len(errors),
                median_abs_err_pct=round(statistics.median(abs(x) for x in errors), 1) if errors else None,
                median_signed_err_pct=round(statistics.median(errors), 1) if errors else None,
                slices=_slice_medians(errors, scored, slice_codes, slice_labels),
                confusion=confusion, rows=[], rows_kept=False)


def _slice_medians(errors: list[float], scored: list[int], codes: dict[str, np.ndarray],
                   labels: dict[str, list]) -> dict:
    """Per slice and label, the median absolute error of the scored rows (``scored``: their
    positions among the addressable rows, whose labels ``codes`` holds as indices into
    ``labels``) and how many, labels in ``_sort_key``'s order. Each median is
    ``statistics.median``'s: the middle value, or the mean of the two middle ones."""
    if not errors:
        return {}
    abs_errs = np.abs(np.array(errors, dtype=float))
    at = np.array(scored, dtype=np.int64)
    out = {}
    for k, all_codes in codes.items():
        c = all_codes[at]
        order = np.argsort(c, kind="stable")
        sorted_codes = c[order]
        starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
        ends = np.r_[starts[1:], len(sorted_codes)]
        groups = {labels[k][sorted_codes[a]]: abs_errs[order[a:b]] for a, b in zip(starts.tolist(), ends.tolist())}
        out[k] = {v: {"median_abs_err_pct": round(float(np.median(xs)), 1), "n": len(xs)}
                  for v, xs in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))}
    return out


def _sort_key(text: object):
    """Numeric slice labels ('seq 4096') in numeric order, then the rest as text; a slice with no
    value (a row without a gpu) has an empty or missing label."""
    text = "" if text is None else str(text)
    words = text.split()
    try:
        return (0, float(words[-1]), text)
    except (ValueError, IndexError):
        return (1, 0.0, text)

"""Ceilings: the largest LoRA rank (a multiple of a step) whose verdict is "fits" on a card, and
the largest that is "tight", by asking the predictor rank by rank; then made consistent with the
physics across recipes (never above an easier recipe's ceiling, never below a harder one's).
``p`` is a ``ledger.answer.predictor.Predictor`` (this module sits beside it and asks it only)."""

from __future__ import annotations

from typing import Optional

from ledger.core.answers import CeilingAnswer, LengthCeiling, Run
from ledger.core.models import Gpu
from ledger.vocab.recipe import Recipe, row_keys_cached


def search(p, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
            margin_mib: float = 0.0, budget_mib: Optional[float] = None, step: int = 8,
            max_rank: int = 512, verdicts_only: bool = False, _depth: int = 0) -> CeilingAnswer:
    """The largest rank (a multiple of ``step``) whose verdict is ``fits``, and the largest that
    is ``tight`` or better, below the first rank that will not fit; at the top level, made
    consistent with the easier and harder recipes' ceilings (``_consistent``). Each recipe's rank
    scan is made once per predictor (``p.subceilings``), whichever search asks for it first.
    ``verdicts_only``: the same ceilings, each rank asked for its verdict alone
    (``Predictor.verdict``), so ``ranks`` holds each rank's verdict without its figure, method
    and evidence (the fit table's cells need the ceilings only)."""
    recipe = p.resolve_model(recipe, gpu)
    key = (recipe, gpu, run, margin_mib, budget_mib, step, max_rank, verdicts_only)
    if key not in p.subceilings:
        p.subceilings[key] = _scan(p, recipe, gpu, entry=entry, run=run, margin_mib=margin_mib,
                                   budget_mib=budget_mib, step=step, max_rank=max_rank, verdicts_only=verdicts_only)
    scan, note = p.subceilings[key]
    if _depth > 0 or scan.status != "ok":
        return scan
    fits_rank, tight_rank, why = _consistent(p, recipe, gpu, entry, run, margin_mib, budget_mib, step,
                                             max_rank, scan.fits_rank, scan.tight_rank, verdicts_only)
    note = why or note
    at_least = fits_rank is not None and fits_rank + step > max_rank
    if at_least:
        note = f"at least {fits_rank}: the search stops at rank {max_rank}"
    return scan.model_copy(update={"fits_rank": fits_rank, "tight_rank": tight_rank, "at_least": at_least,
                                   "note": note})


def _scan(p, recipe: Recipe, gpu: str, *, entry: Optional[Gpu], run: Run, margin_mib: float,
          budget_mib: Optional[float], step: int, max_rank: int, verdicts_only: bool = False
          ) -> tuple[CeilingAnswer, str]:
    """One recipe's ceilings from its own verdicts, rank by rank, and the note before any "at least"."""
    ranks: list[dict] = []
    fits_rank = tight_rank = None
    known = False
    low = high = None
    for rank in range(step, max_rank + 1, step):
        if verdicts_only:
            verdict, low, high = p.verdict(recipe.replace(rank=rank), gpu, entry=entry, run=run,
                                           margin_mib=margin_mib, budget_mib=budget_mib)
            ranks.append({"rank": rank, "verdict": verdict})
        else:
            a = p.predict(recipe.replace(rank=rank), gpu, entry=entry, run=run, margin_mib=margin_mib,
                          budget_mib=budget_mib)
            verdict, low, high = a.verdict, a.limit_low_mib, a.limit_high_mib
            fig = a.allocated
            ranks.append({"rank": rank, "verdict": verdict, "method": a.method,
                          "mib": fig.mib if fig else None, "high_mib": fig.high_mib if fig else None,
                          "evidence": a.evidence})
        if verdict == "unknown":
            continue
        known = True
        if verdict == "won't fit":
            break
        if verdict == "fits" and tight_rank == fits_rank:
            fits_rank = rank
        tight_rank = rank
    first_known = next((r["rank"] for r in ranks if r["verdict"] != "unknown"), None)
    if not known:
        status, note = "unknown", p.predict(recipe.replace(rank=step), gpu, entry=entry, run=run,
                                               budget_mib=budget_mib).why
    elif fits_rank is None and tight_rank is None and first_known != step:
        status, note = "unknown", (f"nothing is known below rank {first_known}, and rank {first_known} "
                                   f"{ranks[-1]['verdict'] if ranks[-1]['rank'] == first_known else 'is known'}")
    else:
        status, note = ("ok" if fits_rank is not None or tight_rank is not None else "none-fits"), ""
    base_note = note
    at_least = fits_rank is not None and fits_rank + step > max_rank
    if at_least:
        note = f"at least {fits_rank}: the search stops at rank {max_rank}"
    return CeilingAnswer(gpu=gpu, run=run, seq_len=recipe.seq_len, fits_rank=fits_rank, tight_rank=tight_rank,
                         status=status, step=step, max_rank=max_rank, at_least=at_least, note=note,
                         limit_low_mib=low, limit_high_mib=high, margin_mib=margin_mib,
                         ranks=[r for r in ranks if r["verdict"] != "unknown"] or ranks[:1]), base_note


def _consistent(p, recipe, gpu, entry, run, margin_mib, budget_mib, step, max_rank, fits_rank, tight_rank,
                verdicts_only=False):
    """Ceilings that respect the physics across recipes: never above an easier recipe's (a
    shorter sequence probed on this card, no dropout, no DoRA), never below a harder one's."""
    seqs = sorted(p.fit.peaks.model_lengths(gpu, recipe.model, recipe.quant, recipe.fixes) | {recipe.seq_len})
    cap = floor = None
    cap_from = floor_from = ""
    for s in seqs:
        for d in (False, True):
            for k in (False, True):
                other = recipe.replace(seq_len=s, dropout=d, dora=k)
                if other == recipe:
                    continue
                easier = s <= recipe.seq_len and d <= recipe.dropout and k <= recipe.dora
                harder = s >= recipe.seq_len and d >= recipe.dropout and k >= recipe.dora
                if not (easier or harder):
                    continue
                c = search(p, other, gpu, entry=entry, run=run, margin_mib=margin_mib, budget_mib=budget_mib,
                           step=step, max_rank=max_rank, verdicts_only=verdicts_only, _depth=1)
                if c.status != "ok" or c.fits_rank is None:
                    continue
                what = f"{s} tokens{', dropout' if d else ''}{', DoRA' if k else ''}"
                if easier and (cap is None or c.fits_rank < cap):
                    cap, cap_from = c.fits_rank, what
                if harder and (floor is None or c.fits_rank > floor):
                    floor, floor_from = c.fits_rank, what
    why = ""
    if floor is not None and (fits_rank is None or floor > fits_rank):
        fits_rank, why = floor, f"at least {floor}: rank {floor} fits the harder recipe at {floor_from}"
    if cap is not None and fits_rank is not None and cap < fits_rank:
        fits_rank, why = cap, f"capped at {cap}: the easier recipe at {cap_from} fits no more"
    if fits_rank is not None and (tight_rank is None or tight_rank < fits_rank):
        tight_rank = fits_rank
    return fits_rank, tight_rank, why


@row_keys_cached()
def ceiling_table(p, step: int = 8) -> list[dict]:
    """Rank ceilings (fits and tight) per card x model x quant x fixes x probed length x (no
    dropout, dropout, DoRA), for the site."""
    rows = []
    for gpu in p.ledger.gpus:
        combos = sorted({(model, quant, fixes, seq) for (g, model, quant, fixes), seqs in p.fit.peaks.seqs.items()
                         if g == gpu for seq in seqs}, key=lambda c: (str(c[0]), str(c[1]), str(c[2]), c[3]))
        for model, quant, fixes, seq in combos:
            cells = {}
            for label, d, k in (("no dropout", False, False), ("dropout", True, False), ("DoRA", False, True)):
                c = search(p, Recipe(model=model, quant=quant or "4bit", dropout=d, dora=k, seq_len=seq, fixes=fixes),
                              gpu, step=step)
                cells[label] = {"rank": c.fits_rank, "tight_rank": c.tight_rank, "status": c.status,
                                "at_least": c.at_least}
            rows.append({"gpu": gpu, "model": model, "quant": quant, "fixes": fixes, "seq_len": seq, "ceilings": cells})
    return rows


def longest(p, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
            margin_mib: float = 0.0, budget_mib: Optional[float] = None, step: int = 256,
            max_len: int = 131072) -> LengthCeiling:
    """The inverse question: at ``recipe.rank``, the longest sequence (a multiple of ``step``, up to
    ``max_len``) whose verdict is ``fits``, and the longest that is ``tight`` or better, scanning
    lengths upwards until the first that will not fit (a step's peak grows with its length).
    Lengths with no answer (past the dry-run rows) are skipped; ``unknown_from`` says where the
    answers stop when nothing past them was known."""
    rows: list[dict] = []
    fits_len = tight_len = None
    low = high = None
    last_known = None
    for seq in range(step, max_len + 1, step):
        a = p.predict(recipe.replace(seq_len=seq), gpu, entry=entry, run=run, margin_mib=margin_mib,
                      budget_mib=budget_mib)
        low, high = a.limit_low_mib, a.limit_high_mib
        fig = a.allocated
        row = {"seq_len": seq, "verdict": a.verdict, "method": a.method, "mib": fig.mib if fig else None,
               "high_mib": fig.high_mib if fig else None, "evidence": a.evidence}
        if a.verdict == "unknown":
            continue
        last_known = seq
        if not rows or rows[-1]["verdict"] != a.verdict:
            rows.append(row)
        else:
            rows[-1] = {**row, "from_seq_len": rows[-1].get("from_seq_len", rows[-1]["seq_len"])}
        if a.verdict == "won't fit":
            break
        if a.verdict == "fits" and tight_len == fits_len:
            fits_len = seq
        tight_len = seq
    stopped = bool(rows) and rows[-1]["verdict"] == "won't fit"
    unknown_from = None if stopped or last_known == max_len else (last_known or 0) + step
    if not rows:
        status, note = "unknown", p.predict(recipe.replace(seq_len=step), gpu, entry=entry, run=run,
                                               budget_mib=budget_mib).why
    elif fits_len is None and tight_len is None:
        status, note = "none-fits", (f"{'full fine-tuning' if recipe.method == 'full' else f'rank {recipe.rank}'} "
                                     f"does not fit at {rows[0]['seq_len']} tokens")
    else:
        status, note = "ok", ""
    at_least = status == "ok" and not stopped
    if at_least:
        note = (f"at least {tight_len if fits_len is None else fits_len} tokens: "
                + (f"no answer from {unknown_from} tokens on (no dry-run rows reach it)" if unknown_from and
                   unknown_from <= max_len else f"the search stops at {max_len} tokens"))
    return LengthCeiling(gpu=gpu, run=run, rank=recipe.rank, fits_len=fits_len, tight_len=tight_len, status=status,
                         step=step, max_len=max_len, at_least=at_least,
                         unknown_from=unknown_from if unknown_from and unknown_from <= max_len else None, note=note,
                         limit_low_mib=low, limit_high_mib=high, margin_mib=margin_mib, lengths=rows)

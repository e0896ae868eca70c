"""Calibration: from probes to real-run predictions and rank ceilings. Pure functions: no I/O, no torch.

Rules (each explicit, none tuned to a held-out row):

- **Recipe key**: card, model, quant, rank, dropout on/off, DoRA, memory fixes. Sequence length is
  the probe's; a real run's longest example is often unknown, so it is not part of the key.
- **Pairs**: each ok probe is paired with the ok real runs of its recipe key measured on or after
  it and before the key's next ok probe (the runs that trained on the corpus it measured); the
  pair's real peak is the highest of them.
- **The probe's core**: a probe runs the corpus's longest example, and with the logits_to_keep fix
  its lm_head holds the logits of that example's response span, read by the loss in fp32
  (vocabulary x 4 bytes per kept position, the vocabulary from the model's shipped config). A real
  run's peak does not follow that span (on the bundled ledger the corpora's longest responses
  moved the probe by 236 MiB and the real runs by 10 MiB), so the over-estimate is measured on the
  probe's core = peak - those logits: over-estimate = (core - real) / core. Logits are subtracted
  only up to the longest span a pair covered (beyond it a real run was never seen to skip them)
  and only when the span and the vocabulary are known; otherwise nothing is (the higher figure).
- **Anchors**: the latest pair of each recipe key. The over-estimate used to predict is the median
  of the anchors; the interval is the range of every pair. Real = core x (1 - over-estimate).
- **Peak of a configuration** (for verdicts and ceilings): the ok probes of its group (card, model,
  quant, sequence length, dropout on/off, DoRA, fixes), linear in rank (slope from the group, else
  the card's, else every card's); a group measured only on other cards borrows their rows
  (allocated bytes do not depend on the card). No rows: unknown.
- **Limits**: an OOM is a censored observation. A card's effective limit for peak allocated lies
  between the largest peak that fit and the smallest predicted (or lower-bound) peak that did not,
  never above the card. Real runs get their own interval (a long run fragments the allocator).

Verdicts and ceilings are the one predictor's (``ledger.answer.predictor``), built on these fits.
"""

from __future__ import annotations

import bisect
import datetime as dt
import hashlib
import statistics
from collections import defaultdict
from operator import itemgetter
from functools import cached_property
from dataclasses import dataclass
from typing import Iterable, Optional

from ledger.vocab.model_configs import vocab_size
from ledger.core.models import Ledger, Measurement
from .peak_rows import fit_slope
from .peaks import PeakModel, date_of, ok_peak
from ledger.vocab.recipe import RecipeKey, capacity_mib, fixes_key, group_key, recipe_key, seq_len_of
from ledger.core.units import to_mib

# -- probe -> real -----------------------------------------------------------------------------

#: Bytes per vocabulary entry of one kept position's logits as the loss reads them (fp32).
LOGIT_BYTES = 4


def kept_positions_of(fixes: str, logits_to_keep: Optional[int], response_len: Optional[int]) -> Optional[int]:
    """Positions the lm_head computes logits for under the logits_to_keep fix (``fixes``: a
    canonical key) - None when the fix is off or neither count is known."""
    if fixes != "all" and "logits_to_keep" not in fixes.split(","):
        return None
    if logits_to_keep:
        return logits_to_keep
    return response_len + 1 if response_len else None


def kept_positions(m) -> Optional[int]:
    """A row's kept positions (see ``kept_positions_of``)."""
    return kept_positions_of(fixes_key(m.memory_fixes), m.logits_to_keep, m.response_len)


def logits_mib(model: Optional[str], keep: Optional[int]) -> Optional[float]:
    """MiB of fp32 logits for ``keep`` positions of ``model`` (None: either unknown)."""
    vocab = vocab_size(model)
    if vocab is None or not keep:
        return None
    return to_mib(keep * vocab * LOGIT_BYTES, "bytes")


@dataclass
class Pair:
    probe: str
    reals: list[str]
    probe_mib: float
    real_mib: float
    overestimate_pct: float
    key: list
    probe_seq_len: Optional[int]
    on: Optional[str]
    kept_positions: Optional[int] = None
    logits_mib: Optional[float] = None
    core_mib: Optional[float] = None
    raw_overestimate_pct: Optional[float] = None


def pair_rows(ms: list[Measurement]) -> dict[tuple, tuple[list[Measurement], list[Measurement]]]:
    """The ok probes and ok real runs of each recipe key (the rows pairs are made of), in ledger order."""
    out: dict[tuple, tuple[list[Measurement], list[Measurement]]] = {}
    for m in ms:
        if m.lora is None or not m.gpu or ok_peak(m) is None or m.kind not in ("probe", "real"):
            continue
        out.setdefault(recipe_key(m), ([], []))[0 if m.kind == "probe" else 1].append(m)
    return out


def key_pairs(key: tuple, ps: list[Measurement], rs: list[Measurement]) -> list[Pair]:
    """The pairs of one recipe key from its ok probes and ok real runs (see the module's rules)."""
    out: list[Pair] = []
    if not ps or not rs:
        return out
    # One probe per day (the highest), and per day the real runs' highest peak and ids.
    per_day: dict[dt.date, Measurement] = {}
    marks: dict[dt.date, tuple] = {}  # the day's probe's (peak, id)
    for p in ps:
        d, mark = date_of(p), (ok_peak(p), p.id)
        if d not in marks or mark > marks[d]:
            marks[d], per_day[d] = mark, p
    real_days: dict[dt.date, list[Measurement]] = defaultdict(list)
    for r in rs:
        real_days[date_of(r)].append(r)
    rdays = sorted(real_days)
    pdays = sorted(per_day)
    for i, day in enumerate(pdays):
        p = per_day[day]
        end = pdays[i + 1] if i + 1 < len(pdays) else dt.date.max
        seg_days = rdays[bisect.bisect_left(rdays, day):bisect.bisect_left(rdays, end)]
        seg = [r for d in seg_days for r in real_days[d]]
        if not seg:
            continue
        top = max(seg, key=lambda r: (ok_peak(r), r.id))
        pp, rp = ok_peak(p), ok_peak(top)
        keep = kept_positions(p)
        lg = logits_mib(p.model, keep)
        core = pp - (lg or 0.0)
        out.append(Pair(probe=p.id, reals=sorted(r.id for r in seg), probe_mib=pp, real_mib=rp,
                        overestimate_pct=round((core - rp) / core * 100, 3), key=list(key),
                        probe_seq_len=seq_len_of(p), on=p.provenance.measured_on.isoformat()
                        if p.provenance.measured_on else None, kept_positions=keep if lg is not None else None,
                        logits_mib=None if lg is None else round(lg, 1), core_mib=round(core, 1),
                        raw_overestimate_pct=round((pp - rp) / pp * 100, 3)))
    return out


def pair_order(p: Pair) -> tuple[str, str]:
    """Pairs are ordered by date, then probe id (a probe is in one pair at most: no two tie)."""
    return p.on or "", p.probe


def sorted_pairs(by_key: Iterable[list[Pair]]) -> list[Pair]:
    return sorted((p for ps in by_key for p in ps), key=pair_order)


def pairs(ms: list[Measurement]) -> list[Pair]:
    """Every probe/real pair of the same recipe key (see the module's rules), by date."""
    return sorted_pairs(key_pairs(k, ps, rs) for k, (ps, rs) in pair_rows(ms).items())


@dataclass
class Overestimate:
    pct: Optional[float]
    low_pct: Optional[float]
    high_pct: Optional[float]
    anchors: list[Pair]
    pairs: list[Pair]
    #: The longest response span (kept positions) a pair's probe covered: logits are subtracted up to it.
    keep_max: Optional[int] = None

    @cached_property
    def fixes(self) -> frozenset[str]:
        """The memory fixes (as ``fixes_key`` spells them) of the recipes its pairs measured: the
        over-estimate is a remainder of those recipes' real runs and is applied to them only."""
        return frozenset(RecipeKey(*p.key).fixes for p in self.pairs)

    @cached_property
    def max_rank(self) -> Optional[int]:
        """The largest LoRA rank a pair measured: its runs' optimizer state is inside the over-estimate."""
        return max((r for r in (RecipeKey(*p.key).rank for p in self.pairs) if r), default=None)

    def logits_off_mib(self, model: Optional[str], keep: Optional[int]) -> float:
        """MiB of a probe's kept logits that the real-run prediction leaves out (0 when unknown)."""
        if not keep or not self.keep_max:
            return 0.0
        return logits_mib(model, min(keep, self.keep_max)) or 0.0


def overestimate(ms: list[Measurement], ps: Optional[list[Pair]] = None) -> Overestimate:
    """The probe's over-estimate of real runs from the pairs of ``ms`` (``ps``: those pairs, made already)."""
    ps = pairs(ms) if ps is None else ps
    latest: dict[tuple, Pair] = {}
    for p in ps:  # sorted by date: the last one per key wins
        latest[tuple(p.key)] = p
    anchors = sorted(latest.values(), key=lambda p: (p.on or "", p.probe))
    if not anchors:
        return Overestimate(None, None, None, [], ps)
    pct = statistics.median(a.overestimate_pct for a in anchors)
    keeps = [p.kept_positions for p in ps if p.kept_positions]
    return Overestimate(round(pct, 3), min(p.overestimate_pct for p in ps), max(p.overestimate_pct for p in ps),
                        anchors, ps, max(keeps) if keeps else None)


def predict_real(probe_mib: float, over: Overestimate, model: Optional[str] = None,
                 keep: Optional[int] = None) -> dict:
    """A real-run peak from a probe peak (of ``model``, its lm_head keeping ``keep`` positions):
    point and interval."""
    if over.pct is None:
        return {"predicted_mib": None, "low_mib": None, "high_mib": None}
    core = probe_mib - over.logits_off_mib(model, keep)
    return {"predicted_mib": round(core * (1 - over.pct / 100), 1),
            "low_mib": round(core * (1 - over.high_pct / 100), 1),
            "high_mib": round(core * (1 - over.low_pct / 100), 1)}


# -- limits ----------------------------------------------------------------------------------


@dataclass
class Limit:
    gpu: str
    kind: str
    low_mib: Optional[float]
    high_mib: Optional[float]
    fit_id: Optional[str]
    exceeded_id: Optional[str]
    card_mib: Optional[float]
    note: str = ""


def card_mib(ledger: Ledger, gpu: str) -> Optional[float]:
    return capacity_mib(ledger.gpus.get(gpu))


def _exceeded_peak(m: Measurement, model: Optional[PeakModel]) -> Optional[float]:
    """What a row that did not fit needed at least: predicted, or what it had allocated."""
    o = m.outcome
    if o.status == "spilled":
        return o.peak_allocated_mib
    if o.status != "oom":
        return None
    candidates = []
    if m.kind == "probe" and m.lora is not None:
        pred, _ = model.predict(m.gpu, group_key(m), m.lora.rank)
        if pred is not None:
            candidates.append(pred)
    if o.oom is not None:  # lower bounds of what it needed
        if o.oom.max_allocated_mib is not None:
            candidates.append(o.oom.max_allocated_mib)
        elif o.oom.allocated_mib is not None:
            candidates.append(o.oom.allocated_mib + (o.oom.tried_mib or 0.0))
    return min(candidates) if candidates else None


def limits(ledger: Ledger, ms: list[Measurement], model: Optional[PeakModel] = None) -> list[Limit]:
    """Each card's interval for the peak allocated that fits, from probes and from real runs."""
    return LimitRows(ms).limits(ledger, model or PeakModel(ms))


#: A limit row's order: its figure, then its id.
_ORDER = itemgetter(0, 1)


class LimitRows:
    """The rows each card's limits rest on, by (card, kind) - training steps only (LoRA set), since a
    forward-only or load row says little about a step's limit - kept so that the limits of the same
    rows less a few (leave-one-out) cost the rows whose figure the peak model gives, not all of them:
    the rows that fit by peak, highest first; the failures whose need is their own, lowest first."""

    def __init__(self, ms: list[Measurement]):
        # One pass over the rows (a large ledger's limits are asked once: each row read once),
        # each kept as (figure, id, row) and ordered by figure and id (``_ORDER``).
        fits: dict[tuple, list] = defaultdict(list)
        fixed: dict[tuple, list] = defaultdict(list)
        modelled: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
        for m in ms:
            kind = m.kind
            if m.lora is None or (kind != "probe" and kind != "real"):
                continue
            key, o = (m.gpu, kind), m.outcome
            if o.status == "ok":  # ok_peak
                if o.peak_allocated_mib is not None:
                    fits[key].append((o.peak_allocated_mib, m.id, m))
            elif o.status == "oom" and kind == "probe":  # its need is read from the peak model
                modelled[key][(m.gpu, group_key(m))].append(m)
            elif (p := _exceeded_peak(m, None)) is not None:
                fixed[key].append((p, m.id, m))
        self._fits, self._fixed = dict(fits), dict(fixed)
        self._ordered: dict[tuple, list] = {}  # (which, key) -> its rows in order, made when rows are removed
        # The OOM probes by (card, kind) and then by (card, group): a peak model made from another
        # by ``without`` answers a group as the other does or not at all of its ranks.
        self.modelled = {k: dict(cells) for k, cells in modelled.items()}
        self._root_needs: tuple = (None, {})

    def _first(self, which: str, key: tuple, removed: frozenset) -> Optional[tuple]:
        """The row that fit with the highest peak (``which`` "fits") or the failure whose need is
        its own with the lowest ("fixed") of ``key``, less ``removed``, as (figure, id, row): with
        nothing removed the one extreme, else the first of the rows sorted once."""
        rows = (self._fits if which == "fits" else self._fixed).get(key)
        if not rows:
            return None
        if not removed:  # the first extreme, as the first of the sorted rows
            return max(rows, key=_ORDER) if which == "fits" else min(rows, key=_ORDER)
        ordered = self._ordered.get((which, key))
        if ordered is None:
            ordered = self._ordered[(which, key)] = sorted(rows, key=_ORDER, reverse=which == "fits")
        return next((r for r in ordered if r[1] not in removed), None)

    def _needs(self, key: tuple, root: PeakModel) -> list[tuple[float, Measurement]]:
        """What the OOM probes of ``key`` needed by the peak model ``root``, lowest first."""
        if self._root_needs[0] is not root:
            self._root_needs = (root, {})
        needs = self._root_needs[1]
        if key not in needs:
            needs[key] = sorted(((p, m) for rows in self.modelled.get(key, {}).values() for m in rows
                                 if (p := _exceeded_peak(m, root)) is not None), key=lambda pm: (pm[0], pm[1].id))
        return needs[key]

    def _least_need(self, key: tuple, model: PeakModel, removed: frozenset) -> Optional[tuple[float, Measurement]]:
        """The least of what the OOM probes of ``key`` (less ``removed``) needed by ``model``: the
        root model's figures where ``model`` answers a cell as its root does, its own elsewhere."""
        over, asked = [], set()
        for (gpu, group), rows in self.modelled.get(key, {}).items():
            if not model.answers_as_root(gpu, group):
                asked.add((gpu, group))
                over += [(p, m) for m in rows if m.id not in removed and (p := _exceeded_peak(m, model)) is not None]
        kept = next((pm for pm in self._needs(key, model.root)
                     if pm[1].id not in removed and (pm[1].gpu, group_key(pm[1])) not in asked), None)
        if kept is not None:
            over.append(kept)
        return min(over, key=lambda pm: (pm[0], pm[1].id)) if over else None

    def limits(self, ledger: Ledger, model: PeakModel, removed: frozenset = frozenset()) -> list[Limit]:
        """The limits of these rows less ``removed`` (ids), with ``model`` predicting what OOM probes needed."""
        return [lim for gpu in ledger.gpus for kind in ("probe", "real")
                if (lim := self.limit(ledger, model, gpu, kind, removed)) is not None]

    def limit(self, ledger: Ledger, model: PeakModel, gpu: str, kind: str,
              removed: frozenset = frozenset()) -> Optional[Limit]:
        """One card's limit from one kind of row (None where it has no such row), as ``limits``."""
        key = (gpu, kind)
        first = self._first("fits", key, removed)
        fit = first[2] if first else None
        least = self._least_need(key, model, removed)
        over = [least] if least is not None else []
        lowest = self._first("fixed", key, removed)
        if lowest is not None:
            over.append((lowest[0], lowest[2]))
        if fit is None and not over:
            return None
        card = card_mib(ledger, gpu)
        exc = min(over, key=lambda pm: (pm[0], pm[1].id)) if over else None
        low = ok_peak(fit) if fit else None
        high = exc[0] if exc else None
        if card is not None and (high is None or high > card):
            high = card
        note = ""
        if low is not None and high is not None and high < low:
            note = "an OOM below a peak that fit: other processes or fragmentation varied between rows"
            high = low
        return Limit(gpu=gpu, kind=kind, low_mib=low, high_mib=high, fit_id=fit.id if fit else None,
                     exceeded_id=exc[1].id if exc else None, card_mib=card, note=note)


def limit_for(lims: list[Limit], gpu: str, kind: str = "probe") -> Optional[Limit]:
    return next((lim for lim in lims if lim.gpu == gpu and lim.kind == kind), None)


# -- marginal costs ------------------------------------------------------------------------------


def _paired_diffs(peaks: "PeakModel", flag: str) -> list[dict]:
    """Probes identical but for dropout (or DoRA) off vs on: the cost, per card and rank."""
    cells: dict[tuple, tuple[float, str]] = {}
    for group, by_gpu in peaks.by_group.items():
        other = group._replace(**{flag: None})
        for gpu, rows in by_gpu.items():
            for rank, peak, mid in rows:
                cells[(gpu, rank, other, getattr(group, flag))] = (peak, mid)
    out = []
    for (gpu, rank, other, on), (peak, mid) in sorted(cells.items(), key=lambda kv: str(kv[0])):
        if on and (gpu, rank, other, False) in cells:
            off_peak, off_id = cells[(gpu, rank, other, False)]
            out.append({"gpu": gpu, "rank": int(rank), "seq_len": other.seq_len, "quant": other.quant,
                        "cost_mib": round(peak - off_peak, 1), "rows": [off_id, mid]})
    return out


def _summary(values: list[float]) -> dict:
    if not values:
        return {"median_mib": None, "min_mib": None, "max_mib": None}
    return {"median_mib": round(statistics.median(values), 1), "min_mib": min(values), "max_mib": max(values)}


def costs(ms: list[Measurement], peaks: Optional["PeakModel"] = None) -> dict:
    """Marginal costs from the data, each with the rows it rests on (ok probes: the highest peak
    per card, group and rank)."""
    peaks = peaks or PeakModel(ms)
    per_rank = []
    seq_points: dict[tuple, list[tuple[int, float, str]]] = defaultdict(list)
    for group, by_gpu in sorted(peaks.by_group.items(), key=lambda kv: str(kv[0])):
        model, quant, seq, dropout, dora, fixes = group  # a GroupKey
        for gpu, rows in sorted(by_gpu.items()):
            s = fit_slope([(x, y) for x, y, _ in rows])
            if s is not None:
                per_rank.append({"gpu": gpu, "quant": quant, "seq_len": seq, "dropout": dropout, "dora": dora,
                                 "fixes": fixes, "mib_per_rank": round(s, 2), "rows": [i for _, _, i in rows]})
            if seq:
                for x, y, i in rows:
                    seq_points[(gpu, model, quant, int(x), dropout, dora, fixes)].append((seq, y, i))
    dropout = _paired_diffs(peaks, "dropout")
    dora = _paired_diffs(peaks, "dora")
    # Sequence length: where at least four lengths were probed; not linear, so a quadratic and the
    # piecewise slopes.
    seq = []
    for key in sorted(seq_points, key=str):
        pts = sorted(seq_points[key])
        if len({x for x, _, _ in pts}) < 4:  # a curve needs more lengths than parameters
            continue
        steps = [{"from": a[0], "to": b[0], "mib_per_token": round((b[1] - a[1]) / (b[0] - a[0]), 4)}
                 for a, b in zip(pts, pts[1:]) if b[0] != a[0]]
        import numpy as np

        c2, c1, c0 = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 2)
        resid = max(abs(y - (c0 + c1 * x + c2 * x * x)) for x, y, _ in pts)
        seq.append({"gpu": key[0], "quant": key[2], "rank": key[3], "fit": "quadratic",
                    "coefficients": {"c0_mib": round(float(c0), 2), "c1_mib_per_token": round(float(c1), 5),
                                     "c2_mib_per_token2": float(f"{c2:.4g}")},
                    "max_residual_mib": round(float(resid), 1), "piecewise": steps, "rows": [i for _, _, i in pts]})
    # Real runs between ranks (mean peak per rank; same card, quant, dropout, DoRA, fixes).
    real = []
    rgroups: dict[tuple, dict[int, list[tuple[float, str]]]] = defaultdict(lambda: defaultdict(list))
    for m in ms:
        if m.kind == "real" and m.lora is not None and m.gpu:
            peak = ok_peak(m)
            if peak is not None:
                rgroups[recipe_key(m)._replace(rank=None)][m.lora.rank].append((peak, m.id))
    for key in sorted(rgroups, key=str):
        ranks = sorted(rgroups[key])
        for a, b in zip(ranks, ranks[1:]):
            ma = statistics.mean(p for p, _ in rgroups[key][a])
            mb = statistics.mean(p for p, _ in rgroups[key][b])
            real.append({"gpu": key.gpu, "dropout": key.dropout, "from_rank": a, "to_rank": b,
                         "cost_mib": round(mb - ma, 1), "mib_per_rank": round((mb - ma) / (b - a), 2),
                         "rows": sorted(i for _, i in rgroups[key][a] + rgroups[key][b])})
    return {
        "rank": per_rank,
        "dropout": {**_summary([d["cost_mib"] for d in dropout]), "pairs": dropout},
        "dora": {**_summary([d["cost_mib"] for d in dora]), "pairs": dora},
        "seq_len": seq,
        "real_rank": real,
    }


# -- the whole calibration ----------------------------------------------------------------------


def calibration_hash(ms: list[Measurement]) -> str:
    """Identifies the data a calibration was fitted on (the rows' ids, recipes and figures)."""
    lines = sorted(f"{m.id}|{m.outcome.status}|{m.outcome.peak_allocated_mib}|{m.outcome.peak_reserved_mib}"
                   for m in ms)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]

"""One answer to "will this recipe fit on this card, and what will it peak at?". Pure: no torch.

Every command that answers it (``vram ceiling``, ``vram predict``, ``vram estimate``, ``vram fit``,
the dry run's ``--find-ceiling``) and the site call :class:`Predictor`.

**The evidence ladder.** For a recipe (model, quant, rank, dropout, DoRA, sequence length, memory
fixes) on a card, the first rung that has data answers; each rung down has a wider interval:

1. ``measured real run``: real runs of this recipe on this card (their longest example is the
   probe's they were paired with when the run does not record it) - the real peak itself.
2. ``measured probe``: a probe of this recipe on this card; a real run's peak is the probe's core
   (less the fp32 logits of the response span it kept, which a real run's peak does not follow)
   times the calibrated probe-to-real factor (interval: the range of every probe/real pair).
3. ``interpolated``: this card's probes of the same model, quant, dropout, DoRA and fixes, affine
   in rank (and linear in sequence length between two probed lengths); interval: the largest
   held-out error of that interpolation over the ledger's probes.
4. ``dry run``: rows of the GPU-free dry run (``ledger/dry-runs.json``) of the same recipe, affine in
   rank, plus the card's remainder (what fake tensors cannot see: workspaces, allocator and
   context differences) fitted from pairs of measured probes and dry runs on the same card (else
   the same vendor, else all); interval: the largest leave-one-out error of that fit.
5. ``transferred``: another card's probes of the same group, shifted by how the cards differ on
   shared rows; interval: the largest held-out error of such transfers.

Then **dominance**: a longer sequence, dropout, DoRA or a larger rank never needs less memory, so a
row of a harder recipe that fit caps the interval's top, and one of an easier recipe that ran out
of memory raises its bottom.

**The limit** is the card's effective limit for peak allocated (``calibration.limits``: the largest
peak that fit and the smallest that did not), real runs' own when judging a real run. A card with
no ledger rows gets one from the card table (``ledger/cards.json``): its usable memory less the
CUDA context, over the reserved/allocated ratio, both as measured on the ledger's cards.

**The verdict** leans safe: ``fits`` when the interval's top is at most the limit's low end minus
the margin; ``won't fit`` when its bottom is over the limit's high end; ``tight`` between;
``unknown`` (and why) without a prediction or a limit.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict

from .calibration import (LOGIT_BYTES, Limit, Overestimate, PeakModel, _exceeded_peak, _probes, before,
                          kept_positions, kept_positions_of, limit_for, limits, logits_mib, ok_peak, overestimate,
                          pairs)
from .models import SCHEMA_VERSION, Gpu, Ledger, Measurement, Provenance
from .cards import Card, card_table, known_card_names, resolve_card  # noqa: F401 (the card vocabulary)
from .dry_runs import load_dry_runs  # noqa: F401 (where the predictor's dry-run rows come from)
from .recipe import GroupKey, capacity_mib, fixes_key, seq_len_of

Verdict = Literal["fits", "tight", "won't fit", "unknown"]
Run = Literal["probe", "real"]
METHODS = ("measured real run", "measured probe", "interpolated", "dry run", "transferred",
           "bounded by measured rows")


def model_name(model: Optional[str]) -> Optional[str]:
    """A model's short name, as configs ship: 'unsloth/gemma-3-4b-it' -> 'gemma-3-4b-it'."""
    if not model:
        return None
    name = model.split("/")[-1].lower()
    return name[:-5] if name.endswith(".json") else name


@dataclass(frozen=True)
class Recipe:
    """What decides a step's memory (the rank may be left open for a ceiling)."""

    model: Optional[str]
    rank: int = 16
    quant: str = "4bit"
    dropout: bool = False
    dora: bool = False
    seq_len: Optional[int] = None
    fixes: str = "all"
    response_len: Optional[int] = None

    def group(self) -> GroupKey:
        return GroupKey(self.model, self.quant, self.seq_len, self.dropout, self.dora, self.fixes)

    def describe(self) -> str:
        return (f"{self.model or 'the model'} {self.quant} r{self.rank}" + (" dropout" if self.dropout else "")
                + (" DoRA" if self.dora else "") + (f" {self.seq_len} tokens" if self.seq_len else "")
                + f" fixes {self.fixes}")


def recipe_of(m: Measurement) -> Optional[Recipe]:
    if m.lora is None:
        return None
    return Recipe(model=m.model, rank=m.lora.rank, quant=m.quant or "4bit", dropout=bool(m.lora.dropout),
                  dora=bool(m.lora.dora), seq_len=seq_len_of(m), fixes=fixes_key(m.memory_fixes),
                  response_len=m.response_len)


class Interval(BaseModel):
    """A predicted figure in MiB: the point and the interval around it (None: no bound that side)."""

    model_config = ConfigDict(extra="forbid")
    mib: Optional[float]
    low_mib: Optional[float]
    high_mib: Optional[float]


def _iv(mib: Optional[float], low: Optional[float], high: Optional[float]) -> Interval:
    r = lambda x: None if x is None else round(x, 1)  # noqa: E731
    return Interval(mib=r(mib), low_mib=r(low), high_mib=r(high))


#: Bytes per vocabulary entry of one response position along the whole logits chain (bf16 logits,
#: their fp32 copy, log-softmax, its gradient): the top of what a longer response span can add.
LOGIT_CHAIN_BYTES = 14


def recipe_keep(recipe: "Recipe") -> Optional[int]:
    """Positions a recipe keeps logits for (None: unknown, or the logits_to_keep fix is off)."""
    return kept_positions_of(recipe.fixes, None, recipe.response_len)


def _around(mib: float, width: float) -> Interval:
    """``mib`` with a relative interval of +-``width`` (a fraction)."""
    return _iv(mib, mib * (1 - width), mib * (1 + width))


def _shift(iv: Interval, mib: float) -> Interval:
    return _iv(*(None if v is None else v + mib for v in (iv.mib, iv.low_mib, iv.high_mib)))


def _scale(iv: Interval, factor: float, low_factor: float, high_factor: float) -> Interval:
    return _iv(None if iv.mib is None else iv.mib * factor,
               None if iv.low_mib is None else iv.low_mib * low_factor,
               None if iv.high_mib is None else iv.high_mib * high_factor)


class Answer(BaseModel):
    """The one typed answer: peaks (allocated and reserved, probe and real, each an interval), the
    method and evidence, the limit it was judged against, and the verdict."""

    model_config = ConfigDict(extra="forbid")
    gpu: str
    card_source: Literal["ledger", "card table", "budget"]
    recipe: dict
    run: Run
    probe_allocated: Optional[Interval]
    real_allocated: Optional[Interval]
    reserved: Optional[Interval]
    method: Optional[str]
    method_text: str
    evidence: list[str]
    limit_low_mib: Optional[float]
    limit_high_mib: Optional[float]
    limit_source: str
    margin_mib: float
    verdict: Verdict
    why: str

    @property
    def allocated(self) -> Optional[Interval]:
        """The judged figure: the real run's for a real run, else the probe's."""
        return self.real_allocated if self.run == "real" else self.probe_allocated


class CeilingAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu: str
    run: Run
    seq_len: Optional[int]
    fits_rank: Optional[int]
    tight_rank: Optional[int]
    status: Literal["ok", "none-fits", "unknown"]
    step: int
    max_rank: int
    at_least: bool
    note: str
    limit_low_mib: Optional[float]
    limit_high_mib: Optional[float]
    margin_mib: float
    ranks: list[dict]


# -- the predictor -----------------------------------------------------------------------------


@dataclass
class Predictor:
    """Holds one ledger's fits; ask it many questions. ``dry_runs``: dry-run rows (kind dry_run,
    no card), e.g. ``ledger/dry-runs.json``; ``as_of``/``exclude`` limit the rows it may use."""

    ledger: Ledger
    dry_runs: list[Measurement] = field(default_factory=list)
    as_of: Optional[dt.date] = None
    exclude: Iterable[str] = ()

    def __post_init__(self) -> None:
        self.exclude = set(self.exclude)
        self.ms = before(self.ledger.measurements, self.as_of, self.exclude)
        # Dry runs are computations, not observations: any of them could have been run on any date,
        # so only the measured rows their remainder is fitted on are limited to ``as_of``.
        self.dry = [m for m in self.dry_runs if m.id not in self.exclude
                    and m.kind == "dry_run" and m.lora is not None and m.outcome.status == "ok"
                    and m.outcome.peak_allocated_mib is not None and m.seq_len]
        self.peaks = PeakModel(self.ms)
        self.lims = limits(self.ledger, self.ms, self.peaks)
        self.over: Overestimate = overestimate(self.ms)
        self._sub: dict = {}
        self._tables: dict = {}
        self._ratios: dict = {}
        self._remainders: dict = {}
        self._limits: dict = {}
        self._by_model: Optional[dict] = None

    # -- fitted widths ---------------------------------------------------------------------

    @cached_property
    def widths(self) -> dict[str, Optional[float]]:
        """Largest held-out relative error of each rung (fractions), from the ledger's own probes."""
        interp, transfer = [], []
        for m in _probes(self.ms):
            peak = ok_peak(m)
            if peak is None:
                continue
            rest = [x for x in self.ms if x.id != m.id]
            pm = PeakModel(rest)
            rows = pm.by_group.get(m_group(m), {})
            if rows.get(m.gpu):
                pred, _ = pm.predict(m.gpu, m_group(m), m.lora.rank)
                if pred is not None:
                    interp.append(abs(pred - peak) / peak)
            others = {g: r for g, r in rows.items() if g != m.gpu}
            if others:
                alone = PeakModel([x for x in rest if not (x.gpu == m.gpu and m_group(x) == m_group(m))])
                pred, _ = alone.predict(m.gpu, m_group(m), m.lora.rank)
                if pred is not None:
                    transfer.append(abs(pred - peak) / peak)
        return {"interpolated": max(interp) if interp else None, "transferred": max(transfer) if transfer else None,
                "interpolated_n": len(interp), "transferred_n": len(transfer)}

    # -- real runs' sequence lengths ---------------------------------------------------------

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

    # -- the dry run, calibrated ----------------------------------------------------------------

    @cached_property
    def dry_pairs(self) -> list[tuple[Measurement, float, float]]:
        """(measured ok probe, its peak, the dry run of the same recipe) for every probe that has one."""
        index: dict[tuple, float] = {}
        for d in self.dry:
            index[(model_name(d.model), d.quant, d.lora.rank, bool(d.lora.dropout), bool(d.lora.dora), d.seq_len,
                   d.response_len, fixes_key(d.memory_fixes))] = d.outcome.peak_allocated_mib
        out = []
        for m in _probes(self.ms):
            if ok_peak(m) is None or not m.seq_len or not m.response_len:
                continue
            key = (model_name(m.model), m.quant, m.lora.rank, bool(m.lora.dropout), bool(m.lora.dora), m.seq_len,
                   m.response_len, fixes_key(m.memory_fixes))
            if key in index:
                out.append((m, ok_peak(m), index[key]))
        return out

    def remainder(self, gpu: str, vendor: Optional[str], leave_out: str = "") -> tuple[Optional[float], str]:
        """MiB to add to a dry run for this card: the median of measured - dry run over the card's
        pairs (at least two), else its vendor's, else all pairs."""
        key = (gpu, vendor, leave_out)
        if key not in self._remainders:
            self._remainders[key] = self._remainder(gpu, vendor, leave_out)
        return self._remainders[key]

    def _remainder(self, gpu: str, vendor: Optional[str], leave_out: str) -> tuple[Optional[float], str]:
        pairs_ = [(m, p, d) for m, p, d in self.dry_pairs if m.id != leave_out]
        for scope, rows in ((gpu, [x for x in pairs_ if x[0].gpu == gpu]),
                            (f"{vendor} cards", [x for x in pairs_ if vendor and self._vendor(x[0].gpu) == vendor]),
                            ("all cards", pairs_)):
            if len(rows) >= 2:
                return statistics.median(p - d for _, p, d in rows), f"{scope} ({len(rows)} pairs)"
        return None, "no measured probe has a dry run"

    def _vendor(self, gpu: Optional[str]) -> Optional[str]:
        g = self.ledger.gpus.get(gpu or "")
        return g.vendor if g else None

    @cached_property
    def dry_loo(self) -> dict:
        """Leave-one-out errors of the calibrated dry run over its pairs (signed %, by row)."""
        rows = []
        for m, peak, dry in self.dry_pairs:
            rem, _ = self.remainder(m.gpu, self._vendor(m.gpu), leave_out=m.id)
            if rem is None:
                continue
            rows.append({"id": m.id, "gpu": m.gpu, "measured_mib": peak, "dry_run_mib": round(dry, 1),
                         "predicted_mib": round(dry + rem, 1), "error_pct": round((dry + rem - peak) / peak * 100, 2)})
        errs = [abs(r["error_pct"]) for r in rows]
        return {"rows": rows, "n": len(rows), "median_abs_err_pct": round(statistics.median(errs), 2) if errs else None,
                "max_abs_err_pct": round(max(errs), 2) if errs else None}

    def _dry_table(self, name: Optional[str], quant: str, fixes: str, dropout: bool, dora: bool,
                   response_len: Optional[int]) -> dict[int, dict[int, tuple[float, str]]]:
        """Dry-run peaks by length and rank for one model, quant, fixes, dropout and DoRA (the
        highest where several response lengths match)."""
        key = (name, quant, fixes, dropout, dora, response_len)
        if key not in self._tables:
            if self._by_model is None:
                self._by_model = defaultdict(list)
                for d in self.dry:
                    self._by_model[model_name(d.model)].append(d)
            table: dict[int, dict[int, tuple[float, str]]] = defaultdict(dict)
            for d in self._by_model.get(name, []):
                if (d.quant == quant and bool(d.lora.dropout) == dropout and bool(d.lora.dora) == dora
                        and fixes_key(d.memory_fixes) == fixes and (response_len is None or d.response_len == response_len)):
                    cell = table[d.seq_len]
                    if d.lora.rank not in cell or d.outcome.peak_allocated_mib > cell[d.lora.rank][0]:
                        cell[d.lora.rank] = (d.outcome.peak_allocated_mib, d.id)
            self._tables[key] = dict(table)
        return self._tables[key]

    @staticmethod
    def _slope(table: dict, seq: int) -> Optional[float]:
        """MiB per rank at a length: from its two ranks, else linear in length between the nearest
        lengths that have two (LoRA's saved activations are tokens x rank), else the nearest's."""
        def at(s):
            (r1, (y1, _)), (r2, (y2, _)) = sorted(table[s].items())[0], sorted(table[s].items())[-1]
            return (y2 - y1) / (r2 - r1)
        two = sorted(s for s, c in table.items() if len(c) >= 2)
        if not two:
            return None
        if seq in two:
            return at(seq)
        lower, upper = [s for s in two if s < seq], [s for s in two if s > seq]
        if lower and upper:
            s1, s2 = lower[-1], upper[0]
            return at(s1) + (at(s2) - at(s1)) * (seq - s1) / (s2 - s1)
        return at(min(two, key=lambda s: abs(s - seq)))

    def _dry_at(self, table: dict, seq: int, rank: int, slope_table: dict) -> tuple[Optional[float], list[str]]:
        cell = table.get(seq)
        if not cell:
            return None, []
        if rank in cell:
            return cell[rank][0], [cell[rank][1]]
        ranks = sorted(cell)
        if len(ranks) >= 2:
            lo = [r for r in ranks if r < rank]
            hi = [r for r in ranks if r > rank]
            a, b = (lo[-1], hi[0]) if lo and hi else (ranks[0], ranks[1]) if not lo else (ranks[-2], ranks[-1])
            (ya, ia), (yb, ib) = cell[a], cell[b]
            return ya + (yb - ya) * (rank - a) / (b - a), [ia, ib]
        slope = self._slope(table, seq)
        if slope is None:
            slope = self._slope(slope_table, seq)
        if slope is None:
            return None, []
        y0, i0 = cell[ranks[0]]
        return y0 + slope * (rank - ranks[0]), [i0]

    def dry_raw(self, recipe: Recipe) -> tuple[Optional[float], list[str]]:
        """The dry run's peak for a recipe from the committed rows of the same model, quant and fixes
        (and response length when given): affine in rank (a length with one rank takes its slope
        per rank from the lengths with two, linear in length); between two dry-run lengths, linear
        in length - for dropout or DoRA, the plain recipe at this length plus their cost over it,
        interpolated in length."""
        if recipe.seq_len is None:
            return None, []
        name, seq, rank = model_name(recipe.model), recipe.seq_len, recipe.rank
        args = (name, recipe.quant, recipe.fixes)
        own = self._dry_table(*args, recipe.dropout, recipe.dora, recipe.response_len)
        plain = self._dry_table(*args, False, False, recipe.response_len)
        if seq in own:
            return self._dry_at(own, seq, rank, plain)
        lower = [s for s in own if s < seq]
        upper = [s for s in own if s > seq]
        if not lower or not upper:
            return None, []
        s1, s2 = max(lower), min(upper)
        (y1, i1), (y2, i2) = self._dry_at(own, s1, rank, plain), self._dry_at(own, s2, rank, plain)
        if y1 is None or y2 is None:
            return None, []
        if (recipe.dropout or recipe.dora) and seq in plain and s1 in plain and s2 in plain:
            (p0, i0), (p1, _), (p2, _) = (self._dry_at(plain, s, rank, plain) for s in (seq, s1, s2))
            if None not in (p0, p1, p2):
                d1, d2 = y1 - p1, y2 - p2
                return p0 + d1 + (d2 - d1) * (seq - s1) / (s2 - s1), i0 + i1 + i2
        return y1 + (y2 - y1) * (seq - s1) / (s2 - s1), i1 + i2

    def dry_exact(self, recipe: Recipe) -> bool:
        """Whether a committed dry-run row is of this very recipe (else its figure is derived)."""
        table = self._dry_table(model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dropout, recipe.dora,
                                recipe.response_len)
        return recipe.rank in table.get(recipe.seq_len, {})

    @cached_property
    def dry_derivation(self) -> dict:
        """How well the table derives a dry run it did not compute: each committed row that is not a
        grid point (rank 8 anywhere; rank 64, dropout and DoRA at a model's shortest and longest
        length) - the held-out points of the fit grid and the ledger recipes' rows - derived from
        the others. Signed % errors by id, and the largest |error| (the width added to derived cells)."""
        lengths: dict[str, tuple[int, int]] = {}
        for d in self.dry:
            name = model_name(d.model)
            lo, hi = lengths.get(name, (d.seq_len, d.seq_len))
            lengths[name] = (min(lo, d.seq_len), max(hi, d.seq_len))
        rows = {}
        for d in self.dry:
            r = recipe_of(d)
            ends = lengths[model_name(d.model)]
            grid = (r.rank == 8 and not (r.dropout or r.dora)) or (r.seq_len in ends and r.rank in (8, 64))
            if grid:
                continue
            # dry_raw reads the dry-run rows alone: no need to refit the ledger for each one.
            p = Predictor(Ledger(schema_version=SCHEMA_VERSION), [x for x in self.dry if x.id != d.id])
            derived, _ = p.dry_raw(r)
            if derived is not None:
                rows[d.id] = round((derived - d.outcome.peak_allocated_mib) / d.outcome.peak_allocated_mib * 100, 2)
        return {"errors_pct": rows, "max_abs_err_pct": max((abs(e) for e in rows.values()), default=None)}

    def _dry_width(self, recipe: Recipe, derived: bool) -> tuple[float, str]:
        width = (self.dry_loo["max_abs_err_pct"] or 0.0) / 100
        text = f"±{width * 100:.2f}% (the largest leave-one-out error over {self.dry_loo['n']} measured probes)"
        extra = self.dry_derivation["max_abs_err_pct"] if derived else None
        if extra:
            width += extra / 100
            text = (f"±{width * 100:.2f}%: {text[1:]} + {extra:.2f}% (the largest error of deriving, from the "
                    f"others, the {len(self.dry_derivation['errors_pct'])} dry runs the grid does not need; this "
                    "figure is derived, not dry-run itself)")
        return width, text

    def dry_calibrated(self, recipe: Recipe, gpu: str, vendor: Optional[str]) -> Optional[tuple[Interval, list[str], str]]:
        raw, ids = self.dry_raw(recipe)
        if raw is None:
            return None
        rem, scope = self.remainder(gpu, vendor)
        if rem is None:
            rem, scope = 0.0, "no remainder fitted (no measured probe has a dry run): raw dry run"
        width, wtext = self._dry_width(recipe, not self.dry_exact(recipe))
        mib = raw + rem
        text = (f"dry run {raw:.1f} MiB + remainder {rem:+.1f} MiB fitted on {scope}; interval {wtext}"
                + self._family_note(recipe))
        return _around(mib, width), ids, text

    @cached_property
    def dry_fitted_on(self) -> list[str]:
        """Models whose measured probes the dry run's remainder is fitted on."""
        return sorted({model_name(m.model) for m, _, _ in self.dry_pairs})

    def _family_note(self, recipe: Recipe) -> str:
        """Says so when the remainder and its error come from another model's measured rows."""
        fitted = self.dry_fitted_on
        if not fitted or model_name(recipe.model) in fitted:
            return ""
        return (f"; the remainder and its error are measured on {', '.join(fitted)} only, not on "
                f"{model_name(recipe.model)}")

    # -- the probe figure, by the ladder ---------------------------------------------------------

    def probe_figure(self, recipe: Recipe, gpu: str, vendor: Optional[str]) -> tuple[Optional[Interval], str, str, list[str]]:
        """(interval, method, method text, evidence ids) for a one-step probe's peak allocated."""
        group = recipe.group()
        obs = self.peaks.observed(gpu, group).get(recipe.rank)
        if obs is not None:
            if obs.outcome.status == "ok":
                p = ok_peak(obs)
                return _iv(p, p, p), "measured probe", f"probe {obs.id} measured {p} MiB", [obs.id]
            need = _exceeded_peak(obs, self.peaks)
            return (_iv(need, need, None), "measured probe",
                    f"probe {obs.id} ran out of memory ({obs.outcome.status}); it needed at least {need} MiB", [obs.id])
        mine = self.peaks.by_group.get(group, {}).get(gpu)
        if mine:
            pred, ids = self.peaks.predict(gpu, group, recipe.rank)
            w = self.widths["interpolated"] or self.widths["transferred"] or 0.0
            if pred is not None:
                return (_around(pred, w), "interpolated",
                        f"affine in rank over this card's probes of the same recipe; ±{w * 100:.2f}% (largest held-out "
                        f"error over {self.widths['interpolated_n']} probes)", ids)
        by_len = self._interpolate_length(recipe, gpu)
        if by_len is not None:
            return by_len
        dry = self.dry_calibrated(recipe, gpu, vendor)
        if dry is not None:
            iv, ids, text = dry
            return iv, "dry run", text, ids
        if self.peaks.by_group.get(group):
            pred, ids = self.peaks.predict(gpu, group, recipe.rank)
            w = self.widths["transferred"] or self.widths["interpolated"] or 0.0
            if pred is not None:
                return (_around(pred, w), "transferred",
                        f"another card's probes of the same recipe, shifted by the cards' median difference on shared "
                        f"rows; ±{w * 100:.2f}% (largest held-out error of such transfers)", ids)
        return None, "", "no probe, real run or dry run of this recipe near it in the ledger", []

    def _interpolate_length(self, recipe: Recipe, gpu: str):
        if recipe.seq_len is None:
            return None
        seqs = sorted({g.seq_len for g, by in self.peaks.by_group.items() if gpu in by and g.seq_len
                       and g._replace(seq_len=None) == recipe.group()._replace(seq_len=None)})
        lower = [s for s in seqs if s < recipe.seq_len]
        upper = [s for s in seqs if s > recipe.seq_len]
        if not lower or not upper:
            return None
        s1, s2 = lower[-1], upper[0]
        y1, i1 = self.peaks.predict(gpu, replace(recipe, seq_len=s1).group(), recipe.rank)
        y2, i2 = self.peaks.predict(gpu, replace(recipe, seq_len=s2).group(), recipe.rank)
        if y1 is None or y2 is None:
            return None
        y = y1 + (y2 - y1) * (recipe.seq_len - s1) / (s2 - s1)
        w = self.widths["interpolated"] or 0.0
        return (_iv(y, min(y1, y) * (1 - w), max(y2, y) * (1 + w)), "interpolated",
                f"linear in length between this card's probes at {s1} and {s2} tokens (a longer sequence never needs "
                f"less); ±{w * 100:.2f}%", i1 + i2)

    # -- dominance ---------------------------------------------------------------------------------

    def _dominance(self, recipe: Recipe, gpu: str, run: Run, iv: Optional[Interval]) -> tuple[Optional[Interval], list[str], str]:
        """Clamp an interval by rows of harder recipes that fit (top) and easier ones that did not
        (bottom), on this card and of this kind."""
        cap = floor = None
        cap_id = floor_id = None
        if recipe.seq_len is not None:
            own = recipe_keep(recipe) if run == "probe" else None
            for r, status, peak, need, mid, keep in self._dominance_rows.get((gpu, run, model_name(recipe.model),
                                                                             recipe.quant, recipe.fixes), ()):
                # A probe that kept logits for fewer (or unknown) positions than the recipe is not harder.
                longer = own is None or (keep is not None and keep >= own)
                if status == "ok" and longer and (r.rank >= recipe.rank and r.seq_len >= recipe.seq_len
                                                  and r.dropout >= recipe.dropout and r.dora >= recipe.dora):
                    if cap is None or peak < cap:
                        cap, cap_id = peak, mid
                elif status != "ok" and need is not None and (r.rank <= recipe.rank and r.seq_len <= recipe.seq_len
                                                             and r.dropout <= recipe.dropout and r.dora <= recipe.dora):
                    if floor is None or need > floor:
                        floor, floor_id = need, mid
        notes, ids = [], []
        if cap is not None:
            ids.append(cap_id)
            notes.append(f"at most {cap} MiB: {cap_id}, a harder or equal recipe, fit")
        if floor is not None:
            ids.append(floor_id)
            notes.append(f"at least {floor} MiB: {floor_id}, an easier or equal recipe, did not fit")
        if iv is None:
            if cap is None and floor is None:
                return None, [], ""
            return _iv(cap if cap is not None else floor, floor, cap), ids, "; ".join(notes)
        low, high, mib = iv.low_mib, iv.high_mib, iv.mib
        if cap is not None:
            high = cap if high is None else min(high, cap)
            mib = None if mib is None else min(mib, cap)
            low = None if low is None else min(low, cap)
        if floor is not None:
            low = floor if low is None else max(low, floor)
            mib = None if mib is None else max(mib, floor)
            if high is not None and high < low:
                high = low
        return _iv(mib, low, high), ids, "; ".join(notes)

    @cached_property
    def _dominance_rows(self) -> dict[tuple, list]:
        """Rows that bound others, by (card, kind, model, quant, fixes): (recipe, status, ok peak,
        what an OOM needed at least, id, kept logit positions)."""
        out: dict[tuple, list] = defaultdict(list)
        for m in self.ms:
            if m.kind not in ("probe", "real") or m.lora is None or not m.gpu:
                continue
            r = self.recipe_for(m)
            if r is None or r.seq_len is None:
                continue
            status = m.outcome.status
            if status == "ok" and ok_peak(m) is not None:
                out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                    (r, "ok", ok_peak(m), None, m.id, kept_positions(m)))
            elif status in ("oom", "spilled"):
                need = _exceeded_peak(m, self.peaks) if m.kind == "probe" else _real_need(m)
                if need is not None:
                    out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                        (r, status, None, need, m.id, kept_positions(m)))
        return dict(out)

    def measured_failure(self, recipe: Recipe, gpu: str, run: Run) -> Optional[tuple[str, str]]:
        """(id, status) of a row of this run's kind on this card whose recipe is this one or an
        easier one (rank, length, dropout, DoRA all at most this recipe's, no more kept logits)
        and that ran out of memory or spilled: measured, so the recipe will not fit whatever an
        interval says. (A probe's OOM says nothing sure of a real run, which peaks lower.)"""
        if recipe.seq_len is None:
            return None
        own = recipe_keep(recipe) if run == "probe" else None
        for r, status, mid, keep in self._failure_rows.get((gpu, run, model_name(recipe.model), recipe.quant,
                                                            recipe.fixes), ()):
            more_logits = own is not None and keep is not None and keep > own
            if (r.rank <= recipe.rank and r.seq_len <= recipe.seq_len and r.dropout <= recipe.dropout
                    and r.dora <= recipe.dora and not more_logits):
                return mid, status
        return None

    @cached_property
    def _failure_rows(self) -> dict[tuple, list]:
        """Rows that ran out of memory or spilled, by (card, kind, model, quant, fixes): (recipe,
        status, id, kept logit positions)."""
        out: dict[tuple, list] = defaultdict(list)
        for m in self.ms:
            if m.kind not in ("probe", "real") or m.lora is None or not m.gpu or m.outcome.status not in ("oom", "spilled"):
                continue
            r = self.recipe_for(m)
            if r is not None and r.seq_len is not None:
                out[(m.gpu, m.kind, model_name(r.model), r.quant, r.fixes)].append(
                    (r, m.outcome.status, m.id, kept_positions(m)))
        return dict(out)

    # -- limits ------------------------------------------------------------------------------------

    def card_limit(self, gpu: str, entry: Optional[Gpu], run: Run) -> tuple[Optional[float], Optional[float], str]:
        """(low, high, where from) of the effective limit for peak allocated."""
        key = (gpu, None if entry is None else (entry.name, entry.total_mib, entry.usable_gib_torch), run)
        if key not in self._limits:
            self._limits[key] = self._card_limit(gpu, entry, run)
        return self._limits[key]

    def _card_limit(self, gpu: str, entry: Optional[Gpu], run: Run) -> tuple[Optional[float], Optional[float], str]:
        lim: Optional[Limit] = None
        if gpu in self.ledger.gpus:
            lim = (limit_for(self.lims, gpu, "real") if run == "real" else None) or limit_for(self.lims, gpu, "probe")
        if lim is not None and lim.low_mib is not None:
            return lim.low_mib, lim.high_mib, (f"{gpu}'s {lim.kind} limit: largest peak that fit {lim.low_mib} MiB "
                                               f"({lim.fit_id}), smallest that did not {lim.high_mib} MiB "
                                               f"({lim.exceeded_id or 'the card'})")
        usable = capacity_mib(entry)
        if usable is None:
            return None, None, "no limit known for this card: give --budget-mib"
        fit = self.overheads
        if not fit["context"]:
            return None, None, f"no measured card to derive {gpu}'s limit from: give --budget-mib"
        low = (usable - max(fit["context"])) / max(fit["ratio"])
        high = (usable - min(fit["context"])) / min(fit["ratio"])
        return round(low, 1), round(min(high, usable), 1), (
            f"{usable} MiB usable (card table) less the CUDA context ({min(fit['context']):.0f}–"
            f"{max(fit['context']):.0f} MiB), over reserved/allocated ({min(fit['ratio']):.3f}–{max(fit['ratio']):.3f}), "
            f"as measured on {', '.join(fit['cards'])}")

    @cached_property
    def overheads(self) -> dict:
        """Per measured card with both limit ends: the context (usable - limit x reserved ratio)."""
        ctx, ratios, cards = [], [], []
        for lim in self.lims:
            # Only cards whose limit is pinned by an out-of-memory probe close above a fit (within 5%):
            # a card that never ran out of memory says nothing about where its limit is.
            exceeded = next((m for m in self.ms if m.id == lim.exceeded_id), None)
            if (lim.kind != "probe" or lim.low_mib is None or lim.high_mib is None or exceeded is None
                    or exceeded.outcome.status != "oom" or lim.high_mib - lim.low_mib > 0.05 * lim.high_mib):
                continue
            usable = capacity_mib(self.ledger.gpus.get(lim.gpu))
            rs = [m.outcome.peak_reserved_mib / m.outcome.peak_allocated_mib for m in _probes(self.ms)
                  if m.gpu == lim.gpu and ok_peak(m) and m.outcome.peak_reserved_mib]
            if usable is None or not rs:
                continue
            ratio = statistics.median(rs)
            ctx += [usable - lim.high_mib * ratio, usable - lim.low_mib * ratio]
            ratios.append(ratio)
            cards.append(lim.gpu)
        return {"context": ctx, "ratio": ratios, "cards": cards}

    def reserved_ratio(self, gpu: str) -> Optional[tuple[float, float, float]]:
        """(median, min, max) of peak reserved / peak allocated over the card's ok probes, else
        every card's; None when no probe has both."""
        if gpu not in self._ratios:
            probes = [m for m in self.peaks.probes if ok_peak(m) and m.outcome.peak_reserved_mib]
            rs = [m.outcome.peak_reserved_mib / ok_peak(m) for m in probes if m.gpu == gpu] or \
                [m.outcome.peak_reserved_mib / ok_peak(m) for m in probes]
            self._ratios[gpu] = (statistics.median(rs), min(rs), max(rs)) if rs else None
        return self._ratios[gpu]

    # -- the answer ----------------------------------------------------------------------------------

    def resolve_model(self, recipe: Recipe, gpu: str) -> Recipe:
        """A recipe that names no model: the one model this card's probes (else all probes) are of."""
        if recipe.model is None:
            models = sorted({m.model for m in self.peaks.probes if m.gpu == gpu and m.model}
                            or {m.model for m in self.peaks.probes if m.model})
            if len(models) == 1:
                recipe = replace(recipe, model=models[0])
        return recipe

    def predict(self, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
                margin_mib: float = 0.0, budget_mib: Optional[float] = None) -> Answer:
        """The answer for a recipe on a card (a ledger key, or a card-table entry given as ``entry``)."""
        recipe = self.resolve_model(recipe, gpu)
        entry = entry or self.ledger.gpus.get(gpu)
        source = "ledger" if gpu in self.ledger.gpus else "card table"
        vendor = entry.vendor if entry else None
        if recipe.model and gpu in self.ledger.gpus:
            known = {m.model for m in self.ms if model_name(m.model) == model_name(recipe.model)}
            if known:
                recipe = replace(recipe, model=sorted(known)[0])
        probe, method, text, evidence = self.probe_figure(recipe, gpu, vendor)
        if method != "dry run":
            probe, span_text = self._longer_span(recipe, probe, evidence)
            text = f"{text}; {span_text}" if span_text else text
        probe, dom_ids, dom_text = self._dominance(recipe, gpu, "probe", probe)
        if dom_text:
            text = f"{text}; {dom_text}" if text else dom_text
            evidence += [i for i in dom_ids if i not in evidence]
            method = method or "bounded by measured rows"
        real = None
        if run == "real":
            real, method, text, evidence = self._real(recipe, gpu, probe, method, text, evidence)
        judged = real if run == "real" else probe
        ratio = self.reserved_ratio(gpu)
        reserved = (None if judged is None or ratio is None else
                    _scale(judged, ratio[0], ratio[1], ratio[2]))
        if budget_mib is not None:
            low, high, lsrc = budget_mib, budget_mib, f"--budget-mib {budget_mib}"
            source = "budget"
        else:
            low, high, lsrc = self.card_limit(gpu, entry, run)
        verdict, why = decide(judged, low, high, margin_mib)
        # A measured failure on the card is one under any budget below the card's limit too.
        failed = self.measured_failure(recipe, gpu, run) if budget_mib is None or (
            budget_mib <= (self.card_limit(gpu, entry, run)[0] or float("inf"))) else None
        if failed is not None and verdict != "won't fit":
            fid, fstatus = failed
            verdict, why = "won't fit", (f"{fid}, this recipe or an easier one, was measured on {gpu} and ran "
                                         f"{'out of memory' if fstatus == 'oom' else 'past the card (spilled)'}")
            if fid not in evidence:
                evidence = [*evidence, fid]
        return Answer(gpu=gpu, card_source=source, recipe={k: v for k, v in recipe.__dict__.items()}, run=run,
                      probe_allocated=probe, real_allocated=real, reserved=reserved, method=method or None,
                      method_text=text, evidence=evidence, limit_low_mib=low, limit_high_mib=high, limit_source=lsrc,
                      margin_mib=margin_mib, verdict=verdict, why=why)

    def judge_dry(self, recipe: Recipe, raw_mib: float, gpu: Optional[str] = None, *, entry: Optional[Gpu] = None,
                  margin_mib: float = 0.0, budget_mib: Optional[float] = None, derived: bool = False) -> Answer:
        """The answer for a dry run just computed (``raw_mib``: its peak with PyTorch's default
        workspaces, as the committed rows are): plus the card's remainder (all cards' without a
        card), with the leave-one-out interval, judged against the card's limit or the budget."""
        entry = entry or (self.ledger.gpus.get(gpu) if gpu else None)
        rem, scope = self.remainder(gpu or "", entry.vendor if entry else None)
        if rem is None:
            rem, scope = 0.0, "no remainder fitted (no measured probe has a dry run)"
        width, wtext = self._dry_width(recipe, derived)
        mib = raw_mib + rem
        iv = _around(mib, width)
        text = (f"dry run {raw_mib:.1f} MiB + remainder {rem:+.1f} MiB fitted on {scope}; interval {wtext}"
                + self._family_note(recipe))
        if budget_mib is not None:
            low, high, lsrc, source = budget_mib, budget_mib, f"--budget-mib {budget_mib}", "budget"
        elif gpu:
            (low, high, lsrc), source = self.card_limit(gpu, entry, "probe"), (
                "ledger" if gpu in self.ledger.gpus else "card table")
        else:
            low, high, lsrc, source = None, None, "no card or budget given", "budget"
        ratio = self.reserved_ratio(gpu or "")
        verdict, why = decide(iv, low, high, margin_mib)
        return Answer(gpu=gpu or "", card_source=source, recipe=dict(recipe.__dict__), run="probe", probe_allocated=iv,
                      real_allocated=None, reserved=_scale(iv, *ratio) if ratio else None, method="dry run",
                      method_text=text, evidence=[], limit_low_mib=low, limit_high_mib=high, limit_source=lsrc,
                      margin_mib=margin_mib, verdict=verdict, why=why)

    def _real(self, recipe: Recipe, gpu: str, probe: Optional[Interval], method: str, text: str, evidence: list[str]):
        same = []
        for m in self.ms:
            if m.kind == "real" and m.gpu == gpu and m.outcome.status in ("ok", "oom"):
                r = self.recipe_for(m)
                if r is not None and r.seq_len == recipe.seq_len and replace(r, response_len=None, model=model_name(
                        r.model)) == replace(recipe, response_len=None, model=model_name(recipe.model)):
                    same.append(m)
        fits = [m for m in same if ok_peak(m) is not None]
        if fits:
            peaks_ = [ok_peak(m) for m in fits]
            iv = _iv(max(peaks_), min(peaks_), max(peaks_))
            return iv, "measured real run", (f"{len(fits)} real runs of this recipe peaked at {min(peaks_)}–"
                                             f"{max(peaks_)} MiB"), [m.id for m in fits]
        real = None
        if probe is not None and self.over.pct is not None:
            real, how = self.probe_to_real(probe, recipe, evidence)
            text = f"{text}; {how}"
        elif probe is not None:
            text += "; no probe/real pairs to calibrate a real run against"
        real, ids, dom = self._dominance(recipe, gpu, "real", real)
        if dom:
            text = f"{text}; {dom}" if text else dom
            evidence = evidence + [i for i in ids if i not in evidence]
        return real, method, text, evidence

    @cached_property
    def _by_id(self) -> dict[str, Measurement]:
        return {m.id: m for m in self.ms}

    def _evidence_keep(self, evidence: list[str]) -> tuple[bool, Optional[int]]:
        """(any probe among the evidence, the fewest positions they kept logits for - None when
        one of them does not say)."""
        rows = [m for m in map(self._by_id.get, evidence) if m is not None and m.kind == "probe"]
        keeps = [kept_positions(m) for m in rows]
        return bool(rows), (None if not rows or None in keeps else min(keeps))

    def figure_keep(self, recipe: Recipe, evidence: list[str]) -> Optional[int]:
        """Positions the lm_head kept logits for in a probe figure: its evidence probes' fewest (each
        must be known), the recipe's own when the figure was raised to it (``_longer_span``) or has no
        probe behind it."""
        has_rows, keep = self._evidence_keep(evidence)
        own = recipe_keep(recipe)
        if not has_rows:
            return own
        if keep is not None and own is not None and own > keep:
            return own
        return keep

    def _longer_span(self, recipe: Recipe, probe: Optional[Interval], evidence: list[str]):
        """A recipe that keeps logits for more response positions than the probes behind its figure
        needs more: at least their fp32 logits (vocabulary x 4 bytes per position, what the RTX 3070 Ti
        probes moved by between 73 and 319 kept positions), at most the whole logits chain
        (vocabulary x 14 bytes: bf16 logits, their fp32 copy, log-softmax and its gradient)."""
        own = recipe_keep(recipe)
        _, keep = self._evidence_keep(evidence)
        if probe is None or own is None or keep is None or own <= keep:
            return probe, ""
        low = logits_mib(recipe.model, own - keep)
        if low is None:
            return probe, ""
        high = low * LOGIT_CHAIN_BYTES / LOGIT_BYTES
        top = None if probe.high_mib is None else round(probe.high_mib + high, 1)
        return (_shift(probe, low).model_copy(update={"high_mib": top}),
                f"the recipe keeps logits for {own - keep} more response positions than the probes behind it: "
                f"+{low:.1f} MiB (their fp32 logits) to +{high:.1f} MiB (the whole logits chain)")

    def probe_to_real(self, probe: Interval, recipe: Recipe, evidence: list[str]) -> tuple[Interval, str]:
        """A real run's peak from a probe figure: its core (less the kept logits a real run does not
        follow, see ``ledger.calibration``) x (1 - the calibrated over-estimate), with the text saying so."""
        o = self.over
        keep = self.figure_keep(recipe, evidence)
        off = o.logits_off_mib(recipe.model, keep)
        core = _shift(probe, -off)
        real = _scale(core, 1 - o.pct / 100, 1 - o.high_pct / 100, 1 - o.low_pct / 100)
        logits = (f"(probe - {off:.1f} MiB of fp32 logits for {min(keep, o.keep_max)} kept positions)" if off else
                  "probe (kept logits unknown: nothing subtracted)")
        return real, (f"real run = {logits} x (1 - {o.pct}%), the median over-estimate of the anchors "
                      f"({', '.join(a.probe for a in o.anchors)}) on the probe's core, interval from every pair "
                      f"({o.low_pct}–{o.high_pct}%)")

    def _consistent(self, recipe, gpu, entry, run, margin_mib, budget_mib, step, max_rank, fits_rank, tight_rank):
        """Ceilings that respect the physics across recipes: never above an easier recipe's (a
        shorter sequence probed on this card, no dropout, no DoRA), never below a harder one's."""
        seqs = sorted({g.seq_len for g, by in self.peaks.by_group.items() if gpu in by and g.seq_len
                       and model_name(g.model) == model_name(recipe.model) and g.quant == recipe.quant
                       and g.fixes == recipe.fixes} | {recipe.seq_len})
        cap = floor = None
        cap_from = floor_from = ""
        for s in seqs:
            for d in (False, True):
                for k in (False, True):
                    other = replace(recipe, seq_len=s, dropout=d, dora=k)
                    if other == recipe:
                        continue
                    easier = s <= recipe.seq_len and d <= recipe.dropout and k <= recipe.dora
                    harder = s >= recipe.seq_len and d >= recipe.dropout and k >= recipe.dora
                    if not (easier or harder):
                        continue
                    key = (other, gpu, run, margin_mib, budget_mib, step, max_rank)
                    if key not in self._sub:
                        self._sub[key] = self.ceiling(other, gpu, entry=entry, run=run, margin_mib=margin_mib,
                                                      budget_mib=budget_mib, step=step, max_rank=max_rank, _depth=1)
                    c = self._sub[key]
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

    # -- ceilings --------------------------------------------------------------------------------------

    def ceiling(self, recipe: Recipe, gpu: str, *, entry: Optional[Gpu] = None, run: Run = "probe",
                margin_mib: float = 0.0, budget_mib: Optional[float] = None, step: int = 8,
                max_rank: int = 512, _depth: int = 0) -> CeilingAnswer:
        """The largest rank (a multiple of ``step``) whose verdict is ``fits``, and the largest that
        is ``tight`` or better, below the first rank that will not fit."""
        recipe = self.resolve_model(recipe, gpu)
        ranks: list[dict] = []
        fits_rank = tight_rank = None
        known = False
        low = high = None
        for rank in range(step, max_rank + 1, step):
            a = self.predict(replace(recipe, rank=rank), gpu, entry=entry, run=run, margin_mib=margin_mib,
                             budget_mib=budget_mib)
            low, high = a.limit_low_mib, a.limit_high_mib
            fig = a.allocated
            ranks.append({"rank": rank, "verdict": a.verdict, "method": a.method,
                          "mib": fig.mib if fig else None, "high_mib": fig.high_mib if fig else None,
                          "evidence": a.evidence})
            if a.verdict == "unknown":
                continue
            known = True
            if a.verdict == "won't fit":
                break
            if a.verdict == "fits" and tight_rank == fits_rank:
                fits_rank = rank
            tight_rank = rank
        first_known = next((r["rank"] for r in ranks if r["verdict"] != "unknown"), None)
        if not known:
            status, note = "unknown", self.predict(replace(recipe, rank=step), gpu, entry=entry, run=run,
                                                   budget_mib=budget_mib).why
        elif fits_rank is None and tight_rank is None and first_known != step:
            status, note = "unknown", (f"nothing is known below rank {first_known}, and rank {first_known} "
                                       f"{ranks[-1]['verdict'] if ranks[-1]['rank'] == first_known else 'is known'}")
        else:
            status, note = ("ok" if fits_rank is not None or tight_rank is not None else "none-fits"), ""
        if _depth == 0 and status == "ok":
            fits_rank, tight_rank, why = self._consistent(recipe, gpu, entry, run, margin_mib, budget_mib, step,
                                                          max_rank, fits_rank, tight_rank)
            note = why or note
        at_least = fits_rank is not None and fits_rank + step > max_rank
        if at_least:
            note = f"at least {fits_rank}: the search stops at rank {max_rank}"
        return CeilingAnswer(gpu=gpu, run=run, seq_len=recipe.seq_len, fits_rank=fits_rank, tight_rank=tight_rank,
                             status=status, step=step, max_rank=max_rank, at_least=at_least, note=note,
                             limit_low_mib=low, limit_high_mib=high, margin_mib=margin_mib,
                             ranks=[r for r in ranks if r["verdict"] != "unknown"] or ranks[:1])


def ceiling_table(p: Predictor, step: int = 8) -> list[dict]:
    """Rank ceilings (fits and tight) per card x model x quant x fixes x probed length x (no
    dropout, dropout, DoRA), for the site."""
    rows = []
    for gpu in p.ledger.gpus:
        combos = sorted({(model, quant, fixes, seq) for (g, model, quant, fixes), seqs in p.peaks.seqs.items()
                         if g == gpu for seq in seqs}, key=lambda c: (str(c[0]), str(c[1]), str(c[2]), c[3]))
        for model, quant, fixes, seq in combos:
            cells = {}
            for label, d, k in (("no dropout", False, False), ("dropout", True, False), ("DoRA", False, True)):
                c = p.ceiling(Recipe(model=model, quant=quant or "4bit", dropout=d, dora=k, seq_len=seq, fixes=fixes),
                              gpu, step=step)
                cells[label] = {"rank": c.fits_rank, "tight_rank": c.tight_rank, "status": c.status,
                                "at_least": c.at_least}
            rows.append({"gpu": gpu, "model": model, "quant": quant, "fixes": fixes, "seq_len": seq, "ceilings": cells})
    return rows


def m_group(m: Measurement) -> GroupKey:
    from .recipe import group_key

    return group_key(m)


def _real_need(m: Measurement) -> Optional[float]:
    o = m.outcome
    if o.oom is None:
        return None
    if o.oom.max_allocated_mib is not None:
        return o.oom.max_allocated_mib
    if o.oom.allocated_mib is not None:
        return o.oom.allocated_mib + (o.oom.tried_mib or 0.0)
    return None


def decide(iv: Optional[Interval], low: Optional[float], high: Optional[float], margin: float) -> tuple[Verdict, str]:
    """The verdict for a predicted interval against a limit interval, leaning safe."""
    if iv is None or (iv.high_mib is None and iv.low_mib is None):
        return "unknown", "no prediction: nothing measured or dry-run near this recipe"
    if low is None:
        return "unknown", "no limit known for this card: give --budget-mib"
    top = iv.high_mib
    if top is not None and top <= low - margin:
        return "fits", (f"the interval's top, {top} MiB, is at most the limit's low end {low} MiB"
                        + (f" less the {margin} MiB margin" if margin else ""))
    if iv.low_mib is not None and iv.low_mib > (high if high is not None else low) - margin:
        return "won't fit", (f"even the interval's bottom, {iv.low_mib} MiB, is over the limit's high end "
                             f"{high if high is not None else low} MiB" + (f" less the {margin} MiB margin" if margin else ""))
    if top is None:
        return "tight", f"only a lower bound is known ({iv.low_mib} MiB), under the limit's high end {high} MiB"
    return "tight", (f"the interval {iv.low_mib}–{top} MiB reaches past the limit's low end {low} MiB"
                     + (f" less the {margin} MiB margin" if margin else ""))

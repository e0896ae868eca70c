"""The measured peaks of configurations: which rows are probes that fit, the ledger as it stood on
a date, and the peak model (a probe's peak allocated for a card, a recipe group and a rank, affine
in rank within a group, shifted from other cards by their median difference on shared rows)."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from typing import Iterable, Optional

from ledger.vocab.model_configs import model_name
from ledger.core.models import Measurement
from ledger.vocab.recipe import fixes_key, group_key, seq_len_of

from .held_out_views import HeldOutViews
from .peak_rows import _best, _from_rows, _term

# -- rows ------------------------------------------------------------------------------------


def ok_peak(m: Measurement) -> Optional[float]:
    o = m.outcome
    return o.peak_allocated_mib if o.status == "ok" and o.peak_allocated_mib is not None else None


def probes(ms: Iterable[Measurement]) -> list[Measurement]:
    return [m for m in ms if m.kind == "probe" and m.lora is not None and m.gpu]


def date_of(m) -> dt.date:
    return m.provenance.measured_on or dt.date.min


def modelled(m: Measurement) -> bool:
    """Whether the fits can read a row: micro-batch 1, gradient checkpointing on, and for a probe or
    dry run no optimizer step inside the measured step (what probes, dry runs and the program's runs
    are), and LoRA (a full fine-tuning row is not answered yet). A row outside that, such as a
    preflight of a batch of 4 with its AdamW step, stays in the ledger as evidence and on the site,
    but is no point of the peak model, the pairs, the card limits or the dry-run table."""
    return ((m.batch_size or 1) == 1 and m.gradient_checkpointing is not False
            and (m.optimizer is None or m.kind == "real") and m.finetune != "full" and one_gpu(m))


def one_gpu(m: Measurement) -> bool:
    """Whether a row is one GPU's step: a rank of a multi-GPU run (``world_size`` above 1) is kept
    apart from every one-GPU fit and table (its figures are a shard's)."""
    return (m.world_size or 1) == 1


def dry_readable(m: Measurement) -> bool:
    """Whether the dry-run table can read a dry-run row: no optimizer step, with gradient
    checkpointing on or off and any micro-batch (the table keeps each apart: ``DryTable.table``), on
    one GPU."""
    return m.optimizer is None and one_gpu(m)


def before(ms: list[Measurement], as_of: Optional[dt.date], exclude: Iterable[str] = ()) -> list[Measurement]:
    """The ledger as it stood on a date, less some rows (prospective or held-out fits), and less
    the rows the fits cannot read (``modelled``)."""
    drop = set(exclude)
    return [m for m in ms if m.id not in drop and modelled(m) and (
        as_of is None or m.provenance.measured_on is None or m.provenance.measured_on <= as_of)]


# -- peaks of configurations --------------------------------------------------------------------


def rank_slope(ms: list[Measurement], gpu: Optional[str] = None, quant: Optional[str] = None) -> Optional[float]:
    """MiB per rank unit: the pooled within-group slope of ok probes (each group centred)."""
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for m in probes(ms):
        if (gpu is None or m.gpu == gpu) and (quant is None or m.quant == quant) and ok_peak(m) is not None:
            groups[(m.gpu, *group_key(m))].append((float(m.lora.rank), ok_peak(m)))
    sxy = sxx = 0.0
    for pts in groups.values():
        if len({x for x, _ in pts}) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    return sxy / sxx if sxx else None


class PeakModel(HeldOutViews):
    """Predicts a probe's peak allocated for (card, group, rank) from ok probes. Its views less some
    rows (``without``, leave-one-out and the held-out widths) are ``HeldOutViews``'."""

    def __init__(self, ms: list[Measurement]):
        self._root: Optional["PeakModel"] = None
        self._excluded: frozenset = frozenset()
        self._ms: Optional[list[Measurement]] = list(ms)
        self._probes: Optional[list[Measurement]] = probes(self._ms)
        # Per group and card, the ok probes as (rank, peak, id); per fixes key, the probed lengths.
        self._cells: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
        self._seq_rows: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        self._cell_of: dict[str, tuple] = {}
        self._seq_of: dict[str, tuple] = {}
        self._seqs: Optional[dict[tuple, set]] = defaultdict(set)
        for m in self._probes:
            seq = seq_len_of(m)
            if seq:
                key = (m.gpu, m.model, m.quant, fixes_key(m.memory_fixes))
                self._seqs[key].add(seq)
                self._seq_rows[key].append((m.id, seq))
                self._seq_of[m.id] = key
            peak = ok_peak(m)
            if peak is not None:
                key = (group_key(m), m.gpu)
                self._cells[key].append((float(m.lora.rank), peak, m.id))
                self._cell_of[m.id] = key
        self.by_group: dict[tuple, dict[str, list[tuple[float, float, str]]]] = defaultdict(dict)
        for (group, gpu), rows in self._cells.items():
            self.by_group[group][gpu] = _best(rows)
        # Held-out answers shared by this model and every model made from it (``own_held_out``,
        # ``transfer_held_out``), keyed by all they read.
        self._held: dict[tuple, tuple] = {}
        self._reset()

    def _reset(self) -> None:
        self._slopes: dict = {}
        self._cache: dict = {}
        self._observed: Optional[dict] = None
        self._offsets: dict = {}

    @property
    def ms(self) -> list[Measurement]:
        if self._ms is None:
            self._ms = [m for m in self._root._ms if m.id not in self._excluded]
        return self._ms

    @property
    def probes(self) -> list[Measurement]:
        if self._probes is None:
            self._probes = [m for m in self._root._probes if m.id not in self._excluded]
        return self._probes

    @property
    def seqs(self) -> dict[tuple, set]:
        """(card, model, quant, fixes key) -> the lengths of its probes."""
        if self._seqs is None:
            root, excluded = self._root, self._excluded
            seqs = defaultdict(set, root._seqs)
            for key in {root._seq_of[i] for i in excluded if i in root._seq_of}:
                left = {s for i, s in root._seq_rows[key] if i not in excluded}
                if left:
                    seqs[key] = left
                else:
                    del seqs[key]
            self._seqs = seqs
        return self._seqs

    def lengths(self, gpu: str, group: tuple) -> list[int]:
        """The lengths this card has ok probes of in the groups that differ from ``group`` by their
        sequence length alone, sorted."""
        if "lengths" not in self._offsets:
            index: dict[tuple, set] = defaultdict(set)
            for g, by in self.by_group.items():
                if g.seq_len:
                    for card in by:
                        index[(card, g._replace(seq_len=None))].add(g.seq_len)
            self._offsets["lengths"] = {k: sorted(v) for k, v in index.items()}
        return self._offsets["lengths"].get((gpu, group._replace(seq_len=None)), [])

    def model_lengths(self, gpu: str, model: Optional[str], quant: str, fixes: str) -> set[int]:
        """The lengths this card has ok probes of for a model (by short name), quant and fixes."""
        if "model_lengths" not in self._offsets:
            index: dict[tuple, set] = defaultdict(set)
            for g, by in self.by_group.items():
                if g.seq_len:
                    for card in by:
                        index[(card, model_name(g.model), g.quant, g.fixes)].add(g.seq_len)
            self._offsets["model_lengths"] = dict(index)
        return self._offsets["model_lengths"].get((gpu, model_name(model), quant, fixes), set())

    def observed(self, gpu: str, group: tuple) -> dict[int, Measurement]:
        """Probes of this card and group that ran to an outcome (ok, oom or spilled), by rank."""
        if self._root is not None:
            out = self._root.observed(gpu, group)
            if any(m.id in self._excluded for m in out.values()):  # a removed row may hide another
                out = {}
                for m in self._root._observed_rows.get((gpu, group), []):
                    if m.id not in self._excluded:
                        out[m.lora.rank] = m
            return out
        if self._observed is None:
            self._observed = defaultdict(dict)
            self._observed_rows: dict[tuple, list[Measurement]] = defaultdict(list)
            for m in self.probes:
                if m.outcome.status in ("ok", "oom", "spilled"):
                    self._observed[(m.gpu, group_key(m))][m.lora.rank] = m
                    self._observed_rows[(m.gpu, group_key(m))].append(m)
        return self._observed.get((gpu, group), {})

    def offset(self, gpu: str, other: str) -> float:
        """Median difference of this card's peaks over another's at the same group and rank
        (allocator and library versions differ a little); 0 when they share no row."""
        if (gpu, other) not in self._offsets:
            diffs = self._diff_list(gpu, other)
            self._offsets[(gpu, other)] = statistics.median(diffs) if diffs else 0.0
        return self._offsets[(gpu, other)]

    def _diffs(self, group: tuple, gpu: str, other: str) -> list[float]:
        rows = self.by_group.get(group, {})
        mine = {x: y for x, y, _ in rows.get(gpu, [])}
        return [mine[x] - y for x, y, _ in rows.get(other, []) if x in mine]

    def _sorted_diffs(self, gpu: str, other: str) -> list[float]:
        key = ("sorted", gpu, other)
        if key not in self._offsets:
            self._offsets[key] = sorted(d for group in self.by_group for d in self._diffs(group, gpu, other))
        return self._offsets[key]

    def slope(self, gpu: str, quant: Optional[str]) -> Optional[float]:
        """MiB per rank: ``rank_slope`` of this card and quant, else of the quant, else of all."""
        if (gpu, quant) not in self._slopes:
            self._slopes[(gpu, quant)] = (self._pooled(gpu, quant) or self._pooled(None, quant)
                                          or self._pooled(None, None))
        return self._slopes[(gpu, quant)]

    def _pooled(self, gpu: Optional[str], quant: Optional[str]) -> Optional[float]:
        """``rank_slope(self.ms, gpu, quant)``, from each group's sums (the root's, those of the groups
        a view changed recomputed), added in the order rank_slope meets the groups."""
        terms = self._slope_terms()
        sxy = sxx = 0.0
        for pos, g, q, gxy, gxx in terms:
            if (gpu is None or g == gpu) and (quant is None or q == quant):
                sxy += gxy
                sxx += gxx
        return sxy / sxx if sxx else None

    def _slope_terms(self) -> list[tuple]:
        """(first position, card, quant, sxy, sxx) of each group with two ranks, in order."""
        if "terms" in self._slopes:
            return self._slopes["terms"]
        root = self.root
        if root is self:
            self._points: dict[tuple, list[tuple[float, float, str, int]]] = defaultdict(list)
            for pos, m in enumerate(self.probes):
                if ok_peak(m) is not None:
                    self._points[(m.gpu, *group_key(m))].append((float(m.lora.rank), ok_peak(m), m.id, pos))
            self._terms = {k: _term(k, pts) for k, pts in self._points.items()}
            self._point_keys: dict[tuple, list[tuple]] = defaultdict(list)  # a group's keys (one per card)
            self._point_ids = {k: frozenset(p[2] for p in pts) for k, pts in self._points.items()}
            for k in self._points:
                self._point_keys[tuple(k[1:])].append(k)
            terms = [t for t in self._terms.values() if t is not None]
        else:
            root_terms = root._slope_terms()
            changed = {}
            for group in self._touched:
                for k in root._point_keys.get(tuple(group), ()):
                    gone = root._point_ids[k] & self._excluded
                    if gone:
                        term = root._term_less(k, gone)
                        if term != root._terms[k]:
                            changed[k] = term
            if changed:
                terms = sorted((t for t in {**root._terms, **changed}.values() if t is not None), key=lambda t: t[0])
            else:  # the root's list itself: its slopes are this model's (``predict``)
                terms = root_terms
        self._slopes["terms"] = terms
        return terms

    def predict(self, gpu: str, group: tuple, rank: int) -> tuple[Optional[float], list[str]]:
        """(predicted peak, ids of the rows it rests on); (None, []) when unknown."""
        key = (gpu, group, rank)
        if key not in self._cache:
            if self._root is not None and group not in self._touched and self._reads_roots(gpu, group):
                # A group this view did not change, answered from what the root's answer reads.
                self._cache[key] = self._root.predict(gpu, group, rank)
            else:
                self._cache[key] = self._predict(gpu, group, rank)
        return self._cache[key]

    def _predict(self, gpu: str, group: tuple, rank: int) -> tuple[Optional[float], list[str]]:
        rows_by_gpu = self.by_group.get(group)
        if not rows_by_gpu:
            return None, []
        rows = rows_by_gpu.get(gpu)
        if not rows:  # borrow other cards' rows, shifted by how this card differs from them
            rows = []
            for other in sorted(rows_by_gpu):
                shift = self.offset(gpu, other)
                rows += [(x, round(y + shift, 1), i) for x, y, i in rows_by_gpu[other]]
        return _from_rows(rows, rank, lambda: self.slope(gpu, group[1]))

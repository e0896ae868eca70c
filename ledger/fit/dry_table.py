"""The dry-run table: the committed dry-run rows of a model, and every other recipe derived from
them (affine in rank, the slope per rank linear in length, dropout's and DoRA's cost over the plain
recipe interpolated in length), with how well that derivation does on rows it did not need."""

from __future__ import annotations

import re
from collections import defaultdict
from bisect import bisect_left
from functools import cached_property
from typing import Callable, Optional

import numpy as np

from ledger.vocab.adapter import ALL_LINEAR, adapter_mib, experts_adapted
from ledger.vocab.model_configs import model_name
from ledger.core.models import Measurement, SimulatedAllocator
from ledger.vocab.recipe import FUSED_PROJECTIONS, Recipe, fixes_key, module_names, recipe_of, targets_of_row


#: The rank the fit grid computes at every length it computes (rank 64, dropout and DoRA only at a
#: few: ``ledger.answer.fits.grid_points``).
GRID_RANK = 8


#: A kind of recipe needs this many dry runs derived from the others before its own largest error
#: widens its derived figures (else the largest error of every kind does).
MIN_KIND_ROWS = 20


def kind_of(recipe: Recipe) -> str:
    """The kind of derivation a recipe's figure is: its memory fixes and gradient checkpointing
    ('fixes none, checkpointing on'), and whether LoRA adapts a mixture of experts' fused experts
    ('..., experts adapted'). The program's preset (its chunked MLP and kept logits), the stock step,
    the step without checkpointing and an adapter of rank x experts over every routed token each
    grow with rank and length by their own rule."""
    kind = f"fixes {recipe.fixes}, checkpointing {'on' if recipe.checkpointing else 'off'}"
    return kind + ", experts adapted" if experts_adapted(recipe.model, recipe.targets) else kind


class DryTable:
    """Dry-run peaks by model, quant, fixes, dropout, DoRA and response span; ``raw`` answers any
    rank and length the rows reach."""

    def __init__(self, dry: list[Measurement]):
        # LoRA rows with a peak only: a dry run recorded as an OOM (a budget, or a step past what
        # any device holds) has no figure to interpolate, and full fine-tuning's rows are
        # ``ledger.fit.full_table``'s.
        self.dry = dry if all(m.outcome.peak_allocated_mib is not None and m.lora is not None for m in dry) else \
            [m for m in dry if m.outcome.peak_allocated_mib is not None and m.lora is not None]
        self._tables: dict = {}
        self._by_model: Optional[dict] = None
        self._slopes: dict = {}
        self._figures: dict = {}  # rank_figure's, by what it reads of the recipe
        self._weights: Optional[dict] = None  # weights_figure's rows, by what the weights depend on
        self._by_id: Optional[dict] = None

    def table(self, name: Optional[str], quant: str, fixes: str, dropout: bool, dora: bool,
              response_len: Optional[int], checkpointing: bool = True, batch: int = 1,
              targets: tuple[str, ...] = ALL_LINEAR) -> dict[int, dict[int, tuple[float, str]]]:
        """Dry-run peaks by length and rank for one model, quant, fixes, dropout and DoRA, with
        gradient checkpointing on or off, at one micro-batch, of LoRA on ``targets`` (the highest
        where several response lengths match)."""
        key = (name, quant, fixes, dropout, dora, response_len, checkpointing, batch, targets)
        if key not in self._tables:
            if self._by_model is None:
                self._by_model = defaultdict(list)
                for d in self.dry:
                    self._by_model[model_name(d.model)].append(d)
            table: dict[int, dict[int, tuple[float, str]]] = defaultdict(dict)
            for d in self._by_model.get(name, []):
                if (d.quant == quant and bool(d.lora.dropout) == dropout and bool(d.lora.dora) == dora
                        and (d.gradient_checkpointing is not False) == checkpointing
                        and (d.batch_size or 1) == batch
                        and fixes_key(d.memory_fixes) == fixes and (response_len is None or d.response_len == response_len)
                        and targets_of_row(d.lora.target_modules) == targets):
                    cell = table[d.seq_len]
                    if d.lora.rank not in cell or d.outcome.peak_allocated_mib > cell[d.lora.rank][0]:
                        cell[d.lora.rank] = (d.outcome.peak_allocated_mib, d.id)
            self._tables[key] = dict(table)
        return self._tables[key]

    def _slope(self, table: dict, seq: int) -> Optional[float]:
        """MiB per rank at a length (remembered per table and length: tables are never changed)."""
        key = (id(table), seq)
        if key not in self._slopes:
            self._slopes[key] = self._slope_of(table, seq)
        return self._slopes[key]

    @staticmethod
    def _slope_of(table: dict, seq: int) -> Optional[float]:
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

    def raw(self, recipe: Recipe) -> tuple[Optional[float], list[str]]:
        """The dry run's peak for a recipe from the committed rows of the same model, quant and fixes
        (and response length when given): affine in rank (a length with one rank takes its slope
        per rank from the lengths with two, linear in length); between two dry-run lengths, linear
        in length - for dropout or DoRA, the plain recipe at this length plus their cost over it,
        interpolated in length. With the ids of the rows it rests on."""
        return self.rank_figure(recipe)(recipe.rank)

    def rank_figure(self, recipe: Recipe) -> Callable[[int], tuple[Optional[float], list[str]]]:
        """``raw`` as a function of the rank alone, the tables and lengths it reads looked up once
        (the fit table asks some ten ranks of each of ten thousand cells)."""
        key = (model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dropout, recipe.dora, recipe.span(),
               recipe.checkpointing, recipe.seq_len, recipe.batch, recipe.targets)
        found = self._figures.get(key)
        if found is None:
            found = self._figures[key] = self._rank_figure(recipe)
        return found

    def _rank_figure(self, recipe: Recipe) -> Callable[[int], tuple[Optional[float], list[str]]]:
        """The chord of the table's rows (``_chord_figure``), never below the end of the step's
        backward (``end_figure``): past the largest rank a row has, a chord of the rows is a lower
        bound, since the peak is the highest of the step's moments, each affine in the rank (the
        gradients that exist at the end of backward grow faster with the rank than the activations
        that peak at its start)."""
        chord, end = self._chord_figure(recipe), self.end_figure(recipe)
        if end is None:
            return chord

        def figure(rank: int) -> tuple[Optional[float], list[str]]:
            y, ids = chord(rank)
            return (y, ids) if y is None else (max(y, end(rank)), ids)

        def column(ranks: np.ndarray) -> np.ndarray:
            y = chord.column(ranks)
            return np.where(np.isnan(y), y, np.maximum(y, end.column(ranks)))
        figure.column = column
        return figure

    def weights_figure(self, recipe: Recipe) -> Optional[Callable[[int], float]]:
        """What the step's weights hold at a rank, as the dry runs measured it before their step:
        the model as prepared (its quantised or bf16 weights, what peft upcasts), the adapter, and
        what the dry run adds to the tracker's figures (``_extras``), from
        a dry-run row of the same model, quant, memory fixes and DoRA (at any length or rank: the
        adapter's share is exact from the config, ``ledger.vocab.adapter.adapter_mib``). None where no
        row or no config says."""
        if self._weights is None:
            self._weights = {}
            for d in self.dry:
                if d.outcome.pre_step_mib is None or d.optimizer:
                    continue
                targets = tuple(d.lora.target_modules)
                own = adapter_mib(d.model, d.lora.rank, targets, bool(d.lora.dora))
                if own is None:
                    continue
                key = (model_name(d.model), d.quant, fixes_key(d.memory_fixes), bool(d.lora.dora))
                base = d.outcome.pre_step_mib - own + _extras(d)
                found = self._weights.get(key)
                if found is None or base > found[0]:
                    self._weights[key] = (base, d.model, any(t in FUSED_PROJECTIONS for t in targets))
        found = self._weights.get((model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dora))
        if found is None:
            return None
        base, model, fused = found
        dora, targets = recipe.dora, _as_named(recipe.targets, fused)

        def weights(rank: int) -> float:
            return base + adapter_mib(model, rank, targets, dora)
        return weights

    def end_figure(self, recipe: Recipe) -> Optional[Callable[[int], float]]:
        """The step at the end of its backward, as a function of the rank: the weights
        (``weights_figure``) and the adapter's gradients (as large as its fp32 weights). A floor of
        the step's peak; None where ``weights_figure`` is."""
        weights = self.weights_figure(recipe)
        if weights is None:
            return None
        found = self._weights[(model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dora)]
        model, targets, dora = found[1], _as_named(recipe.targets, found[2]), recipe.dora

        def end(rank: int) -> float:
            return weights(rank) + adapter_mib(model, rank, targets, dora)
        end.column = lambda ranks: np.array([end(int(r)) for r in ranks], dtype=float)
        return end

    def _chord_figure(self, recipe: Recipe) -> Callable[[int], tuple[Optional[float], list[str]]]:
        none = _unreached()
        if recipe.seq_len is None:
            return none
        name, seq = model_name(recipe.model), recipe.seq_len
        args = (name, recipe.quant, recipe.fixes)
        own = self.table(*args, recipe.dropout, recipe.dora, recipe.span(), recipe.checkpointing, recipe.batch,
                         recipe.targets)
        plain = self.table(*args, False, False, recipe.span(), recipe.checkpointing, recipe.batch, recipe.targets)

        def bracket(s: int) -> bool:
            # A length whose only row is of another rank than the grid's (a held-out point)
            # answers other ranks only along an interpolated slope: the nearest lengths with the
            # grid's rank, or two ranks, bracket instead where there are such.
            return len(own[s]) >= 2 or GRID_RANK in own[s]

        lower = [s for s in own if s < seq and bracket(s)] or [s for s in own if s < seq]
        upper = [s for s in own if s > seq and bracket(s)] or [s for s in own if s > seq]
        if seq in own and (bracket(seq) or not lower or not upper):
            return self._cell_figure(own, seq, plain)
        if not lower or not upper:
            return none
        s1, s2 = max(lower), min(upper)
        exact = own.get(seq, {})  # a held-out row of this length: its own rank is itself
        f1, f2 = self._cell_figure(own, s1, plain), self._cell_figure(own, s2, plain)
        with_cost = (recipe.dropout or recipe.dora) and seq in plain and s1 in plain and s2 in plain
        g0, g1, g2 = (self._cell_figure(plain, x, plain) for x in (seq, s1, s2)) if with_cost else (None,) * 3

        def figure(rank: int) -> tuple[Optional[float], list[str]]:
            if rank in exact:
                return exact[rank][0], [exact[rank][1]]
            (y1, i1), (y2, i2) = f1(rank), f2(rank)
            if y1 is None or y2 is None:
                return None, []
            if with_cost:
                (p0, i0), (p1, _), (p2, _) = g0(rank), g1(rank), g2(rank)
                if None not in (p0, p1, p2):
                    d1, d2 = y1 - p1, y2 - p2
                    return p0 + d1 + (d2 - d1) * (seq - s1) / (s2 - s1), i0 + i1 + i2
            return y1 + (y2 - y1) * (seq - s1) / (s2 - s1), i1 + i2

        def column(ranks: np.ndarray) -> np.ndarray:
            y1, y2 = f1.column(ranks), f2.column(ranks)
            if with_cost:
                p0, p1, p2 = g0.column(ranks), g1.column(ranks), g2.column(ranks)
                d1, d2 = y1 - p1, y2 - p2
                out = np.where(np.isnan(p0) | np.isnan(p1) | np.isnan(p2),
                               y1 + (y2 - y1) * (seq - s1) / (s2 - s1), p0 + d1 + (d2 - d1) * (seq - s1) / (s2 - s1))
            else:
                out = y1 + (y2 - y1) * (seq - s1) / (s2 - s1)
            out[np.isnan(y1) | np.isnan(y2)] = np.nan
            return _with_exact(out, ranks, exact)
        figure.column = column
        return figure

    def _cell_figure(self, table: dict, seq: int, slope_table: dict) -> Callable[[int], tuple[Optional[float], list[str]]]:
        """One length's figure and rows as a function of the rank: the row itself, else between
        (or along) its two nearest ranks, else its one rank along the slope per rank."""
        cell = table.get(seq)
        if not cell:
            return _unreached()
        ranks = sorted(cell)
        if len(ranks) >= 2:
            def interpolated(rank: int) -> tuple[float, list[str]]:
                if rank in cell:
                    return cell[rank][0], [cell[rank][1]]
                i = bisect_left(ranks, rank)
                a, b = (ranks[i - 1], ranks[i]) if 0 < i < len(ranks) else (ranks[0], ranks[1]) if i == 0 \
                    else (ranks[-2], ranks[-1])
                (ya, ia), (yb, ib) = cell[a], cell[b]
                return ya + (yb - ya) * (rank - a) / (b - a), [ia, ib]

            known = np.array(ranks, dtype=float)
            ys = np.array([cell[r][0] for r in ranks])

            def column(at: np.ndarray) -> np.ndarray:
                i = np.clip(np.searchsorted(known, at, "left"), 1, len(ranks) - 1)
                a, b, ya, yb = known[i - 1], known[i], ys[i - 1], ys[i]
                return _with_exact(ya + (yb - ya) * (at - a) / (b - a), at, cell)
            interpolated.column = column
            return interpolated
        slope = self._slope(table, seq)
        if slope is None:
            slope = self._slope(slope_table, seq)
        r0 = ranks[0]
        y0, i0 = cell[r0]

        def along(rank: int) -> tuple[Optional[float], list[str]]:
            if rank == r0:
                return y0, [i0]
            return (None, []) if slope is None else (y0 + slope * (rank - r0), [i0])

        def column(at: np.ndarray) -> np.ndarray:
            out = np.full(len(at), np.nan) if slope is None else y0 + slope * (at - r0)
            out[at == r0] = y0
            return out
        along.column = column
        return along

    def exact_ranks(self, recipe: Recipe) -> set:
        """The ranks a committed dry-run row has of this very recipe at its length."""
        table = self.table(model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dropout, recipe.dora,
                           recipe.span(), recipe.checkpointing, recipe.batch, recipe.targets)
        return set(table.get(recipe.seq_len, {}))

    def exact(self, recipe: Recipe) -> bool:
        """Whether a committed dry-run row is of this very recipe (else its figure is derived)."""
        return recipe.rank in self.exact_ranks(recipe)

    def simulated(self, recipe: Recipe) -> Optional[SimulatedAllocator]:
        """The simulated allocator of the committed dry-run row of this very recipe, where it has
        one; else None."""
        table = self.table(model_name(recipe.model), recipe.quant, recipe.fixes, recipe.dropout, recipe.dora,
                           recipe.span(), recipe.checkpointing, recipe.batch, recipe.targets)
        cell = table.get(recipe.seq_len, {}).get(recipe.rank)
        if cell is None:
            return None
        if self._by_id is None:
            self._by_id = {d.id: d for d in self.dry}
        row = self._by_id.get(cell[1])
        return None if row is None else row.outcome.allocator

    @cached_property
    def derivation(self) -> dict:
        """How well the table derives a dry run it did not compute: each committed row that is not a
        grid point (rank 8 anywhere; rank 64, dropout and DoRA at a model's shortest and longest
        length) - the held-out points of the fit grid and the ledger recipes' rows - derived from
        the others. Signed % errors by id, and the largest |error| (the width added to derived cells)."""
        lengths: dict[str, tuple[int, int]] = {}
        by_model: dict[str, list[Measurement]] = defaultdict(list)
        for d in self.dry:
            name = model_name(d.model)
            lo, hi = lengths.get(name, (d.seq_len, d.seq_len))
            lengths[name] = (min(lo, d.seq_len), max(hi, d.seq_len))
            by_model[name].append(d)
        rows = {}
        kinds: dict[str, list[float]] = defaultdict(list)
        for d in self.dry:
            r = recipe_of(d)
            name = model_name(d.model)
            ends = lengths[name]
            grid = (r.rank == 8 and not (r.dropout or r.dora)) or (r.seq_len in ends and r.rank in (8, 64))
            if grid:
                continue
            # A recipe's figure reads only its model's tables: the table of the model's other rows
            # derives it as the whole table less this row would.
            derived, _ = DryTable([x for x in by_model[name] if x.id != d.id]).raw(r)
            if derived is not None:
                rows[d.id] = round((derived - d.outcome.peak_allocated_mib) / d.outcome.peak_allocated_mib * 100, 2)
                kinds[kind_of(r)].append(abs(rows[d.id]))
        return {"errors_pct": rows, "max_abs_err_pct": max((abs(e) for e in rows.values()), default=None),
                "by_kind": {k: {"max_abs_err_pct": max(v), "n": len(v)} for k, v in sorted(kinds.items())}}

    def derivation_pct(self, recipe: Optional[Recipe]) -> tuple[Optional[float], int, Optional[str]]:
        """The error a derived figure of this recipe is widened by: the largest |error| of deriving
        the dry runs of the same kind (memory fixes, checkpointing: each derives by its own physics)
        where at least ``MIN_KIND_ROWS`` measure it, else the largest of every kind. Returns
        (% or None, how many rows, the kind or None for every kind)."""
        d = self.derivation
        kind = kind_of(recipe) if recipe is not None else None
        found = d["by_kind"].get(kind) if kind else None
        if found and found["n"] >= MIN_KIND_ROWS:
            return found["max_abs_err_pct"], found["n"], kind
        return d["max_abs_err_pct"], len(d["errors_pct"]), None


def _as_named(targets: tuple[str, ...], fused: bool) -> tuple[str, ...]:
    """The recipe's projections as a model names its modules (its fused ones where it fuses them);
    as they are where a fused module is asked in part (an upper bound: the parts' adapters apart)."""
    try:
        return tuple(module_names(targets, fused))
    except ValueError:
        return targets


#: What a dry run adds to the tracker's figures when no row says (two cuBLAS handles' workspaces,
#: PyTorch's default): ``probe_kit.dry_run.CUBLAS_HANDLES`` x ``CUBLAS_WORKSPACE_MIB``.
DEFAULT_EXTRAS_MIB = 16.2
_EXTRAS = re.compile(r'"(?:cublas_workspace|vision_tower)_mib": ([0-9.]+)')


def _extras(d: Measurement) -> float:
    """What the dry run added to its tracker's figures (the cuBLAS workspaces, a vision tower the
    text model does not hold), as its breakdown records them."""
    for note in d.provenance.notes:
        found = _EXTRAS.findall(note)
        if found:
            return sum(float(x) for x in found)
    return DEFAULT_EXTRAS_MIB


def _unreached() -> Callable[[int], tuple[Optional[float], list[str]]]:
    """A figure the table does not reach at any rank (with its ``column``: nan at every rank)."""
    def none(rank: int) -> tuple[Optional[float], list[str]]:
        return None, []
    none.column = lambda ranks: np.full(len(ranks), np.nan)
    return none


def _with_exact(out: np.ndarray, ranks: np.ndarray, cell: dict) -> np.ndarray:
    """``out`` with each rank a row has of itself set to that row's figure."""
    for rank, (y, _) in cell.items():
        out[ranks == rank] = y
    return out

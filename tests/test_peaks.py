"""The peak model fitted less some rows (``PeakModel.without``) answers exactly as one fitted on
the remaining rows: leave-one-out and the held-out widths rely on it."""

from __future__ import annotations

import operator
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from synthetic import synthetic_ledger  # noqa: E402

from ledger.storage import store  # noqa: E402
from ledger.core.paths import DEFAULT_LEDGER  # noqa: E402
from ledger.fit.peaks import PeakModel, rank_slope  # noqa: E402
from ledger.answer.rank_judge import dry_judge  # noqa: E402
from ledger.vocab.recipe import group_key  # noqa: E402

DATA = Path(__file__).parent / "data"


def _answers(pm: PeakModel, ms) -> dict:
    gpus = sorted({m.gpu for m in ms if m.gpu})
    groups = sorted({group_key(m) for m in ms if m.lora}, key=str)
    quants = sorted({m.quant for m in ms if m.quant}) + [None]
    return {
        "by_group": {g: dict(sorted(by.items())) for g, by in pm.by_group.items()},
        "seqs": dict(pm.seqs),
        "observed": {(gpu, g): {r: m.id for r, m in pm.observed(gpu, g).items()} for gpu in gpus for g in groups},
        "offsets": {(a, b): pm.offset(a, b) for a in gpus for b in gpus if a != b},
        "slopes": {(gpu, q): pm.slope(gpu, q) for gpu in gpus for q in quants},
        "predict": {(gpu, g, r): pm.predict(gpu, g, r) for gpu in gpus for g in groups for r in (8, 40, 96, 300)},
        "probes": [m.id for m in pm.probes],
        "ms": [m.id for m in pm.ms],
    }


@pytest.mark.parametrize("source", ["bundled", "small", "synthetic"])
def test_without_equals_a_model_fitted_on_the_rest(source):
    ms = {"bundled": lambda: store.load(DEFAULT_LEDGER).measurements,
          "small": lambda: store.load(DATA / "small-ledger.json").measurements,
          "synthetic": lambda: synthetic_ledger(160, seed=7).measurements}[source]()
    full = PeakModel(ms)
    rng = random.Random(1)
    for trial in range(12):
        drop = {m.id for m in rng.sample(ms, k=min(len(ms), 1 + trial % 4))}
        if trial % 3 == 0:  # a whole cell at once, as the held-out transfer width removes it
            m = rng.choice([m for m in ms if m.kind == "probe" and m.lora])
            drop |= {x.id for x in ms if x.gpu == m.gpu and x.lora and group_key(x) == group_key(m)}
        rest = [m for m in ms if m.id not in drop]
        assert _answers(full.without(drop), ms) == _answers(PeakModel(rest), ms), (source, trial, sorted(drop))
        # a view of a view removes the union
        first, second = set(list(drop)[:1]), set(list(drop)[1:])
        assert _answers(full.without(first).without(second), ms) == _answers(PeakModel(rest), ms)


def test_pooled_slope_is_rank_slope():
    ms = synthetic_ledger(120, seed=2).measurements
    pm = PeakModel(ms)
    for gpu in ("rtx-3070-ti", "rx-7900-xtx", None):
        for quant in ("4bit", "bf16", None):
            assert pm._pooled(gpu, quant) == rank_slope(ms, gpu, quant)


def test_a_predictor_started_from_the_full_one_answers_as_a_fresh_one():
    """Leave-one-out starts each predictor from the full one (``Predictor(base=...)``): the answers,
    limits, reserved/allocated ratios, over-estimate and widths are those of a predictor fitted from
    scratch without the row."""
    from dataclasses import replace

    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import recipe_of

    dry = load_dry_runs()
    for lg in (store.load(DEFAULT_LEDGER), synthetic_ledger(90, seed=5)):
        full = Predictor(lg, dry)
        rng = random.Random(3)
        rows = [m for m in lg.measurements if m.lora is not None and m.gpu]
        for m in rng.sample(rows, k=min(14, len(rows))):
            fresh = Predictor(lg, dry, exclude=[m.id])
            started = Predictor(lg, dry, exclude=[m.id], base=full)
            assert started.fit.widths == fresh.fit.widths
            assert started.fit.over == fresh.fit.over and started.fit.lims == fresh.fit.lims
            assert started.fit.real_seq == fresh.fit.real_seq
            assert started.dominance._rows == fresh.dominance._rows
            assert [d.id for d in started.dry] == [d.id for d in fresh.dry]
            for card in (*lg.gpus, "rtx-4090", ""):  # the card's own ratio, or every card's pooled
                assert started.reserved_ratio(card) == fresh.reserved_ratio(card), (m.id, card)
            r = recipe_of(m)
            for recipe in (r, replace(r, rank=r.rank * 2), replace(r, dropout=not r.dropout)):
                if recipe.seq_len is None:
                    recipe = replace(recipe, seq_len=4096)
                for run in ("probe", "real"):
                    a, b = started.predict(recipe, m.gpu, run=run), fresh.predict(recipe, m.gpu, run=run)
                    assert a.model_dump() == b.model_dump(), (m.id, recipe, run)


def test_a_held_out_fit_keeps_the_bases_dry_rows_less_the_ones_left_out():
    """A fit started from another of the very same dry-run rows keeps the other's (the same list
    while none of them is left out), less any left out; other rows are filtered afresh."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor

    dry = load_dry_runs()
    lg = store.load(DEFAULT_LEDGER)
    full = Predictor(lg, dry)
    probe = next(m for m in lg.measurements if m.kind == "probe")
    started = Predictor(lg, dry, exclude=[probe.id], base=full)
    assert started.dry is full.dry and started.table is full.table
    gone = full.dry[5].id
    without = Predictor(lg, dry, exclude=[gone], base=full)
    assert [d.id for d in without.dry] == [d.id for d in full.dry if d.id != gone]
    assert [d.id for d in without.dry] == [d.id for d in Predictor(lg, dry, exclude=[gone]).dry]
    assert without.table is not full.table
    other = Predictor(lg, list(reversed(dry)), exclude=[probe.id], base=full)  # not the base's rows
    assert [d.id for d in other.dry] == [d.id for d in reversed(full.dry)]


def test_the_fit_tables_rank_figures_are_the_dry_tables():
    """The fit table judges each cell through ``DryTable.rank_figure`` / ``ledger.answer.rank_judge.dry_judge``:
    at every rank the same figure and verdict as ``raw`` and ``judge_dry``."""
    from dataclasses import replace

    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.fits import LENGTHS, SETTINGS, cards
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    p = Predictor(store.load(DEFAULT_LEDGER), load_dry_runs())
    all_cards = cards(p)
    for model in ("qwen2.5-0.5b", "gemma-3-4b-it", "llama-3.1-8b"):
        for quant in ("4bit", "bf16"):
            for fixes in ("none", "all"):
                for _, dropout, dora in SETTINGS:
                    for seq in (*LENGTHS, 3000, 12000, 40000):
                        recipe = Recipe(model=model, quant=quant, fixes=fixes, dropout=dropout, dora=dora, seq_len=seq)
                        figure = p.table.rank_figure(recipe)
                        judges = {g: dry_judge(p, recipe, g, e) for g, e in list(all_cards.items())[::4]}
                        for rank in (8, 16, 40, 64, 72, 200, 512):
                            raw, _ = p.table.raw(replace(recipe, rank=rank))
                            assert figure(rank)[0] == raw, (recipe, rank)
                            for g, judge in judges.items():
                                r = replace(recipe, rank=rank)
                                want = "unknown" if raw is None else p.judge_dry(
                                    r, raw, g, entry=all_cards[g], derived=not p.table.exact(r)).verdict
                                assert judge(rank) == want, (recipe, g, rank)


def _root_and_view(source: str, seed: int):
    """A ledger's rows, and its peak model with views of it: less three random rows, less one, and
    less a card's whole cell of a group. The views share the answers the root made where what
    they read is the root's (``PeakModel._held``): each is checked after the root and the views
    before it have asked."""
    ms = {"bundled": lambda: store.load(DEFAULT_LEDGER).measurements,
          "synthetic": lambda: synthetic_ledger(160, seed=seed).measurements}[source]()
    full = PeakModel(ms)
    rng = random.Random(seed)
    probe = rng.choice([m for m in ms if m.kind == "probe" and m.lora and m.outcome.status == "ok"])
    cell = {x.id for x in ms if x.gpu == probe.gpu and x.lora and group_key(x) == group_key(probe)}
    return ms, (full, full.without({m.id for m in rng.sample(ms, k=3)}), full.without({rng.choice(ms).id}),
                full.without(cell))


def test_a_median_less_some_values_is_the_median_of_what_is_left():
    from statistics import median

    from ledger.fit.peak_rows import _median_less

    rng = random.Random(4)
    for trial in range(400):
        values = sorted(rng.choice([rng.uniform(-50, 50), float(rng.randint(-3, 3))]) for _ in range(rng.randint(0, 25)))
        gone = rng.sample(values, k=rng.randint(0, len(values)))
        left = list(values)
        for d in gone:
            left.remove(d)
        assert _median_less(values, gone) == (median(left) if left else 0.0), (values, gone)


@pytest.mark.parametrize("source", ["bundled", "synthetic"])
def test_the_transfer_held_out_is_the_model_without_the_cell(source):
    """The held-out transfer width asks ``transfer_held_out`` instead of fitting the model without a
    card's whole group: where it answers, it gives that model's figure, on the root and on a view."""
    ms, models = _root_and_view(source, seed=11)
    answered = 0
    for model in models:
        for m in model.probes:
            g = group_key(m)
            cell = {x.id for x in ms if x.gpu == m.gpu and x.lora and group_key(x) == g}
            for rank in (8, 72, m.lora.rank, 400):
                ok, fig = model.transfer_held_out(m.gpu, g, rank)
                if ok:
                    answered += 1
                    assert fig == model.without(cell).predict(m.gpu, g, rank)[0], (m.id, rank)
    assert answered > 20


@pytest.mark.parametrize("source", ["bundled", "synthetic"])
def test_the_own_held_out_is_the_model_without_the_probe(source):
    """The held-out interpolation width asks ``own_held_out`` instead of fitting the model without
    each probe: where it answers, it gives that model's figure (and whether the card keeps rows)."""
    ms, models = _root_and_view(source, seed=12)
    answered = 0
    for model in models:
        for m in model.probes:
            if m.outcome.status != "ok":
                continue
            g = group_key(m)
            rest = model.without({m.id})
            for rank in (8, 72, m.lora.rank, 400):
                kept, ok, fig = model.own_held_out(m, rank)
                assert kept == bool(rest.by_group.get(g, {}).get(m.gpu)), m.id
                if kept and ok:
                    answered += 1
                    assert fig == rest.predict(m.gpu, g, rank)[0], (m.id, rank)
    assert answered > 20


@pytest.mark.parametrize("source", ["bundled", "synthetic-160", "synthetic-240"])
def test_every_held_out_fits_widths_and_limits_are_a_fresh_fits(source):
    """A fit less one row, started from the full fit, asks again only the held-out errors and OOM
    needs whose inputs the row changed (``PeakModel.held_out_changes``, ``answers_as_root``): for
    every row of three ledgers its widths and card limits are those of a fit made from scratch.
    (Each of the cells' rows, the shifts between cards and the pooled slope decides some answer of
    these ledgers: leaving any out of the changes makes this fail.)"""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.fit.ledger_fit import LedgerFit

    lg = {"bundled": lambda: store.load(DEFAULT_LEDGER), "synthetic-160": lambda: synthetic_ledger(160, seed=3),
          "synthetic-240": lambda: synthetic_ledger(240, seed=11)}[source]()
    dry = load_dry_runs()
    full = LedgerFit(lg, dry)
    for m in lg.measurements:
        started, fresh = LedgerFit(lg, dry, exclude=[m.id], base=full), LedgerFit(lg, dry, exclude=[m.id])
        assert started.widths == fresh.widths, m.id
        assert started.lims == fresh.lims, m.id
        assert started.pairs == fresh.pairs and started.over == fresh.over, m.id
        # Its rows are the fresh fit's, the same objects in the same order, and by id.
        assert len(started.ms) == len(fresh.ms) and all(map(operator.is_, started.ms, fresh.ms)), m.id
        assert dict(started.by_id) == fresh.by_id and len(started.by_id) == len(fresh.by_id), m.id
        assert m.id not in started.by_id and started.by_id.get(m.id) is None, m.id
        # Each rung's width is made when first asked, either one first: the same figures.
        other = LedgerFit(lg, dry, exclude=[m.id], base=full)
        assert [(other.width(r), other.width_n(r)) for r in ("transferred", "interpolated")] == \
            [(fresh.widths[r], fresh.widths[f"{r}_n"]) for r in ("transferred", "interpolated")], m.id
        # Each card's limit, asked alone, is the one in the full list.
        assert [other.limit(lim.gpu, lim.kind) for lim in fresh.lims] == fresh.lims, m.id


def test_a_fit_started_from_a_held_out_fit_is_a_fresh_fit():
    """A fit less two rows started from the fit less the first (itself started from the full
    fit): its widths are asked afresh and its limits leave out both rows — the first being the
    row a card's limit rests on, so a limit that kept it would show."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.fit.ledger_fit import LedgerFit

    lg = synthetic_ledger(160, seed=3)
    dry = load_dry_runs()
    full = LedgerFit(lg, dry)
    tops = [lim.fit_id for lim in full.lims if lim.fit_id] + [lim.exceeded_id for lim in full.lims if lim.exceeded_id]
    rng = random.Random(0)
    for first in tops:
        for second in rng.sample([m.id for m in lg.measurements if m.id != first], 3):
            middle = LedgerFit(lg, dry, exclude=[first], base=full)
            started = LedgerFit(lg, dry, exclude=[first, second], base=middle)
            fresh = LedgerFit(lg, dry, exclude=[first, second])
            assert started.widths == fresh.widths and started.lims == fresh.lims, (first, second)

"""The build's fast paths give exactly what the plain code gives: Python's rounding on arrays
(``rank_judge.round1``), the fit table's ceilings by bisecting a profile's interval ends made once
(``rank_judge.ceiling_of``) against the scan's own bisection, and typed cells made without
``model_construct``'s per-field work (``results.maker``, ``fits.cell_results``)."""

from __future__ import annotations

import random
from decimal import Decimal

import numpy as np
import pytest

from ledger.answer.rank_judge import _Profile, ceiling_of, round1
from ledger.core.results import FitCard, FitCellResult, Fits, maker


def test_round1_is_pythons_round():
    rng = random.Random(5)
    values = [rng.uniform(-1e5, 1e5) for _ in range(20000)] + [rng.uniform(0, 50) for _ in range(20000)]
    # Exact and near ties: x.x5 written in decimal (binary just above or below the half), exact binary
    # halves of a tenth (0.25, 0.75, ...), figures already rounded, and rounding's own results scaled.
    values += [float(Decimal(k) / 100) for k in range(-2000, 20000, 5)]
    values += [k / 4 for k in range(-400, 4000)] + [k / 10 for k in range(-1000, 100000)]
    values += [round(v * 0.9417, 1) * 1.0388 for v in values[:5000]] + [0.0, -0.0, 1e-9, -1e-9, 0.05, 0.15, 2.675]
    arr = np.array(values)
    got = round1(arr)
    want = [round(v, 1) for v in values]
    assert got.tolist() == want
    assert [str(x) for x in got.tolist()] == [str(x) for x in want]  # -0.0 kept as Python keeps it
    assert np.isnan(round1(np.array([np.nan, 1.0])))[0]


def test_round1_is_pythons_round_at_the_ties():
    """Values at or a unit in the last place from a half of a tenth, from 1e-4 to 1e8 (medians of
    two tenths, a remainder added to a figure), as Python rounds them, sign and negative zero
    included."""
    rng = random.Random(9)
    values = []
    for _ in range(20000):
        mag = 10 ** rng.uniform(-4, 8)
        base = float(Decimal(round(mag * 20)) / 20)  # a multiple of 0.05 written in decimal
        values.append(base)
        values += [float(np.nextafter(base, np.inf)), float(np.nextafter(base, -np.inf))]
        values.append((round(rng.uniform(0, 2e4), 1) + round(rng.uniform(0, 2e4), 1)) / 2)
        values.append(round(rng.uniform(0, 9e3), 1) + (round(rng.uniform(-50, 50), 1) + round(rng.uniform(-50, 50), 1)) / 2)
    values += [-v for v in values[:5000]] + [2.0 ** e + 0.05 for e in range(-12, 27)] + [-0.04, -0.05, 0.05, 0.25, 0.75]
    arr = np.array(values)
    got = round1(arr)
    want = [round(v, 1) for v in values]
    assert [str(x) for x in got.tolist()] == [str(x) for x in want]


def _synthetic_profile(rng: random.Random, step: int, max_rank: int) -> _Profile:
    """A profile whose derived ranks' ends rise with the rank (with a stretch the table does not
    reach at the top, sometimes), exact ranks off the line, and both ways of asking it."""
    base, slope = rng.uniform(500, 20000), rng.uniform(0.5, 80)
    width = rng.uniform(0.0, 0.08)
    exact = set(rng.sample(range(step, max_rank + 1, step), k=rng.randint(0, 3)))
    reach = max_rank if rng.random() < 0.6 else rng.randrange(step, max_rank + 1, step)

    def bounds(rank: int):
        if rank > reach:
            return None
        mib = base + slope * rank + (rng_fixed[rank] if rank in exact else 0.0)
        w = width / 3 if rank in exact else width
        return round(mib * (1 - w), 1), round(mib * (1 + w), 1)
    rng_fixed = {r: rng.uniform(-200, 200) for r in exact}

    return _Profile(bounds, exact, _column_of(bounds))


def _column_of(bounds):
    """What a profile's column gives: the ends by rank, or None where they do not rise."""
    def column(ranks):
        got = [bounds(r) for r in ranks]
        ends = [[np.inf if b is None else b[0] for b in got], [np.inf if b is None else b[1] for b in got]]
        return None if any(a > b for e in ends for a, b in zip(e, e[1:])) else tuple(ends)
    return column


class _Bisecting(_Profile):
    """The same profile asked rank by rank: the scan's bisection, as before the columns."""

    def columns(self, step, max_rank):
        return None


@pytest.mark.parametrize("seed", range(6))
def test_the_columns_ceiling_is_the_scans(seed):
    rng = random.Random(seed)
    step, max_rank = 8, 512
    for _ in range(300):
        profile = _synthetic_profile(rng, step, max_rank)
        plain = _Bisecting(profile.bounds, profile.exact, profile._column)
        assert profile.columns(step, max_rank) is not None
        top = profile.bounds(step)
        for _ in range(8):
            low = rng.uniform(0, (top[1] if top else 10000) * 6) if rng.random() < 0.9 else None
            high = None if low is None or rng.random() < 0.2 else low * rng.uniform(1.0, 1.06)
            assert ceiling_of(profile, low, high, step, max_rank) == ceiling_of(plain, low, high, step, max_rank)


def test_a_profile_that_does_not_rise_is_bisected_rank_by_rank():
    ends = {r: (1000.0 + r, 1010.0 + r) for r in range(8, 513, 8)}
    ends[200] = None  # a rank the table cannot reach between two it can

    column = _column_of(ends.get)
    profile = _Profile(ends.get, set(), column)
    assert profile.columns(8, 512) is None
    plain = _Bisecting(ends.get, set(), column)
    for low in (900.0, 1100.0, 1250.0, 1400.0):
        assert ceiling_of(profile, low, low, 8, 512) == ceiling_of(plain, low, low, 8, 512)


def _cell(i: int) -> dict:
    return {"model": f"m{i % 3}", "gpu": "rtx-3060-12gb", "quant": "4bit", "fixes": "none", "setting": "plain",
            "seq_len": 512 * (1 + i % 4), "fits_rank": None if i % 5 == 0 else 8 * i, "tight_rank": 16 * i,
            "status": "ok", "at_least": bool(i % 2), "method": "dry run", "measured": [f"p{i}"] if i % 7 else [],
            "label": str(8 * i), "run": "real", "optimizer": None if i % 3 else "adamw_torch",
            "checkpointing": bool(i % 4)}


def test_constructed_cells_are_model_constructs():
    rows = [_cell(i) for i in range(50)]
    fast = list(map(maker(FitCellResult), [dict(r) for r in rows]))
    slow = [FitCellResult.model_construct(**dict(r)) for r in rows]
    for a, b in zip(fast, slow):
        assert a == b
        assert a.__dict__ == b.__dict__ and list(a.__dict__) == list(b.__dict__)
        assert a.model_fields_set == b.model_fields_set
        assert a.model_dump_json(exclude_unset=True) == b.model_dump_json(exclude_unset=True)
    # A row that does not give every field goes through model_construct (its defaults filled in).
    short = {k: v for k, v in rows[1].items() if k not in ("run", "optimizer", "checkpointing")}
    got = maker(FitCellResult)(short)
    assert got.model_fields_set == FitCellResult.model_construct(**short).model_fields_set
    assert got.run == "real" and got.checkpointing is True
    # Inside the table: the same JSON as the table made of model_construct's cells.
    card = FitCard.model_construct(key="rtx-3060-12gb", name="RTX 3060 12GB", usable_mib=11000.0, limit_low_mib=10000.0,
                                   limit_high_mib=10100.0, in_ledger=False, source="card table", common=True)
    doc = {"lengths": [512], "models": ["m0"], "cards": [card], "dry_run_median_abs_err_pct": 1.0,
           "dry_run_max_abs_err_pct": 2.0, "dry_run_n": 3, "dry_run_fitted_on": []}
    assert Fits.model_construct(**doc, cells=fast).model_dump_json(exclude_unset=True) == \
        Fits.model_construct(**doc, cells=slow).model_dump_json(exclude_unset=True)
    # The fit table's own cells (named tuples) made into typed ones: the same objects.
    from ledger.answer.fits import FitCell, cell_results

    tuples = [FitCell(**{k: (tuple(v) if k == "measured" else v) for k, v in r.items() if k != "label"})
              for r in rows]
    for a, b, t in zip(cell_results(tuples), slow, tuples):
        assert a.__dict__ == {**b.__dict__, "label": t.label()} and list(a.__dict__) == list(b.__dict__)
        assert a.model_fields_set == b.model_fields_set
    # ...and from the plain tuples the build's workers send: the same cells, words and all.
    assert [c.__dict__ for c in cell_results([tuple(t) for t in tuples])] == [c.__dict__ for c in cell_results(tuples)]

    from ledger.core.results import typed_rows

    with pytest.raises(ValueError):  # a row without every field is refused, never half made
        typed_rows(FitCellResult, [tuple(rows[0].values())[:-1]])


def test_remembered_cell_words_are_each_cells_own():
    from itertools import product

    from ledger.answer.fits import CellLabels, FitCell

    labels = CellLabels()
    cells = [FitCell("m", "g", "4bit", "none", "plain", 512, f, t, s, a, "dry run", ())
             for f, t, s, a in product((None, 8, 64, 512), (None, 8, 64, 512), ("ok", "none-fits", "unknown"),
                                       (False, True))]
    for c in cells + cells:  # the second time from memory
        assert labels.of(c) == labels.of(tuple(c)) == c.label()
    assert len(labels) == len(cells)
    assert {c.label() for c in cells} >= {"unknown", "none", "none (tight ≤ 64)", "≥ 512", "8 (tight ≤ 64)", "64"}


def test_a_profiles_columns_are_its_bounds():
    """The arrays' arithmetic (``_bounds``' column) gives each derived rank's bounds exactly, for
    the fit table's recipes of three models on every remainder, probe and training run, with and
    without a micro-batch's widening and an optimizer's state."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.fits import LENGTHS, SETTINGS, cards
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.answer.predictor import Predictor
    from ledger.answer.rank_judge import _profile_at, card_limits
    from ledger.vocab.recipe import Recipe
    from ledger.storage import store

    p = Predictor(store.load(DEFAULT_LEDGER), load_dry_runs())
    rems = sorted({rem for rem, _, _ in card_limits(p, list(cards(p).items()), None, "real")})
    checked = 0
    for model in ("qwen2.5-0.5b", "gemma-3-4b-it", "llama-3.1-8b"):
        for quant in ("4bit", "bf16"):
            for fixes in ("none", "all"):
                for _, dropout, dora in SETTINGS:
                    for seq in (*LENGTHS, 3000, 40000):
                        recipe = Recipe(model=model, quant=quant, fixes=fixes, dropout=dropout, dora=dora, seq_len=seq)
                        for rem in rems:
                            for widened, run, optimizer in ((0.0, "probe", None), (0.0, "real", "adamw_torch"),
                                                            (0.0421, "real", "adamw_8bit"), (0.0, "real", None)):
                                profile = _profile_at(p, recipe, rem, widened, run, optimizer)
                                derived, _ = profile.ranks(8, 512)
                                got = profile.columns(8, 512)
                                want = _column_of(profile.bounds)(derived)
                                assert got == want, (recipe, rem, widened, run, optimizer)
                                checked += got is not None
    assert checked > 1000


def test_the_dry_tables_columns_are_its_figures():
    """``DryTable.rank_figure``'s array of ranks (what the fit table's profiles read) is its figure
    rank by rank, bit for bit: every shipped model's committed rows, both weights and presets, the
    three settings, with and without checkpointing, at grid lengths, between them and past them."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.fit.dry_table import DryTable
    from ledger.answer.fits import GRID_MODELS, LENGTHS, SETTINGS
    from ledger.vocab.recipe import Recipe

    table = DryTable(load_dry_runs())
    ranks = [*range(1, 9), *range(8, 513, 8), 100, 1000]
    at = np.array(ranks, dtype=float)
    reached = 0
    for model in GRID_MODELS:
        for quant in ("4bit", "bf16"):
            for fixes in ("none", "all"):
                for _, dropout, dora in SETTINGS:
                    for checkpointing in (True, False):
                        for seq in (*LENGTHS, 300, 1000, 3000, 12000, 50000, 200000):
                            recipe = Recipe(model=model, quant=quant, fixes=fixes, dropout=dropout, dora=dora,
                                            seq_len=seq, checkpointing=checkpointing)
                            figure = table.rank_figure(recipe)
                            want = [figure(r)[0] for r in ranks]
                            got = figure.column(at).tolist()
                            assert [None if g != g else g for g in got] == want, (recipe, got, want)
                            reached += want[8] is not None
    assert reached > 3000


def test_intervals_are_model_constructs():
    """``answers.interval`` makes its Interval with ``results.maker``: the object model_construct makes."""
    from ledger.core.answers import Interval, interval

    for mib, low, high in ((1234.56, 1200.04, None), (None, None, None), (7.25, 7.15, 7.35), (0, -0.04, 1e6)):
        got = interval(mib, low, high)
        r = lambda x: None if x is None else float(round(x, 1))  # noqa: E731
        want = Interval.model_construct(mib=r(mib), low_mib=r(low), high_mib=r(high))
        assert got == want and got.model_fields_set == want.model_fields_set
        assert got.model_dump_json() == want.model_dump_json() and repr(got) == repr(want)
        got.mib = 1.0  # each its own fields set: assignment works as on a model_construct
        assert got.model_fields_set == want.model_fields_set


def test_many_recipes_ceilings_at_once_are_each_recipes_own():
    """``dry_ceilings_many`` (every recipe of a fit-table row on arrays) gives each recipe's
    ceilings on each card exactly as ``dry_ceilings`` (one recipe, its profile bisected per card):
    three models' recipes at grid and other lengths, probe and training runs, AdamW and 8-bit
    states, micro-batch widenings, the cards' own limits and made-up ones (no top end, no limit,
    limits on and between the interval ends), figures that do not rise with the rank and figures
    the table does not reach between ranks it does."""
    import random

    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.fits import LENGTHS, SETTINGS, cards
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.answer.predictor import Predictor
    from ledger.answer.rank_judge import card_limits, dry_ceilings, dry_ceilings_many
    from ledger.vocab.recipe import Recipe
    from ledger.storage import store

    class Bumpy:
        """The dry-run table, but some recipes' figures dip past rank 200 or are unreached between
        ranks 96 and 160 (a profile that does not rise, one the table does not reach throughout)."""

        def __init__(self, table):
            self.table = table

        def __getattr__(self, name):
            return getattr(self.table, name)

        def rank_figure(self, recipe):
            figure = self.table.rank_figure(recipe)
            kind = recipe.seq_len % 3
            if kind == 0:
                return figure

            def bumpy(rank):
                raw, ids = figure(rank)
                if raw is None:
                    return raw, ids
                if kind == 1 and rank > 200:
                    return raw - 300.0, ids
                return (None, ids) if 96 <= rank <= 160 else (raw, ids)
            return bumpy

    rng = random.Random(7)
    for bumpy in (False, True):
        p = Predictor(store.load(DEFAULT_LEDGER), load_dry_runs())
        if bumpy:
            p.table = Bumpy(p.table)
        for run in ("real", "probe"):
            limits = card_limits(p, list(cards(p).items()), None, run)
            rems = sorted({rem for rem, _, _ in limits})
            made_up = [(rng.choice(rems), low, rng.choice([None, low, low + rng.uniform(0, 900)]))
                       for low in (rng.uniform(300, 90000) for _ in range(40))]
            made_up += [(rems[0], None, None), (rems[-1], 5000.0, None), (rems[0], 8000.0, 8000.0)]
            for model in ("qwen2.5-0.5b", "gemma-3-4b-it", "llama-3.1-8b"):
                asks = []
                for quant in ("4bit", "bf16"):
                    for fixes in ("none", "all"):
                        for _, dropout, dora in SETTINGS:
                            for seq in (*LENGTHS, 3000, 40000, 1001):
                                recipe = Recipe(model=model, quant=quant, fixes=fixes, dropout=dropout, dora=dora,
                                                seq_len=seq)
                                asks += [(recipe, widened, optimizer) for widened, optimizer in
                                         ((0.0, None), (0.0421, "adamw_8bit"), (0.0, "adamw_torch"))]
                for lim in (limits, made_up):
                    got = dry_ceilings_many(p, asks, lim, run, 8, 512)
                    want = [dry_ceilings(p, recipe, lim, widened, run, optimizer, 8, 512)
                            for recipe, widened, optimizer in asks]
                    assert got == want, model


def test_a_model_pages_cells_are_the_templates_cells():
    """``filters.html_fit_cells`` writes a row's cells exactly as the template wrote them cell by
    cell under autoescape, hostile ids and names included (escaped, never markup)."""
    from types import SimpleNamespace

    from ledger.site.render import environment

    cell_by_cell = ('{% for c in cs %}<td class="num fit-{{ \'tight\' if c.fits_rank is none and c.tight_rank else '
                    'c.status }}" title="{{ model }} {{ quant }} fixes {{ fixes }} {{ setting }} {{ c.seq_len }} tokens '
                    'on {{ card }}: {{ c.method }}{% if c.measured %}; measured nearby: {{ c.measured | join(\', \') }}'
                    '{% endif %}">{{ c.label }}<span class="meta"> {{ c.method }}</span>{% if c.measured %}<br><span '
                    'class="meta">{% for i in c.measured %}<a href="{{ root }}index.html#m-{{ i }}">{{ i }}</a> '
                    '{% endfor %}</span>{% endif %}</td>{% endfor %}')
    joined = "{{ cs | html_fit_cells(model, quant, fixes, setting, card, root) }}"
    env = environment()
    cells = [SimpleNamespace(fits_rank=None, tight_rank=16, status="ok", seq_len=512, method="ledger",
                             measured=['p"><script>alert(1)</script>', "p&2"], label="none (tight ≤ 16)"),
             SimpleNamespace(fits_rank=64, tight_rank=72, status="ok", seq_len=2048, method="dry run", measured=[],
                             label="≥ 64 (tight ≤ 72)"),
             SimpleNamespace(fits_rank=None, tight_rank=None, status="unknown", seq_len=4096, method="dry run",
                             measured=["it's"], label="unknown")]
    values = {"cs": cells, "model": "m<1>", "quant": "4bit", "fixes": "none", "setting": "DoRA",
              "card": "card\"'&", "root": "../"}
    for template in (env.from_string(cell_by_cell), env.from_string(joined)):
        assert "<script>" not in template.render(**values)
    assert env.from_string(joined).render(**values) == env.from_string(cell_by_cell).render(**values)


def test_the_scoreboards_slice_medians_are_statistics_medians():
    """``scoreboard._slice_medians`` (numpy, over codes made once per build) gives each slice's
    labels, order, counts and medians exactly as grouping the rows' absolute errors and taking
    ``statistics.median`` of each did: odd and even groups, ties, numeric and text labels."""
    import statistics

    from ledger.report.scoreboard import _slice_medians, _sort_key

    rng = random.Random(11)
    names = {"seq_len": ["<= 2048", "<= 4096", "> 16384"], "rank": ["8", "16", "128", "1024"],
             "gpu": ["", "rtx-3060-12gb", "a100-80gb"], "dropout": ["yes", "no"]}
    rows = [{k: rng.choice(v) for k, v in names.items()} for _ in range(3000)]
    scored = sorted(rng.sample(range(len(rows)), 2100))
    errors = [round(rng.choice([rng.uniform(-80, 80), 12.5, -12.5, 0.0]), 1) for _ in scored]
    labels, codes = {}, {}
    for k in names:
        seen: dict = {}
        codes[k] = np.array([seen.setdefault(r[k], len(seen)) for r in rows], dtype=np.int64)
        labels[k] = list(seen)
    want = {}
    for k in names:
        groups: dict = {}
        for i, err in zip(scored, errors):
            groups.setdefault(rows[i][k], []).append(abs(err))
        want[k] = {v: {"median_abs_err_pct": round(statistics.median(xs), 1), "n": len(xs)}
                   for v, xs in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))}
    got = _slice_medians(errors, scored, codes, labels)
    assert got == want and [list(v) for v in got.values()] == [list(v) for v in want.values()]
    assert all(type(c["median_abs_err_pct"]) is float and type(c["n"]) is int for v in got.values() for c in v.values())
    assert _slice_medians([], [], codes, labels) == {}


def test_a_rows_recipe_is_the_dataclasss_own():
    """A row's recipe made without the frozen dataclass's ``__init__`` (``recipe._whole``) is the
    one ``Recipe(...)`` makes: equal, the same hash and the same fields in the same order, for the
    bundled rows and the dry-run rows (every quant, fixes, batch, targets and checkpointing)."""
    from dataclasses import fields

    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.vocab.recipe import Recipe, _recipe_of, _whole

    rows = store.load(DEFAULT_LEDGER).measurements + load_dry_runs()
    made = 0
    for m in rows:
        r = _recipe_of(m)
        if r is None:
            continue
        plain = Recipe(**{f.name: getattr(r, f.name) for f in fields(Recipe)})
        assert r == plain and hash(r) == hash(plain) and list(r.__dict__.items()) == list(plain.__dict__.items())
        made += 1
    assert made > 1000
    # Values that do not name every field go through __init__ (its defaults, its refusal).
    assert _whole(model="m", rank=8) == Recipe(model="m", rank=8)
    with pytest.raises(TypeError):
        _whole(model="m", colour="red")


def test_a_reports_records_are_asdicts():
    """The calibration report's records (``calibration_report._record``) are ``asdict``'s: the
    same dicts, with lists that are copies, for the bundled ledger's pairs, anchors and limits and
    a record holding what is not a plain value (asdict's own)."""
    from dataclasses import asdict, dataclass

    from ledger.storage import store
    from ledger.report.calibration_report import _record
    from ledger.report.held_out import shared_predictor
    from ledger.core.paths import DEFAULT_LEDGER

    fit = shared_predictor(store.load(DEFAULT_LEDGER), []).fit
    records = [*fit.over.anchors, *fit.over.pairs, *fit.lims]
    assert len(records) >= 8 and any(getattr(r, "reals", None) for r in records)
    for r in records:
        got = _record(r)
        assert got == asdict(r) and list(got) == list(asdict(r))
        for k, v in got.items():
            if isinstance(v, list):
                assert v is not getattr(r, k)

    @dataclass
    class Inner:
        x: int

    @dataclass
    class Outer:
        a: list
        b: Inner

    for r in (Outer([1, "x", None], Inner(2)), Outer([Inner(1)], Inner(2)), Outer([(1, 2)], Inner(3))):
        assert _record(r) == asdict(r)


def test_a_cards_remainder_differences_are_the_filtered_pairs():
    """A card's sorted measured - dry-run differences (read from its own pairs) are those of
    every pair filtered by card, in the same order, for each card of a cloned ledger."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from synthetic import realistic_ledger

    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor

    p = Predictor(realistic_ledger(600), load_dry_runs())
    cal = p.dry_cal
    gpus = {m.gpu for m, _, _ in cal.pairs}
    assert len(gpus) >= 2
    for gpu in [*sorted(gpus), "no-such-card"]:
        got = cal._sorted_differences(("card", gpu), lambda g: g == gpu)
        want = sorted(pk - d for m, pk, d in cal.pairs if m.gpu == gpu)
        assert got == want and [str(x) for x in got] == [str(x) for x in want]


def test_a_plot_drawn_once_is_the_plot_drawn_twice(monkeypatch):
    """``plots._saved_once`` hides the points while matplotlib lays the figure out for its tight
    box: the SVG is byte for byte the one the plain two passes give, for the bundled ledger's
    plots and for plots with OOMs, spilled runs, a log scale, a diagonal and a legend cut short."""
    import contextlib

    from conftest import SMALL
    from ledger.storage import store
    from ledger.site import plots
    from ledger.site.plot_data import make_plots
    from ledger.site.views import Plot, PlotPoint, PlotSeries

    rng = random.Random(3)

    def series(i: int, n: int) -> PlotSeries:
        status = ["ok"] * 6 + ["oom", "spilled"]
        return PlotSeries(f"series {i}", [PlotPoint(x=rng.uniform(1, 512), y=rng.uniform(500, 9000), id=f"s{i}-{j}",
                                                    status=rng.choice(status), exceeded=rng.random() < 0.05)
                                          for j in range(n)])

    made = [*make_plots(store.load(SMALL)),
            Plot(id="odd", file="odd.svg", title="odd", caption="", alt="", xlabel="rank", ylabel="MiB",
                 series=[series(i, 30) for i in range(20)], limit_mib=7000.0, limit_label="the card"),
            Plot(id="log", file="log.svg", title="log", caption="", alt="", xlabel="x", ylabel="y",
                 series=[series(i, 40) for i in range(3)], diagonal=True, log=True, markers_only=True)]
    once = [plots.render_svg(p) for p in made]
    monkeypatch.setattr(plots, "_saved_once", lambda fig, points: contextlib.nullcontext())
    assert [plots.render_svg(p) for p in made] == once
    assert all('<g id="odd-pt' in s for s in once[-2:-1])  # the points are drawn


def test_a_title_placed_at_once_is_where_matplotlib_places_it(monkeypatch):
    """``plots._title_stays`` places a plot's title at the top of its axes at once when the y axis
    has no offset text, instead of letting matplotlib measure every tick label again to find that
    out: the SVG is byte for byte the one matplotlib's own placement gives, for the bundled
    ledger's plots and for plots whose y axis does have an offset (a narrow band of large figures)
    or a multiplier, under a title it is in the way of (matplotlib raises the title above it), a log
    scale and a spilled band."""
    from conftest import SMALL
    from ledger.storage import store
    from ledger.site import plots
    from ledger.site.plot_data import make_plots
    from ledger.site.views import Plot, PlotPoint, PlotSeries

    # A title across the whole axes: the y axis's offset text, at its top left, is in its way.
    wide = "a title that runs the whole width of the axes, over the offset text of the y axis at its left"

    def plot(pid: str, ys: list[float], **kw) -> Plot:
        points = [PlotPoint(x=8.0 * (i + 1), y=y, id=f"{pid}-{i}", status="ok") for i, y in enumerate(ys)]
        return Plot(id=pid, file=f"{pid}.svg", title=f"{pid}: {wide}", caption="", alt="", xlabel="rank",
                    ylabel="MiB", series=[PlotSeries("one", points)], **kw)

    made = [*make_plots(store.load(SMALL)),
            plot("offset", [70_010.2, 70_010.9, 70_011.4, 70_012.0]),  # ticks like +7.001e4
            plot("multiplier", [2.1e7, 2.4e7, 3.3e7]),  # ticks like 1e7
            plot("plain", [5_100.0, 6_200.0, 7_900.0]),
            plot("log", [900.0, 4_000.0, 30_000.0], log=True),
            Plot(id="band", file="band.svg", title="band", caption="", alt="", xlabel="rank", ylabel="MiB",
                 series=[PlotSeries("one", [PlotPoint(x=8, y=6_000, id="b-0", status="ok"),
                                            PlotPoint(x=16, y=9_000, id="b-1", status="spilled")])],
                 limit_mib=7_000.0, limit_label="the card")]
    asked: list[bool] = []
    stays = plots._title_stays
    monkeypatch.setattr(plots, "_title_stays", lambda ax: asked.append(stays(ax)) or asked[-1])
    placed = [plots.render_svg(p) for p in made]
    assert True in asked and asked.count(False) >= 2  # both ways taken: the offset and multiplier plots keep matplotlib's
    monkeypatch.setattr(plots, "_title_stays", lambda ax: False)
    assert [plots.render_svg(p) for p in made] == placed
    # The check decides: placed at once regardless, the titles over an offset text would not be raised.
    monkeypatch.setattr(plots, "_title_stays", lambda ax: True)
    assert [plots.render_svg(p) for p in made] != placed

def _templates(env) -> list[str]:
    return sorted(n for n in env.list_templates() if n.endswith(".j2"))


def test_the_template_cache_holds_what_compiling_gives(tmp_path, monkeypatch):
    """A template read back from the cache is jinja's own compilation of its source, byte for
    byte (marshalled code), and a second environment compiles nothing."""
    import marshal

    import jinja2

    from ledger.site.render import environment

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    first = environment()
    names = _templates(first)
    assert len(names) >= 10
    for n in names:
        first.get_template(n)
    compiled = []
    real_compile = jinja2.Environment.compile
    monkeypatch.setattr(jinja2.Environment, "compile", lambda self, *a, **k: compiled.append(a[1]) or real_compile(self, *a, **k))
    second = environment()
    plain = environment(cache=False)
    for n in names:
        source, filename, _ = plain.loader.get_source(plain, n)
        bucket = second.bytecode_cache.get_bucket(second, n, filename, source)
        assert bucket.code is not None, n
        assert marshal.dumps(bucket.code) == marshal.dumps(real_compile(plain, source, n, filename)), n
        second.get_template(n)
    assert compiled == []


def test_a_cache_that_cannot_be_used_changes_nothing(tmp_path, monkeypatch):
    """No cache folder (a file in the way), a folder that cannot be written or that others may
    write to, a file cut short or not jinja's: each template is compiled as without a cache, and
    renders the same."""
    import jinja2.bccache

    from ledger.site.render import environment

    plain = environment(cache=False)
    names = _templates(plain)

    def same(env) -> None:
        for n in names:
            assert env.get_template(n).root_render_func.__code__.co_code == \
                plain.get_template(n).root_render_func.__code__.co_code, n

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path / "file"))
    env = environment()
    assert env.bytecode_cache is None
    same(env)

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path / "c"))

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as m:
        m.setattr(jinja2.bccache.tempfile, "NamedTemporaryFile", refuse)
        same(environment())
    assert not list((tmp_path / "c" / "templates").glob("*"))

    (tmp_path / "c" / "templates").mkdir(parents=True, exist_ok=True)
    for mode in (0o777, 0o722):  # others may write there: not read
        (tmp_path / "c" / "templates").chmod(mode)
        env = environment()
        assert env.bytecode_cache is None
        same(env)
    (tmp_path / "c" / "templates").chmod(0o755)

    same(environment())  # now kept
    kept = sorted((tmp_path / "c" / "templates").glob("*.cache"))
    assert len(kept) == len(names)
    for i, path in enumerate(kept):  # cut short, not jinja's at all, or jinja's header and then not
        data = path.read_bytes()
        path.write_bytes((data[:len(data) // 2], b"not a jinja cache", jinja2.bccache.bc_magic + b"\x80garbage")[i % 3])
    same(environment())  # compiled again, and written again whole
    assert all(p.read_bytes().startswith(jinja2.bccache.bc_magic) for p in kept)
    same(environment())


def test_the_cache_is_kept_apart_for_what_changes_compiled_code(tmp_path, monkeypatch):
    """The compiled code depends on more than a template's source (the whitespace options, a
    filter jinja folds a constant through): an environment that differs there neither reads nor
    overwrites another's entries."""
    from ledger.site.render import TemplateCache, environment, environment_fingerprint

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    base = environment()
    assert environment_fingerprint(base) == environment_fingerprint(environment(cache=False))
    for n in _templates(base):
        base.get_template(n)
    before = {p.name: p.read_bytes() for p in (tmp_path / "templates").glob("*.cache")}

    other = environment()
    other.trim_blocks = False
    changed_filter = environment()
    changed_filter.filters["md_cell"] = lambda s: str(s).upper()
    for env in (other, changed_filter):
        assert environment_fingerprint(env) != environment_fingerprint(base)
    assert environment_fingerprint(other) != environment_fingerprint(changed_filter)
    for env in (other, changed_filter):
        env.bytecode_cache = TemplateCache.for_environment(env)
        env.get_template("vram.md.j2")
    after = {p.name: p.read_bytes() for p in (tmp_path / "templates").glob("*.cache")}
    assert {k: after[k] for k in before} == before and len(after) == len(before) + 2


def test_the_template_cache_removes_other_versions_old_entries(tmp_path, monkeypatch):
    """Entries of another fingerprint older than ``TEMPLATE_CACHE_DAYS`` are removed when a build
    starts; its own, a recent one of another and files that are not entries stay."""
    import os
    import time

    from ledger.site.render import TEMPLATE_CACHE_DAYS, environment, environment_fingerprint

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    folder = tmp_path / "templates"
    folder.mkdir()
    mine = environment_fingerprint(environment(cache=False))
    old = time.time() - (TEMPLATE_CACHE_DAYS + 1) * 86400
    files = {name: folder / name for name in (f"{mine}-a.cache", "0123456789abcdef-a.cache", "fedcba9876543210-a.cache",
                                              "notes.txt")}
    for name, path in files.items():
        path.write_bytes(b"x")
        if not name.startswith("fedcba"):
            os.utime(path, (old, old))
    environment()
    assert sorted(p.name for p in folder.iterdir()) == sorted(n for n in files if not n.startswith("0123"))

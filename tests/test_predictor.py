"""The one predictor (ledger.answer.predictor), the card table and the fit table, on the frozen ledger."""

from __future__ import annotations

import json

import pytest

from conftest import FROZEN as BUNDLED, REPO
from ledger import cli
from ledger.storage import store
from ledger.answer.fits import LENGTHS, fit_table, grid_points, monotone
from ledger.core.models import Gpu
from ledger.core.answers import Interval, decide
from ledger.vocab.cards import card_table, resolve_card
from ledger.storage.dry_runs import load_dry_runs
from ledger.answer.predictor import Predictor
from ledger.vocab.recipe import ALL_LINEAR, Recipe, recipe_of


@pytest.fixture(scope="module")
def ledger():
    return store.load(BUNDLED)


@pytest.fixture(scope="module")
def p(ledger):
    return Predictor(ledger, load_dry_runs())


def test_the_card_table_is_valid_and_resolves_names(ledger):
    table = card_table()
    assert len(table) >= 8 and {c.gpu.vendor for c in table.values()} == {"nvidia", "amd", "apple"}
    for key, card in table.items():
        assert card.source and card.gpu.total_mib > 0
        usable = (card.gpu.usable_gib_torch or 0) * 1024
        assert usable <= card.gpu.total_mib  # PyTorch never reports more than the card has
    assert resolve_card(ledger, "RTX 4090")[0] == "rtx-4090"
    assert resolve_card(ledger, "a100-40gb")[:3:2] == ("a100-40gb", "card table")
    assert resolve_card(ledger, "RTX 3070 Ti")[2] == "ledger"  # the ledger's own entry wins
    assert resolve_card(ledger, "GTX 480") is None


@pytest.mark.parametrize("iv,limit,margin,want", [
    ((7000, 6900, 7100), (7216, 7246), 0, "fits"),
    ((7000, 6900, 7100), (7216, 7246), 200, "tight"),  # 7100 > 7216 - 200
    ((7300, 7260, 7400), (7216, 7246), 0, "won't fit"),
    ((7200, 7150, 7250), (7216, 7246), 0, "tight"),
    ((7000, 6900, 7100), (None, None), 0, "unknown"),
])
def test_the_verdict_leans_safe(iv, limit, margin, want):
    verdict, why = decide(Interval(mib=iv[0], low_mib=iv[1], high_mib=iv[2]), *limit, margin)
    assert verdict == want and why


def test_the_evidence_ladder_picks_the_closest_evidence(p):
    real = p.predict(Recipe(None, rank=112, seq_len=7177), "rtx-3070-ti", run="real")
    assert real.method == "measured real run" and "real-v13" in real.evidence and real.verdict == "fits"
    probe = p.predict(Recipe(None, rank=96, dropout=True, seq_len=7177), "rtx-3070-ti")
    assert probe.method == "measured probe" and probe.probe_allocated.mib == 7127.6 and probe.verdict == "fits"
    oom = p.predict(Recipe(None, rank=104, dropout=True, seq_len=7177), "rtx-3070-ti")
    assert oom.verdict in ("won't fit", "tight") and "sweep-r104-drop" in oom.evidence
    interp = p.predict(Recipe(None, rank=72, seq_len=7177), "rx-7900-xtx")
    assert interp.method == "interpolated" and interp.probe_allocated.low_mib < interp.probe_allocated.high_mib
    table_card = card_table()["rtx-4090"].gpu
    dry = p.predict(Recipe("gemma-3-4b-it", rank=64, seq_len=4096), "rtx-4090", entry=table_card)
    assert dry.method == "dry run" and dry.card_source == "card table" and dry.verdict == "fits"
    far = p.predict(Recipe("gemma-3-4b-it", rank=64, seq_len=30000), "rtx-4090", entry=table_card)
    assert far.verdict == "unknown" and far.why


def test_every_figure_has_an_interval_around_it(p):
    for recipe, gpu in ((Recipe(None, rank=88, seq_len=7288), "rtx-3070-ti"),
                        (Recipe(None, rank=200, seq_len=7177), "rx-7900-xtx")):
        a = p.predict(recipe, gpu, run="real")
        for iv in (a.probe_allocated, a.real_allocated):
            assert iv.low_mib <= iv.mib <= iv.high_mib
        assert a.reserved is None or a.reserved.mib >= a.allocated.mib


def test_a_prediction_fitted_without_a_row_does_not_see_it(ledger):
    row = next(m for m in ledger.measurements if m.id == "sweep-r96-drop")
    p = Predictor(ledger, load_dry_runs(), exclude=[row.id])
    a = p.predict(Recipe(None, rank=96, dropout=True, seq_len=7177), "rtx-3070-ti")
    assert row.id not in a.evidence and a.method != "measured probe"


def test_ceilings_answer_fits_and_tight(p, capsys):
    c = p.ceiling(Recipe(None, seq_len=7177), "rtx-3070-ti", run="real")
    assert c.fits_rank >= 112 and c.tight_rank >= c.fits_rank
    assert cli.main(["ceiling", "--probe", "--ledger", str(BUNDLED), "--gpu", "RTX 4090", "--model", "gemma-3-4b-it",
                     "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    first, answer = out.splitlines()[:2]
    assert first == "for a one-step probe of gemma-3-4b-it 4bit 4096 tokens fixes none (stock), no optimizer step"
    assert answer.startswith("rank ") and "rtx-4090" in out and "by dry run" in out
    probe_rank = int(answer.split()[1])
    # Without --probe (or with --real, the same): a training run, its optimizer's state on the card.
    outs = []
    for flags in ([], ["--real"]):
        assert cli.main(["ceiling", *flags, "--ledger", str(BUNDLED), "--gpu", "RTX 4090", "--model", "gemma-3-4b-it",
                         "--seq-len", "4096"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    first, answer = outs[0].splitlines()[:2]
    assert first == "for a training run of gemma-3-4b-it 4bit 4096 tokens fixes none adamw_torch (stock)"
    assert "fits a training run" in answer and int(answer.split()[1]) < probe_rank
    with pytest.raises(SystemExit) as exc:  # one or the other: a usage error
        cli.main(["ceiling", "--probe", "--real", "--ledger", str(BUNDLED), "--gpu", "RTX 4090", "--model",
                  "gemma-3-4b-it", "--seq-len", "4096"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_estimate_answers_first_and_names_units(capsys):
    assert cli.main(["estimate", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--model", "gemma-3-4b-it", "--rank", "16", "--seq-len",
                     "7177", "--gpu", "rtx-3070-ti"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ours = next(i for i, line in enumerate(lines) if "vram-ledger:" in line)
    theirs = next(i for i, line in enumerate(lines) if "unsloth-studio" in line)
    assert ours < theirs and "FITS" in lines[ours] and "MiB" in lines[ours]
    near = next(line for line in lines if "nearest measured" in line)
    assert "rtx-3070-ti" in near  # the nearest row is on the requested card
    assert cli.main(["estimate", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--model", "gemma-3-4b-it", "--rank", "16", "--seq-len",
                     "7177", "--gpu", "rtx-3070-ti", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["answer"]["verdict"] == "fits"

    def keys(o, path=""):
        if isinstance(o, dict):
            for k, v in o.items():
                yield f"{path}.{k}", k, v
                yield from keys(v, f"{path}.{k}")
        elif isinstance(o, list):
            for v in o:
                yield from keys(v, path)

    for where, k, v in keys(doc):
        assert not k.endswith("_gb"), where  # every figure is in MiB, and says so
        if k.endswith("_mib") and v is not None:
            values = v.values() if isinstance(v, dict) else [v]
            assert all(isinstance(x, (int, float)) for x in values), where


def test_cards_lists_the_table_and_the_ledger(capsys):
    assert cli.main(["cards", "--ledger", str(BUNDLED), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["rtx-3070-ti"]["in_ledger"] and rows["rtx-3070-ti"]["limit_low_mib"] == 7216.0
    h100 = rows["h100-80gb"]
    assert not h100["in_ledger"] and h100["limit_low_mib"] < h100["usable_mib"] and h100["usable_source"]


def test_the_fit_table_is_monotone_and_says_how_each_cell_is_answered(p):
    cells = fit_table(p, models=["gemma-3-4b-it"], gpus=["rtx-3070-ti", "rtx-4090"])
    assert {c.method for c in cells if c.gpu == "rtx-3070-ti"} == {"ledger"}
    assert {c.method for c in cells if c.gpu == "rtx-4090"} == {"dry run"}
    by = {(c.gpu, c.quant, c.fixes, c.setting, c.seq_len): c for c in cells}
    for (gpu, quant, fixes, setting, seq), c in by.items():
        longer = [by[(gpu, quant, fixes, setting, s)] for s in LENGTHS if s > seq and (gpu, quant, fixes, setting, s) in by]
        for o in longer:
            if o.fits_rank is not None:
                assert c.fits_rank is not None and c.fits_rank >= o.fits_rank
        if setting != "plain" and c.fits_rank is not None:
            assert by[(gpu, quant, fixes, "plain", seq)].fits_rank >= c.fits_rank
    # A cell names the measured rows of its length bucket: the program's 7177-token probes at 8192.
    assert "sweep-r96-drop" in by[("rtx-3070-ti", "4bit", "all", "dropout", 8192)].measured


def test_the_fit_tables_own_raising_is_monotones(p, monkeypatch):
    """The fit table makes each card's cells monotone as it makes them (one plan per model): the
    same cells as ``monotone`` of the cells made without it, for the ladder's card and the dry
    run's, with both presets, at micro-batch 1 and 4, and with the raises it makes counted."""
    import ledger.answer.fits as F

    def both(**kw):
        made = fit_table(p, **kw)
        with monkeypatch.context() as m:
            m.setattr(F, "raise_block", lambda cells, at, plan: None)
            p.dry_ceilings.clear(), p.subceilings.clear()
            raw = fit_table(p, **kw)
        return made, raw

    raised = 0
    for kw in ({"fixes_settings": ("none", "all")}, {"batch": 4, "fixes_settings": ("none",)}):
        made, raw = both(models=["gemma-3-4b-it", "qwen2.5-0.5b"], gpus=["rtx-3070-ti", "rx-7900-xtx", "rtx-4090"],
                         **kw)
        assert made == monotone(list(raw))
        raised += sum(a != b for a, b in zip(made, raw))
    assert raised > 0


def test_monotone_raises_to_a_harder_recipe_and_says_at_least():
    from ledger.answer.fits import FitCell

    def cell(setting, seq, fits):
        return FitCell("m", "g", "4bit", "all", setting, seq, fits, fits, "ok" if fits else "unknown", False,
                       "dry run", ())

    out = monotone([cell("plain", 512, None), cell("plain", 2048, 64), cell("dropout", 512, 96)])
    plain512 = out[0]
    assert plain512.fits_rank == 96 and plain512.at_least and plain512.label().startswith("≥")


def test_the_grid_is_small_and_covers_the_table():
    from ledger.answer.fits import PRESET_MAX_LEN, model_lengths

    allowed = model_lengths("qwen2.5-0.5b")  # its context: 32768 tokens
    assert allowed == [s for s in LENGTHS if s <= 32768] and model_lengths("llama-3.1-8b") == list(LENGTHS)
    pts = grid_points("qwen2.5-0.5b")
    stock = [p for p in pts if p["fixes"] == "none"]
    preset = [p for p in pts if p["fixes"] == "all"]
    # quant x (rank 8 at the lengths the step is not affine in, at 16384 and at the longest + rank 64,
    # dropout and DoRA at the shortest, at 16384 and at the longest): a model with full attention in
    # every layer peaks in proportion to the length from AFFINE_FROM on, so rank 8 is computed there
    # only at the ends; the table interpolates the lengths between (cells at every length, below)
    from ledger.answer.fits import AFFINE_FROM

    rank8 = [s for s in allowed if s <= AFFINE_FROM or s in (16384, allowed[-1])]
    assert rank8 == [512, 2048, 16384, 32768]
    assert len(stock) == 2 * (len(rank8) + 3 * 3)
    assert {p["seq_len"] for p in stock} == set(rank8)
    # a model with sliding layers (Gemma 3) is not affine in length: rank 8 at every length
    gemma = [p for p in grid_points("gemma-3-1b-it") if p["fixes"] == "none" and p["rank"] == 8
             and not (p.get("dropout") or p.get("dora"))]
    assert sorted({p["seq_len"] for p in gemma}) == model_lengths("gemma-3-1b-it")
    # the program's preset up to PRESET_MAX_LEN (16384 is its longest: two ends)
    assert len(preset) == 2 * (len([s for s in allowed if s <= PRESET_MAX_LEN]) + 3 * 2)
    assert max(p["seq_len"] for p in preset) == PRESET_MAX_LEN
    cells = fit_table(Predictor(store.load(BUNDLED), load_dry_runs()), models=["qwen2.5-0.5b"], gpus=["rtx-4090"])
    assert {c.seq_len for c in cells if c.fixes == "none"} == set(allowed)
    assert {c.seq_len for c in cells if c.fixes == "all"} == {s for s in allowed if s <= PRESET_MAX_LEN}


def test_lengths_the_grid_derives_are_its_committed_rows():
    """The committed rank-8 rows at the lengths the grid no longer computes (the stock recipe of a
    model with full attention, between AFFINE_FROM and the longest), derived from the table without
    them, are themselves: the step is affine in length there. The DoRA and dropout rows at those
    lengths (the grid's held-out points) are then interpolated between their own rows, never below
    what the plain row and their interpolated cost gave."""
    from ledger.fit.dry_table import DryTable
    from ledger.fit.peaks import one_gpu
    from ledger.vocab.model_configs import model_name
    from ledger.vocab.recipe import recipe_of

    dry = [d for d in load_dry_runs() if d.outcome.status == "ok" and d.response_len == 256
           and (d.batch_size or 1) == 1 and d.memory_fixes == "none" and d.lora is not None
           and one_gpu(d)]  # as the predictor's table: a rank of a multi-GPU run is not one GPU's step

    def point(r, checkpointing):
        return {"model": model_name(r.model), "quant": r.quant, "seq_len": r.seq_len, "rank": r.rank,
                **({"dropout": 0.1} if r.dropout else {}), **({"dora": True} if r.dora else {}),
                **({} if checkpointing else {"no_gradient_checkpointing": True})}

    def in_grid(d) -> bool:
        r = recipe_of(d)
        keys = {"model", "quant", "seq_len", "rank", "dropout", "dora", "no_gradient_checkpointing"}
        return point(r, r.checkpointing) in [{k: v for k, v in p.items() if k in keys}
                                              for p in grid_points(model_name(d.model), checkpointing=r.checkpointing)
                                              if p["fixes"] == "none"]

    plain = [d for d in dry if not (d.lora.dropout or d.lora.dora) and d.lora.rank == 8 and not in_grid(d)]
    assert len(plain) >= 200
    left_out = {d.id for d in plain}
    derived_plain = {(model_name(d.model), d.quant, d.seq_len, d.gradient_checkpointing is not False) for d in plain}
    variants = [d for d in dry if (d.lora.dropout or d.lora.dora) and not in_grid(d)
                and (model_name(d.model), d.quant, d.seq_len, d.gradient_checkpointing is not False) in derived_plain]
    assert variants  # e.g. phi-3.5-mini's DoRA at 32,768 tokens
    for d in plain:
        figure, _ = DryTable([x for x in dry if x.id not in left_out and x.id != d.id]).raw(recipe_of(d))
        assert figure == pytest.approx(d.outcome.peak_allocated_mib, rel=1e-4), d.id
    for d in variants:  # never below what the table with every rank-8 row derives, and close to it
        alone, _ = DryTable([x for x in dry if x.id not in left_out and x.id != d.id]).raw(recipe_of(d))
        full, _ = DryTable([x for x in dry if x.id != d.id]).raw(recipe_of(d))
        assert full * (1 - 1e-9) <= alone <= full * 1.02, d.id


def test_fit_prints_a_cards_table_without_torch(capsys):
    assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", "gemma-3-4b-it", "--gpu", "RTX 4090", "--quant",
                     "4bit", "--fixes", "all"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-4b-it on rtx-4090" in out and "16384" in out and "dry run" in out
    assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", "no-such-model", "--gpu", "t4"]) == 1
    assert "no config for no-such-model: looked in" in capsys.readouterr().err


def test_a_card_without_rows_has_a_derived_limit_under_its_memory(p):
    gpu = Gpu(name="Some card", vendor="nvidia", total_mib=16384.0, usable_gib_torch=15.5)
    low, high, source = p.card_limit("some-card", gpu, "probe")
    assert low < high <= 15.5 * 1024 and "CUDA context" in source


def test_a_longer_response_span_than_the_evidence_raises_the_figure(p, capsys):
    # The RTX 3060 Ti r64 probe ran 7177 tokens with the loss on 237 (238 kept positions).
    base = p.predict(Recipe("unsloth/gemma-3-4b-it", rank=64, seq_len=7177, response_len=237), "rtx-3060-ti")
    assert base.probe_allocated.mib == 6465.0 and base.verdict == "fits"
    longer = p.predict(Recipe("unsloth/gemma-3-4b-it", rank=64, seq_len=7177, response_len=999), "rtx-3060-ti")
    per_position = 262208 * 4 / 2**20  # Gemma 3's vocabulary in fp32, MiB
    fig = longer.probe_allocated
    assert fig.mib == pytest.approx(6465.0 + 762 * per_position, abs=0.1)  # not capped by the shorter-span probe
    assert fig.high_mib == pytest.approx(6465.0 + 762 * per_position * 14 / 4, abs=0.1)
    assert longer.verdict == "won't fit" and "762 more response positions" in longer.method_text
    # A shorter span does not lower it (the peak may lie outside the logits).
    shorter = p.predict(Recipe("unsloth/gemma-3-4b-it", rank=64, seq_len=7177, response_len=50), "rtx-3060-ti")
    assert shorter.probe_allocated.mib == 6465.0
    # The real-run prediction leaves out the kept logits up to the longest span a pair covered, no more.
    real = p.predict(Recipe("unsloth/gemma-3-4b-it", rank=64, seq_len=7177, response_len=999), "rtx-3060-ti",
                     run="real")
    assert real.real_allocated.mib == pytest.approx((fig.mib - 319 * per_position) * (1 - p.over.pct / 100), abs=0.2)
    assert cli.main(["predict", "--ledger", str(BUNDLED), "--gpu", "rtx-3060-ti", "--rank", "64", "--seq-len", "7177",
                     "--response-len", "999", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction"]["response_len"] == 999 and doc["answer"]["verdict"] != "fits"


def test_a_micro_batch_is_answered_as_one_longer_sequence_without_fixes():
    """Stock (no fixes): B sequences of L tokens as one of B x L, the interval widened by the measured
    error of that derivation; with the program's fixes it is not derived, and says why."""
    from dataclasses import replace

    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe
    from ledger.fit.response_span import BATCH_AS_LENGTH_ERR

    p = Predictor(store.load(DEFAULT_LEDGER), load_dry_runs())
    entry = p.ledger.gpus.get("rx-7900-xtx")
    batch = Recipe(model="qwen2.5-7b", rank=16, fixes="none", seq_len=2048, batch=4)
    four = p.predict(batch, "rx-7900-xtx", entry=entry)
    one = p.predict(replace(batch, batch=1, seq_len=8192), "rx-7900-xtx", entry=entry)
    assert four.probe_allocated.mib == one.probe_allocated.mib
    assert four.probe_allocated.high_mib == pytest.approx(one.probe_allocated.high_mib * (1 + BATCH_AS_LENGTH_ERR),
                                                          abs=0.1)
    assert four.recipe["batch"] == 4 and four.recipe["seq_len"] == 2048
    assert "answered as one sequence of 8192 tokens" in four.method_text
    fixed = p.predict(replace(batch, fixes="all"), "rx-7900-xtx", entry=entry)
    # the program's preset: only dry runs of that micro-batch answer it, and none is computed
    assert fixed.verdict == "unknown" and "only dry runs of that micro-batch" in fixed.why


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_batch_derivation_holds_on_a_real_config_dry_run():
    """The measured basis of BATCH_AS_LENGTH_ERR, once, on the smallest shipped config."""
    pytest.importorskip("torch")
    from ledger.fit.response_span import BATCH_AS_LENGTH_ERR
    from probe_kit.dry_run import dry_run
    from probe_kit.recipe import ProbeConfig

    kw = dict(model="qwen2.5-0.5b", rank=16, quant="4bit", fixes=[], random_weights=True)
    batch = dry_run(ProbeConfig(seq_len=512, response_len=64, batch_size=4, **kw))["peak_mib"]
    one = dry_run(ProbeConfig(seq_len=2048, response_len=256, **kw))["peak_mib"]
    assert one >= batch and (one - batch) / batch <= BATCH_AS_LENGTH_ERR


def test_checkpointing_off_is_answered_by_its_own_dry_runs_and_no_compute_refuses_past_them(capsys, tmp_path):
    """Every measured row has checkpointing on: a run without it keeps every layer's activations, so
    it is answered only by dry runs of it — the committed grid's within its lengths, and past them
    computed on demand (``tests/test_any_model.py``); with --no-compute that refuses, naming what
    it would run."""
    assert cli.main(["estimate", "--probe", "--ledger", str(BUNDLED), "--model", "qwen2.5-7b", "--rank", "16", "--seq-len", "2048",
                     "--gpu", "RTX 4090", "--no-gradient-checkpointing", "--no-compute", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)["answer"]
    assert answer["method"] == "dry run" and all("nockpt" in i for i in answer["evidence"])
    assert cli.main(["estimate", "--probe", "--ledger", str(BUNDLED), "--model", "qwen2.5-7b", "--rank", "16", "--seq-len", "2048",
                     "--gpu", "RTX 4090", "--no-compute", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["answer"]["probe_allocated"]["mib"] < answer["probe_allocated"]["mib"]
    # Rows that stop at 16384 tokens: 20000 is past them.
    shipped = store.load(REPO / "ledger" / "dry-runs.json")
    short = tmp_path / "short.json"
    store.save(shipped.model_copy(update={"measurements": [m for m in shipped.measurements if m.seq_len <= 16384]}),
               short)
    for cmd in (["estimate", "--probe", "--rank", "16"], ["ceiling", "--probe"]):
        assert cli.main([*cmd, "--ledger", str(BUNDLED), "--model", "qwen2.5-7b", "--gpu", "RTX 4090",
                         "--seq-len", "20000", "--no-gradient-checkpointing", "--no-compute", "--dry-runs",
                         str(short), "--cache", str(tmp_path / "cache")]) == 1
        assert "needs 2 dry runs" in capsys.readouterr().err


def test_the_fit_table_without_checkpointing_never_fits_more_than_with_it(capsys):
    """Its own committed dry runs answer it (stock only: the program's preset has its own on demand),
    and every cell's rank is at most the checkpointed one's: keeping every layer's activations
    never needs less."""
    def cells(*flags):
        assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", "llama-3.2-1b", "--gpu", "RTX 4060 Ti 16GB",
                         "--no-compute", "--json", *flags]) == 0
        doc = json.loads(capsys.readouterr().out)
        return doc, {(c["quant"], c["fixes"], c["setting"], c["seq_len"]): c for c in doc["cells"]}

    doc, off = cells("--no-gradient-checkpointing")
    _, on = cells()
    from ledger.answer.fits import model_lengths

    assert doc["checkpointing"] is False and {k[1] for k in off} == {"none"}
    assert len(off) == 2 * 3 * len(model_lengths("llama-3.2-1b"))  # quant x setting x its lengths, to 131072
    assert all(not c["checkpointing"] and c["method"] == "dry run" and c["status"] != "unknown" for c in off.values())
    assert all((c["fits_rank"] or 0) <= (on[k]["fits_rank"] or 0) for k, c in off.items())
    assert any((c["fits_rank"] or 0) < (on[k]["fits_rank"] or 0) for k, c in off.items())
    # The program's preset without checkpointing is not in the shipped rows: computed on demand only.
    assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", "llama-3.2-1b", "--gpu", "RTX 4090", "--fixes", "all",
                     "--no-gradient-checkpointing", "--no-compute"]) == 0
    assert "no dry runs of llama-3.2-1b with memory fixes all without gradient checkpointing: every cell is unknown; " \
           "run again with --compute and without --no-compute" in capsys.readouterr().err


def test_fewer_target_modules_are_bounded_by_all_seven_and_never_wont_fit(capsys, tmp_path):
    """Attention-only LoRA without dry runs of it (--no-compute): from rows that train all 7
    projections, an upper bound, so "fits" when it fits, "unknown" (never "won't fit", never a hedge
    that sounds close) when it does not; the optimizer's state counts the recipe's own adapters.
    With its dry runs computed: its own figure, with a lower end."""
    cache = str(tmp_path / "cache")

    def answer(*flags):
        assert cli.main(["estimate", "--ledger", str(BUNDLED), "--model", "llama-3.1-8b", "--rank", "64", "--seq-len",
                         "2048", "--real", "--json", "--cache", cache, *flags]) == 0
        return json.loads(capsys.readouterr().out)["answer"]

    seven = answer("--gpu", "RTX 4090")
    attn = answer("--gpu", "RTX 4090", "--target-modules", "attn", "--no-compute")
    assert attn["verdict"] == "fits" and attn["real_allocated"]["low_mib"] is None
    assert attn["real_allocated"]["mib"] < seven["real_allocated"]["mib"]  # AdamW's state of 4 projections, not 7
    assert "an upper bound" in attn["method_text"]
    small = answer("--gpu", "rtx-3070-ti", "--target-modules", "q_proj,v_proj", "--no-compute")
    assert small["verdict"] == "unknown" and "only a dry run of it can say" in small["why"]
    own = answer("--gpu", "RTX 4090", "--target-modules", "attn")
    assert own["verdict"] == "fits" and own["real_allocated"]["low_mib"] is not None
    assert own["real_allocated"]["high_mib"] < attn["real_allocated"]["high_mib"] and "upper bound" not in own["method_text"]
    assert cli.main(["estimate", "--probe", "--model", "llama-3.1-8b", "--rank", "8", "--seq-len", "512",
                     "--target-modules", "lm_head"]) == 1
    assert capsys.readouterr().err.startswith("--target-modules: unknown target module 'lm_head'")


@pytest.mark.parametrize("run,fixes,checkpointing", [("probe", "none", True), ("real", "none", True),
                                                     ("real", "all", True), ("real", "none", False)])
def test_the_fit_table_says_what_the_ceiling_scan_says(p, run, fixes, checkpointing):
    """The fit table bisects over ranks; a rank dry-run exactly has a narrower interval than the
    ranks derived around it, so its verdict can be stricter or looser. The table's cells equal vram
    ceiling's scan from the smallest rank (which stops at the first "won't fit", and whose "fits"
    needs every rank below to fit), for a one-step probe and for a training run (stock: AdamW's
    state; the program's preset: its calibrated real runs), on a sample that holds both cases
    (qwen2.5-7b bf16 plain on the RTX 4090 at 4096 tokens, and at 16384 with the preset)."""
    from ledger.vocab.cards import card_table
    from ledger.answer.fits import fit_table

    table = card_table()
    # Without checkpointing (dry runs of it alone), also on a card the ledger measured the model on.
    models, gpus = ((["qwen2.5-7b", "qwen2.5-14b"], ["rtx-4090", "rtx-4060-ti-16gb"]) if checkpointing else
                    (["llama-3.2-1b", "gemma-3-4b-it"], ["rtx-4090", "rtx-3070-ti"]))
    cells = fit_table(p, models=models, gpus=gpus, fixes_settings=(fixes,), run=run, checkpointing=checkpointing)
    checked = 0
    for c in cells:
        assert c.run == run and c.optimizer == (("adamw_torch" if fixes == "none" else None) if run == "real" else None)
        assert c.checkpointing is checkpointing and (checkpointing or c.method == "dry run")
        if c.status == "unknown" or c.at_least:  # "at least": raised to a harder recipe's ceiling
            continue
        a = p.ceiling(Recipe(c.model, quant=c.quant, fixes=fixes, seq_len=c.seq_len, dropout=c.setting == "dropout",
                             dora=c.setting == "DoRA", optimizer=c.optimizer, checkpointing=checkpointing), c.gpu,
                      entry=table[c.gpu].gpu if c.gpu in table else None, run=run)
        assert (c.fits_rank, c.tight_rank) == (a.fits_rank, a.tight_rank), c
        checked += 1
    assert checked >= 50
    if (run, fixes) == ("probe", "none"):
        odd = next(c for c in cells if (c.model, c.gpu, c.quant, c.setting, c.seq_len) ==
                   ("qwen2.5-7b", "rtx-4090", "bf16", "plain", 4096))
        assert odd.tight_rank is None and odd.status == "none-fits"
    if (run, fixes) == ("real", "all"):  # rank 64, dry-run exactly, fits; derived ranks below it are tight
        odd = next(c for c in cells if (c.model, c.gpu, c.quant, c.setting, c.seq_len) ==
                   ("qwen2.5-7b", "rtx-4090", "bf16", "plain", 16384))
        assert odd.fits_rank is not None and odd.fits_rank < 64 and p.predict(Recipe("qwen2.5-7b", rank=64, quant="bf16", fixes="all", seq_len=16384),
                                                 "rtx-4090", entry=table["rtx-4090"].gpu, run="real").verdict == "fits"


def test_a_derived_figure_is_widened_by_the_error_of_its_own_kind(p):
    """Each kind of derivation (memory fixes x checkpointing) is widened by the largest error of
    deriving the committed dry runs of that kind, where enough measure it; any other by the largest
    of all. The program's preset derives worst, so the stock recipe's intervals are narrower."""
    from ledger.fit.dry_table import MIN_KIND_ROWS, kind_of

    d = p.dry_derivation
    kinds = {k: v for k, v in d["by_kind"].items() if v["n"] >= MIN_KIND_ROWS}
    assert {"fixes none, checkpointing on", "fixes none, checkpointing off", "fixes all, checkpointing on"} <= set(kinds)
    assert max(v["max_abs_err_pct"] for v in kinds.values()) == d["max_abs_err_pct"]
    loo = p.dry_loo["max_abs_err_pct"] / 100
    for fixes, ckpt in (("none", True), ("none", False), ("all", True)):
        r = Recipe("qwen2.5-7b", rank=24, seq_len=4096, fixes=fixes, checkpointing=ckpt)
        want = kinds[kind_of(r)]["max_abs_err_pct"] / 100
        assert p.dry_cal.width_fraction(True, r) == pytest.approx(loo + want)
        width, text = p.dry_cal.width(r, True)
        assert width == pytest.approx(loo + want) and f"({kind_of(r)})" in text
    # a kind too few dry runs measure (a fix list of its own) takes the largest of every kind
    odd = Recipe("qwen2.5-7b", rank=24, seq_len=4096, fixes="logits_to_keep")
    assert p.dry_cal.width_fraction(True, odd) == pytest.approx(loo + d["max_abs_err_pct"] / 100)
    assert p.dry_cal.width_fraction(False, odd) == pytest.approx(loo)


def test_a_micro_batch_without_checkpointing_is_one_longer_sequence_without_it(p):
    """B sequences of L tokens without gradient checkpointing: the dry runs of one sequence of B x L
    tokens without it, widened by what that was measured to differ by (never below the batch)."""
    from ledger.fit.response_span import (
        BATCH_AS_LENGTH_ERR,
        BATCH_AS_LENGTH_ERR_NO_CKPT,
        answerable,
        batch_err,
    )

    batch = Recipe("qwen2.5-0.5b", rank=16, seq_len=2048, fixes="none", batch=4, checkpointing=False)
    one, how = answerable(batch)
    assert one == Recipe("qwen2.5-0.5b", rank=16, seq_len=8192, fixes="none", checkpointing=False)
    assert "8192 tokens" in how and "without checkpointing" in how
    assert batch_err(batch) == BATCH_AS_LENGTH_ERR_NO_CKPT > batch_err(batch.replace(checkpointing=True)) \
        == BATCH_AS_LENGTH_ERR > batch_err(one) == 0
    card = card_table()["rtx-4090"].gpu
    a = p.predict(batch, "rtx-4090", entry=card, run="real")
    single = p.predict(one, "rtx-4090", entry=card, run="real")
    assert a.verdict != "unknown" and a.evidence == single.evidence
    assert a.probe_allocated.low_mib < single.probe_allocated.low_mib and a.probe_allocated.high_mib > single.probe_allocated.high_mib
    # with the program's memory fixes a batch is not one longer sequence: only its own dry runs answer it
    preset = batch.replace(fixes="all", checkpointing=True)
    assert answerable(preset)[0] == preset and batch_err(preset) == 0


def test_a_micro_batch_with_a_per_token_fix_is_one_longer_sequence_too():
    """Liger's fused loss and TRL's offloading work per token: a batch is answered as one sequence
    of B x L tokens with the width measured for that fix (benchmarks/batch_as_length.py --fixes F);
    the program's preset, or the two together (never measured), only by dry runs of the batch."""
    from ledger.fit.response_span import BATCH_AS_LENGTH_ERR_FIXES, answerable, batch_err

    for fixes in ("fused_linear_ce", "activation_offloading"):
        for ckpt in (True, False):
            batch = Recipe("qwen2.5-0.5b", rank=16, seq_len=1024, fixes=fixes, batch=8, checkpointing=ckpt)
            one, how = answerable(batch)
            assert one == Recipe("qwen2.5-0.5b", rank=16, seq_len=8192, fixes=fixes, checkpointing=ckpt)
            assert batch_err(batch) == BATCH_AS_LENGTH_ERR_FIXES[(fixes, ckpt)] > 0 and batch_err(one) == 0
    both = Recipe("qwen2.5-0.5b", rank=16, seq_len=1024, fixes="fused_linear_ce,activation_offloading", batch=2)
    assert answerable(both) == (both, answerable(both)[1]) and "only dry runs of that micro-batch" in answerable(both)[1]
    assert answerable(both.replace(fixes="all"))[0].batch == 2


def test_the_presets_micro_batch_is_answered_by_dry_runs_of_that_batch_alone(p):
    """Micro-batch 4 with the program's preset: no measured row and no micro-batch-1 dry run answers
    it (the program's chunked MLP and kept logits work per sequence); a dry run of that micro-batch
    does, and answers no other micro-batch."""
    from ledger.answer.predictor import Predictor

    card = card_table()["rtx-4090"].gpu
    four = Recipe("gemma-3-4b-it", rank=8, seq_len=2048, fixes="all", batch=4)
    a = p.predict(four, "rtx-4090", entry=card, run="real")
    assert a.verdict == "unknown" and "micro-batch 4" in a.method_text and a.evidence == []
    one = p.dry_raw(four.replace(batch=1))[0]
    row = next(d for d in p.dry if d.model and "gemma-3-4b-it" in d.model and d.seq_len == 2048
               and d.memory_fixes == "all" and d.lora.rank == 8 and not d.lora.dropout and not d.lora.dora
               and d.gradient_checkpointing is not False)
    batch_row = row.model_copy(deep=True, update={"id": row.id + "-b4", "batch_size": 4})
    batch_row.outcome.peak_allocated_mib = round(row.outcome.peak_allocated_mib * 2.5, 1)
    q = Predictor(p.ledger, [*p.dry, batch_row])
    b = q.predict(four, "rtx-4090", entry=card, run="real")
    assert b.verdict != "unknown" and b.method == "dry run" and batch_row.id in b.evidence
    assert q.dry_raw(four)[0] == batch_row.outcome.peak_allocated_mib
    assert q.dry_raw(four.replace(batch=1))[0] == one and q.dry_raw(four.replace(batch=2))[0] is None


def test_a_verdict_alone_is_the_answers_verdict(ledger):
    """``Predictor.verdict`` (what the fit table's ladder asks rank by rank) gives ``predict``'s
    verdict and limit on 4,000 random questions of the frozen ledger's cards and a card-table card
    (a quarter of them the recipes its rows measured):
    probes and training runs, the program's preset and stock, dropout, DoRA, micro-batches,
    optimizers, checkpointing off, fewer target modules, a margin, budgets under and over the
    card's limit. Every path that decides a verdict is among them (each verdict, a measured
    failure, fewer targets made unknown, a micro-batch nothing answers or with no length, each rung a sampled recipe reaches)."""
    import random

    p = Predictor(ledger, load_dry_runs())
    table = card_table()
    rng = random.Random(7)
    gpus = [*ledger.gpus, "rtx-4090"]
    seen, paths = set(), set()
    measured = [(recipe_of(m), m.gpu) for m in ledger.measurements if m.kind in ("probe", "real") and m.lora and m.gpu]
    for i in range(4000):
        recipe = Recipe(model=rng.choice(["gemma-3-4b-it", "qwen2.5-7b", "llama-3.2-1b"]),
                        rank=rng.choice([8, 16, 32, 64, 96, 128, 256, 512]), quant=rng.choice(["4bit", "bf16"]),
                        dropout=rng.random() < 0.3, dora=rng.random() < 0.2,
                        seq_len=rng.choice([512, 1024, 2048, 4096, 6931, 8192, 16384, 131072, None]),
                        fixes=rng.choice(["none", "all"]), batch=rng.choice([1, 1, 2, 4]),
                        optimizer=rng.choice([None, "adamw_torch", "adamw_8bit", "adafactor"]),
                        checkpointing=rng.random() < 0.85,
                        targets=rng.choice([ALL_LINEAR, ALL_LINEAR, ("q_proj", "v_proj")]))
        gpu = rng.choice(gpus)
        if i % 4 == 0:  # a recipe the ledger measured, on its card (or another's), as asked or changed
            recipe, gpu = rng.choice(measured)
            recipe = recipe.replace(optimizer=rng.choice([None, "adamw_torch"]), batch=rng.choice([1, 1, 2]))
            gpu = gpu if rng.random() < 0.8 else rng.choice(gpus)
        kw = {"entry": table[gpu].gpu if gpu not in ledger.gpus else None, "run": rng.choice(["probe", "real"]),
              "margin_mib": rng.choice([0.0, 0.0, 256.0]), "budget_mib": rng.choice([None, None, 3000.0, 90000.0])}
        a = p.predict(recipe, gpu, **kw)
        assert p.verdict(recipe, gpu, **kw) == (a.verdict, a.limit_low_mib, a.limit_high_mib), (recipe, gpu, kw)
        seen.add(a.verdict)
        paths.add("measured failure" if "was measured on" in a.why else "upper bound" if "upper bound for LoRA" in a.why
                  else "batch" if a.why.startswith("no prediction: micro-batch")
                  else "no length" if a.why.endswith("needs the sequence length") else a.method)
    # A length no row of the card reaches, bounded by its measured rows of harder recipes (a path
    # the random questions may miss once a measured failure decides theirs first).
    asked = next(r for r, g in measured if g == "rx-7900-xtx" and r.rank == 96 and r.dropout and r.fixes == "all")
    for run in ("probe", "real"):
        recipe = asked.replace(seq_len=6931)
        a = p.predict(recipe, "rx-7900-xtx", run=run)
        assert p.verdict(recipe, "rx-7900-xtx", run=run) == (a.verdict, a.limit_low_mib, a.limit_high_mib)
        paths.add(a.method)
    assert seen == {"fits", "tight", "won't fit", "unknown"}
    assert {"measured failure", "upper bound", "batch", "no length", "dry run", "interpolated", "measured probe",
            "measured real run", "bounded by measured rows"} <= paths, paths


def test_the_ladders_scan_of_verdicts_is_the_full_scan(p):
    """The fit table's ladder scans with verdicts alone (``verdicts_only``): its ceilings, status,
    note, limit and the verdict at each rank are the full scan's, for every recipe the ladder asks
    of the ledger's cards (stock and the preset, a probe and a training run, micro-batches and an
    optimizer), the easier and harder recipes it is made consistent with included."""
    asked = []
    ceiling = p.ceiling

    def record(recipe, gpu, **kw):
        asked.append((recipe, gpu, kw))
        return ceiling(recipe, gpu, **kw)

    p.ceiling = record
    try:
        for run, batch, optimizer in (("probe", 1, None), ("real", 1, None), ("real", 4, "adamw_8bit")):
            fit_table(p, models=["gemma-3-4b-it"], gpus=list(p.ledger.gpus), run=run, batch=batch,
                      optimizer=optimizer, lengths=(512, 2048, 6931, 16384))
    finally:
        del p.ceiling
    assert len(asked) >= 100 and all(kw.get("verdicts_only") for _, _, kw in asked)
    fields = ("fits_rank", "tight_rank", "status", "at_least", "note", "limit_low_mib", "limit_high_mib")
    statuses = set()
    for recipe, gpu, kw in asked:
        light = p.ceiling(recipe, gpu, **kw)
        full = p.ceiling(recipe, gpu, **{**kw, "verdicts_only": False})
        assert [getattr(light, f) for f in fields] == [getattr(full, f) for f in fields], (recipe, gpu)
        assert [r["verdict"] for r in light.ranks] == [r["verdict"] for r in full.ranks]
        statuses.add(full.status)
    assert statuses == {"ok", "none-fits", "unknown"}


def test_stale_rows_are_those_of_other_library_versions(monkeypatch, capsys):
    """A dry-run row is stale when a library version it records differs from the ones the build
    compares with: ``VRAM_LEDGER_LIBRARY_VERSIONS``, else the installed ones; a row that records
    none never is; a malformed variable is one located line from the build, nothing written."""
    from ledger.answer.fits import library_versions, stale_rows
    from ledger.core.models import Measurement

    def row(i, **versions):
        return Measurement.model_validate({"id": i, "kind": "dry_run", "environment": versions or None})

    rows = [row("a", torch="2.13.0", transformers="5.24.0", peft="0.21.2"), row("b", transformers="5.25.0"),
            row("c"), row("d", torch="2.12.0")]
    monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", "torch=2.13.0, transformers=5.24.0,peft=0.21.2")
    assert library_versions() == {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2"}
    assert stale_rows(rows) == ["b", "d"]
    monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", "torch=2.13.0,transformers=5.25.0,peft=0.21.2")
    assert stale_rows(rows) == ["a", "d"]
    monkeypatch.delenv("VRAM_LEDGER_LIBRARY_VERSIONS")
    from importlib import metadata
    monkeypatch.setattr(metadata, "version", lambda name: {"torch": "2.12.0", "transformers": "5.25.0",
                                                           "peft": "0.21.2"}[name])
    assert stale_rows(rows) == ["a"]

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    assert library_versions() is None and stale_rows(rows) == []
    for bad in ("torch=2.13.0,transformers=5.24.0", "torch=2.13.0,transformers=,peft=1", "torch=1,torch=2,peft=1,transformers=1"):
        monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", bad)
        out = REPO / "no-such-site"
        assert cli.main(["build", "--ledger", str(BUNDLED), "--out", str(out), "-q"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("VRAM_LEDGER_LIBRARY_VERSIONS: must name each of torch, transformers, peft once") and "\n" not in err
        assert not out.exists()


def test_a_real_run_that_ran_out_of_memory_makes_its_recipe_and_harder_ones_not_fit(p):
    """real-v14: r112, dropout 0.1, the program's preset on the RTX 3070 Ti ran out of memory at
    steps 236 and 239, recording no longest example: that recipe and every harder one won't fit,
    whatever an interval says (its card's runs trained 7,177 tokens at most)."""
    model = "unsloth/gemma-3-4b-it"
    for rank in (112, 120, 128):
        a = p.predict(Recipe(model=model, rank=rank, dropout=True, seq_len=7177, fixes="all"), "rtx-3070-ti", run="real")
        assert a.verdict == "won't fit", rank
        if rank < 128:  # r128's own interval is past the limit already
            assert {"real-v14-run2", "real-v14-run3"} & set(a.evidence), rank
    easier = p.predict(Recipe(model=model, rank=96, dropout=True, seq_len=7177, fixes="all"), "rtx-3070-ti", run="real")
    assert easier.verdict != "won't fit"  # real-v15 fit there
    ceiling = p.ceiling(Recipe(model=model, dropout=True, seq_len=7177, fixes="all"), "rtx-3070-ti", run="real")
    assert ceiling.tight_rank is not None and ceiling.tight_rank < 112


def test_lora_on_fewer_projections_is_answered_by_their_own_dry_runs(ledger, tmp_path):
    """With dry runs of the asked projections, the answer is theirs (below the all-7 figure, with a
    lower end); without, the all-7 figure as an upper bound only."""
    from probe_kit.self_check import _config, dry_row

    asked = Recipe(model="qwen2.5-0.5b", rank=16, seq_len=512, fixes="none", optimizer="adamw_torch",
                   targets=("q_proj", "v_proj"))
    rows = load_dry_runs()
    card = resolve_card(ledger, "rtx-4090")[1]
    bound = Predictor(ledger, rows).predict(asked, "rtx-4090", entry=card, run="real")
    assert bound.real_allocated.low_mib is None and "upper bound" in bound.method_text
    own = [dry_row(_config(asked.replace(optimizer=None), rank=r)) for r in (8, 64)]
    exact = Predictor(ledger, rows + own).predict(asked, "rtx-4090", entry=card, run="real")
    assert exact.real_allocated.low_mib is not None and exact.real_allocated.high_mib < bound.real_allocated.high_mib
    assert exact.verdict == "fits" and set(exact.evidence) >= {m.id for m in own}

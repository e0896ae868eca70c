"""Full fine-tuning answered (``--method full``): the full table reads the dry runs of that very
step (a chord between two lengths, at or above the step), the predictor answers from it with the
card's remainder and interval (a measured row of the recipe first), every answering command takes
``--method``, the fit table has full fine-tuning's cells and the outside estimators their full
modes. No torch: the committed dry-run rows answer."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from conftest import BUNDLED, REPO
from ledger import cli
from ledger.answer.fits import FULL_QUANTS, full_grid_points, full_table
from ledger.answer.full_ft import optimizer_of
from ledger.answer.predictor import Predictor
from ledger.core.answers import around
from ledger.fit.full_table import FullTable
from ledger.storage import store
from ledger.storage.dry_runs import load_dry_runs
from ledger.vocab.recipe import full_recipe, full_recipe_of

MODEL = "qwen2.5-0.5b"


@pytest.fixture(scope="module")
def rows():
    return load_dry_runs(REPO / "ledger" / "dry-runs.json")


@pytest.fixture(scope="module")
def predictor(rows):
    return Predictor(store.load(BUNDLED), rows)


def recipe(seq_len, quant="bf16", **kw):
    return full_recipe(model=MODEL, quant=quant, seq_len=seq_len, fixes="none", optimizer="adamw_torch", **kw)


def _row(rows, seq_len, quant="bf16"):
    return next(m for m in rows if m.finetune == "full" and m.model == MODEL and m.quant == quant
                and m.seq_len == seq_len and m.optimizer == "adamw_torch")


def test_the_grid_has_every_models_full_training_run_at_its_lengths(rows):
    """The committed grid holds each full fine-tuning point ``full_grid_points`` names (bf16 and
    fp32 master weights, AdamW), and each reads back as a full recipe, never as LoRA's."""
    from ledger.answer.fits import GRID_MODELS
    from ledger.vocab.recipe import recipe_of

    have = {(m.model, m.quant, m.seq_len, m.optimizer) for m in rows if m.finetune == "full"}
    for model in GRID_MODELS:
        for p in full_grid_points(model):
            assert (model, p["quant"], p["seq_len"], p["optim"]) in have, p
    some = _row(rows, 2048)
    assert recipe_of(some) is None and full_recipe_of(some).method == "full"


def test_the_full_table_is_a_row_or_the_chord_between_two_and_nothing_outside(rows):
    table = FullTable(rows)
    at = {s: _row(rows, s).outcome.peak_allocated_mib for s in (2048, 4096)}
    assert table.figure(recipe(2048), "adamw_torch").mib == at[2048]
    chord = table.figure(recipe(3072), "adamw_torch")
    assert chord.how == "chord" and len(chord.ids) == 2
    assert chord.mib == pytest.approx(at[2048] + (at[4096] - at[2048]) * 1024 / 2048)
    assert table.figure(recipe(256), "adamw_torch") is None  # below the shortest row
    assert table.figure(recipe(2048), None) is None  # a one-step probe has rows of its own (none here)
    assert table.figure(recipe(2048), "sgd") is None
    assert table.figure(recipe(2048, checkpointing=False), "adamw_torch") is None


def test_a_dry_run_past_any_device_fails_at_its_length_and_beyond(rows):
    row = _row(rows, 2048)
    oom = row.model_copy(update={"id": "oom-row", "seq_len": 8192, "outcome": row.outcome.model_copy(
        update={"status": "oom", "peak_allocated_mib": None, "peak_reserved_mib": None})})
    table = FullTable([r for r in rows if r.model == MODEL] + [oom])
    assert table.figure(recipe(16384), "adamw_torch").how == "past any device"
    assert table.figure(recipe(6144), "adamw_torch") is None  # no chord reaches past the failed length
    a = Predictor(store.load(BUNDLED), [r for r in rows if r.model == MODEL] + [oom]).predict(
        recipe(16384), "rtx-4090", run="real")
    assert a.verdict == "won't fit" and "oom-row" in a.evidence


def test_the_answer_is_its_dry_run_plus_the_cards_remainder_and_never_below_it(predictor, rows):
    from ledger.answer.fits import cards

    entry = cards(predictor)["rtx-4090"]
    for seq in (512, 4096, 32768):
        for quant in FULL_QUANTS:
            a = predictor.predict(recipe(seq, quant), "rtx-4090", entry=entry, run="real")
            fig = predictor.full.table.figure(recipe(seq, quant), "adamw_torch")
            rem = predictor.remainder("rtx-4090", "nvidia")[0]
            width = predictor.dry_cal.width(None, False)[0]
            assert a.method == "dry run" and a.real_allocated == around(fig.mib + rem, width)
            assert a.real_allocated.high_mib >= fig.mib and list(fig.ids) == a.evidence
            assert a.recipe["method"] == "full" and a.recipe["optimizer"] == "adamw_torch"
            assert "full fine-tuning (every weight trained)" in a.method_text
            low, high = a.limit_low_mib, a.limit_high_mib
            assert a.verdict == ("fits" if a.real_allocated.high_mib <= low else
                                 "won't fit" if a.real_allocated.low_mib > high else "tight")
            # The verdict alone (a ceiling's scan) is the same derivation.
            assert predictor.verdict(recipe(seq, quant), "rtx-4090", entry=entry, run="real")[0] == a.verdict
    # fp32 master weights need more than bf16 weights at every length.
    assert (predictor.predict(recipe(512, "fp32"), "rtx-4090", run="real").real_allocated.mib
            > predictor.predict(recipe(512), "rtx-4090", run="real").real_allocated.mib)


def test_a_one_step_probe_or_another_optimizer_needs_dry_runs_of_its_own(predictor):
    a = predictor.predict(recipe(2048), "rtx-4090", run="probe")
    assert a.verdict == "unknown" and "no dry run of a one-step probe" in a.why
    b = predictor.predict(full_recipe(model=MODEL, quant="bf16", seq_len=2048, fixes="none", optimizer="sgd"),
                          "rtx-4090", run="real")
    assert b.verdict == "unknown" and "sgd" in b.why
    assert optimizer_of(full_recipe(model=MODEL, seq_len=512, fixes="none"), "real") == "adamw_torch"


def test_a_measured_full_fine_tuning_run_on_the_card_answers_first(rows):
    ledger = store.load(BUNDLED)
    row = _row(rows, 2048)
    run = row.model_copy(update={"id": "real-full-run", "kind": "real", "gpu": "rtx-3070-ti", "outcome":
                                 row.outcome.model_copy(update={"peak_allocated_mib": 5000.0,
                                                                "peak_reserved_mib": None})})
    p = Predictor(ledger.model_copy(update={"measurements": [*ledger.measurements, run]}), rows)
    a = p.predict(recipe(2048), "rtx-3070-ti", run="real")
    assert a.method == "measured real run" and a.real_allocated.mib == 5000.0 and a.evidence == ["real-full-run"]
    # Another card, or a held-out fit without it, is the dry run again.
    assert p.predict(recipe(2048), "rtx-4090", run="real").method == "dry run"
    held = Predictor(ledger.model_copy(update={"measurements": [*ledger.measurements, run]}), rows,
                     exclude=["real-full-run"])
    assert held.predict(recipe(2048), "rtx-3070-ti", run="real").method == "dry run"


def test_the_fit_tables_full_cells_are_the_predictors_answers(predictor):
    cells = full_table(predictor, gpus=["rtx-4090", "h100-80gb"], models=[MODEL])
    assert {c.quant for c in cells} == set(FULL_QUANTS) and {c.gpu for c in cells} == {"rtx-4090", "h100-80gb"}
    from ledger.answer.fits import cards

    for c in cells:
        a = predictor.predict(recipe(c.seq_len, c.quant), c.gpu, entry=cards(predictor)[c.gpu], run="real")
        assert (c.verdict, c.mib, c.high_mib) == (a.verdict, a.real_allocated.mib, a.real_allocated.high_mib)
    # Every answer at or above its own dry run (the interval's top), on every card the site shows.
    from ledger.answer.fits import page_cards

    for c in full_table(predictor, gpus=page_cards(predictor), models=[MODEL, "llama-3.2-1b"]):
        fig = predictor.full.table.figure(recipe(c.seq_len, c.quant).replace(model=c.model), "adamw_torch")
        assert c.high_mib >= fig.mib, c
    # A card of 80 GB fits every length a 24 GB card fits.
    by = {(c.gpu, c.quant, c.seq_len): c.verdict for c in cells}
    assert all(by[("h100-80gb", q, s)] == "fits" for (g, q, s), v in by.items() if g == "rtx-4090" and v == "fits")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,flag,message", [
    (["estimate", "--seq-len", "512", "--quant", "4bit"], "--quant", "4-bit weights cannot be trained"),
    (["estimate", "--seq-len", "512", "--rank", "16"], "--rank", "a LoRA setting"),
    (["estimate", "--seq-len", "512", "--dropout", "0.1"], "--dropout", "a LoRA setting"),
    (["estimate", "--seq-len", "512", "--dora"], "--dora", "a LoRA setting"),
    (["estimate", "--seq-len", "512", "--target-modules", "attn"], "--target-modules", "a LoRA setting"),
    (["ceiling", "--seq-len", "512", "--gpu", "rtx-4090"], "--seq-len", "full fine-tuning has no rank to search"),
    (["fit", "--quant", "4bit", "--gpu", "rtx-4090"], "--quant", "4-bit weights cannot be trained"),
])
def test_what_full_fine_tuning_cannot_take_is_one_located_line(capsys, argv, flag, message):
    code, out, err = run_cli(capsys, argv[0], "--model", MODEL, "--method", "full", "--no-compute", *argv[1:])
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(flag + ":") and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,flag", [
    (["estimate", "--seq-len", "512", "--rank", "8", "--quant", "fp32"], "--quant"),
    (["fit", "--quant", "fp32", "--gpu", "rtx-4090"], "--quant"),
    (["estimate", "--seq-len", "512"], "--rank"),
])
def test_lora_takes_neither_fp32_weights_nor_no_rank(capsys, argv, flag):
    code, out, err = run_cli(capsys, argv[0], "--model", MODEL, "--no-compute", *argv[1:])
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith(flag + ":")


def test_estimate_fit_and_ceiling_answer_full_fine_tuning(capsys, predictor):
    code, out, _ = run_cli(capsys, "estimate", "--model", MODEL, "--method", "full", "--seq-len", "2048",
                           "--gpu", "rtx-4090", "--no-compute", "--json")
    doc = json.loads(out)
    from ledger.answer.fits import cards

    entry = cards(predictor)["rtx-4090"]
    a = predictor.predict(recipe(2048), "rtx-4090", entry=entry, run="real")
    assert code == 0 and doc["recipe"]["method"] == "full" and doc["recipe"]["rank"] is None
    assert doc["answer"]["real_allocated"] == a.real_allocated.model_dump() and doc["answer"]["verdict"] == a.verdict
    assert doc["nearest_measurement"] is None
    est = {e["estimator"]: e for e in doc["estimates"]}
    assert est["ft01"]["available"] and est["unsloth-studio"]["available"]
    code, out, _ = run_cli(capsys, "estimate", "--model", MODEL, "--method", "full", "--seq-len", "2048",
                           "--gpu", "rtx-4090", "--no-compute")
    first = out.splitlines()[0]
    assert "full fine-tuning (every weight trained), bf16, 2048 tokens" in first and "r16" not in first
    assert "adamw_torch" in first and f"vram-ledger: {a.verdict.upper()}" in out

    code, out, _ = run_cli(capsys, "fit", "--model", MODEL, "--method", "full", "--gpu", "rtx-4090", "--no-compute",
                           "--json")
    doc = json.loads(out)
    assert code == 0 and doc["method"] == "full" and {c["quant"] for c in doc["cells"]} == set(FULL_QUANTS)
    for c in doc["cells"]:
        b = predictor.predict(recipe(c["seq_len"], c["quant"]), "rtx-4090", entry=entry, run="real")
        assert c["verdict"] == b.verdict and c["allocated"] == b.real_allocated.model_dump()
    code, out, _ = run_cli(capsys, "fit", "--model", MODEL, "--method", "full", "--gpu", "rtx-4090", "--no-compute")
    assert "full fine-tuning (every weight trained, no adapter)" in out and "fp32 master weights" in out

    code, out, _ = run_cli(capsys, "ceiling", "--model", MODEL, "--method", "full", "--gpu", "rtx-4090",
                           "--no-compute", "--json")
    c = json.loads(out)
    fits = [s for s in range(256, 32769, 256)
            if predictor.predict(recipe(s), "rtx-4090", entry=entry, run="real").verdict == "fits"]
    assert code == 0 and c["fits_len"] == max(fits)


def test_the_outside_estimators_full_modes():
    from ledger.report.estimators import FT01, Canifinetune, UnslothStudio
    from ledger.vocab.model_configs import load_arch

    arch = load_arch(MODEL)
    r = recipe(2048)
    ft01 = FT01().estimate(arch, r)
    assert ft01.low_bytes == arch.total_params * 16 and ft01.high_bytes == pytest.approx(ft01.low_bytes * 160 / 112)
    u = UnslothStudio().estimate(arch, r)
    H, L, V, M = arch.hidden, arch.layers, arch.vocab, arch.intermediate
    K = (H // arch.heads) * arch.kv_heads
    params = ((2 * H + 2 * K) * H + 3 * H * M) * L + 2 * H * L + V * H + (0 if arch.tied else V * H)
    act = (2048 * (H + 2 * K) + 2048 * 2 + 2048 * 2 * M) * 2 * 1.25 * 2.0
    assert u.bytes == pytest.approx(params * 2 + params * 6 + max(params * 2, params * 2 * 0.15) + act + 1.4e9)
    assert UnslothStudio().estimate(arch, full_recipe(model=MODEL, seq_len=2048, fixes="none",
                                                      optimizer="adafactor")) is None
    if Canifinetune.available():
        c = Canifinetune().estimate(arch, r)
        assert c.breakdown["optimizer"] > 0 and c.bytes > params * 4
        assert Canifinetune().estimate(arch, full_recipe(model=MODEL, seq_len=2048, fixes="none",
                                                         optimizer="adafactor")) is None


def test_a_sweep_point_takes_the_method(tmp_path):
    from probe_kit.run_sweep import load_sweep

    path = tmp_path / "s.toml"
    path.write_text('[sweep]\nname = "t"\ndevice = "dry"\n[base]\nrandom_weights = true\n[[points]]\n'
                    'model = "tiny-llama"\nmethod = "full"\nquant = "fp32"\nseq_len = 128\nresponse_len = 16\n'
                    'optim = "adamw_torch"\n')
    (point,) = load_sweep(str(path)).points
    assert point.config.method == "full" and "--method" in point.flags() and "full" in point.flags()


def test_the_site_shows_full_fine_tuning_on_model_pages_the_picker_and_fits_md(tmp_path, rows):
    """A build from the golden site's rows plus the three models' full fine-tuning rows: a model page
    gets its full fine-tuning tables (or the line saying it fits no listed card), fits.md the same
    tables, the picker's data every common card's cells, and vram.json the cells, valid."""
    from conftest import GOLDEN_DRY, SMALL
    from html.parser import HTMLParser

    from ledger.site.render import render_site

    golden = json.loads(GOLDEN_DRY.read_text(encoding="utf-8"))
    models = {m["model"] for m in golden["measurements"]}
    have = {m["id"] for m in golden["measurements"]}  # (the golden rows hold llama-3.1-8b's several-GPU ones)
    full = [m.model_dump(mode="json", exclude_none=True) for m in rows
            if m.finetune == "full" and m.model in models and m.id not in have]
    dry = tmp_path / "dry.json"
    dry.write_text(json.dumps({**golden, "measurements": golden["measurements"] + full}), encoding="utf-8")
    out = tmp_path / "site"
    render_site(store.load(SMALL), out, dry_runs=dry)
    page = (out / "fits" / f"{MODEL}.html").read_text(encoding="utf-8")
    assert '<section id="full">' in page and f'id="full-{MODEL.replace(".", "-")}-fp32"' in page
    assert 'class="num fit-ok"' in page.split('<section id="full">')[1]
    big = (out / "fits" / "llama-3.1-8b.html").read_text(encoding="utf-8")
    assert "It fits none of the listed cards at any length" not in big or "needs about" in big

    class Check(HTMLParser):  # every tag the section opens is closed
        def __init__(self):
            super().__init__()
            self.stack = []

        def handle_starttag(self, tag, attrs):
            if tag not in ("br", "meta", "link", "input", "img"):
                self.stack.append(tag)

        def handle_endtag(self, tag):
            assert self.stack and self.stack.pop() == tag, tag
    checker = Check()
    checker.feed(page)
    data = json.loads((out / "fits" / f"{MODEL}.json").read_text(encoding="utf-8"))
    doc = json.loads((out / "vram.json").read_text(encoding="utf-8"))
    cells = [c for c in doc["derived"]["fits"]["full_cells"] if c["model"] == MODEL]
    assert cells and {c["quant"] for c in cells} == set(FULL_QUANTS)
    card = cells[0]["gpu"]
    picker = data["full"][f"bf16|{card}"]
    assert [p[:3] for p in picker] == [[c["seq_len"], c["verdict"], c["mib"]] for c in cells
                                        if c["gpu"] == card and c["quant"] == "bf16"]
    md = (out / "fits.md").read_text(encoding="utf-8")
    assert f"### {MODEL}, full fine-tuning, bf16 weights" in md
    assert cli.main(["validate", "--public", str(out / "vram.json")]) == 0


def test_the_full_fine_tuning_board_scores_each_estimators_full_mode_against_the_dry_runs(predictor):
    from ledger.report.dry_board import full_board, full_recipes
    from ledger.report.estimators import FT01
    from ledger.vocab.cards import resolve_card

    recipes = full_recipes(predictor.fit.dry_source)
    board = full_board(predictor)
    assert board["recipes"] == len(recipes) >= 200 and all(r.method == "full" for r in recipes)
    ft01 = next(e for e in board["estimators"] if e["name"] == "ft01")
    assert ft01["n"] == board["recipes"] and set(ft01["slices"]) == {"quant", "size"}
    row = ft01["rows"][0]
    card, entry, _ = resolve_card(predictor.ledger, board["reference_card"])
    r = next(x for x in recipes if (x.model, x.quant, x.seq_len) == (row["model"], row["quant"], row["seq_len"]))
    answer = predictor.predict(r, card, entry=entry, run="real")
    from ledger.vocab.model_configs import load_arch

    est = FT01().estimate(load_arch(r.model), r).bytes / 2**20
    assert row["reference_mib"] == answer.reserved.mib and row["estimate_mib"] == round(est, 1)
    assert row["error_pct"] == round((est - answer.reserved.mib) / answer.reserved.mib * 100, 2)


def test_a_chord_knows_when_it_is_exact_and_a_length_ceiling_dry_runs_the_edges_of_the_others(predictor):
    """The rows beyond a chord's ends give a floor under a convex peak: where the peak moves from the
    optimizer's step to the activations between two lengths (llama-3.2-1b bf16, 2,048 to 4,096
    tokens) the chord sits above it, and a length ceiling whose edge falls there asks for the dry
    run halfway; where the floor reaches the chord (affine in length) it asks nothing."""
    from types import SimpleNamespace

    from ledger.cli.ceiling import CHORD_SLACK, _chord_edge

    r = full_recipe(model="llama-3.2-1b", quant="bf16", fixes="none", optimizer="adamw_torch")
    switch = predictor.full.table.figure(r.replace(seq_len=3072), "adamw_torch")
    affine = predictor.full.table.figure(r.replace(seq_len=12288), "adamw_torch")
    assert switch.how == affine.how == "chord"
    assert switch.floor_mib < switch.mib * (1 - CHORD_SLACK) and affine.floor_mib >= affine.mib * (1 - CHORD_SLACK)
    assert switch.floor_mib <= switch.mib
    assert _chord_edge(predictor, r, SimpleNamespace(fits_len=2816, tight_len=2816), "real", 256) == 3072
    assert _chord_edge(predictor, r, SimpleNamespace(fits_len=11776, tight_len=11776), "real", 256) is None
    assert _chord_edge(predictor, r, SimpleNamespace(fits_len=3840, tight_len=3840), "real", 256) is None  # a row


def test_a_prediction_of_a_full_fine_tune_is_stored_with_its_dry_runs_and_scored_by_a_full_run_only(tmp_path, capsys,
                                                                                                  rows):
    import shutil

    from ledger.answer.predictions import score_predictions

    path = tmp_path / "l.json"
    shutil.copy(BUNDLED, path)
    code, out, err = run_cli(capsys, "predict", "--ledger", str(path), "--model", MODEL, "--method", "full",
                             "--seq-len", "2048", "--gpu", "rtx-4090", "--json")
    assert code == 0, err
    doc = json.loads(out)
    pred = doc["prediction"]
    assert pred["finetune"] == "full" and "lora" not in pred and pred["id"].startswith("pred-rtx-4090-full-")
    assert [d["id"] for d in pred["dry_run_rows"]] == pred["basis"] == [_row(rows, 2048).id]
    ledger = store.load(path)
    base = _row(rows, 2048)
    lora_run = next(m for m in ledger.measurements if m.kind == "real" and m.outcome.peak_allocated_mib)
    lora_run = lora_run.model_copy(update={"id": "lora-run", "gpu": "rtx-4090", "model": MODEL, "quant": "bf16",
                                           "seq_len": 2048})
    # A real run scores a prediction only if measured on or after the day it was made (today).
    full_run = base.model_copy(update={"id": "full-run", "kind": "real", "gpu": "rtx-4090",
                                       "provenance": base.provenance.model_copy(
                                           update={"measured_on": dt.date.fromisoformat(pred["made_on"])})})
    ledger.measurements += [lora_run]
    assert score_predictions(ledger).scored == []  # a LoRA run never scores a full fine-tune's prediction
    ledger.measurements += [full_run]
    assert score_predictions(ledger).scored == [pred["id"]]
    assert ledger.predictions[-1].score.measurement == "full-run"


def test_a_measured_full_fine_tune_is_scored_on_the_board_apart_from_the_dry_runs(rows):
    from ledger.report.dry_board import full_board
    from ledger.report.estimators import FT01
    from ledger.vocab.model_configs import load_arch

    ledger = store.load(BUNDLED)
    row = _row(rows, 2048)
    run = row.model_copy(update={"id": "real-full", "kind": "real", "gpu": "rtx-3070-ti", "outcome":
                                 row.outcome.model_copy(update={"peak_allocated_mib": 7000.0,
                                                                "peak_reserved_mib": 7300.0})})
    p = Predictor(ledger.model_copy(update={"measurements": [*ledger.measurements, run]}), rows)
    board = full_board(p)
    ft01 = next(e for e in board["estimators"] if e["name"] == "ft01")
    (m,) = ft01["measured"]
    est = FT01().estimate(load_arch(MODEL), full_recipe_of(run)).bytes / 2**20
    assert m["id"] == "real-full" and m["measured_mib"] == 7300.0 and m["estimate_mib"] == round(est, 1)
    assert ft01["measured_median_abs_err_pct"] == abs(m["error_pct"])
    assert full_board(Predictor(ledger, rows))["estimators"][0]["measured"] == []  # none measured: none scored

"""Calibration on the bundled ledger and on synthetic data."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FROZEN as BUNDLED
from ledger import cli
from ledger.storage import store
from ledger.fit.calibration import overestimate, predict_real
from ledger.fit.peaks import before, rank_slope
from ledger.report.calibration_report import calibrate, loo
from ledger.storage.dry_runs import load_dry_runs
from ledger.answer.predictor import Predictor
from ledger.vocab.recipe import Recipe
from ledger.core.models import SCHEMA_VERSION, Gpu, Ledger, Lora, Measurement, Outcome, Provenance


@pytest.fixture(scope="module")
def ledger():
    return store.load(BUNDLED)


@pytest.fixture(scope="module")
def predictor(ledger):
    return Predictor(ledger, load_dry_runs())


def ceiling(p, gpu, seq_len, dropout=False, dora=False, **kw):
    return p.ceiling(Recipe(None, seq_len=seq_len, dropout=dropout, dora=dora), gpu, **kw)


def test_the_program_case_is_reproduced(ledger):
    # As the program stood when it predicted v15: data up to 2026-09-23, v15 itself not yet run.
    ms = before(ledger.measurements, dt.date(2026, 9, 23), exclude=["real-v15"])
    over = overestimate(ms)
    (anchor,) = over.anchors
    assert anchor.probe == "probe-0919f-r112" and anchor.probe_mib == 6980.0 and anchor.real_mib == 6653.0
    # The program's method: the raw peaks' over-estimate, 4.7%, and its prediction for v15, 2.5% high.
    assert round(anchor.raw_overestimate_pct, 1) == 4.7
    assert round(7127.6 * (1 - 0.047)) == 6793
    # On the probes' cores (the anchor kept 73 positions, sweep-r96-drop 237, at 262,208 x 4 bytes each).
    assert anchor.kept_positions == 73 and anchor.logits_mib == 73.0
    assert round(over.pct, 2) == 3.68
    pred = predict_real(7127.6, over, "unsloth/gemma-3-4b-it", 237)["predicted_mib"]
    assert pred == pytest.approx((7127.6 - 237 * 262208 * 4 / 2**20) * (1 - over.pct / 100), abs=0.1)
    assert abs(pred - 6629) / 6629 * 100 < 0.2  # 6637.5 MiB
    # An unknown span subtracts nothing; a span past the longest a pair covered only up to it.
    assert predict_real(7127.6, over)["predicted_mib"] == round(7127.6 * (1 - over.pct / 100), 1)
    assert over.keep_max == 319
    long = predict_real(8000, over, "unsloth/gemma-3-4b-it", 2000)
    assert long == predict_real(8000, over, "unsloth/gemma-3-4b-it", 319)
    assert long["predicted_mib"] == round((8000 - 319 * 262208 * 4 / 2**20) * (1 - over.pct / 100), 1)


def test_rank_ceiling_of_the_training_card(predictor, capsys):
    c = ceiling(predictor, "rtx-3070-ti", 7177, dropout=True)
    assert c.fits_rank == 96 and c.status == "ok"
    by_rank = {r["rank"]: r for r in c.ranks}
    assert by_rank[96]["method"] == "measured probe" and "sweep-r96-drop" in by_rank[96]["evidence"]
    assert by_rank[104]["verdict"] in ("tight", "won't fit")  # r104 ran out of memory
    assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "RTX 3070 Ti", "--seq-len", "7177",
                     "--dropout", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_rank"] == 96


def test_an_observed_fit_is_never_capped_away(predictor):
    assert ceiling(predictor, "rtx-3060-ti", 7177).fits_rank >= 64  # r64 fit there, r96 OOMed


def test_unknown_rather_than_a_guess(predictor, capsys):
    c = ceiling(predictor, "rtx-3070-ti", 30000)
    assert c.fits_rank is None and c.status == "unknown"
    assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", "30000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_rank"] is None
    assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", "30000"]) == 0
    first, verdict = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("for a one-step probe of") and "fixes all" in first  # the whole recipe first
    assert verdict.startswith("unknown")


@pytest.mark.parametrize("gpu", ["rtx-3070-ti", "rx-7900-xtx", "rtx-3060-ti"])
def test_ceiling_never_rises_with_seq_len_dropout_or_dora(ledger, predictor, gpu):
    # Over the lengths probed on the card.
    SEQS = sorted({m.seq_len for m in ledger.measurements if m.gpu == gpu and m.kind == "probe" and m.seq_len})

    def rank(**kw):
        c = ceiling(predictor, gpu, **kw)
        return c.fits_rank if c.status == "ok" else (0 if c.status == "none-fits" else None)

    for dropout in (False, True):
        for dora in (False, True):
            ranks = [r for r in (rank(seq_len=s, dropout=dropout, dora=dora) for s in SEQS) if r is not None]
            assert ranks == sorted(ranks, reverse=True), (dropout, dora, ranks)
    for s in SEQS:
        base, drop, dora = rank(seq_len=s), rank(seq_len=s, dropout=True), rank(seq_len=s, dora=True)
        if base is not None and drop is not None:
            assert drop <= base
        if base is not None and dora is not None:
            assert dora <= base


def test_calibrate_json_has_the_promised_keys(capsys):
    assert cli.main(["calibrate", "--ledger", str(BUNDLED), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"anchors", "overestimate_pct", "costs", "limits", "loo"} <= set(doc)
    loo_doc = doc["loo"]
    assert loo_doc["verdict_total"] > 20 and loo_doc["real_n"] == 10
    assert {"verdict_correct", "verdict_total", "real_median_abs_err_pct", "real_n"} <= set(loo_doc)


def test_marginal_costs_from_the_data(ledger):
    c = calibrate(ledger, with_loo=False)["costs"]
    assert 166 <= c["dropout"]["min_mib"] <= c["dropout"]["max_mib"] <= 176  # the program's 167-175
    assert 1800 <= c["dora"]["median_mib"] <= 1850  # ~1.8 GiB
    sweep = next(r for r in c["rank"] if r["gpu"] == "rtx-3070-ti" and r["dropout"])
    assert sweep["mib_per_rank"] == pytest.approx(14.8, abs=0.1) and sweep["rows"] == [
        "sweep-r80-drop", "sweep-r88-drop", "sweep-r96-drop"]
    seq = next(s for s in c["seq_len"] if s["gpu"] == "rx-7900-xtx")
    steps = [p["mib_per_token"] for p in seq["piecewise"]]
    assert max(steps) > 1.2 * min(steps)  # not linear over 2k-16k
    real = {(r["from_rank"], r["to_rank"]): r for r in c["real_rank"] if not r["dropout"]}
    assert 850 <= real[(64, 112)]["cost_mib"] <= 880


def test_limits_are_intervals_between_fits_and_ooms(ledger):
    lims = {(l["gpu"], l["kind"]): l for l in calibrate(ledger, with_loo=False)["limits"]}
    probe = lims[("rtx-3070-ti", "probe")]
    assert probe["low_mib"] == 7216.0 and probe["low_mib"] <= probe["high_mib"] <= 7.65 * 1024
    real = lims[("rtx-3070-ti", "real")]
    assert real["low_mib"] == 6658.0 and real["exceeded_id"] in ("real-v14-run2", "real-v14-run3")


def _row(i, rank, peak, status="ok", kind="probe", gpu="card", seq=4096, day=1):
    return Measurement(id=f"m{i}", kind=kind, gpu=gpu, model="m", quant="4bit", lora=Lora(rank=rank, dropout=0.0),
                       seq_len=seq if kind == "probe" else None, memory_fixes="all",
                       outcome=Outcome(status=status, peak_allocated_mib=peak if status == "ok" else None),
                       provenance=Provenance(measured_on=dt.date(2026, 1, day)))


@settings(max_examples=60, deadline=None)
@given(st.floats(5, 40), st.floats(1000, 8000), st.lists(st.floats(-3, 3), min_size=8, max_size=8))
def test_slope_is_recovered_from_noisy_linear_data(slope, base, noise):
    ranks = [8, 16, 32, 48, 64, 96, 128, 192]
    ms = [_row(i, r, base + slope * r + e) for i, (r, e) in enumerate(zip(ranks, noise))]
    assert rank_slope(ms) == pytest.approx(slope, abs=0.1)


def _toy_ledger():
    ms = [_row(i, r, 3000 + 15 * r) for i, r in enumerate([16, 32, 64, 96])]
    ms += [_row(10, 128, None, status="oom"), _row(11, 112, None, status="oom")]
    ms += [_row(20, 64, 3800.0, kind="real", day=2), _row(21, 96, 4300.0, kind="real", day=3)]
    return Ledger(schema_version=SCHEMA_VERSION, gpus={"card": Gpu(name="Card", total_mib=5000.0)}, measurements=ms)


def test_leave_one_out_never_sees_the_held_out_row():
    lg = _toy_ledger()
    first = {r["id"]: r for r in loo(lg, lg.measurements)["reals"]}
    for mid in ("m20", "m21"):
        changed = [m.model_copy(update={"outcome": m.outcome.model_copy(update={"peak_allocated_mib": 9999.0})})
                   if m.id == mid else m for m in lg.measurements]
        again = {r["id"]: r for r in loo(lg, changed)["reals"]}
        assert again[mid]["predicted_mib"] == first[mid]["predicted_mib"]  # its own value cannot move it
        assert again[mid]["actual_mib"] == 9999.0
    verdicts = {v["id"]: v for v in loo(lg, lg.measurements)["verdicts"]}
    changed = [m.model_copy(update={"outcome": Outcome(status="ok", peak_allocated_mib=1.0)}) if m.id == "m2" else m
               for m in lg.measurements]
    assert {v["id"]: v for v in loo(lg, changed)["verdicts"]}["m2"]["predicted_mib"] == verdicts["m2"]["predicted_mib"]


def test_predict_stores_a_prediction_and_a_real_run_scores_it(tmp_path, capsys):
    path = tmp_path / "l.json"
    path.write_bytes(BUNDLED.read_bytes())
    assert cli.main(["predict", "--fixes", "all", "--ledger", str(path), "--gpu", "rtx-3070-ti", "--rank", "88", "--dropout", "0.1",
                     "--seq-len", "7177", "--date", "2026-11-30", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["prediction"]
    assert doc["basis"][0] == "sweep-r88-drop" and doc["interval_low_mib"] <= doc["predicted_peak_mib"]
    assert doc["predicted_peak_mib"] <= doc["interval_high_mib"] and len(doc["calibration_hash"]) == 16
    lg = store.load(path)
    assert lg.predictions[0].id == "pred-real-v15"  # the program's prediction stays first
    pred = lg.predictions[-1]
    assert pred.id == doc["id"] and pred.score is None
    lg.measurements.append(Measurement(
        id="real-r88", kind="real", gpu="rtx-3070-ti", quant="4bit", lora=Lora(rank=88, dropout=0.1),
        outcome=Outcome(status="ok", peak_allocated_mib=6555.0), provenance=Provenance(measured_on="2026-12-01")))
    from ledger.answer.predictions import score_predictions

    assert score_predictions(lg).scored == [pred.id]
    assert lg.predictions[-1].score.measurement == "real-r88"


def test_a_budget_or_margin_applies_to_observed_probes_too(capsys):
    # sweep-r96-drop peaked at 7127.6 MiB and r88 at 7007.9: neither fits a 7000 MiB budget.
    assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", "7177",
                     "--dropout", "0.1", "--budget-mib", "7000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits_rank"] is not None and doc["fits_rank"] < 88
    assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", "7177",
                     "--dropout", "0.1", "--margin-mib", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_rank"] == 88  # 7007.9 <= 7216.0 - 100 < 7127.6


def test_predict_says_what_the_prediction_means_on_the_card(tmp_path, capsys):
    path = tmp_path / "l.json"
    path.write_bytes(BUNDLED.read_bytes())
    argv = ["predict", "--fixes", "all", "--ledger", str(path), "--gpu", "rtx-3070-ti", "--rank", "256", "--seq-len", "7177",
            "--id", "pred-too-big"]
    assert cli.main(argv) == 1  # refused: over the card
    assert "won't fit" in capsys.readouterr().err
    assert not any(p.id == "pred-too-big" for p in store.load(path).predictions)
    assert cli.main(argv + ["--allow-over"]) == 0
    assert "won't fit" in capsys.readouterr().out
    pred = next(p for p in store.load(path).predictions if p.id == "pred-too-big")
    assert pred.provenance.notes[-1].startswith("Verdict: won't fit")  # stored with the prediction
    assert cli.main(["predict", "--fixes", "all", "--ledger", str(path), "--gpu", "rtx-3070-ti", "--rank", "64", "--seq-len", "7177",
                     "--dry-run"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_predict_replays_the_program_prediction_from_what_was_known(capsys):
    # As the program stood on 2026-09-23, before v15 ran: the r96 + dropout probe's core (less 237
    # kept positions of fp32 logits) x (1 - 3.677%, the anchor's over-estimate on its own core).
    assert cli.main(["predict", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--rank", "96", "--dropout", "0.1",
                     "--seq-len", "7177", "--date", "2026-09-23", "--exclude", "real-v15", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction"]["predicted_peak_mib"] == pytest.approx(6637.1, abs=0.1)
    assert abs(doc["prediction"]["predicted_peak_mib"] - 6629) / 6629 < 0.002  # v15 peaked at 6629 MiB
    assert doc["answer"]["method"] == "measured probe"
    assert "237.1 MiB of fp32 logits for 237 kept positions" in doc["answer"]["method_text"]


def test_a_run_with_reserved_only_says_why_it_does_not_score_a_prediction(tmp_path, capsys):
    from conftest import DATA
    from ledger.core.models import Lora, Prediction

    path = tmp_path / "l.json"
    path.write_bytes((DATA / "small-ledger.json").read_bytes())
    lg = store.load(path)
    lg.predictions.append(Prediction(id="pred-open", gpu="rx-7900-xtx", lora=Lora(rank=16), predicted_peak_mib=7000.0,
                                     made_on="2026-01-01"))
    store.save(lg, path)
    log = DATA / "logs" / "unsloth.log"  # Unsloth prints peak reserved only
    assert cli.main(["ingest-log", str(log), "--ledger", str(path), "--gpu", "rx-7900-xtx", "--rank", "16"]) == 0
    err = capsys.readouterr().err
    assert "prediction pred-open matches real-unsloth-" in err and "peak reserved only" in err
    assert next(p for p in store.load(path).predictions if p.id == "pred-open").score is None


def test_real_runs_that_trained_are_evidence_for_a_real_ceiling(capsys):
    # real-v13 trained at r112 on 7177 tokens (6653 MiB): the real-run ceiling is at least 112.
    assert cli.main(["ceiling", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", "7177", "--real",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits_rank"] >= 112 and any("real-v13" in r["evidence"] for r in doc["ranks"])


def test_a_shorter_sequence_never_has_a_lower_ceiling(capsys):
    def rank(seq):
        assert cli.main(["ceiling", "--probe", "--fixes", "all", "--ledger", str(BUNDLED), "--gpu", "rtx-3070-ti", "--seq-len", str(seq),
                         "--dropout", "0.1", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    long, short = rank(7177), rank(4096)
    assert short["status"] == "ok" and short["fits_rank"] >= long["fits_rank"]


def test_leave_one_out_verdicts_never_say_fits_for_an_oom(ledger):
    from ledger.report.calibration_report import calibrate

    loo_doc = calibrate(ledger, with_loo=True, dry_runs=load_dry_runs())["loo"]
    costly = [v["id"] for v in loo_doc["verdicts"] if v["verdict"] == "fits" and not v["fits_actual"]]
    assert costly == [] and loo_doc["verdict_costly"] == 0
    assert loo_doc["verdict_correct"] == loo_doc["verdict_total"] >= 30

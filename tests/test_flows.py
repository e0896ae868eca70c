"""The documented flows a new user runs, end to end: each fails loudly or works, loses nothing,
and writes nothing it should not (predict, ceiling, ingest-log, the callback, init, fit
--compute, the site's text, the small messages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUNDLED, DATA, FROZEN, REPO, SMALL
from ledger import cli
from ledger.storage import store


def run(*argv) -> int:
    return cli.main([str(a) for a in argv])


@pytest.fixture
def bundled_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "copy.json"
    shutil.copy(BUNDLED, dst)
    return dst


# -- predict ----------------------------------------------------------------------------------


def test_a_prediction_from_the_dry_run_rung_is_stored_with_the_rows_it_rests_on(bundled_copy, capsys):
    assert run("predict", "--fixes", "all", "--ledger", bundled_copy, "--gpu", "rtx-3070-ti", "--rank", "16", "--seq-len", "2048") == 0
    assert "by dry run" in capsys.readouterr().out
    lg = store.load(bundled_copy)  # valid: every basis id is in the ledger or carried with the prediction
    pred = lg.predictions[-1]
    carried = {d.id for d in pred.dry_run_rows}
    assert carried and carried <= set(pred.basis) and all(d.kind == "dry_run" for d in pred.dry_run_rows)
    assert run("validate", bundled_copy) == 0


def test_predict_takes_every_card_the_other_commands_take_and_adds_it(bundled_copy, capsys):
    assert "rtx-4090" not in store.load(bundled_copy).gpus
    assert run("predict", "--ledger", bundled_copy, "--gpu", "RTX 4090", "--model", "qwen2.5-7b", "--rank", "16",
               "--seq-len", "2048", "--fixes", "none") == 0
    lg = store.load(bundled_copy)
    assert lg.predictions[-1].gpu == "rtx-4090" and lg.gpus["rtx-4090"].total_mib == 24576.0
    capsys.readouterr()
    assert run("predict", "--ledger", bundled_copy, "--gpu", "GTX 480", "--rank", "16", "--seq-len", "2048") == 1
    assert "unknown gpu 'GTX 480'" in capsys.readouterr().err


def test_a_prediction_dated_in_the_future_is_refused(bundled_copy, capsys):
    before = bundled_copy.read_bytes()
    assert run("predict", "--fixes", "all", "--ledger", bundled_copy, "--gpu", "rtx-3070-ti", "--rank", "16", "--seq-len", "2048",
               "--date", "2999-01-01") == 1
    assert capsys.readouterr().err.startswith("--date: 2999-01-01 is in the future")
    assert bundled_copy.read_bytes() == before


def test_a_measured_oom_of_the_recipe_is_wont_fit(capsys):
    """sweep-r104-drop ran out of memory on the RTX 3070 Ti at 7177 tokens: r104 with dropout
    there is "won't fit", not "tight", and so is every harder recipe."""
    assert run("ceiling", "--probe", "--fixes", "all", "--ledger", FROZEN, "--gpu", "rtx-3070-ti", "--seq-len", "7177", "--dropout", "0.1",
               "--json") == 0
    c = json.loads(capsys.readouterr().out)
    r104 = next(r for r in c["ranks"] if r["rank"] == 104)
    assert r104["verdict"] == "won't fit" and "sweep-r104-drop" in r104["evidence"]
    assert c["fits_rank"] == 96 and c["tight_rank"] == 96
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    p = Predictor(store.load(FROZEN), load_dry_runs())
    harder = p.predict(Recipe(model="gemma-3-4b-it", rank=112, dropout=True, seq_len=8192), "rtx-3070-ti")
    assert harder.verdict == "won't fit"


# -- ingest-log -------------------------------------------------------------------------------


def test_a_peak_past_the_card_is_spilled_and_past_any_driver_refused(tmp_path, capsys):
    ledger = tmp_path / "l.json"
    shutil.copy(SMALL, ledger)
    log = tmp_path / "unsloth.log"
    log.write_text("Peak reserved memory = 16.000 GB.\n")
    assert run("ingest-log", log, "--ledger", ledger, "--gpu", "rtx-3070-ti") == 0
    m = store.load(ledger).measurements[-1]
    assert m.outcome.status == "spilled" and m.outcome.peak_reserved_mib == 16384.0
    assert "status" in m.provenance.inferred_fields
    before = ledger.read_bytes()
    log.write_text("Peak reserved memory = 900.000 GB.\n")
    capsys.readouterr()
    assert run("ingest-log", log, "--ledger", ledger, "--gpu", "rtx-3070-ti") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{log}:1: outcome.peak_reserved_mib: 921600.0 MiB is more than") and "\n" not in err
    assert ledger.read_bytes() == before


def test_a_log_of_two_runs_gives_a_row_per_run(tmp_path):
    ledger = tmp_path / "l.json"
    shutil.copy(SMALL, ledger)
    log = tmp_path / "train.log"
    log.write_text(
        "2026-09-23 04:11:09 INFO epoch 0\n"
        " 20%|##        | 236/1172 [41:21<2:44:03, 10.51s/it]\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 72.00 MiB. GPU 0 has a total capacity of "
        "7.65 GiB of which 58.00 MiB is free.\n"
        "2026-09-24 10:00:00 INFO resumed with a smaller rank\n"
        " 10%|#         | 117/1172 [20:00<2:44:12, 10.50s/it]\n"
        "100%|##########| 1172/1172 [3:20:00<00:00, 10.50s/it]\n"
        "Peak GPU memory: 6.47 GiB allocated\n")
    assert run("ingest-log", log, "--ledger", ledger, "--gpu", "rtx-3070-ti", "--rank", "96") == 0
    first, second = store.load(ledger).measurements[-2:]
    assert (first.outcome.status, first.outcome.failed_at_step, str(first.provenance.measured_on)) == (
        "oom", 236, "2026-09-23")
    assert first.outcome.peak_allocated_mib is None and first.provenance.source == f"{log}:1-3"
    assert (second.outcome.status, second.outcome.peak_allocated_mib, str(second.provenance.measured_on)) == (
        "ok", 6625.3, "2026-09-24")
    assert second.provenance.source == f"{log}:4-7" and second.outcome.failed_at_step is None
    from ledger.intake.logs import LogError, parse_log

    with pytest.raises(LogError, match="2 runs in one log"):
        parse_log(log.read_text(), "train.log")


def test_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    ledger = tmp_path / "l.json"
    shutil.copy(SMALL, ledger)
    assert run("ingest-log", fifo, "--ledger", ledger, "--gpu", "rtx-3070-ti") == 1
    assert capsys.readouterr().err.strip() == f"{fifo}: not a regular file"
    assert run("build", "--ledger", SMALL, "--out", tmp_path / "site", "--previous", fifo, "-q") == 1


# -- a new ledger, the callback ---------------------------------------------------------------


def test_init_starts_a_valid_empty_ledger_and_never_overwrites(tmp_path, capsys):
    new = tmp_path / "runs.json"
    assert run("init", new) == 0 and run("validate", new) == 0
    assert store.load(new).measurements == []
    new.write_text("keep me")
    capsys.readouterr()
    assert run("init", new) == 1 and new.read_text() == "keep me"
    assert "exists already" in capsys.readouterr().err


def test_ingest_log_and_predict_start_a_missing_ledger(tmp_path):
    new = tmp_path / "runs.json"
    assert run("ingest-log", DATA / "logs" / "axolotl.log", "--ledger", new, "--gpu", "RTX 3090") == 0
    lg = store.load(new)
    assert len(lg.measurements) == 1 and list(lg.gpus) == ["rtx-3090"]
    # predict starts a missing ledger only with an answer to store: from no rows it is unknown,
    # said so, and nothing is made
    other = tmp_path / "predictions.json"
    assert run("predict", "--ledger", other, "--gpu", "RTX 4090", "--rank", "16", "--seq-len", "2048") == 1
    assert not other.exists()


def _tiny_train(tmp_path: Path, cb) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from probe_kit.recipe import load_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny-llama"))
    data = [{"input_ids": torch.randint(0, 1024, (32,)), "labels": torch.randint(0, 1024, (32,))} for _ in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True)
    with cb.watch():
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()


def test_the_readme_callback_snippet_starts_its_ledger(tmp_path, monkeypatch):
    import io

    from probe_kit.callback import VramLedgerCallback

    monkeypatch.chdir(tmp_path)
    cb = VramLedgerCallback(ledger="runs.json", gpu="rtx-3070-ti", rank=96, dropout=0.1, stream=io.StringIO())
    _tiny_train(tmp_path, cb)
    assert not cb.failures
    m = store.load(tmp_path / "runs.json").measurements[-1]
    assert m.kind == "real" and m.lora.rank == 96 and m.gpu is None  # measured on the CPU: no card


def test_the_callback_never_raises_into_training(tmp_path, caplog):
    import io

    from probe_kit.callback import VramLedgerCallback

    blocked = tmp_path / "a-folder"
    blocked.mkdir()  # a folder where the ledger should be: it cannot be written
    out = io.StringIO()
    cb = VramLedgerCallback(ledger=str(blocked), rank=8, stream=out)
    _tiny_train(tmp_path, cb)  # trains to the end, no exception
    assert cb.failures and "could not record the run" in caplog.text
    kept = Path(f"{blocked}.unrecorded.log")
    new = tmp_path / "later.json"
    assert run("ingest-log", kept, "--ledger", new) == 0  # the kept record ingests on its own
    assert store.load(new).measurements[-1].outcome.peak_allocated_mib is not None


# -- dry runs a user computes -----------------------------------------------------------------


def test_fit_compute_writes_to_the_cache_and_never_to_the_shipped_rows(tmp_path, capsys):
    """Only the grid points neither file holds are computed, into the cache folder."""
    shipped = store.load(REPO / "ledger" / "dry-runs.json")
    mine = [m for m in shipped.measurements if m.model and m.model.endswith("qwen2.5-0.5b")]
    drop = next(m for m in mine if m.quant == "4bit" and m.seq_len == 512 and m.lora.rank == 8
                and not m.lora.dropout and not m.lora.dora and m.memory_fixes == "none")
    rows = tmp_path / "rows.json"
    store.save(shipped.model_copy(update={"measurements": [m for m in mine if m.id != drop.id]}), rows)
    before = rows.read_bytes()
    cache = tmp_path / "cache"
    assert run("fit", "--model", "qwen2.5-0.5b", "--gpu", "RTX 4090", "--dry-runs", rows, "--cache", cache,
               "--compute", "--quant", "4bit", "--fixes", "none") == 0
    assert "computing 1 dry runs" in capsys.readouterr().err
    assert rows.read_bytes() == before
    computed = store.load(cache / "dry-runs.json").measurements
    assert len(computed) == 1 and computed[0].seq_len == 512 and computed[0].lora.rank == 8
    assert abs(computed[0].outcome.peak_allocated_mib - drop.outcome.peak_allocated_mib) < 0.01 * \
        drop.outcome.peak_allocated_mib


# -- the site's text --------------------------------------------------------------------------


def test_bidi_controls_are_shown_never_obeyed_and_long_notes_are_clipped(tmp_path):
    doc = json.loads(SMALL.read_text())
    doc["measurements"][7]["provenance"]["notes"] = ["peak \u202e0.0917\u202c MiB \u2066x\u2069", "long " * 4000]
    doc["measurements"][7]["provenance"]["source"] = "sweep \u202elog.txt"
    gpu = doc["measurements"][7]["gpu"]
    doc["gpus"][gpu]["name"] = "card \u202eIT 0903 XTR"  # reaches the picker's data (fits/<model>.js)
    ledger = tmp_path / "l.json"
    ledger.write_text(json.dumps(doc))
    assert run("build", "--ledger", ledger, "--out", tmp_path / "site", "-q") == 0
    site = tmp_path / "site"
    controls = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    scripts = sorted(p.relative_to(site).as_posix() for p in (site / "fits").glob("*.js"))
    assert scripts
    for name in ("index.html", "vram.md", "vram.csv", "feed.xml", "estimators.html", "fits.html", *scripts):
        text = (site / name).read_text(encoding="utf-8")
        assert not any(c in text for c in controls), name
    assert "[U+202E]0.0917[U+202C]" in (site / "index.html").read_text()
    assert "[U+2066]" in (site / "vram.md").read_text() and "sweep [U+202E]log.txt" in (site / "vram.csv").read_text()
    public = json.loads((site / "vram.json").read_text())
    assert public["ledger"]["measurements"][7]["provenance"]["notes"][0] == doc["measurements"][7]["provenance"]["notes"][0]
    page = (site / "index.html").read_text()
    assert "shortened: 20,000 characters in all; the whole text is in vram.json" in page
    assert "long " * 1000 not in page


# -- installs and messages --------------------------------------------------------------------


def test_the_main_install_scores_canifinetune():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("canifinetune") for d in deps)
    from ledger.report.estimators import Canifinetune

    assert Canifinetune.available()


def test_calibrate_says_what_it_cannot_measure(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    assert run("init", empty) == 0
    capsys.readouterr()
    assert run("calibrate", "--ledger", empty) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "unknown" in out
    assert run("calibrate", "--ledger", SMALL) == 0
    assert "None" not in capsys.readouterr().out


def test_merge_counts_its_files_in_words(tmp_path, capsys):
    assert run("merge", SMALL, "-o", tmp_path / "m.json") == 0
    assert capsys.readouterr().out.strip().endswith("from 1 file")


def test_progress_names_every_axis_of_the_recipe():
    from probe_kit.recipe import ProbeConfig

    label = ProbeConfig(model="gemma-3-4b-it", rank=8, dropout=0.1, dora=True, seq_len=512, fixes=[]).label()
    assert label == "gemma-3-4b-it 4bit r8 dropout 0.1 DoRA 512 tokens fixes none"


def test_known_library_noise_is_silenced(tmp_path):
    done = subprocess.run([sys.executable, "-m", "probe_kit.probe_vram", "--model", "tiny-llama", "--random-weights",
                           "--rank", "8", "--seq-len", "64", "--response-len", "16", "--device", "cpu"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "kernels-community" not in done.stderr and "FutureWarning" not in done.stderr


def test_the_dry_run_ceiling_says_each_dry_run_as_it_goes(monkeypatch, capsys):
    """--find-ceiling runs several dry runs of seconds to minutes each: one line per dry run."""
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from probe_kit import dry_run
    from probe_kit.recipe import ProbeConfig

    monkeypatch.setattr(dry_run, "predict", lambda cfg, multimodal=None: ({"peak_allocated_mib": 3000.0 + 10 * cfg.rank},
                                                                          {}))
    p = Predictor(store.load(SMALL), load_dry_runs())
    doc = dry_run.find_ceiling(ProbeConfig(model="tiny-llama", rank=8, dropout=0.1, seq_len=512, response_len=64), p,
                               budget_mib=5000.0)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dry run ")]
    assert len(lines) == doc["probes"] > 1
    assert all("tiny-llama 4bit" in line and "dropout 0.1" in line and "512 tokens" in line for line in lines)

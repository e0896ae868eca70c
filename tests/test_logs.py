"""Log ingestion: every log form, ingest into a ledger, idempotence, and the TrainerCallback."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import DATA, SMALL
from ledger import cli
from ledger.storage import store
from ledger.intake.logs import LogError, parse_log

LOGS = sorted((DATA / "logs").glob("*.log"))


def summary(path: Path) -> dict:
    try:
        e = parse_log(path.read_text(encoding="utf-8"), path.name)
    except LogError as exc:
        return {"error": str(exc)}
    d = {k: v for k, v in asdict(e).items()
         if v not in (None, [], {}) and k not in ("callback", "first_line", "last_line")}
    if e.oom:
        d["oom"] = e.oom.model_dump(mode="json", exclude_defaults=True, exclude={"message", "untrusted"})
    if e.measured_on:
        d["measured_on"] = e.measured_on.isoformat()
    return {"parse": d}


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_each_log_form_parses_as_expected(path):
    expected = json.loads(path.with_suffix(".expected.json").read_text())
    assert summary(path) == expected


def test_the_corpus_covers_every_form():
    names = {p.stem for p in LOGS}
    assert {"oom-current", "oom-legacy", "oom-hip", "hf-trainer-metrics", "hf-trainer-log-metrics", "axolotl",
            "unsloth", "deepspeed", "callback", "crash-xid", "garbled", "truncated-oom", "nothing", "oom-processes", "progress-plain",
            "peak-plain", "torch-names", "unread-peak"} <= names


def test_garbled_lines_are_skipped_with_a_warning():
    e = parse_log((DATA / "logs" / "garbled.log").read_text(), "garbled.log")
    assert len(e.warnings) == 2 and all(w.startswith("garbled.log:") for w in e.warnings)


def test_random_garbage_never_crashes():
    import random

    rng = random.Random(0)
    pieces = ["CUDA out of memory.", "Tried to allocate", "GiB", "Xid", "memory/max_mem_allocated(gib)': ",
              "Peak reserved memory = ", "vram-ledger: {", "MA 1 GB Max_MA", "236/1172 [", "\x00", "ü", "12.5"]
    for _ in range(300):
        text = "\n".join(" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(5))
        try:
            parse_log(text, "x")
        except LogError:
            pass


def _runs(text: str, fast: bool):
    from ledger.intake.logs import parse_runs

    try:
        return [asdict(r) for r in parse_runs(text, "x", fast=fast)]
    except LogError as exc:
        return str(exc)


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_the_fast_scan_reads_each_log_as_the_line_by_line_reading(path):
    text = path.read_text()
    assert _runs(text, True) == _runs(text, False)


def test_the_fast_scan_reads_random_logs_as_the_line_by_line_reading():
    """Progress counters redrawn, going back, several on a line, with long and odd numbers, after
    a '/' or a '.', mixed with every trigger and Unicode that lower-cases longer (the scan's
    fallback): both readings give the same runs."""
    import random

    rng = random.Random(1)
    pieces = ["\r 45%|███ | 236/1172 [12:01<09:20, 3.01s/it]", "236/1172 [", "237/1172 [", "10/1172 [", "3/3 [",
              "7/5 [", "1/1 [", "/12 [", "a/12/34 [", "1.5/20 [", "123456789012345678901234567890/99 [",
              "99/123456789012345678901234567890 [", "s/it]", "step 31/1000", "31/1000 it/s", "| 31/1000",
              "***** Running training *****", "2026-11-30 10:00:00", "CUDA out of memory. Tried to allocate 2 GiB",
              "vram-ledger: {\"peak_allocated_mib\": 5}", "Peak reserved memory = 5.5 GB.", "Xid 79",
              "'train_mem_gpu_peaked_delta': 1048576", "\u0130", "\u2028", "\x1c", "\t", " ", "max_gpu 1 GB"]
    for _ in range(400):
        text = "\n".join("".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
                         for _ in range(rng.randint(1, 30)))
        assert _runs(text, True) == _runs(text, False), text


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_bytes(SMALL.read_bytes())
    return path


def test_ingest_round_trip_and_idempotence(ledger, capsys):
    log = DATA / "logs" / "oom-current.log"
    args = ["ingest-log", str(log), "--ledger", str(ledger), "--gpu", "RTX 3070 Ti", "--rank", "112", "--rslora",
            "--dropout", "0.1", "--model", "unsloth/gemma-3-4b-it", "--quant", "4bit", "--seq-len", "7177"]
    assert cli.main(args) == 0
    assert store.validate_file(ledger) == []
    m = store.load(ledger).measurements[-1]
    assert m.kind == "real" and m.gpu == "rtx-3070-ti" and m.outcome.status == "oom"
    assert m.outcome.failed_at_step == 236 and m.outcome.oom.reserved_unallocated_mib == 394
    assert m.provenance.source == f"{log}:6" and str(m.provenance.measured_on) == "2026-09-23"
    assert m.lora.rank == 112 and m.dataset.longest_example_tokens == 7177
    before = ledger.read_bytes()
    capsys.readouterr()
    assert cli.main(args) == 0
    assert ledger.read_bytes() == before
    assert "already in the ledger" in capsys.readouterr().out


def test_dry_run_json_writes_nothing(ledger, capsys):
    before = ledger.read_bytes()
    assert cli.main(["ingest-log", str(DATA / "logs" / "axolotl.log"), str(DATA / "logs" / "unsloth.log"),
                     "--ledger", str(ledger), "--gpu", "rx-7900-xtx", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["outcome"]["status"] for m in doc["would_append"]] == ["ok", "ok"]
    unsloth = doc["would_append"][1]
    assert unsloth["outcome"]["peak_reserved_mib"] == 7077.9 and "measured_on" in unsloth["provenance"]
    assert unsloth["provenance"]["inferred_fields"] == ["measured_on"]  # no timestamp: the file's date
    assert ledger.read_bytes() == before


def test_unparseable_log_is_one_line_and_nothing_is_written(ledger, capsys):
    before = ledger.read_bytes()
    bad = DATA / "logs" / "nothing.log"
    assert cli.main(["ingest-log", str(DATA / "logs" / "axolotl.log"), str(bad), "--ledger", str(ledger),
                     "--gpu", "rx-7900-xtx"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{bad}: no peak-memory line (vram-ledger callback, HF Trainer memory metrics, axolotl, Unsloth, "
                   "DeepSpeed, torch.cuda.max_memory_*, 'Peak GPU memory: X GiB'), OOM message or crash found"]
    assert ledger.read_bytes() == before


def test_unknown_gpu_is_a_clear_error(ledger, capsys):
    before = ledger.read_bytes()
    assert cli.main(["ingest-log", str(DATA / "logs" / "axolotl.log"), "--ledger", str(ledger), "--gpu",
                     "GTX 480"]) == 1
    err = capsys.readouterr().err
    assert "unknown gpu 'GTX 480'" in err and "vram cards" in err and ledger.read_bytes() == before


def test_a_card_of_the_card_table_joins_the_ledger_with_its_first_run(ledger):
    assert "rtx-4090" not in store.load(ledger).gpus
    assert cli.main(["ingest-log", str(DATA / "logs" / "axolotl.log"), "--ledger", str(ledger), "--gpu",
                     "RTX 4090"]) == 0
    lg = store.load(ledger)
    assert lg.measurements[-1].gpu == "rtx-4090" and lg.gpus["rtx-4090"].total_mib == 24576.0


def test_hf_deltas_are_recorded_as_deltas(ledger):
    assert cli.main(["ingest-log", str(DATA / "logs" / "hf-trainer-metrics.log"), "--ledger", str(ledger),
                     "--gpu", "rtx-3070-ti"]) == 0
    m = store.load(ledger).measurements[-1]
    assert m.outcome.peak_delta_mib == 3335.0 and m.outcome.peak_allocated_mib is None
    assert any("not an absolute peak" in n for n in m.provenance.notes)


def test_ingesting_a_matching_run_scores_an_open_prediction(ledger):
    from ledger.core.models import Lora, Prediction

    lg = store.load(ledger)
    lg.predictions.append(Prediction(id="pred-next", gpu="rtx-3070-ti", quant="4bit",
                                     lora=Lora(rank=96, dropout=0.1), predicted_peak_mib=6700.0,
                                     made_on="2026-11-01"))
    store.save(lg, ledger)
    assert cli.main(["ingest-log", str(DATA / "logs" / "callback.log"), "--ledger", str(ledger), "--gpu",
                     "rtx-3070-ti", "--quant", "4bit", "--rank", "96", "--dropout", "0.1"]) == 0
    pred = next(p for p in store.load(ledger).predictions if p.id == "pred-next")
    assert pred.score.actual_peak_mib == 6629.4 and pred.score.error_pct == pytest.approx(1.06, abs=0.01)


def test_callback_in_a_tiny_cpu_trainer_writes_a_line_that_ingests(tmp_path, ledger):
    import io

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from probe_kit.callback import VramLedgerCallback
    from probe_kit.recipe import load_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny-llama"))
    data = [{"input_ids": torch.randint(0, 1024, (64,)), "labels": torch.randint(0, 1024, (64,))} for _ in range(4)]
    out = io.StringIO()
    log_file = tmp_path / "train.log"
    cb = VramLedgerCallback(ledger=str(ledger), log_file=str(log_file), stream=out, gpu="rtx-3070-ti", rank=8)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    with cb.watch():
        trainer.train()
    line = out.getvalue().strip()
    assert line.startswith("vram-ledger: ")
    doc = json.loads(line.split(": ", 1)[1])
    assert doc["event"] == "train_end" and doc["step"] == 3 and doc["meter"] == "tracker"
    assert doc["peak_allocated_mib"] > 1
    m = store.load(ledger).measurements[-1]  # appended by the callback itself
    assert m.kind == "real" and m.outcome.peak_allocated_mib == doc["peak_allocated_mib"] and m.lora.rank == 8
    # measured on the CPU: recorded with its device and meter, never as a run on the configured card
    assert m.gpu is None and m.environment.device == "cpu" and m.environment.meter == "tracker"
    # and the log line ingests on its own
    e = parse_log(log_file.read_text(), "train.log")
    assert e.status == "ok" and e.peak_allocated_mib == doc["peak_allocated_mib"]


def test_callback_records_an_oom_and_reraises(tmp_path):
    import io

    import torch

    from probe_kit.callback import VramLedgerCallback

    out = io.StringIO()
    cb = VramLedgerCallback(stream=out)
    with pytest.raises(torch.OutOfMemoryError):
        with cb.watch():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 72.00 MiB. GPU 0 has a total "
                                         "capacity of 7.65 GiB of which 58.00 MiB is free.")
    e = parse_log(out.getvalue(), "x")
    assert e.status == "oom" and e.oom.tried_mib == 72 and e.oom.free_mib == 58


def test_ingest_needs_the_card(ledger, capsys):
    before = ledger.read_bytes()
    assert cli.main(["ingest-log", str(DATA / "logs" / "oom-current.log"), "--ledger", str(ledger)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{DATA / 'logs' / 'oom-current.log'}:6: --gpu is required")
    assert ledger.read_bytes() == before


def test_an_oom_on_another_card_is_refused(ledger, capsys):
    before = ledger.read_bytes()
    log = DATA / "logs" / "oom-processes.log"  # a 23.99 GiB card
    assert cli.main(["ingest-log", str(log), "--ledger", str(ledger), "--gpu", "rtx-3070-ti", "--rank", "16"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"{log}:2: the log says the card has 23.99 GiB but rtx-3070-ti has 7.65 GiB: is --gpu right?"
    assert ledger.read_bytes() == before
    assert cli.main(["ingest-log", str(log), "--ledger", str(ledger), "--gpu", "rx-7900-xtx", "--rank", "16"]) == 0
    oom = store.load(ledger).measurements[-1].outcome.oom
    assert [(p.pid, p.in_use_mib) for p in oom.processes] == [(48213, 22988.8), (51002, 1126.4)]
    assert oom.other_processes_mib == 1126.4  # the first listed process is this one (its in-use figure)


def test_reingesting_with_other_flags_names_the_fields_and_replace_fixes_it(ledger, capsys):
    log = DATA / "logs" / "oom-current.log"
    base = ["ingest-log", str(log), "--ledger", str(ledger), "--gpu", "rtx-3070-ti", "--dropout", "0.1"]
    assert cli.main(base + ["--rank", "112"]) == 0
    before = ledger.read_bytes()
    capsys.readouterr()
    assert cli.main(base + ["--rank", "96"]) == 1
    err = capsys.readouterr().err.strip()
    assert "already in the ledger as real-oom-current-" in err and "lora.rank: 112 there, 96 now" in err
    assert err.endswith("run again with --replace to replace that row") and ledger.read_bytes() == before
    n = len(store.load(ledger).measurements)
    assert cli.main(base + ["--rank", "96", "--replace"]) == 0
    after = store.load(ledger).measurements
    assert len(after) == n and after[-1].lora.rank == 96


def test_a_cpu_callback_line_is_not_filed_under_a_card(ledger, tmp_path, capsys):
    log = tmp_path / "cpu.log"
    log.write_text('vram-ledger: {"date": "2026-11-01", "device": "cpu", "event": "train_end", "meter": "tracker", '
                   '"peak_allocated_mib": 11.9, "step": 3}\n')
    assert cli.main(["ingest-log", str(log), "--ledger", str(ledger), "--gpu", "rtx-3070-ti"]) == 1
    assert "measured on the CPU" in capsys.readouterr().err
    assert cli.main(["ingest-log", str(log), "--ledger", str(ledger)]) == 0
    m = store.load(ledger).measurements[-1]
    assert m.gpu is None and m.environment.device == "cpu" and m.environment.meter == "tracker"


def test_the_bundled_ledger_refuses_cpu_rows(tmp_path, monkeypatch, capsys):
    import shutil

    from ledger.storage import store as store_module

    bundled = tmp_path / "vram.json"
    shutil.copy(SMALL, bundled)
    monkeypatch.setattr(store_module, "DEFAULT_LEDGER", bundled)
    log = tmp_path / "cpu.log"
    log.write_text('vram-ledger: {"date": "2026-11-01", "device": "cpu", "event": "train_end", "meter": "tracker", '
                   '"peak_allocated_mib": 11.9, "step": 3}\n')
    before = bundled.read_bytes()
    assert cli.main(["ingest-log", str(log), "--ledger", str(bundled)]) == 1
    assert "measured on the CPU or simulated: the published ledger takes GPU measurements only" in \
        capsys.readouterr().err
    assert bundled.read_bytes() == before


def test_progress_without_a_bracket_gives_the_oom_step():
    e = parse_log((DATA / "logs" / "progress-plain.log").read_text(), "p.log")
    assert e.failed_at_step == 31 and e.total_steps == 1000
    for line in ("2026/11/30 12:00 31/1000", "see a/b/31/1000 there"):
        assert parse_log(line + "\nCUDA out of memory. Tried to allocate 2 MiB", "x").failed_at_step is None


def test_unread_peak_forms_are_warned_about():
    with pytest.raises(LogError, match="unread-peak.log:2: skipped: a memory figure in a form"):
        parse_log((DATA / "logs" / "unread-peak.log").read_text(), "unread-peak.log")
    e = parse_log((DATA / "logs" / "peak-plain.log").read_text(), "peak-plain.log")
    assert e.peak_allocated_mib == 6635.5 and e.peak_reserved_mib == 7188.5


def test_the_callbacks_record_reads_the_ledger_once(tmp_path, monkeypatch):
    """A run the callback records is made against the ledger the locked write reads, which is
    parsed once and written once; the same record again adds nothing and writes nothing; a card
    of the card table joins the ledger with its row."""
    from ledger.intake.ingest import RunSpec, record_callback
    from ledger.core.models import Ledger
    from ledger.answer.predictions import score_predictions

    path = tmp_path / "l.json"
    store.save(store.load(SMALL), path)
    text = path.read_text()
    parses = []
    real_parse = Ledger.model_validate_json

    def counted(given, *args, **kwargs):
        parses.append(given == path.read_text())
        return real_parse(given, *args, **kwargs)

    monkeypatch.setattr(Ledger, "model_validate_json", counted)
    doc = {"date": "2026-11-02", "device": "cuda:0", "event": "train_end", "meter": "allocator",
           "peak_allocated_mib": 3001.5, "peak_reserved_mib": 3300.0, "step": 40}
    spec = RunSpec(gpu="rtx-4090", model="unsloth/gemma-3-4b-it", quant="4bit", rank=16)
    assert "rtx-4090" not in store.load(path).gpus
    parses.clear()
    added = record_callback(doc, str(path), spec, then=score_predictions)
    assert len(added) == 1 and parses.count(True) == 1
    after = store.load(path)
    assert after.measurements[-1] == added[0] and added[0].gpu == "rtx-4090" and "rtx-4090" in after.gpus
    assert path.read_text() != text
    again = path.read_text()
    assert record_callback(doc, str(path), spec, then=score_predictions) == [] and path.read_text() == again

"""Legacy import: nothing of the older vram.json is lost; free text becomes structure."""

from __future__ import annotations

import json
import re

import pytest

from conftest import BUNDLED, DATA, LEGACY
from ledger import cli
from ledger.storage import store
from ledger.core.errors import LedgerError
from ledger.intake.legacy import import_legacy, parse_oom_summary, slug

OTHER = DATA / "legacy" / "other-program-vram.json"


def leaves(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, node


def missing_leaves(old: dict, new: dict) -> list[str]:
    """Old leaves not found in the new ledger: a number as a number (or inside a kept text),
    a text inside some text, a flag among the flags."""
    new_leaves = [v for _, v in leaves(new)]
    numbers = {v for v in new_leaves if isinstance(v, (int, float)) and not isinstance(v, bool)}
    texts = [v for v in new_leaves if isinstance(v, str)]
    flags = {v for v in new_leaves if isinstance(v, bool)}
    missing = []
    for path, value in leaves(old):
        if isinstance(value, bool):
            found = value in flags
        elif isinstance(value, (int, float)):
            pattern = re.compile(rf"(?<![\d.]){re.escape(str(value))}(?!\d)")
            found = value in numbers or any(pattern.search(t) for t in texts)
        elif isinstance(value, str):
            found = any(value in t for t in texts)
        else:
            found = True
        if not found:
            missing.append(f"{path} = {value!r}")
    return missing


@pytest.mark.parametrize("src", [LEGACY, OTHER], ids=["program", "other"])
def test_every_leaf_of_the_old_file_is_in_the_new_ledger(src):
    old = json.loads(src.read_text())
    new = json.loads(store.dumps(import_legacy(old, str(src))))
    assert missing_leaves(old, new) == []


def test_leaf_check_can_fail():
    old = json.loads(LEGACY.read_text())
    new = json.loads(store.dumps(import_legacy(old, "x")))
    new["measurements"][0]["provenance"]["source"] = "elsewhere"
    assert any("e2b-contended-load" not in m and ".source" in m for m in missing_leaves(old, new))


def test_bundled_ledger_is_the_migrated_program_ledger():
    old = json.loads(LEGACY.read_text())
    assert store.dumps(import_legacy(old, str(LEGACY))) == BUNDLED.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def program():
    return import_legacy(json.loads(LEGACY.read_text()), "program-vram.json")


def by_id(ledger, mid):
    return next(m for m in ledger.measurements if m.id == mid)


def test_free_text_oom_becomes_structured_and_text_is_kept(program):
    m = by_id(program, "first-real-step-oom")
    assert m.outcome.status == "oom"
    assert m.outcome.oom.in_use_mib == pytest.approx(7.39 * 1024, abs=0.1)
    assert m.outcome.oom.free_mib == 256 and m.outcome.oom.tried_mib == 248
    assert m.outcome.result_text == "OOM: 7.39 GB used, 256 MB free, tried to allocate 248 MB"
    assert m.lora.rank == 16 and "lora.rank" in m.provenance.inferred_fields
    assert m.memory_fixes == "none"


def test_oom_at_step_with_reserved_unallocated(program):
    m = by_id(program, "real-v14-run2")
    assert m.outcome.failed_at_step == 236
    assert m.outcome.oom.allocated_mib == pytest.approx(6.98 * 1024, abs=0.1)
    assert m.outcome.oom.reserved_unallocated_mib == 394
    assert m.outcome.oom.free_mib == 58
    assert m.outcome.peak_allocated_mib is None  # an OOM has no peak


def test_split_peak_and_crash(program):
    split = by_id(program, "e2b-two-gpu-split")
    assert split.outcome.per_device_peak_mib == {"GPU0": pytest.approx(4485.1), "GPU1": pytest.approx(3246.1)}
    assert split.outcome.peak_as_reported.startswith("4.38 GB on GPU0")
    crash = by_id(program, "real-v14-run1")
    assert (crash.outcome.status, crash.outcome.failed_at_step, crash.outcome.xid) == ("crashed", 184, 31)


def test_cross_gpu_probes_land_on_their_gpus(program):
    probes = [m for m in program.measurements if m.gpu in ("rx-7900-xtx", "rtx-3060-ti")]
    assert len(probes) == 27
    assert all(m.kind == "probe" and m.model == "unsloth/gemma-3-4b-it" for m in probes)
    oom = next(m for m in probes if m.gpu == "rtx-3060-ti" and m.outcome.status == "oom")
    assert oom.outcome.peak_allocated_mib is None and oom.outcome.oom.max_allocated_mib == 6757.3
    spilled = [m for m in probes if m.outcome.status == "spilled"]
    assert len(spilled) == 2 and all(m.memory_fixes == "none" for m in spilled)
    assert {"rx_7900_xtx", "RX 7900 XTX"} <= set(program.gpus["rx-7900-xtx"].aliases)


def test_sections_become_findings_with_evidence(program):
    findings = {f.id: f for f in program.findings}
    assert set(findings) == {"rank-cost", "dropout-memory", "calibration", "probe-vs-real-gap",
                             "inference-footprint", "host-ram", "cross-gpu"}
    cal = findings["calibration"]
    assert {"probe-0919f-r112", "sweep-r96-drop", "real-v13", "real-v15"} <= set(cal.evidence)
    assert any(f.label == "Anchor: probe overestimate" and f.value == 4.7 and f.unit == "%" for f in cal.figures)
    ranges = {f.label: (f.low, f.high) for f in findings["rank-cost"].figures if f.low is not None}
    assert ranges["Real peak by rank: 16"] == (4889, 5117)
    assert findings["dropout-memory"].status == "inferred"


def test_a_probe_of_the_same_longest_example_inherits_its_kept_positions(program):
    by_id = {m.id: m for m in program.measurements}
    # Same dataset and longest example: probe-0917-r112 kept what probe-0917-r96 says it kept.
    m = by_id["probe-0917-r112"]
    assert m.logits_to_keep == 319 and "logits_to_keep" in m.provenance.inferred_fields
    assert "probe-0917-r96" in m.provenance.notes[-1]
    # No dataset name, but the same day, the same log and the same longest example as sweep-r112-drop.
    assert by_id["sweep-r96-drop"].logits_to_keep == 237
    assert "logits_to_keep" not in by_id["sweep-r112-drop"].provenance.inferred_fields  # its own figure
    # The unfiltered 2026-09-18 corpus never said: nothing is made up.
    assert by_id["probe-0918-r104"].logits_to_keep is None


def test_program_prediction_is_imported_and_scored(program):
    (pred,) = program.predictions
    assert pred.predicted_peak_mib == 6793 and pred.score.measurement == "real-v15"
    assert pred.score.actual_peak_mib == 6629 and pred.score.error_pct == pytest.approx(2.47, abs=0.01)
    assert pred.basis == ["probe-0919f-r112", "sweep-r96-drop"]


def test_other_file_imports_with_its_own_gpus_and_defaults():
    ledger = import_legacy(json.loads(OTHER.read_text()), "other")
    assert set(ledger.gpus) == {"rtx-4090", "rtx-a6000"}
    r32 = by_id(ledger, "l8-r32")
    assert r32.model == "meta-llama/Llama-3.1-8B-Instruct" and r32.quant == "4bit"
    assert r32.dataset.epochs == 3 and r32.lora.alpha == 64
    crash = by_id(ledger, "l8-crash")
    assert (crash.outcome.status, crash.outcome.xid, crash.lora.rank) == ("crashed", 13, 128)
    oom = by_id(ledger, "l8-r64-oom")
    assert "gradient_accumulation: 8" in oom.provenance.notes


def test_parse_oom_summary_units():
    oom = parse_oom_summary("OOM (tried 70 MiB, 48 MiB free)")
    assert (oom.tried_mib, oom.free_mib) == (70, 48)
    oom = parse_oom_summary("OOM: 1.5 GiB allocated, 512 KiB free")
    assert oom.allocated_mib == 1536 and oom.free_mib == 0.5


def test_slug():
    assert slug("NVIDIA GeForce RTX 3070 Ti") == "rtx-3070-ti"
    assert slug("AMD Radeon RX 7900 XTX") == "rx-7900-xtx"


def test_cli_import_refuses_to_overwrite_and_reports_bad_input(tmp_path, capsys):
    out = tmp_path / "new.json"
    assert cli.main(["import-legacy", str(LEGACY), "-o", str(out)]) == 0
    assert store.load(out)
    assert cli.main(["import-legacy", str(LEGACY), "-o", str(out)]) == 1
    assert "exists already" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"measurements": [{"id": "x", "mode": "teleport"}]}))
    out2 = tmp_path / "new2.json"
    assert cli.main(["import-legacy", str(bad), "-o", str(out2)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"{bad}:measurements[0].mode: unknown mode 'teleport' (known: computed, dry_run, load, probe, real)"
    assert not out2.exists()


def test_import_refuses_a_ledger():
    with pytest.raises(LedgerError, match="already a ledger"):
        import_legacy(json.loads(BUNDLED.read_text()), "x")

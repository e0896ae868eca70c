"""A corpus of malformed ledgers made from the small fixture ledger: broken JSON, values the
models refuse, cross-references that point nowhere, physically impossible figures, and files that
are not files. Each case is (name, writer) where the writer puts the case at a path."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable

from conftest import SMALL

BASE = json.loads(SMALL.read_text(encoding="utf-8"))
#: Rows of the small ledger by what they are (see tests/data/small-ledger.json).
OK_REAL, OOM_REAL, OK_PROBE, OOM_PROBE, OK_RESERVED, SPILLED = 1, 3, 7, 6, 9, 11


def _text(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text, encoding="utf-8")


def _doc(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        doc = copy.deepcopy(BASE)
        change(doc)
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False), encoding="utf-8")
    return write


def _set(where: str, value) -> Callable[[dict], None]:
    """Set a dotted path ('measurements.3.outcome.peak_allocated_mib') to a value."""
    def change(doc: dict) -> None:
        node = doc
        parts = where.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[int(parts[-1]) if isinstance(node, list) else parts[-1]] = value
    return change


def _drop(where: str) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        node = doc
        parts = where.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        del node[parts[-1]]
    return change


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.mkdir()


def cases() -> list[tuple[str, Callable[[Path], None]]]:
    text = json.dumps(BASE, indent=1)
    out: list[tuple[str, Callable[[Path], None]]] = [
        # -- not JSON, or JSON no ledger can be --
        ("empty", _text("")),
        ("truncated", _text(text[: len(text) // 2])),
        ("not-utf8", lambda p: p.write_bytes(b'{"schema_version": 1, "about": "\xff\xfe"}')),
        ("binary", lambda p: p.write_bytes(bytes(range(256)) * 4)),
        ("top-level-list", _text("[]")),
        ("top-level-string", _text('"ledger"')),
        ("nan", _text(text.replace('"peak_allocated_mib": 6653.0', '"peak_allocated_mib": NaN', 1))),
        ("infinity", _text(text.replace('"peak_allocated_mib": 6653.0', '"peak_allocated_mib": Infinity', 1))),
        ("huge-float", _text(text.replace('"peak_allocated_mib": 6653.0', '"peak_allocated_mib": 1e400', 1))),
        ("5000-digit-int", _text(text.replace('"schema_version": 1', '"schema_version": ' + "9" * 5000, 1))),
        ("5000-digit-rank", _text(text.replace('"rank": 112', '"rank": ' + "1" * 5000, 1))),
        ("duplicate-key", _text(text.replace('"schema_version": 1,', '"schema_version": 1, "schema_version": 1,', 1))),
        ("lone-surrogate", _text(text.replace('"about": "', '"about": "\\ud800', 1))),
        ("deep-nesting", _text('{"schema_version": 1, "about": ' + "[" * 100000 + "]" * 100000 + "}")),
        ("trailing-garbage", _text(text + "}")),
        ("fifo", _fifo),
        ("a-folder", _folder),
        # -- the version --
        ("no-version", _doc(_drop("schema_version"))),
        ("version-string", _doc(_set("schema_version", "1"))),
        ("version-zero", _doc(_set("schema_version", 0))),
        ("version-newer", _doc(_set("schema_version", 99))),
        ("version-float", _doc(_set("schema_version", 1.5))),
        # -- values the models refuse --
        ("unknown-top-field", _doc(_set("extra", 1))),
        ("unknown-row-field", _doc(_set("measurements.1.colour", "red"))),
        ("rank-zero", _doc(_set(f"measurements.{OK_PROBE}.lora.rank", 0))),
        ("rank-negative", _doc(_set(f"measurements.{OK_PROBE}.lora.rank", -8))),
        ("rank-huge", _doc(_set(f"measurements.{OK_PROBE}.lora.rank", 10**9))),
        ("rank-string", _doc(_set(f"measurements.{OK_PROBE}.lora.rank", "96"))),
        ("rank-float", _doc(_set(f"measurements.{OK_PROBE}.lora.rank", 96.5))),
        ("dropout-one", _doc(_set(f"measurements.{OK_PROBE}.lora.dropout", 1.0))),
        ("dropout-negative", _doc(_set(f"measurements.{OK_PROBE}.lora.dropout", -0.1))),
        ("seq-len-zero", _doc(_set(f"measurements.{OK_PROBE}.seq_len", 0))),
        ("seq-len-huge", _doc(_set(f"measurements.{OK_PROBE}.seq_len", 10**12))),
        ("quant-3bit", _doc(_set(f"measurements.{OK_PROBE}.quant", "3bit"))),
        ("status-unknown", _doc(_set(f"measurements.{OK_PROBE}.outcome.status", "fine"))),
        ("kind-unknown", _doc(_set(f"measurements.{OK_PROBE}.kind", "guess"))),
        ("id-with-space", _doc(_set(f"measurements.{OK_PROBE}.id", "a b"))),
        ("id-empty", _doc(_set(f"measurements.{OK_PROBE}.id", ""))),
        ("id-too-long", _doc(_set(f"measurements.{OK_PROBE}.id", "x" * 300))),
        ("peak-negative", _doc(_set(f"measurements.{OK_PROBE}.outcome.peak_allocated_mib", -1.0))),
        ("peak-1e300", _doc(_set(f"measurements.{OK_PROBE}.outcome.peak_allocated_mib", 1e300))),
        ("peak-string", _doc(_set(f"measurements.{OK_PROBE}.outcome.peak_allocated_mib", "7 GB"))),
        ("peak-bool", _doc(_set(f"measurements.{OK_PROBE}.outcome.peak_allocated_mib", True))),
        ("date-month-13", _doc(_set(f"measurements.{OK_PROBE}.provenance.measured_on", "2026-13-01"))),
        ("date-words", _doc(_set(f"measurements.{OK_PROBE}.provenance.measured_on", "yesterday"))),
        ("date-with-time", _doc(_set(f"measurements.{OK_PROBE}.provenance.measured_on", "2026-09-01T10:00"))),
        ("fixes-unknown", _doc(_set(f"measurements.{OK_PROBE}.memory_fixes", ["magic"]))),
        ("note-too-long", _doc(_set(f"measurements.{OK_PROBE}.provenance.notes", ["n" * 200_000]))),
        ("about-too-long", _doc(_set("about", "a" * 200_000))),
        ("name-too-long", _doc(_set("gpus.rtx-3070-ti.name", "N" * 5000))),
        ("measurements-object", _doc(_set("measurements", {}))),
        ("gpus-list", _doc(_set("gpus", []))),
        ("gpu-total-zero", _doc(_set("gpus.rtx-3070-ti.total_mib", 0))),
        ("gpu-key-invalid", _doc(lambda d: d["gpus"].update({"bad key": d["gpus"]["rx-7900-xtx"]}))),
        ("step-negative", _doc(_set(f"measurements.{OK_PROBE}.outcome.step_s", -3.0))),
        ("prediction-peak-missing", _doc(_drop("predictions.0.predicted_peak_mib"))),
        # -- cross-references --
        ("unknown-gpu", _doc(_set(f"measurements.{OK_PROBE}.gpu", "rtx-9999"))),
        ("duplicate-measurement-id", _doc(_set(f"measurements.{OK_PROBE}.id", BASE["measurements"][OK_REAL]["id"]))),
        ("duplicate-finding-id", _doc(lambda d: d["findings"].append(copy.deepcopy(d["findings"][0])))),
        ("duplicate-prediction-id", _doc(lambda d: d["predictions"].append(copy.deepcopy(d["predictions"][0])))),
        ("unknown-evidence", _doc(lambda d: d["findings"][0].setdefault("evidence", []).append("nowhere"))),
        ("unknown-basis", _doc(lambda d: d["predictions"][0].setdefault("basis", []).append("nowhere"))),
        ("unknown-score-row", _doc(_set("predictions.0.score", {"measurement": "nowhere", "actual_peak_mib": 1.0,
                                                                 "error_pct": 0.0}))),
        ("prediction-unknown-gpu", _doc(_set("predictions.0.gpu", "rtx-9999"))),
        ("carried-row-not-dry", _doc(lambda d: d["predictions"][0].update(
            dry_run_rows=[copy.deepcopy(d["measurements"][OK_PROBE])]))),
        # -- physically impossible --
        ("oom-with-peak", _doc(_set(f"measurements.{OOM_PROBE}.outcome.peak_allocated_mib", 7300.0))),
        ("oom-with-reserved", _doc(_set(f"measurements.{OOM_REAL}.outcome.peak_reserved_mib", 7500.0))),
        ("reserved-below-allocated", _doc(_set(f"measurements.{OK_RESERVED}.outcome.peak_reserved_mib", 100.0))),
        ("reserved-below-allocated-real", _doc(_set(f"measurements.{OK_REAL}.outcome.peak_reserved_mib", 6000.0))),
        ("future-date", _doc(_set(f"measurements.{OK_PROBE}.provenance.measured_on", "9999-12-31"))),
        ("future-date-real", _doc(_set(f"measurements.{OK_REAL}.provenance.measured_on", "2999-01-01"))),
        ("future-gpu-date", _doc(_set("gpus.rtx-3070-ti.provenance.measured_on", "9999-12-31"))),
        ("future-finding-date", _doc(_set("findings.0.provenance.measured_on", "9999-12-31"))),
        ("future-prediction", _doc(_set("predictions.0.made_on", "9999-12-31"))),
        ("ok-past-the-card", _doc(_set(f"measurements.{OK_PROBE}.outcome.peak_allocated_mib", 500000.0))),
        ("ok-real-past-the-card", _doc(_set(f"measurements.{OK_REAL}.outcome.peak_allocated_mib", 9000.0))),
        ("ok-reserved-past-the-card", _doc(_set(f"measurements.{OK_RESERVED}.outcome.peak_reserved_mib", 30000.0))),
        ("spilled-past-any-driver", _doc(_set(f"measurements.{SPILLED}.outcome.peak_reserved_mib", 900000.0))),
        ("dry-run-row-future", _doc(lambda d: d["predictions"][0].update(dry_run_rows=[{
            **{k: v for k, v in copy.deepcopy(d["measurements"][OK_PROBE]).items() if k != "gpu"},
            "id": "dry-x", "kind": "dry_run", "provenance": {"measured_on": "9999-12-31"}}]))),
        ("oom-row-peak-on-card-2", _doc(_set(f"measurements.{OOM_PROBE}.outcome.peak_reserved_mib", 8000.0))),
        ("reserved-below-allocated-spilled", _doc(_set(f"measurements.{SPILLED}.outcome.peak_reserved_mib", 100.0))),
        ("oom-text-too-long", _doc(_set(f"measurements.{OOM_REAL}.outcome.oom", {"message": "m" * 30000}))),
        ("interval-inverted", _doc(lambda d: d["predictions"][0].update(interval_low_mib=9000.0,
                                                                          interval_high_mib=100.0))),
    ]
    return out


#: Near misses that are valid and must be accepted (nothing impossible in them).
VALID = [
    ("as-shipped", _doc(lambda d: None)),
    ("spilled-within-a-driver", _doc(_set(f"measurements.{SPILLED}.outcome.peak_reserved_mib", 40000.0))),
    ("bidi-in-a-note", _doc(_set(f"measurements.{OK_PROBE}.provenance.notes", ["\u202eexif.gnp \u2066x\u2069"]))),
]

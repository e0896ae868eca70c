"""``vram ingest-log``: real-run measurements from training logs, appended to the ledger.

Idempotent: a measurement's id comes from the log's content, so ingesting the same log twice
adds nothing. Nothing is written unless every log given could be read.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import store
from .cli import dump_json, register
from .errors import Issue, UserError
from .logs import LogError, RunEvidence, parse_log
from .models import Dataset, Environment, Ledger, Lora, Measurement, Outcome, Provenance
from .recipe import capacity_mib, fixes_value, parse_fixes, require_gpu
from .paths import DEFAULT_LEDGER, shown


def add_config_options(p: argparse.ArgumentParser) -> None:
    """The recipe flags a real run is described by (shared with predict and ceiling)."""
    p.add_argument("--gpu", help="the card (a key of the ledger's gpus, an alias or its name)")
    p.add_argument("--model", help="model id, e.g. unsloth/gemma-3-4b-it")
    p.add_argument("--quant", choices=["4bit", "8bit", "bf16", "fp16", "fp32"], help="base weights")
    p.add_argument("--rank", type=int, help="LoRA rank")
    p.add_argument("--alpha", type=float, help="lora_alpha")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised LoRA")
    p.add_argument("--dropout", type=float, help="lora_dropout")
    p.add_argument("--dora", action="store_true", help="DoRA")
    p.add_argument("--seq-len", type=int, help="tokens in the longest example")
    p.add_argument("--fixes", help="memory fixes: all, none or a comma list")
    p.add_argument("--dataset", help="dataset name or date")
    p.add_argument("--examples", type=int, help="training examples")
    p.add_argument("--epochs", type=float, help="epochs")


def fixes_option(text: Optional[str]):
    """The ``--fixes`` option as the ledger records it: 'all', 'none' or a list (a located error)."""
    if text is None:
        return None
    try:
        return fixes_value(parse_fixes(text))
    except ValueError as exc:
        raise UserError(Issue("--fixes", "", str(exc))) from None


def config_fields(args: argparse.Namespace, ledger: Ledger) -> dict:
    """Measurement fields from the recipe flags (validated by the models on construction)."""
    fields: dict = {}
    if args.gpu:
        fields["gpu"] = require_gpu(ledger, args.gpu)
    if args.model:
        fields["model"] = args.model
    if args.quant:
        fields["quant"] = args.quant
    if args.rank is not None:
        fields["lora"] = Lora(rank=args.rank, alpha=args.alpha, rslora=args.rslora or None,
                              dropout=args.dropout, dora=args.dora or None)
    elif any(x is not None for x in (args.alpha, args.dropout)) or args.rslora or args.dora:
        raise UserError(Issue("--rank", "", "LoRA settings need --rank"))
    if args.fixes:
        fields["memory_fixes"] = fixes_option(args.fixes)
    ds = {k: v for k, v in (("name", args.dataset), ("examples", args.examples),
                            ("longest_example_tokens", args.seq_len), ("epochs", args.epochs)) if v is not None}
    if ds:
        fields["dataset"] = Dataset(**ds)
    return fields


def log_id(path: Path, text: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")[:60] or "log"
    return f"real-{stem}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:8]}"


def measurement_from_log(path: Path, text: str, ev: RunEvidence, fields: dict, mid: Optional[str]) -> Measurement:
    inferred: list[str] = []
    measured_on = ev.measured_on
    if measured_on is None:
        measured_on = dt.date.fromtimestamp(os.stat(path).st_mtime)
        inferred.append("measured_on")
    notes = []
    if ev.kinds:
        notes.append("Read from " + ", ".join(ev.kinds) + " lines.")
    if ev.peak_delta_mib is not None and ev.peak_allocated_mib is None:
        notes.append("HF Trainer reports train_mem_gpu_peaked_delta: the peak over the memory at the start of "
                     "training, not an absolute peak.")
    if ev.total_steps and ev.failed_at_step is not None:
        notes.append(f"Died at step {ev.failed_at_step} of {ev.total_steps}.")
    notes += ev.warnings
    return Measurement(
        id=mid or log_id(path, text),
        kind="real",
        outcome=Outcome(status=ev.status, peak_allocated_mib=ev.peak_allocated_mib,
                        peak_reserved_mib=ev.peak_reserved_mib, peak_delta_mib=ev.peak_delta_mib, oom=ev.oom,
                        per_device_peak_mib=ev.per_device_peak_mib,
                        failed_at_step=ev.failed_at_step, xid=ev.xid, result_text=ev.crash_text),
        provenance=Provenance(source=f"{path}:{ev.evidence_line}" if ev.evidence_line else str(path),
                              measured_on=measured_on, inferred_fields=inferred, notes=notes),
        environment=_environment(ev),
        **fields,
    )


def _flat(doc: object, prefix: str = "") -> dict[str, object]:
    if isinstance(doc, dict):
        out: dict[str, object] = {}
        for k, v in doc.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: doc}


def differences(old: Measurement, new: Measurement) -> list[str]:
    """'lora.rank: 112 there, 96 now' for each field two measurements disagree on."""
    a, b = _flat(old.model_dump(mode="json", exclude_none=True)), _flat(new.model_dump(mode="json", exclude_none=True))
    return [f"{k}: {a.get(k, 'unset')} there, {b.get(k, 'unset')} now" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


#: How far an OOM message's card capacity may be from the card's own figures (torch reports a
#: little less than the vendor's total: 7.65 GiB of an 8 GiB RTX 3070 Ti is 4.4% less).
CAPACITY_TOLERANCE = 0.10


def _card_check(ev: RunEvidence, ledger: Ledger, gpu_key: Optional[str], where: str) -> Optional[Issue]:
    """An Issue when what the log says about its device contradicts the card it is filed under."""
    cb = ev.callback
    if cb.get("device") == "cpu" or cb.get("meter") == "tracker":
        if gpu_key is not None:
            return Issue(where, "", f"the run was measured on the CPU (the callback's {cb.get('meter') or 'no'} meter), "
                         f"not on {gpu_key}: ingest it without --gpu, into a ledger of its own")
        return None
    if gpu_key is None:
        return Issue(where, "", "--gpu is required: a real run's figures mean nothing without the card they ran on "
                     "(a key of the ledger's gpus, an alias or its name)")
    gpu = ledger.gpus[gpu_key]
    card = capacity_mib(gpu)
    said = ev.oom.total_mib if ev.oom is not None else cb.get("total_mib")
    if card and isinstance(said, (int, float)) and abs(said - card) > CAPACITY_TOLERANCE * card:
        return Issue(where, "", f"the log says the card has {said / 1024:.2f} GiB but {gpu_key} has "
                     f"{card / 1024:.2f} GiB: is --gpu right?")
    return None


def _environment(ev: RunEvidence) -> Optional[Environment]:
    """The device and meter the callback line names (other logs do not say)."""
    cb = ev.callback
    if not cb.get("meter") and not cb.get("device"):
        return None
    cpu = cb.get("device") == "cpu"
    total = cb.get("total_mib")
    return Environment(device="cpu" if cpu else "cuda", device_name=None if cpu else str(cb.get("device")),
                       device_total_mib=float(total) if isinstance(total, (int, float)) and total > 0 else None,
                       meter=str(cb["meter"]) if cb.get("meter") else None)


@dataclass
class Ingested:
    """What ``ingest`` found: rows to add, rows to replace (same id, other content), rows already there."""

    new: list[Measurement]
    replaced: list[Measurement]
    already: list[str]


def ingest(paths: list[str], ledger_path: str, args: argparse.Namespace) -> Ingested:
    """Parse every log and build its measurement. Raises UserError (one line per bad log) before
    anything is written."""
    ledger = store.load(ledger_path)
    fields = config_fields(args, ledger)
    if args.id and len(paths) > 1:
        raise UserError(Issue("--id", "", "names one measurement: give one log"))
    existing = {m.id: m for m in ledger.measurements}
    issues: list[Issue] = []
    result = Ingested([], [], [])
    for raw in paths:
        path = Path(raw)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            issues.append(Issue(raw, "", f"cannot read: {exc.strerror or exc}"))
            continue
        try:
            ev = parse_log(text, raw)
        except LogError as exc:
            issues.append(Issue(raw, "", str(exc)))
            continue
        for w in ev.warnings:
            print(f"warning: {w}", file=sys.stderr)
        problem = _card_check(ev, ledger, fields.get("gpu"), f"{raw}:{ev.evidence_line}" if ev.evidence_line else raw)
        if problem:
            issues.append(problem)
            continue
        try:
            m = measurement_from_log(path, text, ev, fields, args.id)
        except ValueError as exc:  # pydantic: a flag value out of range
            issues.append(Issue(raw, "", str(exc).splitlines()[-1].strip()))
            continue
        old = existing.get(m.id)
        if any(n.id == m.id for n in result.new + result.replaced) or old == m:
            result.already.append(m.id)
        elif old is not None:
            if getattr(args, "replace", False):
                result.replaced.append(m)
            else:
                diff = differences(old, m)
                issues.append(Issue(raw, "", f"already in the ledger as {m.id} with other content ("
                                    + "; ".join(diff[:4]) + ("; ..." if len(diff) > 4 else "")
                                    + "): run again with --replace to replace that row"))
        else:
            result.new.append(m)
    if issues:
        raise UserError(issues)
    return result


def add_ingest_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", help="training log files")
    p.add_argument("--ledger", default=shown(DEFAULT_LEDGER), help="ledger to append to (default: %(default)s)")
    add_config_options(p)
    p.add_argument("--id", help="measurement id (one log only; default: from the log's name and content)")
    p.add_argument("--replace", action="store_true",
                   help="replace a row this log made before (same id) whose flags were wrong")
    p.add_argument("--dry-run", action="store_true", help="show what would be appended; write nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_ingest(args: argparse.Namespace) -> int:
    """Append kind=real measurements read from training logs: the peak (callback line, HF Trainer,
    axolotl, Unsloth, DeepSpeed), or the OOM / crash and the step it happened at. The recipe flags
    describe the run. Source is the log's path and line; measured_on comes from the log's
    timestamps or, failing that, the file's date (flagged inferred). Ingesting a log twice adds
    nothing. A log with nothing to read is an error naming the file; nothing is written."""
    found = ingest(args.logs, args.ledger, args)
    new, already = found.new + found.replaced, found.already
    if not args.dry_run and new:
        from .predictions import score_predictions

        def change(ledger: Ledger) -> None:
            replacing = {m.id: m for m in found.replaced}
            ledger.measurements[:] = [replacing.pop(m.id, m) for m in ledger.measurements]
            ledger.measurements.extend(found.new)
            score_predictions(ledger)

        store.update(args.ledger, change)
    if args.json:
        key = "would_append" if args.dry_run else "appended"
        dump_json({key: [m.model_dump(mode="json", exclude_none=True) for m in found.new],
                   "replaced" if not args.dry_run else "would_replace":
                       [m.model_dump(mode="json", exclude_none=True) for m in found.replaced],
                   "already_in_ledger": already})
    else:
        replaced = {m.id for m in found.replaced}
        for m in new:
            verb = ("would replace" if args.dry_run else "replaced") if m.id in replaced else (
                "would append" if args.dry_run else "appended")
            o = m.outcome
            figure = (f"peak allocated {o.peak_allocated_mib} MiB" if o.peak_allocated_mib is not None else
                      f"peak reserved {o.peak_reserved_mib} MiB" if o.peak_reserved_mib is not None else
                      f"peak delta {o.peak_delta_mib} MiB" if o.peak_delta_mib is not None else "")
            print(f"{verb} {m.id}: {o.status}" + (f", {figure}" if figure else "")
                  + (f", at step {o.failed_at_step}" if o.failed_at_step is not None else ""))
        for mid in already:
            print(f"{mid}: already in the ledger")
    return 0


register("ingest-log", "append real-run peaks, OOMs and crashes read from training logs", add_ingest_options)(cmd_ingest)

"""Real-run measurements from training logs and from the TrainerCallback (the library half of
``vram ingest-log``; the command is ``ledger.cli.ingest_log``).

Data coming in only: scoring predictions is the caller's (the command passes it as ``then``, run
inside the same locked write). Idempotent: a measurement's id comes from the log's content, so
ingesting the same log twice adds nothing. Nothing is written unless every log given could be
read. The run is described by a typed ``RunSpec`` (the recipe flags), never by parsed
command-line arguments.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, TypeVar

from ledger.storage import store
from ledger.core.checks import MAX_SPILL_MIB, measurement_issues
from ledger.core.errors import Issue, UserError
from .logs import LogError, RunEvidence, evidence_from_callback, parse_runs
from ledger.core.models import Dataset, Environment, Ledger, Lora, Measurement, Outcome, Provenance
from ledger.vocab.cards import require_card
from ledger.vocab.recipe import capacity_mib, fixes_value, parse_fixes

T = TypeVar("T")


@dataclass(frozen=True)
class RunSpec:
    """What the user says about a real run: the card and the recipe (None where not given)."""

    gpu: Optional[str] = None
    model: Optional[str] = None
    quant: Optional[str] = None
    rank: Optional[int] = None
    alpha: Optional[float] = None
    rslora: bool = False
    dropout: Optional[float] = None
    dora: bool = False
    seq_len: Optional[int] = None
    fixes: Optional[str] = None
    dataset: Optional[str] = None
    examples: Optional[int] = None
    epochs: Optional[float] = None


def fixes_option(text: Optional[str]):
    """The ``--fixes`` option as the ledger records it: 'all', 'none' or a list (a located error)."""
    if text is None:
        return None
    try:
        return fixes_value(parse_fixes(text))
    except ValueError as exc:
        raise UserError(Issue("--fixes", "", str(exc))) from None


def config_fields(spec: RunSpec, ledger: Ledger) -> dict:
    """Measurement fields from a run's description (validated by the models on construction). A
    card of the card table the ledger lacks is added to this (in-memory) ledger: the write adds it
    to the file with the row."""
    args = spec
    fields: dict = {}
    if args.gpu:
        key, entry, _ = require_card(ledger, args.gpu)
        ledger.gpus.setdefault(key, entry)
        fields["gpu"] = key
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


def measurement_from_evidence(ev: RunEvidence, fields: dict, *, mid: str, source: str,
                              measured_on_fallback: Optional[dt.date] = None) -> Measurement:
    """A real-run Measurement from what a log or the callback said and the run's fields."""
    inferred: list[str] = []
    measured_on = ev.measured_on
    if measured_on is None and measured_on_fallback is not None:
        measured_on = measured_on_fallback
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
        id=mid,
        kind="real",
        outcome=Outcome(status=ev.status, peak_allocated_mib=ev.peak_allocated_mib,
                        peak_reserved_mib=ev.peak_reserved_mib, peak_delta_mib=ev.peak_delta_mib, oom=ev.oom,
                        per_device_peak_mib=ev.per_device_peak_mib,
                        failed_at_step=ev.failed_at_step, xid=ev.xid, result_text=ev.crash_text),
        provenance=Provenance(source=source, measured_on=measured_on, inferred_fields=inferred, notes=notes),
        environment=_environment(ev),
        **fields,
    )


def measurement_from_log(path: Path, text: str, ev: RunEvidence, fields: dict, mid: Optional[str],
                         run: int = 1, runs: int = 1) -> Measurement:
    """The row of one run of a log; a log of several runs gives each its id (``-runK``) and its
    line range as the source."""
    if runs == 1:
        return measurement_from_evidence(
            ev, fields, mid=mid or log_id(path, text),
            source=f"{path}:{ev.evidence_line}" if ev.evidence_line else str(path),
            measured_on_fallback=dt.date.fromtimestamp(os.stat(path).st_mtime))
    m = measurement_from_evidence(
        ev, fields, mid=f"{mid or log_id(path, text)}-run{run}", source=f"{path}:{ev.first_line}-{ev.last_line}",
        measured_on_fallback=dt.date.fromtimestamp(os.stat(path).st_mtime))
    note = (f"Run {run} of {runs} in this log (lines {ev.first_line}-{ev.last_line})"
            + (f"; the figures are read at line {ev.evidence_line}." if ev.evidence_line else "."))
    return m.model_copy(update={"provenance": m.provenance.model_copy(update={"notes": [note, *m.provenance.notes]})})


def record_callback(doc: dict, ledger_path: str, spec: RunSpec,
                    then: Optional[Callable[[Ledger], object]] = None) -> list[Measurement]:
    """Append what the TrainerCallback measured (its record, as printed) to a ledger; returns
    what was added (nothing when the same record is there already). ``then`` runs on the ledger in
    the same locked write when a row was added (the callback scores predictions with it)."""
    ev = evidence_from_callback(doc)
    text = json.dumps(doc, sort_keys=True)
    mid = f"real-run-{doc.get('date', 'undated')}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:8]}"
    added: list[Measurement] = []

    def change(lg: Ledger):
        # The row is made against the ledger as the locked write reads it: the file is parsed once.
        fields = config_fields(spec, lg)  # a card-table card joins the ledger with the row
        problem = _card_check(ev, lg, fields.get("gpu"), "probe_kit.callback")
        if problem:
            raise UserError(problem)
        m = spilled_past_card(measurement_from_evidence(
            ev, fields, source="probe_kit.callback (VramLedgerCallback)", mid=mid), lg)
        bad = impossible(m, lg, "probe_kit.callback")
        if bad:
            raise UserError(bad)
        if any(x.id == m.id for x in lg.measurements):
            return store.UNCHANGED
        lg.measurements.append(m)
        added.append(m)
        if then is not None:
            then(lg)

    store.update(ledger_path, change, create=True)
    return added


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


def spilled_past_card(m: Measurement, ledger: Ledger) -> Measurement:
    """A run read as ``ok`` whose peak is above its card's total finished only by spilling past
    the card (the driver's shared host memory): recorded as ``spilled``, never as a fit. Past what
    a driver can spill, ``ledger.core.checks`` refuses the figure."""
    gpu = ledger.gpus.get(m.gpu) if m.gpu else None
    o = m.outcome
    peak = max((v for v in (o.peak_allocated_mib, o.peak_reserved_mib) if v is not None), default=None)
    if (o.status != "ok" or gpu is None or gpu.total_mib is None or peak is None or peak <= gpu.total_mib
            or peak > gpu.total_mib + MAX_SPILL_MIB):
        return m
    note = (f"The peak, {peak} MiB, is above {m.gpu}'s {gpu.total_mib} MiB: the run finished only by spilling "
            "past the card (shared host memory), so it is recorded as spilled, not as a fit.")
    return m.model_copy(update={
        "outcome": o.model_copy(update={"status": "spilled"}),
        "provenance": m.provenance.model_copy(update={"inferred_fields": [*m.provenance.inferred_fields, "status"],
                                                      "notes": [*m.provenance.notes, note]})})


def impossible(m: Measurement, ledger: Ledger, where: str) -> list[Issue]:
    """What no instrument can have read (``ledger.core.checks``), located at the log line it came from."""
    return [Issue(where, "", f"{i.location.split('.', 1)[1]}: {i.message}")
            for i in measurement_issues(ledger, m, "m", where, dt.date.today())]


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
    """What ``ingest`` found: rows to add, rows to replace (same id, other content), rows already
    there, and the cards they name (a card-table card joins the ledger with its first row)."""

    new: list[Measurement]
    replaced: list[Measurement]
    already: list[str]
    cards: dict = field(default_factory=dict)


def ingest(paths: list[str], ledger_path: str, spec: RunSpec, *, mid: Optional[str] = None,
           replace: bool = False) -> Ingested:
    """Parse every log and build its measurement against the ledger at ``ledger_path`` (what
    ``--dry-run`` shows). Raises UserError (one line per bad log); writes nothing."""
    return read_logs(paths, store.load_or_new(ledger_path), spec, mid=mid, replace=replace)


def ingest_into(paths: list[str], ledger_path: str, spec: RunSpec, *, mid: Optional[str] = None,
                replace: bool = False, then: Optional[Callable[[Ledger], T]] = None) -> tuple[Ingested, Optional[T]]:
    """``ingest`` and ``apply`` in one locked read-modify-write: the ledger is read, checked and
    written once. Nothing is written when every run is in the ledger already, or on any error."""
    out: list = [None, None]

    def change(ledger: Ledger):
        found = out[0] = read_logs(paths, ledger, spec, mid=mid, replace=replace)
        if not (found.new or found.replaced):
            return store.UNCHANGED
        _apply_found(ledger, found)
        if then is not None:
            out[1] = then(ledger)

    store.update(ledger_path, change, create=True)
    return out[0], out[1]


def read_logs(paths: list[str], ledger: Ledger, spec: RunSpec, *, mid: Optional[str] = None,
              replace: bool = False) -> Ingested:
    """Parse every log and build its measurement for ``ledger``. Raises UserError (one line per bad
    log) before anything is written. ``mid`` names the one measurement of a single log; with
    ``replace``, a row this log made before with other content is replaced instead of refused."""
    fields = config_fields(spec, ledger)
    if mid and len(paths) > 1:
        raise UserError(Issue("--id", "", "names one measurement: give one log"))
    existing = {m.id: m for m in ledger.measurements}
    issues: list[Issue] = []
    result = Ingested([], [], [])
    for raw in paths:
        path = Path(raw)
        try:
            if not path.is_file() and path.exists():  # a FIFO or a device would block or never end
                issues.append(Issue(raw, "", "not a regular file"))
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            issues.append(Issue(raw, "", f"cannot read: {exc.strerror or exc}"))
            continue
        try:
            runs = parse_runs(text, raw)
        except LogError as exc:
            issues.append(Issue(raw, "", str(exc)))
            continue
        for k, ev in enumerate(runs, start=1):
            for w in ev.warnings:
                print(f"warning: {w}", file=sys.stderr)
            where = f"{raw}:{ev.evidence_line}" if ev.evidence_line else raw
            problem = _card_check(ev, ledger, fields.get("gpu"), where)
            if problem:
                issues.append(problem)
                continue
            try:
                m = spilled_past_card(measurement_from_log(path, text, ev, fields, mid, k, len(runs)), ledger)
            except ValueError as exc:  # pydantic: a flag value out of range
                issues.append(Issue(raw, "", str(exc).splitlines()[-1].strip()))
                continue
            bad = impossible(m, ledger, where)
            if bad:
                issues += bad
                continue
            _sort(result, existing.get(m.id), m, raw, replace, issues)
    if issues:
        raise UserError(issues)
    result.cards = {m.gpu: ledger.gpus[m.gpu] for m in result.new + result.replaced if m.gpu}
    return result


def _sort(result: Ingested, old: Optional[Measurement], m: Measurement, raw: str, replace: bool,
          issues: list[Issue]) -> None:
    """File a run's row as new, a replacement, already there, or (other content, no --replace) refused."""
    if any(n.id == m.id for n in result.new + result.replaced) or old == m:
        result.already.append(m.id)
    elif old is not None:
        if replace:
            result.replaced.append(m)
        else:
            diff = differences(old, m)
            issues.append(Issue(raw, "", f"already in the ledger as {m.id} with other content ("
                                + "; ".join(diff[:4]) + ("; ..." if len(diff) > 4 else "")
                                + "): run again with --replace to replace that row"))
    else:
        result.new.append(m)


def _apply_found(ledger: Ledger, found: Ingested) -> None:
    for key, entry in found.cards.items():
        ledger.gpus.setdefault(key, entry)
    replacing = {m.id: m for m in found.replaced}
    ledger.measurements[:] = [replacing.pop(m.id, m) for m in ledger.measurements]
    ledger.measurements.extend(found.new)

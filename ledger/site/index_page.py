"""The main page's data (``index.html``, ``vram.md``): a row per measurement, tables (or, past
``ROW_LIMIT``, a grouped summary), each card's specs, findings and predictions, and the helpers
they share (anchors, the ledger's canonical JSON and hash)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Optional

from ledger.core.models import Finding, Gpu, Ledger, Measurement, Prediction
from ledger.vocab.recipe import fixes_key, seq_len_of
from . import filters
from .views import ROW_LIMIT, FigureRow, FindingGroup, FindingView, GpuSpec, PredictionRow, Row, Table

# -- helpers ------------------------------------------------------------------------------


def anchor(text: str) -> str:
    """An HTML id from any text: lower case, a-z0-9 and '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def canonical_json(ledger: Ledger) -> str:
    """The ledger's compact canonical JSON (model field order, defaults and nulls left out, as
    the ledger file stores it): a field added to the format with a default changes no hash."""
    return ledger.model_dump_json(exclude_defaults=True)


def ledger_hash(ledger: Ledger, text: Optional[str] = None) -> str:
    """sha256 of the ledger's canonical JSON: changes when and only when the content does."""
    return hashlib.sha256((text if text is not None else canonical_json(ledger)).encode("utf-8")).hexdigest()


def fixes_text(m: Measurement) -> str:
    """The memory fixes as the tables show them (blank when the row does not say)."""
    return "" if m.memory_fixes is None else fixes_key(m.memory_fixes)


def gpu_label(ledger: Ledger, key: Optional[str]) -> str:
    if key is None:
        return ""
    gpu = ledger.gpus[key]
    short = [a for a in gpu.aliases if " " in a]
    return short[0] if short else gpu.name


def _oom_text(m: Measurement) -> str:
    o = m.outcome.oom
    if o is None:
        return "OOM"
    parts = []
    for label, value in (
        ("tried", o.tried_mib),
        ("free", o.free_mib),
        ("in use", o.in_use_mib),
        ("allocated", o.allocated_mib),
        ("reserved-unallocated", o.reserved_unallocated_mib),
        ("max allocated before", o.max_allocated_mib),
    ):
        if value is not None:
            parts.append(f"{label} {filters.mib(value)}")
    return "OOM" + (": " + ", ".join(parts) if parts else "")


def _provenance_title(m: Measurement) -> str:
    p = m.provenance
    bits = []
    if p.source:
        bits.append(f"source: {p.source}")
    if p.measured_on:
        bits.append(f"measured on {p.measured_on.isoformat()}")
    if p.inferred:
        bits.append("inferred, not read off an instrument")
    if p.simulated:
        bits.append("simulated")
    if p.inferred_fields:
        bits.append("filled from stated defaults or derived: " + ", ".join(p.inferred_fields))
    return "; ".join(bits)


def make_row(ledger: Ledger, m: Measurement) -> Row:
    o = m.outcome
    lora = m.lora
    seq = seq_len_of(m)
    if o.status == "oom":
        peak_text = _oom_text(m)
    elif o.peak_allocated_mib is not None:
        peak_text = filters.num(o.peak_allocated_mib)
    elif o.per_device_peak_mib:
        peak_text = " + ".join(f"{filters.mib(v)} on {k}" for k, v in o.per_device_peak_mib.items())
    else:
        peak_text = o.peak_as_reported or ""
    detail_bits = []
    if m.finetune == "full":
        detail_bits.append("Full fine-tuning: every weight trained, no adapter")
    if m.config_text:
        detail_bits.append(f"Config: {m.config_text}")
    if o.result_text and o.status != "oom":
        detail_bits.append(f"Result: {o.result_text}")
    elif o.result_text:
        detail_bits.append(f"Message: {o.result_text}")
    if o.failed_at_step is not None and "step" not in (o.result_text or ""):
        detail_bits.append(f"Failed at step {o.failed_at_step}")
    if m.dataset:
        d = m.dataset
        ds = [x for x in (d.name, f"{d.examples} examples" if d.examples else None,
                          f"{d.epochs:g} epochs" if d.epochs else None) if x]
        if ds:
            detail_bits.append("Dataset: " + ", ".join(ds))
    if m.logits_to_keep:
        detail_bits.append(f"logits_to_keep {m.logits_to_keep}")
    if o.peak_delta_mib is not None:
        detail_bits.append(f"Peak delta (HF Trainer's peaked memory) {filters.num(o.peak_delta_mib)} MiB")
    if o.oom is not None and (o.oom.total_mib is not None or o.oom.in_use_mib is not None):
        detail_bits.append("OOM message: " + ", ".join(
            x for x in (f"card total {filters.num(o.oom.total_mib)} MiB" if o.oom.total_mib is not None else None,
                        f"in use {filters.num(o.oom.in_use_mib)} MiB" if o.oom.in_use_mib is not None else None) if x))
    env = m.environment
    if env is not None and (env.device or env.device_name):
        detail_bits.append("Device: " + " ".join(x for x in (env.device, f"({env.device_name})" if env.device_name
                                                              else None) if x))
    return Row(
        id=m.id,
        kind=m.kind,
        model=m.model or "",
        quant=m.quant or "",
        rank=lora.rank if lora else None,
        alpha=lora.alpha if lora else None,
        rslora=lora.rslora if lora else None,
        dropout=lora.dropout if lora else None,
        dora=lora.dora if lora else None,
        seq_len=seq,
        fixes=fixes_text(m),
        after_load_mib=o.after_load_mib,
        pre_step_mib=o.pre_step_mib,
        peak_allocated_mib=o.peak_allocated_mib,
        peak_reserved_mib=o.peak_reserved_mib,
        step_s=o.step_s,
        status=o.status,
        inferred=m.provenance.inferred,
        peak_text=peak_text,
        detail="; ".join(detail_bits),
        notes=list(m.provenance.notes),
        source=m.provenance.source or "",
        measured_on=m.provenance.measured_on.isoformat() if m.provenance.measured_on else "",
        provenance_title=_provenance_title(m),
    )


def _summary(ledger: Ledger, measurements: list[Measurement]) -> list[dict]:
    """A table too long to list, as one row per (card, kind, model, quant, fixes, dropout, DoRA):
    its rows, ranks, lengths, peaks and outcomes, gathered in one pass over the rows."""
    labels = {key: gpu_label(ledger, key) for key in ledger.gpus}
    # Per group: rows, [least, most] peak allocated, rank and length (None until one is seen), outcomes.
    groups: dict[tuple, list] = {}
    for m in measurements:
        lora = m.lora
        key = (labels.get(m.gpu, ""), m.kind, m.model or "", m.quant or "", fixes_text(m),
               bool(lora and lora.dropout), bool(lora and lora.dora))
        g = groups.get(key)
        if g is None:
            g = groups[key] = [0, None, None, None, Counter()]
        g[0] += 1
        o = m.outcome
        for at, value in ((1, o.peak_allocated_mib), (2, lora.rank if lora else None), (3, m.seq_len or None)):
            if value is not None:
                span = g[at]
                if span is None:
                    g[at] = [value, value]
                elif value < span[0]:
                    span[0] = value
                elif value > span[1]:
                    span[1] = value
        g[4][o.status or "unknown"] += 1
    out = []
    for key in sorted(groups, key=lambda k: tuple(str(x) for x in k)):
        rows, peaks, ranks, seqs, status = groups[key]
        out.append(
            {
                "gpu": key[0], "kind": key[1], "model": key[2], "quant": key[3], "fixes": key[4],
                "dropout": "yes" if key[5] else "no", "dora": "yes" if key[6] else "no",
                "rows": rows,
                "ranks": f"{ranks[0]}–{ranks[1]}" if ranks else "",
                "seq_lens": f"{seqs[0]}–{seqs[1]}" if seqs else "",
                "peak_min_mib": peaks[0] if peaks else None,
                "peak_max_mib": peaks[1] if peaks else None,
                "status": ", ".join(f"{k} {v}" for k, v in sorted(status.items())),
            }
        )
    return out


def make_table(ledger: Ledger, table_id: str, title: str, measurements: list[Measurement]) -> Table:
    if len(measurements) <= ROW_LIMIT:
        rows = [make_row(ledger, m) for m in measurements]
        return Table(id=table_id, title=title, rows=rows, total=len(rows))
    return Table(id=table_id, title=title, rows=[], total=len(measurements),
                 summary=_summary(ledger, measurements))


def gpu_spec(key: str, gpu: Gpu) -> GpuSpec:
    specs = [("Name", gpu.name)]
    for label, value in (
        ("Vendor", gpu.vendor),
        ("Arch", gpu.arch),
        ("Total", f"{filters.mib(gpu.total_mib)} ({filters.gib(gpu.total_mib)})" if gpu.total_mib else None),
        ("Usable as torch reports it", f"{gpu.usable_gib_torch:.2f} GiB" if gpu.usable_gib_torch else None),
        ("OS", gpu.os),
        ("Driver", gpu.driver),
        ("Stack", gpu.stack),
        ("Libraries", gpu.libraries),
        ("Python", gpu.python),
    ):
        if value:
            specs.append((label, value))
    p = gpu.provenance
    return GpuSpec(
        key=key, anchor=f"gpu-{key}", title=gpu.name, specs=specs, notes=list(p.notes), source=p.source,
        measured_on=p.measured_on.isoformat() if p.measured_on else None, inferred=p.inferred,
    )


def _figure_value(fig) -> str:
    unit = fig.unit or ""
    if isinstance(fig.value, bool):
        return "yes" if fig.value else "no"
    if fig.low is not None and fig.high is not None:
        text = f"{fig.low:g}–{fig.high:g} {unit}".strip()
    elif fig.value is not None:
        text = f"{fig.value:g} {unit}".strip() if unit != "%" else f"{fig.value:g}%"
    else:
        text = fig.text or ""
    if fig.text and fig.text not in text and not re.fullmatch(r"[\d.\s\-–]+", fig.text):
        text += f" ({fig.text})"
    return text


def finding_view(f: Finding) -> FindingView:
    groups: dict[Optional[str], FindingGroup] = {}

    def group(label: str) -> tuple[FindingGroup, str]:
        head, sep, rest = label.partition(": ")
        name = head if sep else None
        if name not in groups:
            groups[name] = FindingGroup(
                anchor=f"{f.id}-{anchor(name)}" if name else None, title=name, figures=[], details=[]
            )
        return groups[name], (rest if sep else label)

    for fig in f.figures:
        g, label = group(fig.label)
        src = ""
        if fig.provenance and (fig.provenance.source or fig.provenance.measured_on):
            src = "; ".join(
                x for x in (fig.provenance.source,
                            f"measured on {fig.provenance.measured_on}" if fig.provenance.measured_on else None) if x
            )
        g.figures.append(FigureRow(label=label, value=_figure_value(fig), source=src))
    for d in f.details:
        g, label = group(d.label)
        g.details.append((label, d.text))
    ordered = [groups[k] for k in groups if k is None] + [groups[k] for k in groups if k is not None]
    p = f.provenance
    return FindingView(
        id=f.id, title=f.title, claim=f.claim, groups=ordered, evidence=list(f.evidence), status=f.status,
        source=p.source or "", measured_on=p.measured_on.isoformat() if p.measured_on else "",
        notes=list(p.notes),
    )


def prediction_row(ledger: Ledger, p: Prediction) -> PredictionRow:
    bits = []
    if p.lora:
        bits.append(f"r{p.lora.rank}")
        if p.lora.rslora:
            bits.append("rsLoRA" + (f" alpha {p.lora.alpha:g}" if p.lora.alpha else ""))
        if p.lora.dropout:
            bits.append(f"dropout {p.lora.dropout:g}")
        if p.lora.dora:
            bits.append("DoRA")
    if p.quant:
        bits.append(p.quant)
    if p.seq_len:
        bits.append(f"{p.seq_len} tokens")
    interval = ""
    if p.interval_low_mib is not None and p.interval_high_mib is not None:
        interval = f"{filters.num(p.interval_low_mib)}–{filters.num(p.interval_high_mib)}"
    return PredictionRow(
        id=p.id, gpu=gpu_label(ledger, p.gpu), config=", ".join(bits), predicted_mib=p.predicted_peak_mib,
        interval=interval, actual_mib=p.score.actual_peak_mib if p.score else None,
        error_pct=p.score.error_pct if p.score else None,
        scored_against=p.score.measurement if p.score else None,
        made_on=p.made_on.isoformat() if p.made_on else "", basis=list(p.basis), method=p.method,
        source=p.provenance.source or "",
    )


def training_gpu_key(ledger: Ledger) -> Optional[str]:
    """The card the real runs were trained on (most real runs); else the first card."""
    reals = Counter(m.gpu for m in ledger.measurements if m.kind == "real" and m.gpu)
    if reals:
        return sorted(reals.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    return next(iter(ledger.gpus), None)

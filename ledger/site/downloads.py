"""The flat download: vram.csv, one row per measurement, units in the headers."""

from __future__ import annotations

import csv
import io
from operator import attrgetter

from ledger.core.models import Ledger, Measurement
from .index_page import fixes_text


#: A text cell starting with one of these is a formula to a spreadsheet (CSV injection).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _v(value: object) -> object:
    if value is None:
        return ""
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        # Spreadsheet-safe, as OWASP advises: a leading apostrophe makes the cell text. Numbers
        # are written as numbers and are never touched.
        return "'" + value
    return value


#: Column names, units in the names; a stable order (consumers index by name).
COLUMNS = [
    "id", "kind", "gpu", "model", "quant", "lora_rank", "lora_alpha", "lora_rslora", "lora_dropout", "lora_dora",
    "seq_len_tokens", "response_len_tokens", "batch_size", "memory_fixes", "logits_to_keep", "dataset",
    "dataset_examples", "longest_example_tokens", "status", "after_load_mib", "pre_step_mib", "peak_allocated_mib",
    "peak_reserved_mib", "peak_delta_mib", "step_s", "oom_tried_mib", "oom_free_mib", "oom_total_mib", "oom_in_use_mib",
    "oom_allocated_mib", "oom_reserved_unallocated_mib", "oom_max_allocated_mib", "failed_at_step", "device",
    "source", "measured_on", "inferred", "optimizer", "gradient_checkpointing",
]
_NO_LORA = ("", "", "", "", "")
_NO_DATASET = ("", "", "")
_NO_OOM = ("", "", "", "", "", "", "")


def csv_row(m: Measurement) -> list:
    """One measurement as the COLUMNS (one function per row: the file has 100k rows at scale).
    Numbers and None go to the writer as they are (it writes None as an empty cell and a number
    as str() does, which is ``_v``'s result; the models hold a number or None there); texts and
    booleans through ``_v``."""
    lora, ds, o, p = m.lora, m.dataset, m.outcome, m.provenance
    oom = o.oom
    return [
        _v(m.id), m.kind, _v(m.gpu), _v(m.model), _v(m.quant),
        *((lora.rank, lora.alpha, _v(lora.rslora), lora.dropout, _v(lora.dora)) if lora else _NO_LORA),
        m.seq_len, m.response_len, m.batch_size, fixes_text(m), m.logits_to_keep,
        *((_v(ds.name), ds.examples, ds.longest_example_tokens) if ds else _NO_DATASET),
        _v(o.status), o.after_load_mib, o.pre_step_mib, o.peak_allocated_mib, o.peak_reserved_mib,
        o.peak_delta_mib, o.step_s,
        *((oom.tried_mib, oom.free_mib, oom.total_mib, oom.in_use_mib, oom.allocated_mib,
           oom.reserved_unallocated_mib, oom.max_allocated_mib) if oom else _NO_OOM),
        o.failed_at_step, _v(m.environment.device if m.environment else None), _v(p.source),
        p.measured_on.isoformat() if p.measured_on else "", _v(p.inferred),
        _v(m.optimizer), _v(m.gradient_checkpointing),
    ]


def measurements_csv(ledger: Ledger) -> str:
    """vram.csv text (RFC 4180 quoting, '\n' line ends)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(map(csv_row, ledger.measurements))
    return buf.getvalue()


class _SafeColumn(dict):
    """One column's texts made spreadsheet-safe, each distinct value once (a column holds one
    kind of value: True and 1 never meet in one)."""

    def __missing__(self, value: object) -> object:
        found = self[value] = _v(value)
        return found


def fits_csv(fits) -> str:
    """The fit table as CSV (``ledger.answer.fits.CSV_FIELDS``), text cells spreadsheet-safe. The table
    repeats a few texts (models, cards, settings) some 70,000 times: each is made safe once per
    column."""
    from ledger.answer.fits import CSV_FIELDS

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    at = CSV_FIELDS.index("measured")
    columns = [_SafeColumn() for _ in CSV_FIELDS]
    fields = attrgetter(*CSV_FIELDS)
    for c in fits.cells:
        values = list(fields(c))
        values[at] = " ".join(c.measured)
        row = [column[value] for column, value in zip(columns, values)]
        w.writerow(row)
    return buf.getvalue()

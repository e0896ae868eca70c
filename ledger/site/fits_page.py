"""The fit table's data (``fits.html``, ``fits.md``, ``fits.csv``) and the first section's grids
of the ledger's own cards, from the committed dry-run rows and the one predictor."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from ledger.storage.dry_runs import load_dry_runs
from ledger.answer.worlds import world_table
from ledger.answer.fits import CellLabels, cell_results, fit_table, fits_document, ledger_grids
from ledger.core.models import Ledger
from ledger.report.held_out import shared_predictor
from ledger.core.results import FitCard, Fits
from .filters import neutral

#: Above this many rows the whole ladder per cell (and leave-one-out) is too slow for a build.
LOO_LIMIT = 1000


#: Micro-batches the picker answers beside 1: stock recipes only (the program's preset's come from
#: dry runs of that micro-batch, which the shipped rows do not have: the picker gives the command),
#: each as ``vram fit --batch-size N`` answers it.
PICKER_BATCHES = (2, 4, 8)
#: Optimizers the picker answers a stock training run with beside the default (AdamW with fp32
#: moments, ``STOCK_OPTIMIZER``), each as ``vram fit --optim NAME`` answers it.
PICKER_OPTIMIZERS = ("adamw_8bit",)


def fit_table_doc(ledger: Ledger) -> tuple[Optional[dict], list]:
    """The fit table (site/fits.html) from the committed dry-run rows (``fits.fits_document``, None
    without any; ``fits_of`` types it) and the first section's grids of the ledger's own cards
    (none above LOO_LIMIT rows)."""
    p = shared_predictor(ledger, load_dry_runs())
    small = len(ledger.measurements) <= LOO_LIMIT
    grids = ledger_grids(p) if small else []
    if not p.dry:
        return None, grids
    # Above LOO_LIMIT rows the whole ladder per cell is too slow for a build: the dry run answers.
    rows = load_dry_runs()
    return fits_document(p, ladder=small, world_cells=lambda gpus, entries: world_table(p, rows, gpus, entries)), grids


def fits_of(doc: Optional[dict]) -> Optional[Fits]:
    """``fit_table_doc``'s document as ``results.Fits`` (None for none)."""
    if doc is None:
        return None
    from ledger.core.results import FullCellResult, WorldCellResult

    return Fits.model_construct(**{**doc, "cards": [FitCard.model_construct(**c) for c in doc["cards"]],
                                   "cells": cell_results(doc["cells"]),
                                   "full_cells": [FullCellResult.model_construct(**{**c._asdict(), "evidence": list(
                                       c.evidence)}) if hasattr(c, "_asdict") else c
                                                  for c in doc.get("full_cells", [])],
                                   "world_cells": [WorldCellResult.model_construct(**{**c._asdict(), "dry_runs": list(
                                       c.dry_runs)}) if hasattr(c, "_asdict") else c
                                                   for c in doc.get("world_cells", [])]})


def as_tuples(cells: list) -> list[tuple]:
    """Fit-table cells as plain tuples, to send between processes (a tenth of the cost of pickling
    them as named tuples, a hundredth of pickling them typed); ``fits_of`` and ``fit_models`` read
    them by position as they are."""
    return [tuple(c) for c in cells]


#: The picker's stock cells beside the fit table's own (micro-batch 1, the default optimizer,
#: checkpointing on), as (micro-batch, optimizer or None for the default, checkpointing), in two
#: shares of about equal cost (a build computes each in a worker of its own). Without
#: checkpointing the picker holds micro-batch 1 (``vram fit --batch-size N
#: --no-gradient-checkpointing`` answers more: three more tables would cost every page).
PICKER_SHARES = (tuple((b, None, True) for b in PICKER_BATCHES) + ((1, None, False),),
                 tuple((b, o, True) for o in PICKER_OPTIMIZERS for b in (1, *PICKER_BATCHES))
                 + tuple((1, o, False) for o in PICKER_OPTIMIZERS))


def picker_tables(ledger: Ledger, which: tuple[tuple[int, Optional[str], bool], ...]) -> dict:
    """The picker's other stock cells: (micro-batch, optimizer, checkpointing) -> fit cells, for each
    of ``which`` (``PICKER_SHARES``), as ``vram fit --batch-size N --optim NAME
    [--no-gradient-checkpointing]`` answers them."""
    p = shared_predictor(ledger, load_dry_runs())
    if not p.dry:
        return {}
    small = len(ledger.measurements) <= LOO_LIMIT
    return {(b, o, c): fit_table(p, ladder=small, batch=b, fixes_settings=("none",), optimizer=o, checkpointing=c)
            for b, o, c in which}


# -- the fit pages: an index of models and a page per model, with the picker's data ------------

#: The cards the fit index's headline columns answer for, one per common memory size (the
#: ledger's and the card table's keys; a column is left out when its card is not in the table).
HEADLINE_CARDS = (("8 GB", "rtx-3070-ti"), ("12 GB", "rtx-3060-12gb"), ("16 GB", "rtx-4060-ti-16gb"),
                  ("24 GB", "rtx-4090"), ("48 GB", "rtx-6000-ada"), ("80 GB", "a100-80gb"))
#: The headline recipe: stock (no memory fixes), 4-bit, plain LoRA, at this length.
HEADLINE_LEN = 2048
#: Ranks the "longest length at a rank" view answers.
VIEW_RANKS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class FitModel:
    """One model's fit page: its name, family and size, its cells by table row, the headline
    answers per common card size, and its picker data (JSON, and the same as a script a page
    opened from file:// can load)."""

    name: str
    slug: str
    family: str
    params_b: Optional[float]
    max_len: Optional[int]
    headline: list[tuple[str, str, str]]
    data_json: str


def family_of(model: str) -> str:
    for prefix, family in (("qwen3", "Qwen3"), ("qwen2.5", "Qwen2.5"), ("llama-3", "Llama 3"), ("gemma-3", "Gemma 3"),
                           ("mistral", "Mistral"), ("phi", "Phi"), ("deepseek", "DeepSeek-R1 distills")):
        if model.startswith(prefix):
            return family
    return "Other"


def model_slug(model: str) -> str:
    """A model's page name (fits/<slug>.html): its name, with only [a-z0-9.-]."""
    return re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.") or "model"


def fit_models(fits: Fits, batches: Optional[dict] = None) -> list[FitModel]:
    """Every model of the fit table, smallest first within its family, with its page's data (the
    cells of ``batches``, (micro-batch, optimizer, checkpointing) -> fit cells, keyed with them:
    ``_picker_suffix``)."""
    from ledger.vocab.model_configs import load_arch, max_length

    by_row = fits.by_row()
    heads = fits.table_lengths()
    cards = {c.key: c for c in fits.common_cards()}  # the page's and the picker's; every card in fits.md / .csv
    # The picker's other tables' cells (``FitCell``s or their plain tuples: read by position), by
    # model (each model's data reads only its own).
    others: dict[str, list] = {}
    for (batch, optim, ckpt), cells in (batches or {}).items():
        suffix = _picker_suffix(batch, optim, ckpt)
        for c in cells:
            others.setdefault(c[0], []).append((suffix, c))
    own: dict[str, dict[str, list]] = {}  # each model's rows of the common cards
    for k, cells in by_row.items():
        if k[4] in cards:
            own.setdefault(k[0], {})["|".join(k[1:])] = [_cell(c, c.label) for c in cells]
    labels = CellLabels()
    out = []
    for model in fits.models:
        arch = load_arch(model)
        headline = []
        for size, key in HEADLINE_CARDS:
            if key not in cards:
                continue
            cells = by_row.get((model, "4bit", "none", "plain", key), [])
            cell = next((c for c in cells if c.seq_len == HEADLINE_LEN), None)
            headline.append((size, key, cell.label if cell else "unknown"))
        rows = own.get(model, {})
        # A cell by position: model, gpu, quant, fixes, setting, seq_len, fits, tight, status,
        # at least, method, measured, ... (``FitCell``'s order).
        for suffix, c in others.get(model, ()):
            rows.setdefault(f"{c[2]}|{c[3]}|{c[4]}|{c[1]}{suffix}", []).append(
                [c[5], c[6], c[7], c[8], c[9], c[10], labels.of(c), list(c[11])])
        lengths = sorted({s for (m, _, _), seqs in heads.items() if m == model for s in seqs})
        data = {"model": model, "lengths": lengths, "ranks": list(VIEW_RANKS),
                "cards": [{"key": c.key, "name": c.name, "limit_low_mib": c.limit_low_mib,
                           "limit_high_mib": c.limit_high_mib} for c in cards.values()],
                "rows": rows}
        full = {f"{q}|{g}": [[c.seq_len, c.verdict, c.mib, c.high_mib, c.method] for c in cells]
                for (q, g), cells in fits.full_rows(model).items() if g in cards}
        # One GPU of a run on several (the picker's "GPUs" and "strategy"), keyed as the one-GPU
        # rows with the world after them: LoRA's ceilings in ``rows``, full fine-tuning in ``full``.
        for (method, quant, n, strategy, gpu), cells in fits.world_rows(model).items():
            if gpu not in cards:
                continue
            world = f"|g{n}-{strategy}"
            if method == "full":
                full[f"{quant}|{gpu}{world}"] = [[c.seq_len, c.verdict, c.mib, c.high_mib, WORLD_METHOD]
                                                  for c in cells]
            else:
                rows[f"{quant}|none|plain|{gpu}{world}"] = [
                    [c.seq_len, c.fits_rank, c.tight_rank, _world_status(c), False, WORLD_METHOD, c.label, []]
                    for c in cells]
        if full:  # full fine-tuning's training run with AdamW, stock: the picker's "full" choices
            data["full"] = full
        settings = fits.settings(model)
        if settings != ["plain", "dropout", "DoRA"]:  # a mixture of experts: the plain adapter only
            data["settings"] = settings
        out.append(FitModel(name=model, slug=model_slug(model), family=family_of(model),
                            params_b=round(arch.total_params / 1e9, 2) if arch else None,
                            max_len=max_length(model), headline=headline,
                            data_json=json.dumps(data, separators=(",", ":"), ensure_ascii=False)))
    order = {f: i for i, f in enumerate(dict.fromkeys(family_of(m) for m in fits.models))}
    return sorted(out, key=lambda m: (order[m.family], m.params_b or 0, m.name))


#: How the picker names a several-GPU cell's method.
WORLD_METHOD = "dry run of one rank"


def _world_status(c) -> str:
    """A several-GPU LoRA cell's status as the picker colours one (``FitCell.status``)."""
    if c.fits_rank is not None or c.tight_rank:
        return "ok"
    return "unknown" if c.verdict == "unknown" else "none-fits"


def _picker_suffix(batch: int, optimizer: Optional[str], checkpointing: bool) -> str:
    """A row of a model's picker data is keyed as picker.js spells it, ``quant|fixes|setting|card``
    and then this: the default micro-batch (1), optimizer (None: the recipe's default) and
    checkpointing (on) leave their part out. Every cell of one table shares it."""
    return "".join("|" + part for part in ([str(batch)] if batch != 1 or optimizer else [])
                   + ([optimizer] if optimizer else []) + ([] if checkpointing else ["nockpt"]))


def _cell(c, label: str) -> list:
    """A cell as the picker reads it: length, fits, tight, status, at least, method, words, rows."""
    return [c.seq_len, c.fits_rank, c.tight_rank, c.status, c.at_least, c.method, label, list(c.measured)]


def data_script(m: FitModel) -> str:
    """The picker's data for one model as a script (a page opened from file:// cannot fetch JSON,
    but it can load a script): it registers the JSON under the model's name. The picker shows its
    texts: every bidirectional control is written out (``filters.neutral``), as the pages write it."""
    safe = neutral(m.data_json).replace("</", "<\\/")
    return f"window.VRAM_FITS=window.VRAM_FITS||{{}};window.VRAM_FITS[{json.dumps(m.name)}]={safe};\n"

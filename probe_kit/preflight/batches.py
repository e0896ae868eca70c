"""The worst batch a training run can meet, collated as the trainer collates (``preflight``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

DEFAULT_MAX_SCAN = 200_000


# -- the worst batch -------------------------------------------------------------------------


@dataclass
class WorstBatch:
    """The largest batch shape the run can meet, collated as the trainer collates."""

    inputs: dict
    batch_size: int
    seq_len: int
    scanned: int
    total: Optional[int]
    scan_s: float
    lengths: list[int]  # every scanned example's length, longest first
    indices: list[int]  # the examples in the batch

    def describe(self) -> str:
        scope = (f"all {self.scanned:,} examples" if self.total is not None and self.scanned >= self.total
                 else f"the first {self.scanned:,} of {self.total:,} examples" if self.total is not None
                 else f"the first {self.scanned:,} examples")
        return f"{self.batch_size} × {self.seq_len} tokens (the longest of {scope}, scanned in {self.scan_s:.1f} s)"

    def longer_than(self, n: int) -> int:
        return sum(1 for x in self.lengths if x > n)


def _tokens(batch: Any) -> Optional[torch.Tensor]:
    """The collated batch's token tensor (``input_ids``, else its first 2-D tensor)."""
    if isinstance(batch, dict):
        t = batch.get("input_ids")
        if isinstance(t, torch.Tensor):
            return t
        return next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    return None


def _lengths(dataset, collate: Callable, n: int) -> list[int]:
    """Token counts of the first ``n`` examples: an Arrow ``input_ids`` column is measured without
    reading it into Python; an example with ``input_ids`` by their length; any other is collated
    alone (what the trainer's collator makes of it)."""
    data = getattr(dataset, "data", None)  # a datasets.Dataset's Arrow table
    if data is not None and "input_ids" in getattr(dataset, "column_names", ()) and \
            getattr(dataset, "_indices", None) is None:
        import pyarrow.compute as pc

        return pc.list_value_length(data.column("input_ids").slice(0, n)).to_pylist()
    out = []
    for i in range(n):
        ex = dataset[i]
        ids = ex.get("input_ids") if isinstance(ex, dict) else None
        if ids is not None and not isinstance(ids, str):
            out.append(len(ids))
            continue
        t = _tokens(collate([ex]))
        if t is None:
            raise ValueError("preflight: cannot tell an example's length (no input_ids after collation)")
        out.append(int(t.shape[-1]))
    return out


def _train_data(trainer) -> tuple[Any, Callable]:
    """The training set and collator as the trainer's dataloader sees them (unused columns removed)."""
    dataset, collate = trainer.train_dataset, trainer.data_collator
    if dataset is None:
        raise ValueError("preflight: the trainer has no train_dataset")
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return trainer._remove_unused_columns(dataset, description="training"), collate
    except ImportError:
        pass
    return dataset, trainer._get_collator_with_removed_columns(collate, description="training")


def find_worst_batch(dataset, collate: Callable, batch_size: int, max_scan: Optional[int] = DEFAULT_MAX_SCAN
                     ) -> WorstBatch:
    """The ``batch_size`` longest of the first ``max_scan`` examples (all with None), collated."""
    t0 = time.perf_counter()
    try:
        total: Optional[int] = len(dataset)
    except TypeError:
        total = None
    if total is None:  # an iterable dataset: the first max_scan examples
        items = []
        for ex in dataset:
            items.append(ex)
            if max_scan is not None and len(items) >= max_scan:
                break
        dataset = items
        n = len(items)
    else:
        n = total if max_scan is None else min(total, max_scan)
    if n == 0:
        raise ValueError("preflight: the training set is empty")
    lengths = _lengths(dataset, collate, n)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    take = order[:min(batch_size, n)]
    inputs = collate([dataset[i] for i in take])
    tokens = _tokens(inputs)
    if tokens is None:
        raise ValueError("preflight: the collator made no input_ids")
    return WorstBatch(inputs=dict(inputs), batch_size=int(tokens.shape[0]), seq_len=int(tokens.shape[-1]),
                      scanned=n, total=total, scan_s=time.perf_counter() - t0,
                      lengths=sorted(lengths, reverse=True), indices=take)


def shrink(inputs: dict, batch_size: int, seq_len: int) -> dict:
    """The batch cut to ``batch_size`` rows and ``seq_len`` positions (what a smaller micro-batch or
    a length cap makes of the worst batch: its longest rows, truncated)."""
    tokens = _tokens(inputs)
    full = tokens.shape[-1] if tokens is not None else None
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            v = v[:batch_size]
            if v.dim() >= 2 and full is not None and v.shape[1] == full:
                v = v[:, :seq_len]
            v = v.contiguous()
        out[k] = v
    return out

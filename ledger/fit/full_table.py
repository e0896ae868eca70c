"""Full fine-tuning's dry-run table: the dry runs of every weight trained (``finetune: full``), by
model, precision, memory fixes, micro-batch, gradient checkpointing and optimizer, at the lengths
they were run, and the figure at any length between two of them.

Between two lengths a recipe was dry-run at, the figure is the chord of the two rows. A step's
peak is the highest of its moments, each affine in the length (weights, gradients and optimizer
state do not grow with it; activations grow linearly, eager attention's scores quadratically),
so the peak is convex in the length and a chord lies at or above it: an interpolated figure never
under-states the step. Outside the lengths run there is no figure (the answering commands compute
the dry run there).

A dry run recorded as an OOM (a step past what any device holds, 16 TiB) fails at its length and
every longer one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Optional

from ledger.core.models import Measurement
from ledger.vocab.model_configs import model_name
from ledger.vocab.recipe import Recipe, fixes_key


class FullKey(NamedTuple):
    """What a full fine-tuning dry run's figure depends on, but its length."""

    model: Optional[str]
    quant: str
    fixes: str
    batch: int
    checkpointing: bool
    optimizer: Optional[str]


class FullFigure(NamedTuple):
    """A full fine-tuning step's dry-run peak at one length (MiB, before the card's remainder), the
    rows it rests on, and how it was read: "dry run" (a row of this very recipe), "chord" (between
    two lengths) or "past any device" (an OOM row at this length or a shorter one; ``mib`` None)."""

    mib: Optional[float]
    ids: tuple[str, ...]
    how: str
    pre_step_mib: Optional[float] = None
    #: For a chord: the highest the step can be below it, where rows beyond its ends say (the
    #: lines through the two rows below it and the two above, extended to the length, lie at or
    #: below a convex peak); the chord is exact when this reaches it.
    floor_mib: Optional[float] = None


def full_key(recipe: Recipe, optimizer: Optional[str]) -> FullKey:
    return FullKey(model_name(recipe.model), recipe.quant, recipe.fixes, recipe.batch, recipe.checkpointing, optimizer)


def row_key(m: Measurement) -> FullKey:
    return FullKey(model_name(m.model), m.quant or "bf16", fixes_key(m.memory_fixes), m.batch_size or 1,
                   m.gradient_checkpointing is not False, m.optimizer)


class FullTable:
    """Full fine-tuning dry runs by ``FullKey`` and length; ``figure`` answers any length between."""

    def __init__(self, rows: list[Measurement]):
        self.rows: dict[FullKey, dict[int, tuple[Optional[float], str, Optional[float]]]] = defaultdict(dict)
        for m in rows:
            if (m.kind != "dry_run" or m.finetune != "full" or not m.seq_len or m.outcome.status not in ("ok", "oom")
                    or (m.world_size or 1) != 1):  # a rank of a sharded run is not one GPU's step
                continue
            peak = m.outcome.peak_allocated_mib if m.outcome.status == "ok" else None
            if m.outcome.status == "ok" and peak is None:
                continue
            cell = self.rows[row_key(m)]
            old = cell.get(m.seq_len)
            # Two rows of one recipe and length: an OOM wins, else the higher peak (the safe side).
            if old is None or (old[0] is not None and (peak is None or peak > old[0])):
                cell[m.seq_len] = (peak, m.id, m.outcome.pre_step_mib)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def lengths(self, recipe: Recipe, optimizer: Optional[str]) -> list[int]:
        """The lengths this recipe (with ``optimizer``'s step, or none) was dry-run at."""
        return sorted(self.rows.get(full_key(recipe, optimizer), {}))

    def figure(self, recipe: Recipe, optimizer: Optional[str]) -> Optional[FullFigure]:
        """The step's dry-run peak at ``recipe.seq_len`` with ``optimizer``'s step (None: a one-step
        probe), or None where no row of this recipe reaches the length."""
        cell = self.rows.get(full_key(recipe, optimizer))
        seq = recipe.seq_len
        if not cell or seq is None:
            return None
        failed = [s for s, (peak, _, _) in cell.items() if peak is None and s <= seq]
        if failed:
            s = min(failed)
            return FullFigure(None, (cell[s][1],), "past any device")
        if seq in cell:
            peak, rid, pre = cell[seq]
            return FullFigure(peak, (rid,), "dry run", pre)
        lower = [s for s, v in cell.items() if s < seq and v[0] is not None]
        upper = [s for s, v in cell.items() if s > seq]
        if not lower or not upper:
            return None
        s1, s2 = max(lower), min(upper)
        (y1, i1, p1), (y2, i2, _) = cell[s1], cell[s2]
        if y2 is None:  # the next length run is past any device: no chord reaches this length
            return None
        floors = [y1]
        below = [s for s in lower if s < s1]
        above = [s for s in upper if s > s2 and cell[s][0] is not None]
        if below:
            s0 = max(below)
            floors.append(y1 + (y1 - cell[s0][0]) * (seq - s1) / (s1 - s0))
        if above:
            s3 = min(above)
            floors.append(y2 - (cell[s3][0] - y2) * (s2 - seq) / (s3 - s2))
        return FullFigure(y1 + (y2 - y1) * (seq - s1) / (s2 - s1), (i1, i2), "chord", p1, max(floors))

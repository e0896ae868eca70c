"""Every answer at or above the project's own dry run of the same recipe (``probe_kit.self_check``):
200 random recipes on tiny configs of three families (fixed seed; 50 groups of model, quant,
dropout, DoRA, length, fixes, micro-batch and checkpointing, four ranks and optimizers each, so a
group's grid dry runs are shared), each answered as ``vram estimate --gpu`` answers it (a training
run, the dry runs it lacks computed first) and held against the dry run of the recipe itself with
its optimizer's step, plus the card's remainder. The sample is checked in four parts of whole
groups, so the suite's workers share it."""

from __future__ import annotations

import pytest

from conftest import BUNDLED
from ledger.storage import store
from ledger.storage.dry_runs import load_dry_runs
from probe_kit.self_check import check, sample_recipes

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
PARTS = 4


def recipes():
    return sample_recipes(FAMILIES, 200, seed=0, max_tokens=1024, lengths=(128, 256, 512), per_group=4)


def test_the_sample_covers_every_axis_the_commands_answer():
    sample = recipes()
    assert len(sample) == 200
    assert {r.optimizer for r in sample} >= {"adamw_torch", "adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"}
    assert {r.batch for r in sample} >= {1, 2, 4} and {r.checkpointing for r in sample} == {True, False}
    assert {r.quant for r in sample} == {"4bit", "bf16"} and max(r.rank for r in sample) == 512
    assert {r.fixes for r in sample} >= {"none", "all"} and {r.dropout for r in sample} == {True, False}
    assert {r.dora for r in sample} == {True, False} and {r.model for r in sample} == set(FAMILIES)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("part", range(PARTS))
def test_no_answer_falls_below_its_own_dry_run(part):
    size = 200 // PARTS  # a multiple of the group size: no group's dry runs are computed twice
    chosen = recipes()[part * size:(part + 1) * size]
    checks = check(store.load(BUNDLED), load_dry_runs(), chosen, "rtx-4090")
    answered = [c for c in checks if c.answer_top_mib is not None]
    assert len(answered) >= 0.95 * len(chosen)  # 190 of the 200 at least
    below = [f"{short(c.recipe)}: top {c.answer_top_mib} < dry run {c.dry_mib:.1f} MiB ({c.method})"
             for c in answered if c.below]
    assert not below, "\n".join(below)


def short(r) -> str:
    return (f"{r.model} {r.quant} r{r.rank} {r.batch}x{r.seq_len} {r.fixes} {r.optimizer}"
            + (" dropout" if r.dropout else "") + (" DoRA" if r.dora else "") + ("" if r.checkpointing else " no-ckpt"))

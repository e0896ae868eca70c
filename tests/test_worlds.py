"""The several-GPU table (``ledger.answer.worlds``): its bisected ceilings, and its cells against
the commands that answer the same question (the site's tables of it: tests/test_site.py)."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from ledger import cli
from ledger.answer.worlds import (CEILING_RANKS, WORLD_FULL_MODELS, WORLD_GPUS, WORLD_LORA_MODELS, WorldCell,
                                  ceiling, raise_shorter, world_grid_points, world_table)
from ledger.answer.fits import MAX_RANK, STEP, cell_label
from ledger.report.held_out import shared_predictor
from ledger.storage import store
from ledger.storage.dry_runs import load_dry_runs
from ledger.core.paths import DEFAULT_LEDGER


class _Verdict:
    def __init__(self, verdict):
        self.verdict = verdict


class _Judge:
    """A judge whose verdict worsens past two thresholds (fits up to ``a``, tight up to ``b``)."""

    def __init__(self, a, b):
        self.a, self.b, self.asked = a, b, 0

    def at(self, rank):
        self.asked += 1
        return _Verdict("fits" if rank <= self.a else "tight" if rank <= self.b else "won't fit")


def test_bisected_ceiling_is_the_scan():
    """The bisection finds what a scan of every rank finds, in a few verdicts instead of 64."""
    rng = random.Random(7)
    for _ in range(300):
        a = rng.choice([0, *range(1, 600)])
        b = a + rng.choice([0, *range(1, 200)])
        judge = _Judge(a, b)
        scan = [r for r in range(STEP, MAX_RANK + 1, STEP)]
        want = (max([r for r in scan if r <= a], default=None), max([r for r in scan if r <= b], default=None))
        assert ceiling(judge) == want, (a, b)
        assert judge.asked <= 2 * 8


def _cell(seq, fits, tight, verdict="fits"):
    return WorldCell("m", 2, "fsdp", "rtx-4090", "lora", "4bit", seq, fits, tight, verdict, 1.0, 1.0, ("x",),
                     cell_label("ok", fits, tight, False))


def test_a_shorter_sequence_fits_what_a_longer_one_fits():
    cells = raise_shorter([_cell(512, 8, 16), _cell(2048, 24, 32), _cell(4096, None, 8, "tight")])
    assert [(c.fits_rank, c.tight_rank, c.label) for c in cells] == [
        (24, 32, "≥ 24 (tight ≤ 32)"), (24, 32, "24 (tight ≤ 32)"), (None, 8, "none (tight ≤ 8)")]


def test_grid_points_are_the_commands_points():
    """The shipped grid's points are the ones ``vram fit --gpus`` looks up: every model and world,
    a LoRA length at both ceiling ranks, a training run with AdamW's step."""
    points = world_grid_points()
    assert {p["gpus"] for p in points} == set(WORLD_GPUS) and {p["strategy"] for p in points} == {"fsdp"}
    assert {p["model"] for p in points} == set(WORLD_LORA_MODELS + WORLD_FULL_MODELS)
    assert all(p["optim"] == "adamw_torch" for p in points)
    lora = [p for p in points if p.get("method") != "full"]
    assert {p["rank"] for p in lora} == set(CEILING_RANKS) and all(p["quant"] == "4bit" for p in lora)


def _run(args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(args)
    assert code == 0, args
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def committed():
    """The several-GPU cells of the shipped rows on two cards."""
    rows = load_dry_runs()
    p = shared_predictor(store.load(DEFAULT_LEDGER), rows)
    from ledger.answer.fits import cards

    all_cards = cards(p)
    return world_table(p, rows, ["rtx-4090", "a100-80gb"], all_cards)


def test_every_model_and_world_of_the_grid_is_in_the_table(committed):
    have = {(c.model, c.gpus) for c in committed}
    assert have == {(m, n) for m in WORLD_LORA_MODELS + WORLD_FULL_MODELS for n in WORLD_GPUS}
    # More GPUs never make one GPU's step larger.
    by = {(c.model, c.gpu, c.seq_len, c.gpus): c for c in committed if c.mib is not None}
    for (model, gpu, seq, n), c in by.items():
        if (model, gpu, seq, 2 * n) in by:
            assert by[model, gpu, seq, 2 * n].mib < c.mib, (model, gpu, seq, n)


@pytest.mark.parametrize("model,gpus,seq", [("llama-3.3-70b", 2, 2048), ("mixtral-8x7b", 4, 8192)])
def test_a_lora_cell_is_what_vram_ceiling_answers(committed, model, gpus, seq, tmp_path):
    """A cell's ceiling is ``vram ceiling --gpus N --seq-len L``'s from the same committed rows (the
    table's ceiling raised only by a longer length's, never lowered)."""
    cell = next(c for c in committed if (c.model, c.gpus, c.seq_len, c.gpu) == (model, gpus, seq, "rtx-4090"))
    doc = _run(["ceiling", "--model", model, "--gpu", "rtx-4090", "--gpus", str(gpus), "--strategy", "fsdp",
                "--seq-len", str(seq), "--no-compute", "--cache", str(tmp_path), "--json"])
    if cell.label.startswith("≥"):
        assert (cell.fits_rank or 0) >= (doc["fits_rank"] or 0)
    else:
        assert (cell.fits_rank, cell.tight_rank) == (doc["fits_rank"], doc["tight_rank"])
    assert set(cell.dry_runs) == set(doc["dry_runs"])


def test_a_full_cell_is_what_vram_estimate_answers(committed, tmp_path):
    cell = next(c for c in committed if (c.model, c.gpus, c.seq_len, c.gpu) == ("qwen2.5-14b", 2, 2048, "a100-80gb"))
    doc = _run(["estimate", "--model", "qwen2.5-14b", "--method", "full", "--quant", "bf16", "--seq-len", "2048",
                "--gpu", "a100-80gb", "--gpus", "2", "--strategy", "fsdp", "--no-compute", "--cache", str(tmp_path),
                "--json"])
    assert doc["answer"]["verdict"] == cell.verdict
    assert doc["answer"]["probe_allocated"]["mib"] == cell.mib
    assert doc["dry_run"] == cell.dry_runs[0]

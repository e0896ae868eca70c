"""Write sweeps/fit-grid.toml: the dry runs behind the fit table (vram fit, site/fits.html).

    python sweeps/make_fit_grid.py            # then: python -m probe_kit.run_sweep sweeps/fit-grid.toml --resume
    python sweeps/make_fit_grid.py --ray [ADDRESS]   # write it and compute what ledger/dry-runs.json lacks on Ray

The grid is ``ledger.answer.fits.grid_points`` for every model of ``ledger.answer.fits.GRID_MODELS``: as few dry
runs as the physics allows (rank 8 at each length the model allows, 512 to 131,072 tokens; rank 64,
dropout and DoRA at the shortest, at 16,384 and at the longest), with gradient checkpointing and,
for the stock recipe, without it; full fine-tuning's training runs with AdamW in bf16 and fp32
master weights (``full_grid_points``); in the order ``priority`` gives. The held-out points at the end are computed directly only so that
``benchmarks/fit_grid.py`` can measure the interpolations against them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.answer.fits import (
    GRID_MODELS,
    GRID_RESPONSE_LEN,
    PRESET_MAX_LEN,
    full_grid_points,
    grid_points,
    sweep_toml,
    target_option,
)
from ledger.answer.worlds import world_grid_points

#: (model, quant, fixes, seq_len, rank, extra): points the table derives, computed directly.
HELD_OUT = [("gemma-3-4b-it", "4bit", "all", 4096, 64, {}), ("qwen2.5-7b", "bf16", "none", 8192, 64, {}),
            ("llama-3.2-3b", "4bit", "all", 4096, 8, {"dropout": 0.1}),
            ("qwen3-8b", "4bit", "none", 8192, 8, {"dora": True}),
            ("qwen2.5-1.5b", "4bit", "all", 8192, 64, {}), ("mistral-7b", "4bit", "all", 2048, 8, {"dropout": 0.1}),
            # without gradient checkpointing (stock only)
            ("qwen2.5-1.5b", "4bit", "none", 4096, 64, {"no_gradient_checkpointing": True}),
            ("llama-3.2-3b", "bf16", "none", 2048, 8, {"dora": True, "no_gradient_checkpointing": True}),
            ("gemma-3-1b-it", "4bit", "none", 8192, 8, {"dropout": 0.1, "no_gradient_checkpointing": True}),
            # past 16,384 tokens and on the larger models: the slope per rank and dropout's / DoRA's
            # cost interpolated between 16,384 tokens and the model's longest
            ("llama-3.1-8b", "4bit", "none", 65536, 64, {}), ("phi-3.5-mini", "bf16", "none", 32768, 8, {"dora": True}),
            ("qwen2.5-32b", "4bit", "none", 8192, 64, {}),
            ("llama-3.3-70b", "4bit", "none", 65536, 8, {"dropout": 0.1})]


def held_out() -> list[dict]:
    return [{"model": m, "quant": q, "fixes": f, "response_len": GRID_RESPONSE_LEN, "seq_len": s, "rank": r, **extra,
             **target_option(m)} for m, q, f, s, r, extra in HELD_OUT]


#: The grid's models before it reached 32k-128k tokens and 26 models: their points up to 16,384
#: tokens were computed first.
FIRST_MODELS = ("qwen2.5-0.5b", "gemma-3-1b-it", "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b", "llama-3.2-3b",
                "phi-3.5-mini", "gemma-3-4b-it", "qwen3-4b", "mistral-7b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b",
                "gemma-3-12b-it", "qwen2.5-14b")


def priority(point: dict) -> int:
    """The order the sweep computes the grid in (it appends each row as it finishes, and
    ``--resume`` skips rows already there): what was computed before first; then the newer
    models' stock recipe in 4-bit (what most people fine-tune them in); the first models' stock
    recipe past 16,384 tokens, with and then without gradient checkpointing; the newer models'
    stock bf16; the program's preset for the newer models; their stock recipe without
    checkpointing; then full fine-tuning's training runs (``full_grid_points``); then one rank's
    step of the models no card holds whole, on 2, 4 and 8 GPUs (``world_grid_points``)."""
    if point.get("gpus", 1) > 1:
        return 8
    if point.get("method") == "full":
        return 7
    first = point["model"] in FIRST_MODELS
    off = point.get("no_gradient_checkpointing", False)
    if first and point["seq_len"] <= PRESET_MAX_LEN:
        return 0
    if first:
        return 3 if off else 2
    if off:
        return 6
    if point["fixes"] == "all":
        return 5
    return 1 if point["quant"] == "4bit" else 4


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                    help="then compute the grid's missing dry runs as tasks on a Ray cluster (run_sweep --resume "
                         "--ray): without ADDRESS a Ray instance on this machine, 'auto' the one `ray start` runs "
                         "here, HOST:PORT a remote one")
    ap.add_argument("--ledger", help="with --ray: the rows' file (default ledger/dry-runs.json)")
    args = ap.parse_args(argv)
    if args.ledger and args.ray is None:
        print("--ledger: only with --ray", file=sys.stderr)
        return 1
    points = ([p for m in GRID_MODELS for p in grid_points(m)] + held_out()
              + [p for m in GRID_MODELS for p in grid_points(m, checkpointing=False)]
              + [p for m in GRID_MODELS for p in full_grid_points(m)] + world_grid_points())
    points = sorted(points, key=priority)  # stable: within a priority, the models smallest first
    header = ("# Generated by sweeps/make_fit_grid.py: the dry runs behind the fit table. Do not edit by hand.\n"
              "#   python -m probe_kit.run_sweep sweeps/fit-grid.toml --resume [--shard K/N]   # -> ledger/dry-runs.json")
    grid = Path(__file__).with_name("fit-grid.toml")
    grid.write_text(sweep_toml(points, "fit-grid", header), encoding="utf-8")
    if args.ray is None:
        return 0
    from probe_kit import run_sweep

    return run_sweep.main([str(grid), "--resume", "--ray", *([args.ray] if args.ray else []),
                           *(["--ledger", args.ledger] if args.ledger else [])])


if __name__ == "__main__":
    sys.exit(main())

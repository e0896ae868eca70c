"""``--gpus N --strategy S``: an answer for one rank of a multi-GPU run.

A rank's step is not one GPU's: FSDP shards the weights, gradients and optimizer state and gathers
a unit at a time, DDP keeps everything whole and adds gradient buckets. No one-GPU row answers it,
so the answer always rests on a dry run of that very world (``probe_kit.distributed``: fake
tensors, torch's fake process group), computed once into the user's dry-run cache and reused, then
calibrated as any dry run is (the card's remainder and interval) and judged per GPU.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from ledger.answer.fits import GRID_RESPONSE_LEN, target_option
from ledger.core.errors import Issue, UserError
from ledger.storage.dry_runs import load_dry_runs
from ledger.vocab.model_configs import model_name
from ledger.vocab.optimizers import STOCK_OPTIMIZER
from ledger.vocab.recipe import STRATEGIES, Recipe, full_recipe_of, recipe_of, world_problem

from .compute import compute_points, model_for_rows

#: What a rank's figure leaves out, said with every answer.
NOT_COUNTED = ("not in the figure: the collectives' own buffers outside PyTorch's allocator (NCCL's, on the card), "
               "which a card's measured remainder holds only for one GPU")


def add_world_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="GPUs of one data-parallel or sharded run (default 1); the answer is per GPU, one rank's "
                        "step, from a dry run of that world")
    p.add_argument("--strategy", metavar="NAME",
                   help="how --gpus N split the model: " + " | ".join(STRATEGIES) + " (DDP; FSDP2 fully_shard "
                        "FULL_SHARD; SHARD_GRAD_OP), as accelerate and the Trainer launch them")


def world_of(args: argparse.Namespace) -> tuple[int, Optional[str]]:
    """The world asked for, or a one-line error naming the flag."""
    gpus, strategy = getattr(args, "gpus", 1), getattr(args, "strategy", None)
    problem = world_problem(gpus, strategy)
    if problem:
        raise UserError(Issue(problem.split()[0], "", problem.split(" ", 1)[1]))
    return gpus, strategy


def rank_point(recipe: Recipe, model_rows: str, run: str) -> dict:
    """The dry-run point of one rank: the recipe at its own rank, the world, and for a training
    run the optimizer's step (its state is what FSDP shards: part of the step, not a term after)."""
    point = {"model": model_rows, "quant": recipe.quant, "fixes": recipe.fixes, "seq_len": recipe.seq_len,
             "response_len": recipe.response_len or min(GRID_RESPONSE_LEN, recipe.seq_len - 1),
             "gpus": recipe.gpus, "strategy": recipe.strategy,
             **({} if recipe.checkpointing else {"no_gradient_checkpointing": True}),
             **({"batch_size": recipe.batch} if recipe.batch != 1 else {})}
    if recipe.method == "full":
        point["method"] = "full"
    else:
        point.update(rank=recipe.rank, **({"dropout": 0.1} if recipe.dropout else {}),
                     **({"dora": True} if recipe.dora else {}), **target_option(recipe.model, recipe.targets))
    if run == "real":
        point["optim"] = recipe.optimizer or STOCK_OPTIMIZER
    return point


def _point_recipe(recipe: Recipe, point: dict) -> Recipe:
    return recipe.replace(response_len=point["response_len"], optimizer=point.get("optim"))


def find_row(rows, recipe: Recipe):
    """The cached dry run of this rank's recipe (the newest), or None."""
    found = None
    for m in rows:
        if m.kind != "dry_run" or (m.world_size or 1) != recipe.gpus or m.strategy != recipe.strategy:
            continue
        if (full_recipe_of(m) if recipe.method == "full" else recipe_of(m)) == recipe:
            found = m
    return found


def rank_row(args: argparse.Namespace, recipe: Recipe, run: str):
    """The rank's dry-run row: from the cache, else computed into it (``--no-compute`` refuses)."""
    point = rank_point(recipe, model_for_rows(args.model, args.cache), run)
    wanted = _point_recipe(recipe, point)
    row = find_row(load_dry_runs(cache=args.cache), wanted)
    if row is None:
        label = f"{model_name(args.model)} on each of {recipe.gpus} GPUs ({recipe.strategy})"
        compute_points([point], label, args.cache, no_compute=args.no_compute, ray=getattr(args, "ray", None))
        row = find_row(load_dry_runs(cache=args.cache), wanted)
    if row is None:
        raise UserError(Issue("--gpus", "", "the rank's dry run did not record a row (see above)"))
    return row


def estimate_ranks(args: argparse.Namespace, predictor, recipe: Recipe, gpu: Optional[str], entry) -> dict:
    """The per-GPU answer for one rank (``judge_dry`` of its dry run) and its figures."""
    run = "real" if args.real else "probe"
    row = rank_row(args, recipe, run)
    o = row.outcome
    if o.status != "ok" or o.peak_allocated_mib is None:
        answer = None
    else:
        answer = predictor.judge_dry(recipe, o.peak_allocated_mib, gpu, entry=entry, budget_mib=args.budget_mib)
    return {"gpus": recipe.gpus, "strategy": recipe.strategy, "per_gpu": True, "dry_run": row.id,
            "rank_after_load_mib": o.after_load_mib, "rank_pre_step_mib": o.pre_step_mib,
            "rank_dry_peak_mib": o.peak_allocated_mib, "rank_status": o.status,
            "optimizer_in_step": row.optimizer, "not_counted": NOT_COUNTED,
            "answer": answer.model_dump(mode="json") if answer else None}


def print_ranks(doc: dict, headline: str, width: int = 100) -> None:
    """The per-GPU answer as lines."""
    print(headline)
    a = doc["answer"]
    if a is None:
        print(f"  vram-ledger: WON'T FIT: one rank's dry run ran out of memory ({doc['dry_run']})"
              if doc["rank_status"] == "oom" else f"  vram-ledger: unknown: the rank's dry run is {doc['rank_status']}")
    else:
        iv = a["probe_allocated"]
        verdict = a["verdict"].upper() if a["gpu"] else "no card given"
        print(f"  vram-ledger: {verdict}: each GPU peaks at {iv['mib']} MiB allocated ({iv['low_mib']}–{iv['high_mib']} "
              f"MiB), by a dry run of one of the {doc['gpus']} ranks ({doc['strategy']})")
        print(textwrap.fill(a["method_text"], width, initial_indent="    ", subsequent_indent="      "))
        print(f"    the rank holds {doc['rank_after_load_mib']} MiB once the strategy has the model, "
              f"{doc['rank_pre_step_mib']} MiB before the step"
              + (f" (the {doc['optimizer_in_step']} state made)" if doc["optimizer_in_step"] else ""))
        if a["gpu"]:
            print(textwrap.fill(f"{a['why']} ({a['limit_source']})", width, initial_indent="    ",
                                subsequent_indent="      "))
    print(textwrap.fill(doc["not_counted"], width, initial_indent="    ", subsequent_indent="      "))
    sys.stdout.flush()

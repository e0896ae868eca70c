"""``--gpus N --strategy S`` on the command line: the options, the rank's dry runs found in the
committed rows or the user's cache (the missing ones computed into it), and the answers printed.
What a rank's answer is: ``ledger.answer.worlds``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from ledger.core.errors import Issue, UserError
from ledger.storage.dry_runs import load_dry_runs
from ledger.vocab.cards import is_mac
from ledger.vocab.model_configs import model_name
from ledger.vocab.recipe import STRATEGIES, Recipe, full_recipe_of, recipe_of, world_problem
from ledger.answer.fits import cell_label as fits_cell_label
from ledger.answer.worlds import CEILING_RANKS, rank_judge, rank_point

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
                        "FULL_SHARD; SHARD_GRAD_OP; DeepSpeed ZeRO-2, ZeRO-3 (the deepspeed extra, with an "
                        "optimizer), as accelerate and the Trainer launch them")
    p.add_argument("--cpu-offload", action="store_true",
                   help="FSDP's CPU offload (accelerate's fsdp_offload_params; with --strategy fsdp or "
                        "fsdp-shard-grad-op): each rank's sharded parameters, gradients and optimizer state in host "
                        "RAM, the optimizer stepping there; the answer adds the host RAM they take")


def world_of(args: argparse.Namespace, gpu: Optional[str] = None, entry=None) -> dict:
    """The world asked for as a recipe's fields (``gpus``, ``strategy``, ``cpu_offload``), or a
    one-line error naming the flag (several GPUs on a Mac among them)."""
    gpus, strategy = getattr(args, "gpus", 1), getattr(args, "strategy", None)
    offload = bool(getattr(args, "cpu_offload", False))
    problem = world_problem(gpus, strategy, offload)
    if problem:
        raise UserError(Issue(problem.split()[0], "", problem.split(" ", 1)[1]))
    if gpus > 1 and is_mac(entry):
        raise UserError(Issue("--gpus", "", f"{gpu} is a Mac: its one GPU shares the unified memory (no "
                              "data-parallel or sharded run across GPUs)"))
    return {"gpus": gpus, "strategy": strategy, "cpu_offload": offload}


def world_words(doc: dict) -> str:
    """A rank's strategy in words: 'fsdp', 'fsdp, CPU offload'."""
    return doc["strategy"] + (", CPU offload" if doc.get("cpu_offload") else "")


def _point_recipe(recipe: Recipe, point: dict) -> Recipe:
    # The row names the model as the point does (a user's config: its copy in the cache).
    return recipe.replace(model=point["model"], response_len=point["response_len"], optimizer=point.get("optim"))


def find_row(rows, recipe: Recipe):
    """The cached dry run of this rank's recipe (the newest), or None."""
    found = None
    for m in rows:
        if m.kind != "dry_run" or (m.world_size or 1) != recipe.gpus or m.strategy != recipe.strategy:
            continue
        if (full_recipe_of(m) if recipe.method == "full" else recipe_of(m)) == recipe:
            found = m
    return found


def rank_rows(args: argparse.Namespace, recipes: list[Recipe], run: str) -> list:
    """Each recipe's rank dry-run row: from the cache, the missing ones computed into it together
    (``--no-compute`` refuses)."""
    model_rows = model_for_rows(args.model, args.cache)
    points = [rank_point(r, model_rows, run) for r in recipes]
    wanted = [_point_recipe(r, p) for r, p in zip(recipes, points)]
    cached = load_dry_runs(cache=args.cache)
    missing = [p for p, w in zip(points, wanted) if find_row(cached, w) is None]
    if missing:
        r = recipes[0]
        label = (f"{model_name(args.model)} on each of {r.gpus} GPUs "
                 f"({world_words({'strategy': r.strategy, 'cpu_offload': r.cpu_offload})})")
        compute_points(missing, label, args.cache, no_compute=args.no_compute, ray=getattr(args, "ray", None))
        cached = load_dry_runs(cache=args.cache)
    rows = [find_row(cached, w) for w in wanted]
    if any(row is None for row in rows):
        raise UserError(Issue("--gpus", "", "a rank's dry run did not record a row (see above)"))
    return rows


def rank_row(args: argparse.Namespace, recipe: Recipe, run: str):
    """The rank's dry-run row (``rank_rows`` of one recipe)."""
    return rank_rows(args, [recipe], run)[0]


def ceiling_ranks(args: argparse.Namespace, predictor, recipe: Recipe, gpu: Optional[str], entry,
                  rows: Optional[list] = None) -> dict:
    """The largest rank (a multiple of ``args.step``) whose per-GPU verdict is "fits", and the
    largest that is at worst "tight", from dry runs of the world at ``CEILING_RANKS`` (``rows``:
    those two, found already)."""
    run = "real" if args.real else "probe"
    a, b = CEILING_RANKS
    if rows is None:
        rows = rank_rows(args, [recipe.replace(rank=a), recipe.replace(rank=b)], run)
    if any(r.outcome.status != "ok" or r.outcome.peak_allocated_mib is None for r in rows):
        raise UserError(Issue("--gpus", "", f"the rank's dry run at rank {a} or {b} did not finish ok: "
                              f"{rows[0].id}, {rows[1].id}"))
    judge = rank_judge(predictor, recipe, rows[0], rows[1], gpu, entry, margin_mib=args.margin_mib,
                       budget_mib=args.budget_mib)
    ranks, fits, tight = [], None, None
    for rank in range(args.step, args.max_rank + 1, args.step):
        answer = judge.at(rank)
        iv = answer.probe_allocated
        ranks.append({"rank": rank, "verdict": answer.verdict, "mib": iv.mib, "high_mib": iv.high_mib,
                      "dry_mib": round(rows[0].outcome.peak_allocated_mib + judge.mib_per_rank * (rank - a), 1)})
        if answer.verdict == "fits":
            fits = rank
        if answer.verdict != "won't fit":
            tight = rank
        limit = f"{answer.limit_low_mib}–{answer.limit_high_mib} MiB allocated ({answer.limit_source})"
    return {"gpus": recipe.gpus, "strategy": recipe.strategy, "cpu_offload": recipe.cpu_offload, "per_gpu": True,
            "seq_len": recipe.seq_len,
            "fits_rank": fits, "tight_rank": tight, "limit": limit, "dry_runs": [r.id for r in rows],
            "mib_per_rank": round(judge.mib_per_rank, 4), "ranks": ranks, "not_counted": NOT_COUNTED}


def print_rank_ceiling(doc: dict, recipe: Recipe, what: str, where: str, width: int = 100) -> None:
    print(f"for {what} of {recipe.replace(rank=0).describe().replace(' r0', '')}")
    each = f"each of {doc['gpus']} GPUs ({world_words(doc)})"
    if doc["fits_rank"] is None:
        head = f"no rank fits {what} on {each} for sure" + (f"; up to rank {doc['tight_rank']} is tight"
                                                             if doc["tight_rank"] else "")
    else:
        head = f"rank {doc['fits_rank']} fits {what} on {each}" + (
            "" if doc["tight_rank"] == doc["fits_rank"] else f"; up to rank {doc['tight_rank']} is tight")
    print(textwrap.fill(f"{head}, {where} ({doc['limit']})", width, subsequent_indent="  "))
    shown = {doc["fits_rank"], doc["tight_rank"]}
    first_over = next((r["rank"] for r in doc["ranks"] if r["verdict"] == "won't fit"), None)
    for r in doc["ranks"]:
        if r["rank"] in shown or r["rank"] == first_over:
            print(f"  r{r['rank']}: {r['verdict']}, {r['mib']} MiB per GPU (up to {r['high_mib']} MiB) by dry run of "
                  f"one rank, {doc['mib_per_rank']} MiB per LoRA rank between [{', '.join(doc['dry_runs'])}]")
    print(textwrap.fill(doc["not_counted"], width, initial_indent="  ", subsequent_indent="    "))
    sys.stdout.flush()


def estimate_ranks(args: argparse.Namespace, predictor, recipe: Recipe, gpu: Optional[str], entry) -> dict:
    """The per-GPU answer for one rank (``judge_dry`` of its dry run) and its figures."""
    run = "real" if args.real else "probe"
    row = rank_row(args, recipe, run)
    o = row.outcome
    if o.status != "ok" or o.peak_allocated_mib is None:
        answer = None
    else:
        answer = predictor.judge_dry(recipe, o.peak_allocated_mib, gpu, entry=entry, budget_mib=args.budget_mib)
    return {"gpus": recipe.gpus, "strategy": recipe.strategy, "cpu_offload": recipe.cpu_offload, "per_gpu": True,
            "dry_run": row.id, "rank_after_load_mib": o.after_load_mib, "rank_pre_step_mib": o.pre_step_mib,
            "rank_host_ram_mib": o.host_peak_mib,
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
              f"MiB), by a dry run of one of the {doc['gpus']} ranks ({world_words(doc)})")
        print(textwrap.fill(a["method_text"], width, initial_indent="    ", subsequent_indent="      "))
        print(f"    the rank holds {doc['rank_after_load_mib']} MiB once the strategy has the model, "
              f"{doc['rank_pre_step_mib']} MiB before the step"
              + (f" (the {doc['optimizer_in_step']} state made)" if doc["optimizer_in_step"] else ""))
        if doc.get("rank_host_ram_mib") is not None:
            host = doc["rank_host_ram_mib"]
            print(textwrap.fill(
                f"host RAM: CPU offload holds up to {host:,.1f} MiB a rank (sharded parameters, gradients, optimizer "
                f"state), {host * doc['gpus']:,.1f} MiB for the {doc['gpus']} ranks on one machine; the processes, "
                "their libraries and the model's loading come on top", width, initial_indent="    ",
                subsequent_indent="      "))
        if a["gpu"]:
            print(textwrap.fill(f"{a['why']} ({a['limit_source']})", width, initial_indent="    ",
                                subsequent_indent="      "))
    short = doc["rank_status"] == "oom" if a is None else a["gpu"] and a["verdict"] in ("won't fit", "tight")
    if short and doc["strategy"].startswith("fsdp") and not doc.get("cpu_offload"):
        print(textwrap.fill("FSDP's CPU offload keeps each rank's sharded parameters, gradients and optimizer state "
                            "in host RAM: --cpu-offload answers that run (the card's figure and the host RAM)", width,
                            initial_indent="    ", subsequent_indent="      "))
    print(textwrap.fill(doc["not_counted"], width, initial_indent="    ", subsequent_indent="      "))
    u = doc.get("unsloth_studio")
    if u:
        print(textwrap.fill(
            f"outside estimator, for comparison: unsloth-studio {u['estimate_mib']:,.1f} MiB reserved in all, "
            f"{u['share_mib']:,.1f} MiB a GPU by its rule ({u['rule']})"
            + (f": {u['verdict']} in {u['pool_mib']:,.1f} MiB" if u["verdict"] else "")
            + "; it splits the model by layers and leaves out the logits", width, initial_indent="  ",
            subsequent_indent="    "))
    sys.stdout.flush()


def fit_ranks(args: argparse.Namespace, predictor, recipes: dict[str, Recipe], lengths: list[int],
              gpu: Optional[str], entry) -> dict[str, list[dict]]:
    """``ceiling_ranks`` at every length, for each named recipe: the per-GPU rank tables (their dry
    runs, two a length a recipe, computed together)."""
    a, b = CEILING_RANKS
    at = [r.replace(seq_len=n, rank=k) for r in recipes.values() for n in lengths for k in (a, b)]
    rows = rank_rows(args, at, "real" if args.real else "probe")
    out, i = {}, 0
    for name, recipe in recipes.items():
        out[name] = []
        for n in lengths:
            out[name].append(ceiling_ranks(args, predictor, recipe.replace(seq_len=n), gpu, entry, rows[i:i + 2]))
            i += 2
    return out


def length_ceiling_ranks(args: argparse.Namespace, predictor, recipe: Recipe, gpu: Optional[str], entry,
                         ladder: tuple[int, ...], step: int, limit: int) -> dict:
    """The longest sequence (a multiple of ``step``, at most ``limit``) whose per-GPU verdict is
    "fits", and the longest at worst "tight": the rank's dry run at the ``ladder``'s lengths in
    turn until one is not "fits", then halving the span between the last that was and the first
    that was not (a rank's peak grows with the length), each length a dry run of the world."""
    memo: dict[int, dict] = {}

    def at(n: int) -> dict:
        if n not in memo:
            doc = estimate_ranks(args, predictor, recipe.replace(seq_len=n), gpu, entry)
            if doc["answer"] is None and doc["rank_status"] != "oom":
                raise UserError(Issue("--gpus", "", f"the rank's dry run at {n} tokens did not finish ok: "
                                      f"{doc['dry_run']} ({doc['rank_status']})"))
            memo[n] = doc
        return memo[n]

    def verdict(n: int) -> str:
        answer = at(n)["answer"]
        return answer["verdict"] if answer else "won't fit"

    def longest(ok) -> Optional[int]:
        rungs = sorted({n for n in ladder if step <= n < limit and n % step == 0} | {limit - limit % step})
        good = None
        for n in rungs:
            if not ok(verdict(n)):
                lo, hi = (good or 0) // step, n // step
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if ok(verdict(mid * step)) else (lo, mid)
                return lo * step or None
            good = n
        return good

    fits = longest(lambda v: v == "fits")
    tight = longest(lambda v: v != "won't fit")
    lengths = []
    for n in sorted(memo):
        doc = memo[n]
        a = doc["answer"]
        iv = a["probe_allocated"] if a else None
        lengths.append({"seq_len": n, "verdict": verdict(n), "mib": iv["mib"] if iv else None,
                        "high_mib": iv["high_mib"] if iv else None, "dry_run": doc["dry_run"]})
    limit_text = next((f"{d['answer']['limit_low_mib']}–{d['answer']['limit_high_mib']} MiB allocated "
                       f"({d['answer']['limit_source']})" for d in memo.values() if d["answer"]), None)
    return {"gpus": recipe.gpus, "strategy": recipe.strategy, "cpu_offload": recipe.cpu_offload, "per_gpu": True,
            "rank": recipe.rank if recipe.method != "full" else None,
            "method": recipe.method, "fits_len": fits, "tight_len": tight, "limit": limit_text,
            "lengths": lengths, "not_counted": NOT_COUNTED}


def print_length_ceiling(doc: dict, recipe_line: str, what: str, where: str, width: int = 100) -> None:
    """``length_ceiling_ranks`` as lines."""
    print(recipe_line)
    at = "of full fine-tuning" if doc["method"] == "full" else f"at rank {doc['rank']}"
    each = f"each of {doc['gpus']} GPUs ({world_words(doc)})"
    if doc["fits_len"] is None:
        head = f"no length fits {what} {at} on {each} of {where} for sure" + (
            f"; up to {doc['tight_len']} tokens is tight" if doc["tight_len"] else "")
    else:
        head = f"{doc['fits_len']} tokens fit {what} {at} on {each} of {where}" + (
            "" if doc["tight_len"] == doc["fits_len"] else f"; up to {doc['tight_len']} tokens is tight")
    print(textwrap.fill(head + (f" ({doc['limit']})" if doc["limit"] else ""), width, subsequent_indent="  "))
    for r in doc["lengths"]:
        fig = f"{r['mib']} MiB, up to {r['high_mib']} MiB" if r["mib"] is not None else "the dry run ran out of memory"
        print(f"  {r['seq_len']} tokens: {r['verdict']} ({fig}) by a dry run of one rank [{r['dry_run']}]")
    print(textwrap.fill(doc["not_counted"], width, initial_indent="  ", subsequent_indent="    "))
    sys.stdout.flush()


def cell_label(doc: dict) -> str:
    """A cell of the per-GPU table as the fit table writes one: '264 (tight ≤ 312)', 'none'."""
    return fits_cell_label("ok", doc["fits_rank"], doc["tight_rank"], False)

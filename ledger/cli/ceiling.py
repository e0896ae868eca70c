"""``vram ceiling``: the largest LoRA rank that fits a card at a length, or with ``--rank`` the
longest sequence that fits at a rank."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional

from ledger.storage import store
from ledger.core.errors import Issue, UserError
from .options import (Command, add_batch_option, add_json_option, add_ledger_option, add_method_option,
                      add_optimizer_option, add_recipe_options, add_run_option, dump_json)
from .world import (add_world_options, ceiling_ranks, length_ceiling_ranks, print_length_ceiling, print_rank_ceiling,
                    world_of)
from .question import (BUDGET_CARD, add_card_option, add_dry_runs_option, card_from, predictor_for, recipe_from,
                       require_model)


def add_ceiling_options(p: argparse.ArgumentParser) -> None:
    from .compute import add_compute_option

    add_ledger_option(p)
    add_dry_runs_option(p)
    add_compute_option(p)
    add_card_option(p, budget=True)
    add_recipe_options(p, skip=("rank", "alpha", "rslora"))
    add_method_option(p)
    p.add_argument("--rank", type=int, help="instead of --seq-len: the longest sequence that fits at this rank (a length "
                                            "ceiling, the form of published context tables)")
    p.add_argument("--max-seq-len", type=int, help="with --rank: the longest length searched (default: the model's "
                                                   f"max_position_embeddings, at most {MAX_SEARCHED_LEN})")
    p.add_argument("--seq-step", type=int, default=256, help="with --rank: the length step (default 256)")
    add_run_option(p)
    add_optimizer_option(p)
    add_batch_option(p)
    p.add_argument("--step", type=int, default=8, help="rank step (default 8)")
    p.add_argument("--max-rank", type=int, default=512, help="largest rank searched (default 512)")
    p.add_argument("--margin-mib", type=float, default=0.0, help="stay this far under the limit, MiB (default 0)")
    p.add_argument("--simulate-allocator", action="store_true",
                   help="with --seq-len on one card: replay the step at the rank that fits through a model of "
                        "PyTorch's CUDA caching allocator (vram estimate --simulate-allocator; a dry run of every "
                        "layer, seconds to minutes each, needs torch), and step the rank down while the simulated OOM "
                        "point does not fit what the card leaves PyTorch (at most 4 simulations)")
    add_world_options(p)
    add_json_option(p)


#: The longest sequence a length ceiling searches unless told (128k tokens).
MAX_SEARCHED_LEN = 131072
#: Lengths dry runs are computed at when a length ceiling needs rows the committed ones lack (a
#: model without rows, or past the grid's lengths): doublings, each asked only while the
#: previous still fits.
LENGTH_LADDER = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def cmd_ceiling(args: argparse.Namespace) -> int:
    """The largest LoRA rank (a multiple of --step) whose verdict is "fits" on the card, and the
    largest that is "tight" (the predicted interval reaches past the card's limit): from the one
    predictor (ledger.answer.predictor: measured real runs, probes, interpolation, the calibrated dry run,
    other cards), judged against the low end of the card's effective limit less --margin-mib.
    With --rank instead of --seq-len: the longest sequence that fits at that rank."""
    if args.step <= 0 or args.max_rank < args.step:
        raise UserError(Issue("--step", "", "needs 0 < --step <= --max-rank"))
    full = args.method == "full"
    if full and args.seq_len is not None:
        raise UserError(Issue("--seq-len", "", "full fine-tuning has no rank to search: `vram ceiling --method full` "
                              "answers the longest sequence that fits (ask one length with `vram estimate --method "
                              "full --seq-len N`)"))
    if not full and (args.seq_len is None) == (args.rank is None):
        raise UserError(Issue("--seq-len", "", "give --seq-len N (the largest rank at that length) or --rank N (the "
                              "longest sequence at that rank)" + (", not both" if args.seq_len is not None else "")))
    ledger = store.load(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    if args.simulate_allocator and (args.rank is not None or full or (args.gpus or 1) > 1 or gpu == BUDGET_CARD
                                    or args.budget_mib is not None):
        raise UserError(Issue("--simulate-allocator", "", "the simulation checks a rank ceiling on one card: give "
                              "--seq-len and --gpu (or --gpu-mib), without --rank, --method full, --gpus or --budget-mib"))
    if args.simulate_allocator and entry is not None and entry.vendor == "apple":
        raise UserError(Issue("--simulate-allocator", "", f"{gpu} is a Mac: the simulation is of CUDA's (and ROCm's) "
                              "caching allocator, not the MPS one"))
    if args.rank is not None or full:
        return _length_ceiling(args, ledger, gpu, entry)
    recipe = recipe_from(args)
    world = world_of(args, gpu, entry)
    if world["gpus"] > 1:  # one rank of a multi-GPU run: dry runs of that world alone
        recipe = recipe.replace(**world)
        doc = ceiling_ranks(args, predictor_for(args, ledger), recipe, gpu, entry)
        if args.json:
            dump_json(doc)
        else:
            where = f"{'a budget' if gpu == BUDGET_CARD else gpu} at {args.seq_len} tokens" + _budget_text(args)
            print_rank_ceiling(doc, recipe.replace(optimizer=recipe.optimizer or "adamw_torch") if args.real
                               else recipe, "a training run" if args.real else "a one-step probe", where)
        return 0
    from .compute import ensure_dry_runs

    predictor = predictor_for(args, ledger)
    if ensure_dry_runs(args, predictor, recipe):
        predictor = predictor_for(args, ledger)
    c = predictor.ceiling(recipe, gpu, entry=entry, run="real" if args.real else "probe",
                                            margin_mib=args.margin_mib, budget_mib=args.budget_mib, step=args.step,
                                            max_rank=args.max_rank)
    sim = _simulated_ceiling(args, predictor, recipe, gpu, entry, c) if args.simulate_allocator else None
    if args.json:
        dump_json({**c.model_dump(mode="json"), **({"allocator": sim} if args.simulate_allocator else {})})
        return 0
    what = "a training run" if args.real else "a one-step probe"
    where = f"{'a budget' if gpu == BUDGET_CARD else gpu} at {args.seq_len} tokens" + _budget_text(args)
    print(_recipe_line(replace(recipe, rank=0), args).replace(" r0", ""))
    limit = _limit_text(c)
    if c.status == "unknown":
        print(f"unknown: {c.note or 'no evidence near this recipe'} ({where})")
        return 0
    if c.fits_rank is None:
        print(f"no rank fits {what} on {where} for sure" + (f"; up to rank {c.tight_rank} is tight"
                                                            if c.tight_rank else "") + f" ({limit})")
    else:
        print(f"rank {c.fits_rank} fits {what} on {where}" + ("" if c.tight_rank == c.fits_rank else
                                                               f"; up to rank {c.tight_rank} is tight") + f" ({limit})")
    for r in c.ranks:
        if r["rank"] in (c.fits_rank, c.tight_rank) or r["verdict"] == "won't fit":
            span = f"up to {r['high_mib']} MiB" if r["high_mib"] is not None else "a lower bound: the step needs more"
            print(f"  r{r['rank']}: {r['verdict']}, {r['mib']} MiB ({span}) by {r['method']}"
                  + (f" [{', '.join(r['evidence'][:3])}]" if r["evidence"] else ""))
    if c.note:
        print(f"  {c.note}")
    if args.simulate_allocator:
        for line in _simulated_lines(sim):
            print(line)
    return 0


#: Simulations a rank ceiling's check may run (each a dry run of every layer).
MAX_SIMULATIONS = 4


def _simulated_ceiling(args: argparse.Namespace, predictor, recipe, gpu: str, entry, c) -> Optional[dict]:
    """The rank that fits, replayed through the caching allocator's model (``estimate._simulation``:
    the card's remainder held, the OOM point against what the card leaves PyTorch). While the
    simulation does not say fits, the next rank asked is the largest below whose predicted figure
    plus that simulation's overhead (its OOM point less the predicted figure) fits, at most
    ``MAX_SIMULATIONS`` in all. None when no rank fits."""
    from .estimate import SIM_WIDTH, _simulation

    if c.fits_rank is None:
        return None
    run = "real" if args.real else "probe"

    def answer(rank: int):
        a = predictor.predict(recipe.replace(rank=rank), gpu, entry=entry, run=run, margin_mib=args.margin_mib)
        return a, (a.real_allocated if run == "real" else a.probe_allocated)

    checked, rank = [], c.fits_rank
    while rank >= args.step and len(checked) < MAX_SIMULATIONS:
        a, figure = answer(rank)
        sim = _simulation(predictor, recipe.replace(rank=rank), gpu, entry, a, "")
        checked.append({"rank": rank, **sim})
        free = sim["free_for_pytorch_mib"]
        if sim["verdict"] in ("fits", None, "unknown") or free is None or figure is None or figure.mib is None:
            break
        over = sim["runs"][0]["oom_below_mib"] - figure.mib
        rank -= args.step
        while rank >= args.step:
            _, f = answer(rank)
            if f is not None and f.mib is not None and (f.mib + over) * (1 + SIM_WIDTH) <= free[0]:
                break
            rank -= args.step
    last = checked[-1]
    return {"fits_rank": last["rank"] if last["verdict_leaning_safe"] == "fits" else None, "checked": checked}


def _simulated_lines(sim: Optional[dict]) -> list[str]:
    if sim is None:
        return ["  the allocator's simulation: no rank fits, nothing to check"]
    out = []
    for one in sim["checked"]:
        run = one["runs"][0]
        free = one["free_for_pytorch_mib"]
        out.append(f"  simulated at r{one['rank']}: peak reserved {run['peak_reserved_mib']:,.1f} MiB, an OOM with "
                   f"{run['oom_below_mib']:,.1f} MiB or less free for PyTorch"
                   + (f"; the card leaves PyTorch {free[0]:,.1f}–{free[1]:,.1f} MiB" if free else "")
                   + f": {one['verdict'] or 'unknown'}")
    first = sim["checked"][0]["rank"]
    if sim["fits_rank"] == first:
        out.append(f"  the simulated allocator agrees: rank {first} fits")
    elif sim["fits_rank"] is not None:
        out.append(f"  leaning safe, the simulated allocator lowers the ceiling to rank {sim['fits_rank']}")
    else:
        below = ", ".join(f"r{one['rank']}" for one in sim["checked"][1:])
        out.append(f"  leaning safe: the simulated allocator does not confirm rank {first}"
                   + (f" (nor {below})" if below else "")
                   + "; ask `vram estimate --simulate-allocator` at lower ranks")
    return out


#: Dry runs a full fine-tuning length ceiling may add to pin its edges (each halves a chord's span).
MAX_REFINE = 12
#: A chord within this fraction of the floor the rows beyond it give is taken as exact.
CHORD_SLACK = 0.001


def _chord_edge(predictor, recipe, c, run: str, step: int):
    """A length (a multiple of ``step``) halfway through the chord that answers the first length past
    a verdict's edge (the first not "fits", the first "won't fit"), or None where each edge is
    answered by a dry run of its own length or its chord spans one step. A chord lies at or above
    the step, so an edge read off one can sit lower than the step's own: dry runs there move it."""
    from ledger.answer.full_ft import optimizer_of

    opt = optimizer_of(recipe, run)
    for edge in (c.fits_len, c.tight_len):
        first = (edge or 0) + step
        fig = predictor.full.table.figure(recipe.replace(seq_len=first), opt)
        if fig is None or fig.how != "chord" or fig.floor_mib >= fig.mib * (1 - CHORD_SLACK):
            continue  # a dry run of its own, or a chord the rows beyond it show to be exact
        have = predictor.full.table.lengths(recipe, opt)
        lo, hi = max(s for s in have if s < first), min(s for s in have if s > first)
        mid = (lo + hi) // 2 // step * step
        if lo < mid < hi:
            return mid
    return None


def _recipe_line(recipe, args: argparse.Namespace) -> str:
    """The first line of a ceiling: the whole recipe the answer is for."""
    what = "a training run" if args.real else "a one-step probe"
    shown = replace(recipe, optimizer=recipe.optimizer if args.real else None)
    return (f"for {what} of {shown.describe()}"
            + (" (the program's preset)" if recipe.fixes == "all" else " (stock)" if recipe.fixes == "none" else "")
            + ((", optimizer state as in the program's measured runs" if recipe.optimizer is None else "")
               if args.real else ", no optimizer step"))


def _budget_text(args: argparse.Namespace) -> str:
    return (f", judged against --budget-mib {args.budget_mib:g} MiB of peak allocated (no CUDA context or allocator "
            "overhead taken off)" if args.budget_mib is not None else "")


def _limit_text(c) -> str:
    return f"limit {c.limit_low_mib}–{c.limit_high_mib} MiB allocated" + (
        f", margin {c.margin_mib} MiB" if c.margin_mib else "")


def _length_ceiling(args: argparse.Namespace, ledger, gpu: str, entry) -> int:
    """``vram ceiling --rank N`` (or ``--method full``): the longest sequence (a multiple of --seq-step) that fits at the
    rank, computing the dry runs of the lengths no row reaches (``LENGTH_LADDER``, within the model's
    context) while the longest answered still fits, unless --no-compute."""
    from ledger.answer.ceilings import longest
    from ledger.vocab.model_configs import max_length
    from .compute import ensure_dry_runs

    full = args.method == "full"
    if (args.rank is not None and args.rank <= 0) or args.seq_step <= 0:
        raise UserError(Issue("--rank", "", "--rank and --seq-step must be > 0"))
    limit = args.max_seq_len or min(max_length(args.model or "") or MAX_SEARCHED_LEN, MAX_SEARCHED_LEN)
    if limit < args.seq_step:
        raise UserError(Issue("--max-seq-len", "", f"must be at least --seq-step ({args.seq_step})"))
    recipe = recipe_from(args, args.rank)
    run = "real" if args.real else "probe"
    predictor = predictor_for(args, ledger)
    world = world_of(args, gpu, entry)
    if world["gpus"] > 1:  # one rank of a multi-GPU run: dry runs of that world alone
        recipe = recipe.replace(**world)
        doc = length_ceiling_ranks(args, predictor, recipe, gpu, entry, LENGTH_LADDER, args.seq_step, limit)
        if args.json:
            dump_json(doc)
        else:
            where = ("a budget" if gpu == BUDGET_CARD else gpu) + _budget_text(args)
            print_length_ceiling(doc, _recipe_line(recipe, args), "a training run" if args.real else
                                 "a one-step probe", where)
        return 0

    def ask():
        return longest(predictor, recipe, gpu, entry=entry, run=run, margin_mib=args.margin_mib,
                       budget_mib=args.budget_mib, step=args.seq_step, max_len=limit)

    c = ask()
    for _ in LENGTH_LADDER:
        length = next((n for n in LENGTH_LADDER if c.unknown_from is not None and c.unknown_from <= n <= limit), None)
        if length is None or args.no_compute or not ensure_dry_runs(args, predictor, replace(recipe, seq_len=length)):
            break
        predictor = predictor_for(args, ledger)
        c = ask()
    if full and not args.no_compute:  # the verdicts' edges from dry runs, not a chord above the step
        for _ in range(MAX_REFINE):
            mid = _chord_edge(predictor, recipe, c, run, args.seq_step)
            if mid is None or not ensure_dry_runs(args, predictor, replace(recipe, seq_len=mid)):
                break
            predictor = predictor_for(args, ledger)
            c = ask()
    if args.json:
        dump_json(c.model_dump(mode="json"))
        return 0
    what = "a training run" if args.real else "a one-step probe"
    print(_recipe_line(recipe, args))
    where = ("a budget" if gpu == BUDGET_CARD else gpu) + _budget_text(args)
    lim = _limit_text(c)
    if c.status == "unknown":
        print(f"unknown: {c.note or 'no evidence near this recipe'} ({where})")
        return 0
    at = "of full fine-tuning" if full else f"at rank {args.rank}"
    if c.fits_len is None:
        print(f"no length fits {what} {at} on {where} for sure"
              + (f"; up to {c.tight_len} tokens is tight" if c.tight_len else "") + f" ({lim})")
    else:
        print(f"{c.fits_len} tokens fit {what} {at} on {where}"
              + ("" if c.tight_len == c.fits_len else f"; up to {c.tight_len} tokens is tight") + f" ({lim})")
    for r in c.lengths:
        span = f"up to {r['high_mib']} MiB" if r["high_mib"] is not None else "a lower bound: the step needs more"
        first = r.get("from_seq_len")
        print(f"  {f'{first}–' if first else ''}{r['seq_len']} tokens: {r['verdict']}"
              + (f" (at {r['seq_len']}: " if first else " (") + f"{r['mib']} MiB, {span}) by {r['method']}"
              + (f" [{', '.join(r['evidence'][:3])}]" if r["evidence"] else ""))
    if c.note:
        print(f"  {c.note}")
    return 0


COMMANDS = [
    Command("ceiling", "the largest LoRA rank that fits a card (and that is tight) at a sequence length, or the "
                       "longest sequence at a rank", add_ceiling_options, cmd_ceiling),
]

"""``vram estimate``: every estimator's figure for one configuration, beside the ledger's nearest row."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from ledger.storage import store
from ledger.core.answers import verdict_for
from ledger.core.errors import Issue, UserError
from ledger.report.estimators import estimate_all, nearest_row
from ledger.vocab.model_configs import load_arch
from ledger.vocab.recipe import capacity_mib, keeps_logits, seq_len_of
from ledger.fit.response_span import answerable
from .question import (BUDGET_CARD, add_card_option, add_dry_runs_option, card_from, predictor_for, recipe_from,
                        require_model)
from .compute import add_compute_option, ensure_dry_runs
from ledger.report.dry_board import unsloth_pool

from .world import add_world_options, estimate_ranks, print_ranks, world_of, world_words
from .options import (Command, add_batch_option, add_json_option, add_ledger_option, add_method_option,
                      add_optimizer_option, add_recipe_options, add_run_option, dump_json)


def add_estimate_options(p: argparse.ArgumentParser) -> None:
    add_recipe_options(p, required=("model", "seq-len"), skip=("alpha", "rslora"))
    add_method_option(p)
    add_batch_option(p)
    add_card_option(p, required=False, budget=True)
    add_run_option(p)
    add_optimizer_option(p)
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_compute_option(p)
    add_world_options(p)
    add_json_option(p)
    p.add_argument("--simulate-allocator", action="store_true",
                   help="also replay the step's allocations through a model of PyTorch's CUDA caching allocator (a dry "
                        "run of every layer, on the CPU, seconds to minutes; needs torch), the card's measured "
                        "remainder held through the step: peak reserved, the memory free for PyTorch below which the "
                        "step raises an OOM, and with --gpu that point judged against the card (the verdict then "
                        "leans on the worse of the two)")
    p.add_argument("--alloc-conf", metavar="CONF",
                   help="with --simulate-allocator (implied): the simulation again with this PYTORCH_CUDA_ALLOC_CONF "
                        "beside PyTorch's defaults, e.g. expandable_segments:True: what it changes in peak reserved and "
                        "in the OOM point")
    p.add_argument("--verbose", action="store_true", help="every part of how the answer was made (by default the "
                   "first two: its basis and its interval; --json has them all)")


def cmd_estimate(args: argparse.Namespace) -> int:
    """The answer first: this project's predicted peak (ledger.answer.predictor: measured runs, probes,
    interpolation, the calibrated dry run, other cards), its interval, method, evidence and, with
    --gpu, its verdict on that card (fits / tight / won't fit / unknown). Then, as a comparison,
    every outside estimator's figure (canifinetune, Unsloth Studio's formula, the FT01 rule of
    thumb) with the quantity it claims to predict, and the ledger's nearest measured row (on the
    requested card when it has one). How each fares against the ledger is on the estimator page."""
    require_model(args.model)
    if args.alloc_conf:  # refused before any work
        from probe_kit.allocator import AllocConf, AllocConfError

        try:
            AllocConf.parse(args.alloc_conf)
        except AllocConfError as exc:
            raise UserError(Issue("--alloc-conf", "", str(exc))) from None
    arch = load_arch(args.model)
    if args.method == "lora" and args.rank is not None and args.rank <= 0:
        raise UserError(Issue("--rank", "", f"must be > 0, got {args.rank}"))
    ledger = store.load(args.ledger)
    gpu, entry = card_from(args, ledger, required=False)
    card = capacity_mib(entry) if entry is not None else None
    predictor = predictor_for(args, ledger)
    question = recipe_from(args, args.rank)
    world = world_of(args, gpu, entry)
    simulate = args.simulate_allocator or bool(args.alloc_conf)
    if simulate and entry is not None and entry.vendor == "apple":
        raise UserError(Issue("--simulate-allocator", "", f"{gpu} is a Mac: the simulation is of CUDA's (and ROCm's) "
                              "caching allocator, not the MPS one"))
    if world["gpus"] > 1:  # one rank of a multi-GPU run: answered by a dry run of that world alone
        if simulate:
            raise UserError(Issue("--simulate-allocator" if args.simulate_allocator else "--alloc-conf", "",
                                  "the allocator's simulation is one GPU's (without --gpus)"))
        question = question.replace(**world)
        doc = {"model": arch.name, "params": arch.total_params, "recipe": question.memory_fields(), "gpu": gpu,
               "card_mib": card, **estimate_ranks(args, predictor, question, gpu, entry),
               "unsloth_studio": unsloth_pool(arch, question, card)}
        if args.json:
            dump_json(doc)
        else:
            print_ranks(doc, _headline(args, arch, question, question.optimizer or "adamw_torch", gpu))
        return 0
    if ensure_dry_runs(args, predictor, question):
        predictor = predictor_for(args, ledger)
    fixes, optimizer = question.fixes, question.optimizer if args.real else None
    if gpu is not None:
        answer = predictor.predict(question, gpu, entry=entry, run="real" if args.real else "probe",
                                   budget_mib=args.budget_mib)
    else:  # no card: the same answer, with no limit to judge it against
        answer = predictor.predict(question, "", run="real" if args.real else "probe")
    figures = estimate_all(arch, question, card)
    sim = _simulation(predictor, question, gpu, entry, answer, args.alloc_conf or "",
                      judged=args.budget_mib is None) if simulate else None
    near = nearest_row(ledger, args.model, question, None if gpu == BUDGET_CARD else gpu)
    full = question.method == "full"
    doc = {"model": arch.name, "params": arch.total_params,
           "recipe": {"method": question.method, "quant": question.quant, "rank": None if full else question.rank, "seq_len": question.seq_len,
                      "dropout": args.dropout, "dora": question.dora, "batch": question.batch, "fixes": fixes,
                      "response_len": args.response_len, "optimizer": optimizer},
           "gpu": gpu, "card_mib": card,
           "answer": answer.model_dump(mode="json") if answer else None, "allocator": sim,
           "near_limit": None if sim is not None or args.budget_mib is not None or answer is None or not gpu
           else _near_the_limit(predictor, answer, gpu), "estimates": figures,
           "nearest_measurement": None if near is None else {
               "id": near.id, "gpu": near.gpu, "kind": near.kind, "rank": near.lora.rank, "seq_len": seq_len_of(near),
               "peak_allocated_mib": near.outcome.peak_allocated_mib,
               "peak_reserved_mib": near.outcome.peak_reserved_mib}}
    if args.json:
        dump_json(doc)
        return 0
    # The first line names the whole recipe the answer is for.
    print(_headline(args, arch, question, optimizer, gpu))
    if answer is not None and answer.allocated is not None:
        iv = answer.allocated
        what = "a training run" if args.real else "a one-step probe"
        span = f"{iv.low_mib}–{iv.high_mib} MiB" if iv.low_mib is not None else f"at most {iv.high_mib} MiB: an upper bound"
        shown = answer.verdict.upper()
        if sim is not None and sim["verdict_leaning_safe"] and sim["verdict_leaning_safe"] != answer.verdict:
            shown = (f"{sim['verdict_leaning_safe'].upper()} (by the simulated allocator; {answer.verdict} by the "
                     "figure below)")
        print(f"  vram-ledger: {shown if gpu else 'no card given'}: {what} peaks at {iv.mib} MiB "
              f"allocated ({span})"
              + (f", {answer.reserved.mib} MiB reserved" if answer.reserved and answer.reserved.mib else "")
              + f", by {answer.method}")
        for line in _details(answer.method_text, args.verbose):
            print(line)
        if gpu:
            print(textwrap.fill(f"{answer.why} ({answer.limit_source})", WIDTH, initial_indent="    ",
                                subsequent_indent="      "))
            if doc["near_limit"]:
                print(textwrap.fill(doc["near_limit"], WIDTH, initial_indent="    ", subsequent_indent="      ",
                                    break_on_hyphens=False))
        else:
            print("    give --gpu (or --gpu-mib for a card not in `vram cards`) for a verdict on a card")
    elif answer is not None:
        print(f"  vram-ledger: {answer.verdict}: {answer.why}")
    else:
        one, why = answerable(question)
        print("  vram-ledger: unknown: " + (why if one is None else
                                          "no measured row or dry run of this recipe (run python -m probe_kit.dry_run)"))
    print("  outside estimators, for comparison:")
    for f in figures:
        if not f["available"]:
            print(f"  {f['estimator']:>15}: " + (f["note"] if f.get("installed") else
                                                  "not installed (pip install canifinetune)"))
            continue
        rng = f" (range {f['low_mib']:,.0f}–{f['high_mib']:,.0f} MiB)" if f["low_mib"] else ""
        print(f"  {f['estimator']:>15}: {f['estimate_mib']:>9,.1f} MiB {f['predicts']}{rng}")
    if sim is not None:
        for line in _simulation_lines(sim):
            print(line)
    if near is not None:
        n = doc["nearest_measurement"]
        print(f"  nearest measured: {n['id']} ({n['kind']}, {n['gpu']}, r{n['rank']}, {n['seq_len']} tokens): "
              f"{n['peak_allocated_mib']:,.1f} MiB allocated"
              + (f", {n['peak_reserved_mib']:,.1f} MiB reserved" if n["peak_reserved_mib"] else ""))
    return 0


def _headline(args: argparse.Namespace, arch, question, optimizer, gpu) -> str:
    """The whole recipe an answer is for, in one line."""
    full, fixes = question.method == "full", question.fixes
    return (f"{arch.name} ({arch.total_params / 1e9:.2f}B params), "
          + ("full fine-tuning (every weight trained), " if full else "")
          + f"{args.quant}" + ("" if full else f", r{args.rank}") + f", {args.seq_len} tokens"
          + (f", dropout {args.dropout:g}" if args.dropout else "") + (", DoRA" if args.dora else "")
          + f", batch {args.batch_size}" + (", no gradient checkpointing" if args.no_gradient_checkpointing else
                                             ", gradient checkpointing")
          + ("" if full else f", LoRA on {args.target_modules}") + f", memory fixes {fixes}"
          + (" (the program's preset)" if fixes == "all" else " (stock)" if fixes == "none" else "")
          + ((f", {optimizer}" if optimizer else ", optimizer state as in the program's measured runs") if args.real
             else ", a one-step probe (no optimizer step; without --probe: a training run)")
          + (f", on {gpu}" if gpu and gpu != BUDGET_CARD else "")
          + (f", judged against --budget-mib {args.budget_mib:g} MiB of peak allocated (no CUDA context or allocator "
             "overhead taken off)" if args.budget_mib is not None else "")
          + (" (--response-len ignored: without logits_to_keep every position's logits are made)"
             if args.response_len is not None and not keeps_logits(fixes) else "")
          + (f", on each of {question.gpus} GPUs ({world_words(question.memory_fields())}), per GPU"
             if question.gpus > 1 else ""))


def _near_the_limit(predictor, answer, gpu: str) -> Optional[str]:
    """A line for a verdict of fits or tight whose figure is near enough the limit that a step
    whose allocator caches as much as the most any probe of the ledger measured would not fit:
    the limit divides by the card's reserved/allocated, which one step can exceed."""
    iv, low = answer.allocated, answer.limit_low_mib
    ratio, top = predictor.reserved_ratio(gpu), predictor.limits.largest_ratio()
    if answer.verdict not in ("fits", "tight") or iv is None or iv.high_mib is None or not low or not ratio or not top:
        return None
    if iv.high_mib * top[0] <= low * ratio[0]:
        return None
    return (f"near the limit: it allows for the allocator's cache at about {ratio[0]:.3f} x allocated (the median "
            f"of {'this card' if predictor.limits.has_own_ratio(gpu) else 'every card'}'s probes), and the ledger's probes "
            f"measured up to {top[0]:.3f} ({top[1]}): --simulate-allocator replays this step's own allocations "
            "through the caching allocator's model (seconds to minutes)")


#: The simulated OOM point's width either way, as a fraction: the window the RTX 3070 Ti's probes
#: that fit and that ran out of memory leave the simulated point is 0.99% wide (``benchmarks/
#: allocator_accuracy.py --oom-pairs``), the issue's target 2%.
SIM_WIDTH = 0.02
_WORSE = {"fits": 0, "tight": 1, "won't fit": 2}


def _simulation(predictor, recipe, gpu, entry, answer, conf_text: str, judged: bool = True) -> dict:
    """The step's allocation trace (every layer, the vision tower of a multimodal config loaded)
    replayed through the caching allocator's model (``probe_kit.dry_run.simulate_allocator``) with
    the card's remainder (measured less dry-run peak allocated, ``predictor.remainder``) held
    through the step, with PyTorch's defaults and with ``conf_text``; on a card (and ``judged``:
    not against a --budget-mib of allocated memory), the OOM point judged against the memory the
    card leaves PyTorch, and the answer's verdict leaning on the worse of the two."""
    import importlib.util

    flag = "--alloc-conf" if conf_text else "--simulate-allocator"
    if importlib.util.find_spec("torch") is None:
        raise UserError(Issue(flag, "", "the allocator's simulation runs a dry run, which needs torch: install the "
                              "probe extra (pip install -e '.[probe]')"))
    from probe_kit.allocator import AllocConf, AllocConfError
    from probe_kit.dry_run import allocation_trace, simulate_allocator
    from probe_kit.recipe import ProbeConfig, RecipeError
    from ledger.vocab.recipe import parse_fixes

    try:
        conf = AllocConf.parse(conf_text)
    except AllocConfError as exc:
        raise UserError(Issue("--alloc-conf", "", str(exc))) from None
    full = recipe.method == "full"
    try:
        cfg = ProbeConfig(model=recipe.model, method=recipe.method, rank=None if full else recipe.rank,
                          quant=recipe.quant, dropout=(recipe.dropout_rate or 0.1) if recipe.dropout else 0.0,
                          dora=recipe.dora, seq_len=recipe.seq_len,
                          response_len=recipe.response_len or min(256, recipe.seq_len - 1),
                          fixes=parse_fixes(recipe.fixes), batch_size=recipe.batch,
                          gradient_checkpointing=recipe.checkpointing, optimizer=recipe.optimizer,
                          random_weights=True, **({} if full else {"target_modules": list(recipe.targets)}))
    except RecipeError as exc:
        raise UserError(Issue(flag, "", str(exc))) from None
    card = bool(gpu) and gpu != BUDGET_CARD
    held, held_source = predictor.remainder(gpu, entry.vendor if entry else None) if card else (None, "no card given")
    print("simulating the caching allocator: a traced dry run on the CPU (seconds to minutes)...",
          file=sys.stderr, flush=True)
    trace, _ = allocation_trace(cfg, vision=True)
    runs = [simulate_allocator(cfg, AllocConf(), "", trace, held_mib=held or 0.0)]
    if conf_text:
        runs.append(simulate_allocator(cfg, conf, conf_text, trace, held_mib=held or 0.0))
    doc = {"method": "the dry run's allocation trace (the model's whole depth) replayed through probe_kit.allocator, a model of "
                     "PyTorch's CUDA caching allocator; no fitted figure but the card's remainder",
           "held_mib": None if held is None else round(max(held, 0.0), 1),
           "held_source": (f"the card's remainder (measured less dry-run peak allocated), median over {held_source}"
                           if held is not None else held_source),
           "runs": runs, "width_pct": SIM_WIDTH * 100, "free_for_pytorch_mib": None, "free_source": None,
           "verdict": None, "verdict_leaning_safe": answer.verdict if answer is not None else None}
    if card and judged:
        low, high, source = predictor.free_for_pytorch(gpu, entry)
        # The defaults' run, or the asked configuration's where one is given: what the run will use.
        point = runs[-1]["oom_below_mib"]
        verdict = verdict_for(point * (1 - SIM_WIDTH), point * (1 + SIM_WIDTH), low, high, 0.0)
        doc.update(free_for_pytorch_mib=None if low is None else [low, high], free_source=source, verdict=verdict)
        if answer is not None and verdict != "unknown":
            doc["verdict_leaning_safe"] = (verdict if answer.verdict == "unknown"
                                           else max(answer.verdict, verdict, key=_WORSE.__getitem__))
    return doc


def _simulation_lines(sim: dict) -> list[str]:
    """``_simulation``'s figures and verdict as lines."""
    def line(text: str, indent: str = "    ") -> str:
        return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")

    out = [line("the caching allocator, simulated (the step's allocations replayed"
                + (f", the card's remainder of {sim['held_mib']:,.1f} MiB held" if sim["held_mib"] else "")
                + "; the CUDA context on top):", "  ")]
    for run in sim["runs"]:
        what = f"PYTORCH_CUDA_ALLOC_CONF={run['conf']}" if run["conf"] else "PyTorch's defaults"
        out.append(line(f"{what}: peak reserved {run['peak_reserved_mib']:,.1f} MiB for "
                        f"{run['peak_allocated_mib']:,.1f} MiB allocated; an OOM with {run['oom_below_mib']:,.1f} MiB "
                        "or less free for PyTorch"))
    if len(sim["runs"]) > 1:
        base, asked = sim["runs"]
        out.append(line(f"{asked['conf']}: {asked['peak_reserved_mib'] - base['peak_reserved_mib']:+,.1f} MiB "
                        f"reserved, the OOM point {asked['oom_below_mib'] - base['oom_below_mib']:+,.1f} MiB"))
    if sim["verdict"] is not None:
        free = sim["free_for_pytorch_mib"]
        where = (f"the card leaves PyTorch {free[0]:,.1f}–{free[1]:,.1f} MiB ({sim['free_source']})" if free
                 else sim["free_source"])
        safe = sim["verdict_leaning_safe"]
        out.append(line(f"simulated verdict: {sim['verdict'].upper()}: the OOM point ±{sim['width_pct']:g}% against "
                        f"{where}" + (f"; leaning safe, the answer is {safe.upper()}" if safe else "")))
    return out


#: Columns an answer's lines are wrapped to.
WIDTH = 100
#: Parts of the method's text shown without --verbose (the figure's basis and its interval).
SHOWN_PARTS = 2


def _details(text: str, verbose: bool) -> list[str]:
    """The method's text as lines of at most ``WIDTH`` columns, one part (``; ``-separated) a
    line: the first ``SHOWN_PARTS`` and how many more ``--verbose`` shows, or every part."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):  # "; " outside parentheses separates the parts
        depth += (c == "(") - (c == ")")
        if c == ";" and depth == 0 and text[i + 1:i + 2] == " ":
            parts.append(text[start:i].strip())
            start = i + 1
    parts = [p for p in parts + [text[start:].strip()] if p]
    shown = parts if verbose else parts[:SHOWN_PARTS]
    lines = [textwrap.fill(p, WIDTH, initial_indent="    ", subsequent_indent="      ") for p in shown]
    if len(parts) > len(shown):
        lines.append(f"    ({len(parts) - len(shown)} more parts of how it was made: --verbose, or --json)")
    return lines


COMMANDS = [Command("estimate", "this project's answer for one configuration, then every outside estimator's figure",
                    add_estimate_options, cmd_estimate)]

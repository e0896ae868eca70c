"""``vram fit``: one model's fit table on one card, from the committed dry-run rows."""

from __future__ import annotations

import argparse
import sys

from ledger.storage import store
from ledger.core.errors import Issue, UserError
from ledger.answer.fits import SETTINGS, fit_table, grid_points, model_lengths, settings_of, stale_rows
from ledger.vocab.model_configs import config_path, model_name
from ledger.storage.dry_runs import cache_file
from ledger.vocab.optimizers import optimizer_for
from ledger.vocab.recipe import Recipe, fixes_key, fixes_value, parse_fixes
from .question import BUDGET_CARD, add_card_option, add_dry_runs_option, card_from, dry_rows, predictor_for, require_model
from .compute import add_compute_option, compute_points, model_for_rows
from .world import add_world_options, cell_label, fit_ranks, world_of, world_words
from .options import Command, add_json_option, add_ledger_option, add_method_option, add_optimizer_option, dump_json


def add_fit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a shipped model config name (e.g. qwen2.5-7b) or a config JSON")
    add_card_option(p, budget=True)
    add_method_option(p)
    p.add_argument("--quant", choices=("4bit", "bf16", "fp32"), action="append",
                   help="base weights (repeatable; default 4bit and bf16; with --method full, bf16 and fp32 master "
                        "weights)")
    p.add_argument("--fixes", action="append",
                   help="memory fixes: none (stock transformers + peft, the default), all (the program's preset) or "
                        "a comma list (e.g. fused_linear_ce, activation_offloading; see vram estimate --help); "
                        "repeatable, a table for each")
    p.add_argument("--compute", action="store_true",
                   help="first run every grid dry run this model lacks (needs torch; kept in --cache, never in the "
                        "shipped rows); a model with no rows at all has them run without it, unless --no-compute")
    p.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="micro-batch: N sequences, each padded to the length (default 1): as one sequence of N x the "
                        "length, or, with the program's preset, from dry runs of that micro-batch")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="without gradient checkpointing (every layer's activations kept), from dry runs of it alone "
                        "(a micro-batch as one longer sequence; the shipped rows have it for the stock recipe, any "
                        "other --fixes computes them)")
    add_optimizer_option(p, table=True)
    add_compute_option(p)
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_world_options(p)
    add_json_option(p)


def cmd_fit(args: argparse.Namespace) -> int:
    """The largest LoRA rank whose training run fits (and, in brackets, that is tight) for one
    model on one card, at each sequence length, for each quant, memory-fixes setting, and without /
    with dropout / with DoRA: stock, the step with the optimizer's state (AdamW unless --optim);
    the program's preset, as its measured runs. The one predictor's answers from the committed
    dry-run rows (no torch), or the whole evidence ladder where the ledger measured the model on
    the card. With --compute, the dry runs the model lacks are run first (python -m
    probe_kit.run_sweep, device "dry")."""
    ledger = store.load(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    world = world_of(args, gpu, entry)
    if world["gpus"] > 1:
        return _world_table(args, ledger, gpu, entry, world)
    if args.method == "full":
        return _full_table(args, ledger, gpu, entry)
    if "fp32" in (args.quant or []):
        raise UserError(Issue("--quant", "", "fp32 master weights are a full fine-tuning precision (--method full); "
                              "LoRA's base weights are 4bit or bf16"))
    name = model_name(args.model)
    quants = args.quant or ["4bit", "bf16"]
    fixes = list(dict.fromkeys(_fixes_key(text) for text in args.fixes or ["none"]))
    ckpt = not args.no_gradient_checkpointing
    # Every grid point of the table has its row (an answer's few dry runs at one length are not the grid).
    wanted = {(p["quant"], p["fixes"], p.get("batch_size", 1), p["seq_len"], p["rank"], bool(p.get("dropout")),
               bool(p.get("dora")))
              for p in grid_points(args.model, checkpointing=ckpt, fixes_settings=tuple(fixes), batch=args.batch_size)
              if p["quant"] in quants}
    have = {(d.quant, fixes_key(d.memory_fixes), d.batch_size or 1, d.seq_len, d.lora.rank, bool(d.lora.dropout),
             bool(d.lora.dora)) for d in dry_rows(args)
            if d.lora is not None and model_name(d.model) == name and (d.gradient_checkpointing is not False) == ckpt}
    has_rows = wanted <= have
    if args.compute or (not has_rows and not args.no_compute and config_path(args.model) is not None):
        _compute(args, quants, fixes)
    p = predictor_for(args, ledger)
    if not any(model_name(d.model) == name for d in p.dry):
        raise UserError(Issue("--model", "", f"no dry-run rows for {name} in {args.dry_runs} or {cache_file(args.cache)}: "
                              "run again without --no-compute (needs torch), or pick a model of the fit table "
                              "(`vram fit --help`)"))
    if args.batch_size <= 0:
        raise UserError(Issue("--batch-size", "", f"must be > 0, got {args.batch_size}"))
    # The lengths its config allows, read from the config as given (a path's name alone finds none).
    # The model as its config is read (a user's config by its path: the adapter's size, what the
    # optimizer keeps for it, comes from the config), each cell named by its short name.
    source = args.model if config_path(args.model) is not None else name
    cells = [c._replace(model=name)
             for c in fit_table(p, models=[source], gpus=[gpu], extra_cards={gpu: entry}, budget_mib=args.budget_mib,
                                lengths=model_lengths(args.model),
                                batch=args.batch_size, fixes_settings=tuple(fixes), optimizer=args.optim,
                                checkpointing=not args.no_gradient_checkpointing)
             if c.quant in quants]
    stale = [i for i in stale_rows(p.dry) if name in i]
    unknown = sum(c.status == "unknown" for c in cells)
    if unknown and not all(c.status == "unknown" for c in cells) and config_path(args.model) is not None:
        print(f"warning: {unknown} of {len(cells)} cells are unknown: the grid's dry runs of them are not computed; "
              "run again with --compute (needs torch) to compute them", file=sys.stderr)
    for f in fixes:
        if all(c.status == "unknown" for c in cells if c.fixes == f):
            print(f"warning: no dry runs of {name} with memory fixes {f}"
                  + ("" if ckpt else " without gradient checkpointing")
                  + (f" at micro-batch {args.batch_size}" if args.batch_size != 1 else "")
                  + ": every cell is unknown; run again with --compute and without --no-compute (needs torch)",
                  file=sys.stderr)
    if args.budget_mib is not None:
        low, high, source = args.budget_mib, args.budget_mib, (
            f"--budget-mib {args.budget_mib:g}: peak allocated, no CUDA context or allocator overhead taken off")
    else:
        low, high, source = p.card_limit(gpu, entry, "real")
    if args.json:
        dump_json({"model": name, "gpu": gpu, "batch": args.batch_size, "checkpointing": ckpt, "run": "real",
                   "optimizers": {f: optimizer_for(f, args.optim) for f in fixes}, "limit_low_mib": low, "limit_high_mib": high, "limit_source": source,
                   "dry_run_median_abs_err_pct": p.dry_loo["median_abs_err_pct"],
                   "dry_run_max_abs_err_pct": p.dry_loo["max_abs_err_pct"], "stale": stale,
                   "cells": [{**c._asdict(), "measured": list(c.measured), "label": c.label()} for c in cells]})
        return 0
    print(f"{name} on {gpu}" + (f", micro-batch {args.batch_size} (sequences each padded to the length; the "
                                "program's preset's from dry runs of that micro-batch)" if args.batch_size != 1 else "")
          + ("" if ckpt else ", gradient checkpointing off (every layer's activations kept)")
          + f": the largest LoRA rank whose training run fits (tight: the interval reaches past the limit); "
          f"limit {low}–{high} MiB allocated ({source})")
    settings = settings_of(name)
    for q in quants:
        for f in fixes:
            print(f"\n{q}, {run_words(f, optimizer_for(f, args.optim))}")
            print(f"  {'tokens':>7}  " + "  ".join(f"{s:<22}" for s, _, _ in settings))
            for seq in sorted({c.seq_len for c in cells if c.quant == q and c.fixes == f}):
                row = {c.setting: c for c in cells if c.quant == q and c.fixes == f and c.seq_len == seq}
                print(f"  {seq:>7}  " + "  ".join(f"{row[s].label() if s in row else '':<22}" for s, _, _ in settings))
    if len(settings) < len(SETTINGS):
        print(f"\n{name} is a mixture of experts: LoRA on its fused expert weights (peft's target_parameters) takes "
              "no dropout and no DoRA, so the table has the plain adapter only (`vram estimate --target-modules "
              "attn` answers LoRA on attention only, with either)")
    methods = sorted({c.method for c in cells})
    loo = (f"median {p.dry_loo['median_abs_err_pct']}%, worst {p.dry_loo['max_abs_err_pct']}% (over {p.dry_loo['n']})"
           if p.dry_loo["n"] else "not measured (no measured probe has a dry run of its recipe)")
    kinds = sorted({p.table.derivation_pct(Recipe(model=name, quant=c.quant, fixes=c.fixes,
                                                   checkpointing=c.checkpointing))[::2] for c in cells},
                   key=lambda t: (t[1] or "", t[0]))
    derived = ("widened by the largest error of deriving, from the others, a dry run of its kind that was "
               "computed: " + "; ".join(f"{pct}% ({kind or 'every kind'})" for pct, kind in kinds)
               if p.dry_derivation["max_abs_err_pct"] is not None else
               "not widened: no derivation error could be measured (too few dry runs)")
    print(f"\nanswered by: {', '.join(methods)}; the calibrated dry run's leave-one-out error on the ledger's measured "
          f"probes: {loo}; a figure the grid derives rather than dry-runs has its interval {derived}")
    measured = sorted({i for c in cells for i in c.measured})
    if measured:
        print(f"measured on this card: {', '.join(measured)}")
    if stale:
        print(f"warning: {len(stale)} of this model's dry-run rows were computed with other library versions; "
              "rerun with --compute")
    return 0


def _full_table(args: argparse.Namespace, ledger, gpu: str, entry) -> int:
    """``vram fit --method full``: full fine-tuning's verdict and peak at each length, for each
    precision (bf16 weights; fp32 master weights), a training run with the optimizer's step
    (AdamW unless --optim); the dry runs a length lacks are computed first unless --no-compute."""
    from ledger.answer.fits import FULL_QUANTS, full_grid_points
    from ledger.vocab.optimizers import STOCK_OPTIMIZER
    from ledger.vocab.recipe import full_recipe

    from .compute import full_points

    if "4bit" in (args.quant or []):
        raise UserError(Issue("--quant", "", "--method full with --quant 4bit: 4-bit weights cannot be trained (QLoRA "
                              "is LoRA on 4-bit weights: --method lora); full fine-tuning runs in bf16 or fp32"))
    if args.batch_size <= 0:
        raise UserError(Issue("--batch-size", "", f"must be > 0, got {args.batch_size}"))
    fixes = list(dict.fromkeys(_fixes_key(text) for text in args.fixes or ["none"]))
    quants = list(dict.fromkeys(args.quant or FULL_QUANTS))
    optimizer = args.optim or STOCK_OPTIMIZER
    ckpt = not args.no_gradient_checkpointing
    name = model_name(args.model)
    lengths = model_lengths(args.model)
    # The grid's lengths of each precision: the table reads the rest between them.
    wanted = [(q, f, s) for q in quants for f in fixes
              for s in sorted({p["seq_len"] for p in full_grid_points(args.model, checkpointing=ckpt)})]

    def recipe(q, f, s):
        return full_recipe(model=args.model, quant=q, seq_len=s, fixes=f, optimizer=optimizer, batch=args.batch_size,
                           checkpointing=ckpt)
    p = predictor_for(args, ledger)
    if config_path(args.model) is not None:
        rows_model = model_for_rows(args.model, args.cache)
        # The grid's lengths each need a row of their own (a chord needs its two ends).
        points = [{**pt, "seq_len": s} for q, f, s in wanted
                  for pt in full_points(p, recipe(q, f, s), rows_model)
                  if s not in p.full.table.lengths(recipe(q, f, s), optimizer)]
        if points:
            compute_points(points, f"{name}'s full fine-tuning table", args.cache, no_compute=args.no_compute,
                           ray=args.ray)
            p = predictor_for(args, ledger)
    answers = {(q, f, s): p.predict(recipe(q, f, s), gpu, entry=entry, run="real", budget_mib=args.budget_mib)
               for q in quants for f in fixes for s in lengths}
    some = next(iter(answers.values()))
    low, high, source = some.limit_low_mib, some.limit_high_mib, some.limit_source
    if args.json:
        dump_json({"model": name, "gpu": gpu, "method": "full", "batch": args.batch_size, "checkpointing": ckpt,
                   "run": "real", "optimizer": optimizer, "limit_low_mib": low, "limit_high_mib": high,
                   "limit_source": source,
                   "cells": [{"quant": q, "fixes": f, "seq_len": s, "verdict": a.verdict,
                              "allocated": a.allocated.model_dump() if a.allocated else None, "method": a.method,
                              "evidence": a.evidence} for (q, f, s), a in answers.items()]})
        return 0
    print(f"{name} on {gpu}, full fine-tuning (every weight trained, no adapter): a training run with {optimizer}'s "
          f"step" + (f", micro-batch {args.batch_size}" if args.batch_size != 1 else "")
          + ("" if ckpt else ", gradient checkpointing off")
          + f"; its verdict and peak allocated (MiB, the interval's top in brackets); limit {low}–{high} MiB "
          f"allocated ({source})")
    words = {"bf16": "bf16 weights (gradients and state in bf16)",
             "fp32": "fp32 master weights, bf16 autocast"}
    for f in fixes:
        print(f"\nmemory fixes {f}{' (stock)' if f == 'none' else ''}")
        print(f"  {'tokens':>7}  " + "  ".join(f"{words[q]:<44}" for q in quants))
        for s in lengths:
            cells = []
            for q in quants:
                a = answers[(q, f, s)]
                fig = a.allocated
                cells.append(a.verdict + (f" {fig.mib:,.0f} ({fig.high_mib:,.0f})" if fig and fig.mib else ""))
            print(f"  {s:>7}  " + "  ".join(f"{c:<44}" for c in cells))
    methods = sorted({a.method for a in answers.values() if a.method})
    print(f"\nanswered by: {', '.join(methods) or 'nothing (no dry runs: run without --no-compute)'}; "
          f"{next((a.method_text.split('; interval ')[1] for a in answers.values() if '; interval ' in a.method_text), '')}")
    return 0


def _fixes_key(text: str) -> str:
    """A --fixes value as its canonical key ('none', 'all', a comma list in the recipe's order)."""
    try:
        return fixes_key(fixes_value(parse_fixes(text)))
    except ValueError as exc:
        raise UserError(Issue("--fixes", "", str(exc))) from None


def run_words(fixes: str, optimizer) -> str:
    """The recipe a table of the fit answers for, in words (the CLI's and the pages' headings)."""
    if fixes == "all":
        return ("memory fixes all (the program's preset), a training run as the program's measured runs"
                + (f", plus {optimizer}'s state" if optimizer else ""))
    return (f"memory fixes {fixes}{' (stock)' if fixes == 'none' else ''}, a training run with {optimizer}'s "
            "state")


def _compute(args: argparse.Namespace, quants: list[str], fixes: list[str]) -> None:
    """Run the model's grid points (of the asked quants and fixes) that neither --dry-runs nor the
    cache holds, as a dry-run sweep sharded over the cores, appending to the cache's file (never to
    the shipped rows)."""
    have = {_point_key(d) for d in dry_rows(args)}
    rows_model = model_for_rows(args.model, args.cache)
    points = [{**p, "model": rows_model}
              for p in grid_points(args.model, checkpointing=not args.no_gradient_checkpointing, fixes_settings=tuple(fixes),
                                   batch=args.batch_size)
              if _point_key(p) not in have and p["quant"] in quants]
    if not points:
        print(f"every grid point of {model_name(args.model)} is computed already", file=sys.stderr)
        return
    compute_points(points, f"{model_name(args.model)}'s fit table", args.cache, no_compute=args.no_compute,
                           ray=args.ray)


def _point_key(p) -> tuple:
    """A grid point's recipe, from a point dict or a dry-run row, to tell which are computed."""
    if isinstance(p, dict):  # a grid point: no optimizer step
        return (model_name(p["model"]), p["quant"], p["fixes"], p["rank"], p["seq_len"], bool(p.get("dropout")),
                bool(p.get("dora")), p.get("batch_size", 1), True, not p.get("no_gradient_checkpointing"))
    return (model_name(p.model), p.quant, fixes_key(p.memory_fixes), p.lora.rank if p.lora else None, p.seq_len,
            bool(p.lora and p.lora.dropout), bool(p.lora and p.lora.dora), p.batch_size or 1,
            p.optimizer is None, p.gradient_checkpointing is not False)


COMMANDS = [Command("fit", "one model's fit table on one card: the largest rank whose training run fits at each length",
                    add_fit_options, cmd_fit)]


def _world_table(args: argparse.Namespace, ledger, gpu: str, entry, world: dict) -> int:
    """``vram fit --gpus N --strategy S``: the largest LoRA rank per GPU at each length, the stock
    recipe of each asked quant with the plain adapter, dropout 0.1 and DoRA (as the one-GPU table's
    columns), from two dry runs of the world a length (computed together into the cache: seconds
    each for a tiny model, some for a 70B)."""
    import argparse as _argparse

    gpus = world["gpus"]
    if args.method == "full":
        raise UserError(Issue("--gpus", "", "the per-GPU table is LoRA's (ranks): a full fine-tune on several GPUs "
                              "is answered one length at a time by `vram estimate --method full --gpus N`"))
    if args.batch_size <= 0:
        raise UserError(Issue("--batch-size", "", f"must be > 0, got {args.batch_size}"))
    quants = args.quant or ["4bit"]
    if "fp32" in quants:
        raise UserError(Issue("--quant", "", "fp32 master weights are a full fine-tuning precision"))
    fixes = _fixes_key((args.fixes or ["none"])[0])
    name = model_name(args.model)
    p = predictor_for(args, ledger)
    lengths = model_lengths(args.model)
    ask = _argparse.Namespace(**{**vars(args), "real": True, "step": 8, "max_rank": 512, "margin_mib": 0.0})
    tables = {}
    for q in quants:
        recipe = Recipe(model=args.model, rank=8, quant=q, fixes=fixes, batch=args.batch_size,
                        checkpointing=not args.no_gradient_checkpointing,
                        optimizer=args.optim or optimizer_for(fixes, None), **world)
        tables[q] = fit_ranks(ask, p, {name: recipe.replace(dropout=d, dora=o) for name, d, o in SETTINGS},
                              lengths, gpu, entry)
    if args.json:
        dump_json({"model": name, "gpu": gpu, **world, "per_gpu": True, "tables": tables})
        return 0
    first = next(iter(next(iter(tables.values())).values()))[0]
    where = f"{gpus} GPUs of a budget" if gpu == BUDGET_CARD else f"{gpus} {gpu}"
    print(f"{name} on each of {where} ({world_words(world)}): the largest LoRA rank per GPU whose training run fits "
          f"(tight: the interval reaches past the limit); limit {first['limit']}")
    for q, settings in tables.items():
        print(f"\n{q}, {run_words(fixes, optimizer_for(fixes, args.optim))}, per GPU")
        cells = {k: [cell_label(d) for d in docs] for k, docs in settings.items()}
        width = {k: max(len(k), *(len(c) for c in v)) for k, v in cells.items()}
        print(f"  {'tokens':>7}  " + "  ".join(f"{k:>{width[k]}}" for k in cells))
        for i, n in enumerate(lengths):
            print(f"  {n:>7}  " + "  ".join(f"{cells[k][i]:>{width[k]}}" for k in cells))
    print(f"\n{first['not_counted']}; each length from two dry runs of one rank (ranks 8 and 64), a rank's step "
          "being affine in the LoRA rank")
    return 0


"""``vram fit``: one model's fit table on one card, from the committed dry-run rows."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from .. import store
from ..errors import Issue, UserError
from ..fits import LENGTHS, SETTINGS, fit_table, grid_points, stale_rows, sweep_toml
from ..model_configs import model_name
from ..dry_runs import cache_file
from ..recipe import fixes_key
from .calibrate import add_card_option, add_dry_runs_option, card_from, dry_rows, predictor_for, require_model
from .options import Command, add_json_option, add_ledger_option, dump_json


def add_fit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a shipped model config name (e.g. qwen2.5-7b) or a config JSON")
    add_card_option(p)
    p.add_argument("--quant", choices=("4bit", "bf16"), action="append",
                   help="base weights (repeatable; default both)")
    p.add_argument("--fixes", choices=("none", "all"), action="append",
                   help="memory fixes (repeatable; default both)")
    p.add_argument("--compute", action="store_true",
                   help="first run the dry runs this model lacks (needs torch; kept in --cache, never in the shipped "
                        "rows)")
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_json_option(p)


def cmd_fit(args: argparse.Namespace) -> int:
    """The largest LoRA rank that fits (and, in brackets, that is tight) for one model on one
    card, at each sequence length, for each quant, memory-fixes setting, and without / with
    dropout / with DoRA: the one predictor's answers from the committed dry-run rows (no torch),
    or the whole evidence ladder where the ledger measured the model on the card. With --compute,
    the dry runs the model lacks are run first (python -m probe_kit.run_sweep, device "dry")."""
    ledger = store.load(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    name = model_name(args.model)
    if args.compute:
        _compute(args)
    p = predictor_for(args, ledger)
    if not any(model_name(d.model) == name for d in p.dry):
        raise UserError(Issue("--model", "", f"no dry-run rows for {name} in {args.dry_runs} or {cache_file(args.cache)}: "
                              "run again with --compute "
                              "(needs torch), or pick a model of the fit table (`vram fit --help`)"))
    quants = args.quant or ["4bit", "bf16"]
    fixes = args.fixes or ["none", "all"]
    cells = [c for c in fit_table(p, models=[name], gpus=[gpu], extra_cards={gpu: entry}) if c.quant in quants and c.fixes in fixes]
    stale = [i for i in stale_rows(p.dry) if name in i]
    low, high, source = p.card_limit(gpu, entry, "probe")
    if args.json:
        dump_json({"model": name, "gpu": gpu, "limit_low_mib": low, "limit_high_mib": high, "limit_source": source,
                   "dry_run_median_abs_err_pct": p.dry_loo["median_abs_err_pct"],
                   "dry_run_max_abs_err_pct": p.dry_loo["max_abs_err_pct"], "stale": stale,
                   "cells": [{**c.__dict__, "measured": list(c.measured), "label": c.label()} for c in cells]})
        return 0
    print(f"{name} on {gpu}: the largest LoRA rank that fits (tight: the interval reaches past the limit); limit "
          f"{low}–{high} MiB allocated ({source})")
    for q in quants:
        for f in fixes:
            print(f"\n{q}, memory fixes {f}")
            print(f"  {'tokens':>7}  " + "  ".join(f"{s:<22}" for s, _, _ in SETTINGS))
            for seq in LENGTHS:
                row = {c.setting: c for c in cells if c.quant == q and c.fixes == f and c.seq_len == seq}
                print(f"  {seq:>7}  " + "  ".join(f"{row[s].label() if s in row else '':<22}" for s, _, _ in SETTINGS))
    methods = sorted({c.method for c in cells})
    loo = (f"median {p.dry_loo['median_abs_err_pct']}%, worst {p.dry_loo['max_abs_err_pct']}% (over {p.dry_loo['n']})"
           if p.dry_loo["n"] else "not measured (no measured probe has a dry run of its recipe)")
    derived = (f"widened by {p.dry_derivation['max_abs_err_pct']}% (the largest error of deriving a dry run it did "
               "compute)" if p.dry_derivation["max_abs_err_pct"] is not None else
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


def _compute(args: argparse.Namespace) -> None:
    """Run the model's grid points that neither --dry-runs nor the cache holds as a dry-run
    sweep, appending to the cache's file (never to the shipped rows)."""
    have = {_point_key(d) for d in dry_rows(args)}
    points = [p for p in grid_points(args.model) if _point_key(p) not in have]
    target = cache_file(args.cache)
    if not points:
        print(f"every grid point of {model_name(args.model)} is computed already", file=sys.stderr)
        return
    print(f"computing {len(points)} dry runs of {model_name(args.model)} into {target}", file=sys.stderr)
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="vram-fit-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(sweep_toml(points, f"fit-{model_name(args.model)}"))
        argv = [sys.executable, "-m", "probe_kit.run_sweep", path, "--resume", "--ledger", str(target)]
        try:  # the sweep's progress goes to our stderr (its stdout too: ours is for the table)
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a stream with no file (captured in a library call)
            out = None
        if out is not None:
            proc = subprocess.run(argv, stdout=out)
        else:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            sys.stderr.write(proc.stdout or "")
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise UserError(Issue("--compute", "", f"the dry-run sweep exited {proc.returncode} (see above)"))


def _point_key(p) -> tuple:
    """A grid point's recipe, from a point dict or a dry-run row, to tell which are computed."""
    if isinstance(p, dict):
        return (model_name(p["model"]), p["quant"], p["fixes"], p["rank"], p["seq_len"], bool(p.get("dropout")),
                bool(p.get("dora")))
    return (model_name(p.model), p.quant, fixes_key(p.memory_fixes), p.lora.rank if p.lora else None, p.seq_len,
            bool(p.lora and p.lora.dropout), bool(p.lora and p.lora.dora))


COMMANDS = [Command("fit", "one model's fit table on one card: the largest rank that fits at each length",
                    add_fit_options, cmd_fit)]

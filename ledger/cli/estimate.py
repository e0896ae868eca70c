"""``vram estimate``: every estimator's figure for one configuration, beside the ledger's nearest row."""

from __future__ import annotations

import argparse

from .. import store
from ..errors import Issue, UserError
from ..estimators import Recipe, estimate_all, load_arch, nearest_row
from ..ingest import fixes_option
from ..recipe import capacity_mib, fixes_key, require_gpu, seq_len_of
from .options import Command, add_json_option, add_ledger_option, add_recipe_options, dump_json


def add_estimate_options(p: argparse.ArgumentParser) -> None:
    add_recipe_options(p, required=("model", "rank", "seq-len"), skip=("alpha", "rslora"))
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--gpu", help="a card in the ledger (its capacity; the nearest measurement on it)")
    add_ledger_option(p)
    add_json_option(p)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Print every estimator's figure (canifinetune, Unsloth Studio's formula, the FT01 rule of
    thumb) with its breakdown and the quantity it claims to predict, and the ledger's nearest
    measured row. How each estimator fares against the ledger is on the site's estimator page."""
    arch = load_arch(args.model)
    if arch is None:
        raise UserError(Issue(args.model, "", "no such config (give a config JSON or a model whose config ships)"))
    if args.rank <= 0 or args.seq_len <= 0 or args.batch_size <= 0:
        raise UserError(Issue("--rank", "", "rank, seq-len and batch size must be > 0"))
    ledger = store.load(args.ledger)
    gpu = require_gpu(ledger, args.gpu) if args.gpu else None
    card = None
    if gpu:
        g = ledger.gpus[gpu]
        card = capacity_mib(g)
    recipe = Recipe(quant=args.quant, rank=args.rank, seq_len=args.seq_len, dropout=args.dropout, dora=args.dora,
                    batch=args.batch_size, fixes=fixes_key(fixes_option(args.fixes)))
    figures = estimate_all(arch, recipe, card)
    near = nearest_row(ledger, args.model, recipe, gpu)
    doc = {"model": arch.name, "params": arch.total_params, "recipe": {**recipe.__dict__, "response_len": args.response_len},
           "gpu": gpu,
           "card_mib": card, "estimates": figures,
           "nearest_measurement": None if near is None else {
               "id": near.id, "gpu": near.gpu, "kind": near.kind, "rank": near.lora.rank,
               "seq_len": seq_len_of(near),
               "peak_allocated_mib": near.outcome.peak_allocated_mib, "peak_reserved_mib": near.outcome.peak_reserved_mib}}
    if args.json:
        dump_json(doc)
        return 0
    print(f"{arch.name} ({arch.total_params / 1e9:.2f}B params), {args.quant}, r{args.rank}, {args.seq_len} tokens"
          + (f", dropout {args.dropout:g}" if args.dropout else "") + (", DoRA" if args.dora else ""))
    for f in figures:
        if not f["available"]:
            print(f"  {f['estimator']:>15}: not installed (pip install canifinetune)")
            continue
        rng = f" (range {f['low_mib']:,.0f}–{f['high_mib']:,.0f})" if f["low_mib"] else ""
        print(f"  {f['estimator']:>15}: {f['estimate_mib']:>9,.1f} MiB {f['predicts']}{rng}")
    if near is not None:
        n = doc["nearest_measurement"]
        print(f"  nearest measured: {n['id']} ({n['kind']}, {n['gpu']}, r{n['rank']}, {n['seq_len']} tokens): "
              f"{n['peak_allocated_mib']:,.1f} MiB allocated"
              + (f", {n['peak_reserved_mib']:,.1f} MiB reserved" if n["peak_reserved_mib"] else ""))
    return 0


COMMANDS = [Command("estimate", "every VRAM estimator's figure for one configuration, beside the ledger's nearest row",
                    add_estimate_options, cmd_estimate)]

"""What an answering command is asked about, read the same way by ``estimate``, ``ceiling``,
``predict`` and ``fit``: the card (``--gpu``, ``--gpu-mib``, ``--budget-mib``), the model (its
config found, a mixture of experts refused), the typed recipe, and the predictor with the dry-run
rows it may use."""

from __future__ import annotations

import argparse
from typing import Optional

from ledger.core.errors import Issue, UserError
from ledger.intake.ingest import fixes_option
from ledger.vocab.model_configs import max_length, model_name
from ledger.vocab.recipe import fixes_key
from ledger.core.paths import shown

BUDGET_HELP = ("peak allocated (what the predictor predicts, not reserved) may reach this many MiB: the answer is "
               "judged against it instead of a card's effective limit, with no CUDA context or allocator overhead "
               "taken off; for a card not in `vram cards` prefer --gpu-mib")


def add_card_option(p: argparse.ArgumentParser, required: bool = True, budget: bool = False) -> None:
    """--gpu NAME or --gpu-mib TOTAL (and --budget-mib where a bare budget can be judged). ``required``:
    one of them must be given (checked by ``card_from``, which names all of them)."""
    p.add_argument("--gpu", help="the card: a ledger key, alias or name, or a common card from the card table "
                                 "(e.g. 'RTX 4090', a100-40gb; see `vram cards`)"
                                 + ("" if required else "; this project's verdict is for it"))
    p.add_argument("--gpu-mib", type=float, metavar="TOTAL",
                   help="a card the table does not list, by its total memory as nvidia-smi shows it (MiB): its usable "
                        "memory and effective limit are derived as for the table's cards (`vram cards` says how)")
    if budget:
        p.add_argument("--budget-mib", type=float, help=BUDGET_HELP)


def card_from(args: argparse.Namespace, ledger, required: bool = True) -> tuple[Optional[str], object]:
    """(key, entry) of the card a command is asked about: --gpu (the ledger or the card table) or
    --gpu-mib (a card of that total); with neither, (``BUDGET_CARD``, None) when --budget-mib is
    given, else a one-line error when ``required``, else (None, None)."""
    from ledger.vocab.cards import card_of_total, require_card
    from ledger.core.models import MAX_MIB

    total = getattr(args, "gpu_mib", None)
    budget = getattr(args, "budget_mib", None)
    if budget is not None and not 0 < budget <= MAX_MIB:
        raise UserError(Issue("--budget-mib", "", f"must be in (0, {MAX_MIB:.0f}] MiB, got {budget:g}"))
    if args.gpu and total is not None:
        raise UserError(Issue("--gpu-mib", "", "give --gpu NAME or --gpu-mib TOTAL, not both"))
    if total is not None:
        if not 0 < total <= MAX_MIB:
            raise UserError(Issue("--gpu-mib", "", f"must be in (0, {MAX_MIB:.0f}] MiB, got {total:g}"))
        return card_of_total(total)
    if args.gpu:
        key, entry, _ = require_card(ledger, args.gpu)
        return key, entry
    if budget is not None:
        return BUDGET_CARD, None
    if required:
        raise UserError(Issue("--gpu", "", "which card? give --gpu NAME (see `vram cards`), --gpu-mib TOTAL (a card "
                              "not listed: the total nvidia-smi shows)" + (" or --budget-mib MIB" if hasattr(
                                  args, "budget_mib") else "")))
    return None, None


#: The card key of an answer judged against --budget-mib alone (no card named).
BUDGET_CARD = "budget"


def predictor_for(args: argparse.Namespace, ledger, as_of=None, exclude=()):
    from ledger.answer.predictor import Predictor

    return Predictor(ledger, dry_rows(args), as_of=as_of, exclude=exclude)


def dry_rows(args: argparse.Namespace) -> list:
    """The dry-run rows a command answers from: --dry-runs, then those computed into --cache."""
    from ledger.storage.dry_runs import load_dry_runs

    from .compute import fresh_rows

    cache = getattr(args, "cache", None)
    return fresh_rows(load_dry_runs(getattr(args, "dry_runs", None), cache=cache), getattr(args, "model", None), cache)


def add_dry_runs_option(p: argparse.ArgumentParser) -> None:
    from ledger.storage.dry_runs import user_cache_dir
    from ledger.core.paths import DRY_RUNS

    p.add_argument("--dry-runs", default=shown(DRY_RUNS),
                   help="dry-run rows the predictor may use (default: %(default)s)")
    p.add_argument("--cache", default=str(user_cache_dir()), metavar="DIR",
                   help="where dry runs computed by `vram fit --compute` are kept and read from, beside --dry-runs "
                        "(default: %(default)s; VRAM_LEDGER_CACHE sets it)")


def require_model(model: Optional[str], ledger=None) -> None:
    """A model the command can answer for, or a one-line error: its config must be found (a path
    or folder, a shipped name, a Hub id in the local Hugging Face cache) unless the ledger measured
    it; a mixture of experts the project does not model (dense layers among the sparse ones, a
    shared expert) is refused with the reason, not mis-modelled."""
    from ledger.vocab.model_configs import config_path, model_name, moe_experts, moe_unsupported, where_looked

    if not model:
        return
    if config_path(model) is None:
        if ledger is not None and any(model_name(m.model) == model_name(model) for m in ledger.measurements):
            return
        raise UserError(Issue("--model", "", where_looked(model)))
    why = moe_unsupported(model) if moe_experts(model) else None
    if why:
        raise UserError(Issue("--model", "", f"{model} is a mixture-of-experts config the project does not model: {why}; "
                              "answered are those whose every decoder layer is sparse with fused expert weights "
                              "(Qwen3-MoE, Mixtral, gpt-oss), so no answer rather than a wrong one"))


def recipe_from(args: argparse.Namespace, rank: Optional[int] = 16):
    """The typed recipe a command is asked about (``--method full``: ``full_recipe_of_args``), or a
    one-line error naming the flag."""
    from ledger.vocab.recipe import Recipe

    if args.seq_len is not None and args.seq_len <= 0:
        raise UserError(Issue("--seq-len", "", f"must be > 0, got {args.seq_len}"))
    if getattr(args, "batch_size", 1) is not None and getattr(args, "batch_size", 1) <= 0:
        raise UserError(Issue("--batch-size", "", f"must be > 0, got {args.batch_size}"))
    longest = max_length(args.model) if getattr(args, "model", None) else None
    if args.seq_len is not None and longest and args.seq_len > longest:
        raise UserError(Issue("--seq-len", "", f"{args.seq_len} tokens is past {model_name(args.model)}'s context "
                              f"(max_position_embeddings {longest}): the model cannot take it"))
    if getattr(args, "response_len", None) is not None and (args.response_len <= 0 or (
            args.seq_len and args.response_len >= args.seq_len)):
        raise UserError(Issue("--response-len", "", "must be in [1, --seq-len)"))
    if getattr(args, "method", "lora") == "full":
        return full_recipe_of_args(args)
    if args.quant is None:
        args.quant = "4bit"
    if args.quant == "fp32":
        raise UserError(Issue("--quant", "", "fp32 master weights are a full fine-tuning precision (--method full); "
                              "LoRA's base weights are 4bit or bf16"))
    if rank is None:
        raise UserError(Issue("--rank", "", "LoRA needs a rank (--method lora, the default); full fine-tuning "
                              "(--method full) has none"))
    if not 0 <= (args.dropout or 0) < 1:
        raise UserError(Issue("--dropout", "", f"must be in [0, 1), got {args.dropout}"))
    from ledger.vocab.adapter import experts_refuse

    why = experts_refuse(args.model, targets_of(args), (args.dropout or 0) > 0, bool(args.dora))
    if why:
        raise UserError(Issue("--dropout" if (args.dropout or 0) > 0 else "--dora", "", why))
    fixes = fixes_key(fixes_option(args.fixes))
    return Recipe(model=args.model, rank=rank, quant=args.quant, dropout=(args.dropout or 0) > 0, dora=args.dora,
                  seq_len=args.seq_len, fixes=fixes, response_len=getattr(args, "response_len", None),
                  optimizer=optimizer_of(args, fixes), batch=getattr(args, "batch_size", 1) or 1,
                  checkpointing=not getattr(args, "no_gradient_checkpointing", False), targets=targets_of(args),
                  dropout_rate=args.dropout, alpha=getattr(args, "alpha", None), rslora=bool(getattr(args, "rslora", False)))


#: The LoRA flags a full fine-tune refuses, with how each reads "given".
LORA_FLAGS = (("--rank", lambda a: getattr(a, "rank", None) is not None),
              ("--alpha", lambda a: getattr(a, "alpha", None) is not None),
              ("--rslora", lambda a: bool(getattr(a, "rslora", False))),
              ("--dropout", lambda a: bool(getattr(a, "dropout", 0))),
              ("--dora", lambda a: bool(getattr(a, "dora", False))),
              ("--target-modules", lambda a: (getattr(a, "target_modules", None) or "all-linear") != "all-linear"))


def full_recipe_of_args(args: argparse.Namespace):
    """A full fine-tuning recipe (``--method full``): weights bf16 (the default) or fp32 master
    weights; a LoRA flag or 4-bit weights are one-line errors, as the probe kit's are."""
    from ledger.vocab.recipe import full_recipe

    if args.quant is None:
        args.quant = "bf16"
    if args.quant == "4bit":
        raise UserError(Issue("--quant", "", "--method full with --quant 4bit: 4-bit weights cannot be trained (QLoRA "
                              "is LoRA on 4-bit weights: --method lora); full fine-tuning runs in --quant bf16 or fp32"))
    given = next((flag for flag, on in LORA_FLAGS if on(args)), None)
    if given:
        raise UserError(Issue(given, "", "a LoRA setting: --method full trains every weight, with no adapter"))
    fixes = fixes_key(fixes_option(args.fixes))
    optimizer = getattr(args, "optim", None)
    from ledger.vocab.optimizers import STOCK_OPTIMIZER

    return full_recipe(model=args.model, quant=args.quant, seq_len=args.seq_len, fixes=fixes,
                       response_len=getattr(args, "response_len", None),
                       optimizer=(optimizer or STOCK_OPTIMIZER) if hasattr(args, "optim") else None,
                       batch=getattr(args, "batch_size", 1) or 1,
                       checkpointing=not getattr(args, "no_gradient_checkpointing", False))


def targets_of(args: argparse.Namespace) -> tuple:
    """--target-modules as the projections it names, or a one-line error."""
    from ledger.vocab.adapter import parse_targets

    try:
        return parse_targets(getattr(args, "target_modules", None) or "all-linear")
    except ValueError as exc:
        raise UserError(Issue("--target-modules", "", str(exc))) from None


def optimizer_of(args: argparse.Namespace, fixes: str):
    """--optim; unset: a stock recipe (any fixes but the program's full set) steps STOCK_OPTIMIZER,
    whose state a real run adds, and the program's preset (--fixes all) counts none beyond what its
    measured runs hold."""
    from ledger.vocab.optimizers import optimizer_for

    if not hasattr(args, "optim"):
        return None
    return optimizer_for(fixes, args.optim)

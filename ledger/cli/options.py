"""Option groups shared by the commands (each defined once), the command record, and output."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from ledger.core.errors import Issue, UserError
from ledger.core.paths import DEFAULT_LEDGER, shown

#: Base weights a recipe option accepts: the same choices as ``python -m probe_kit.probe_vram``.
QUANTS = ("4bit", "bf16", "fp32")
#: Fine-tuning methods: the same choices as ``python -m probe_kit.probe_vram --method``.
METHODS = ("lora", "full")


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one line of help, its options, and what it runs (whose
    docstring is the long help)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_ledger_option(p: argparse.ArgumentParser, help: str = "ledger file") -> None:
    p.add_argument("--ledger", default=shown(DEFAULT_LEDGER), help=f"{help} (default: %(default)s)")


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document")


def add_recipe_options(p: argparse.ArgumentParser, *, required: tuple[str, ...] = (), defaults: bool = True,
                       skip: tuple[str, ...] = ()) -> None:
    """The recipe flags, with the names and choices of ``python -m probe_kit.probe_vram``: --model,
    --rank, --alpha, --rslora, --dropout, --dora, --quant, --seq-len, --response-len, --fixes.
    ``defaults=False`` leaves every unset flag None (a real run is described only by what the
    user says)."""
    d = (lambda value: value) if defaults else (lambda value: None)
    options = {
        "model": dict(help="model id, or a config JSON (a path, or a shipped name such as gemma-3-4b-it)"),
        "rank": dict(type=int, help="LoRA rank"),
        "alpha": dict(type=float, help="lora_alpha (default: the rank)"),
        "rslora": dict(action="store_true", help="rank-stabilised LoRA scaling"),
        "dropout": dict(type=float, default=d(0.0), help="lora_dropout (any value > 0 stores masks)"),
        "dora": dict(action="store_true", help="DoRA (weight-decomposed LoRA)"),
        "quant": dict(choices=QUANTS, default=None,
                      help="base weights: 4bit = bitsandbytes nf4, bf16 = plain, fp32 = fp32 master weights under bf16 "
                           "autocast (full fine-tuning only)" + (" (default 4bit; bf16 with --method full)"
                                                                 if defaults else "")),
        "seq-len": dict(type=int, help="tokens in the longest example"),
        "response-len": dict(type=int, help="tokens the loss is computed on"),
        "fixes": dict(default=d("none"), help="memory fixes: none (stock transformers + peft + Trainer, the default), all "
                                              "(the program's preset: chunked MLP, activation offload, bf16 lm_head, "
                                              "logits_to_keep) or a comma list of chunked_mlp, save_on_cpu, "
                                              "bf16_lm_head, logits_to_keep, fused_linear_ce (Liger's fused linear "
                                              "cross-entropy), activation_offloading (TRL's)" if defaults else
                      "memory fixes: all, none or a comma list of chunked_mlp, save_on_cpu, bf16_lm_head, "
                      "logits_to_keep, fused_linear_ce, activation_offloading"),
    }
    for name, kw in options.items():
        if name in skip:
            continue
        if name in required:
            kw = {**kw, "required": True}
        p.add_argument(f"--{name}", **kw)


def add_method_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, default="lora",
                   help="lora (an adapter; QLoRA is LoRA with --quant 4bit; the default) or full (full fine-tuning: "
                        "every weight trained, no adapter, --quant bf16 or fp32; answered by dry runs of it alone)")


def add_optimizer_option(p: argparse.ArgumentParser, table: bool = False) -> None:
    from ledger.vocab.optimizers import OPTIMIZERS

    p.add_argument("--optim", choices=OPTIMIZERS, metavar="NAME",
                   help="the optimizer a " + ("" if table else "real ") + "run steps, by its TrainingArguments name ("
                        + ", ".join(OPTIMIZERS) + "): its state for the adapter's trainable parameters is added to the "
                        + ("training run each cell judges" if table else "real-run figure")
                        + " (default: adamw_torch for a stock recipe; none beyond what the measured runs hold for "
                          "the program's preset, --fixes all)")


def add_run_option(p: argparse.ArgumentParser) -> None:
    """What is judged: a training run (the default) or, with --probe, one probe step."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--real", dest="real", action="store_true", default=True,
                   help="a training run: the step with the optimizer's state (stock: adamw_torch unless --optim; the "
                        "program's preset: as its measured runs). The default")
    g.add_argument("--probe", dest="real", action="store_false",
                   help="instead, a one-step probe: one forward and backward with no optimizer step, what the probe "
                        "kit measures (less than a training run needs)")


def add_batch_option(p: argparse.ArgumentParser) -> None:
    """--batch-size, --target-modules and --no-gradient-checkpointing: how the step is run."""
    p.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="micro-batch: N sequences, each padded to --seq-len (the worst batch; gradient accumulation "
                        "does not change the peak; default 1)")
    p.add_argument("--target-modules", default="all-linear", metavar="TARGETS",
                   help="the projections LoRA targets: all-linear (the 7 attention and MLP projections, the default), "
                        "attn (q,k,v,o) or a comma list; fewer than 7 are answered by all 7, an upper bound")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="a run without gradient checkpointing (answered by dry runs of it alone, computed when "
                        "missing unless --no-compute: every measured row has checkpointing on)")


def parse_date(text: Optional[str], flag: str) -> Optional[dt.date]:
    if text is None:
        return None
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise UserError(Issue(flag, "", f"must be a date as YYYY-MM-DD, got {text!r}")) from None


def dump_json(doc: object) -> None:
    """Print one JSON document on stdout (for --json)."""
    json.dump(doc, sys.stdout, indent=2, ensure_ascii=False, sort_keys=False)
    sys.stdout.write("\n")

"""``python -m probe_kit.preflight``: preflight for a script that is not a Trainer: the probe kit's
recipe model, a Trainer over a tokenised .jsonl or .parquet file, and its worst batch."""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ledger.vocab.optimizers import STOCK_OPTIMIZER

from . import DEFAULT_MAX_SCAN, PreflightResult, preflight
from .data import read_examples, tokenize


# -- command line ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from ..probe_vram import add_recipe_options

    p = argparse.ArgumentParser(
        prog="python -m probe_kit.preflight",
        description="Before training: the recipe's steady-state step (forward, backward, optimizer) on the "
                    "dataset's worst batch, with a verdict against the card.")
    add_recipe_options(p)
    for action in p._actions:  # the data decides the lengths; a stock run has none of the program's fixes
        if action.dest in ("seq_len", "response_len", "logits_to_keep"):
            action.help = argparse.SUPPRESS
        elif action.dest == "fixes":
            action.default = "none"
            action.help = ("memory fixes: none (stock, the default), all, or a comma list of chunked_mlp, save_on_cpu, "
                           "bf16_lm_head, logits_to_keep")
        elif action.dest == "batch_size":
            action.help = "per-device micro-batch (default 1)"
        elif action.dest == "optim":
            action.help = f"the optimizer, by its TrainingArguments name (default {STOCK_OPTIMIZER}, as a stock Trainer)"
    p.add_argument("--data", required=True, help="a .jsonl or .parquet file with a 'text' or 'messages' column")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the model's folder)")
    p.add_argument("--max-length", type=int, help="truncate examples to this many tokens, as the run does")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu", help="the card (a name `vram cards` lists): the ledger's answer, and the limit on the CPU")
    p.add_argument("--budget-mib", type=float, help="judge against this many MiB (on the CPU: a simulated OOM above it)")
    p.add_argument("--max-scan", type=int, default=DEFAULT_MAX_SCAN, help="examples scanned for lengths (default %(default)s)")
    p.add_argument("--ledger", help="append the measurement to this ledger")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    return p


def _tokenizer_for(args):
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..recipe import RecipeError

    where = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    if where is None:
        raise RecipeError(f"{args.model}: no tokenizer to read the data with: pass --tokenizer DIR "
                          "(a folder with tokenizer.json, as the model's repository has it)")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{where}: cannot load a tokenizer: {str(exc).splitlines()[0]}") from None


def run(args: argparse.Namespace, json_out=None) -> PreflightResult:
    """The command: the probe kit's recipe model, a Trainer over the tokenised file, preflight
    (with --json, the result printed on ``json_out``, default stdout)."""
    import json
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ..probe_vram import config_from_args
    from ..recipe import RecipeError, build_model, prepare

    if args.batch_size <= 0 or args.grad_accum <= 0:
        raise RecipeError("--batch-size and --grad-accum must be > 0")
    optim = args.optim or STOCK_OPTIMIZER
    args.optim = None  # the Trainer steps it; the probe config only builds the model and adapter
    cfg = config_from_args(args)
    unsupported = [f for f in cfg.fixes if f in ("save_on_cpu", "logits_to_keep")]
    if unsupported:
        raise RecipeError(f"--fixes {unsupported[0]}: the probe applies it inside its own step, which a Trainer "
                          "does not run (chunked_mlp and bf16_lm_head are model changes and work here)")
    device = torch.device(args.device)
    tokenizer = _tokenizer_for(args)
    rows = tokenize(read_examples(args.data, None), tokenizer, args.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    torch.manual_seed(cfg.seed)
    model = prepare(build_model(cfg, device), cfg)

    def collate(examples):
        n = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), n), pad, dtype=torch.long)
        mask = torch.zeros((len(examples), n), dtype=torch.long)
        for i, e in enumerate(examples):
            ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[i, :len(e["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size,
                                  gradient_accumulation_steps=args.grad_accum, optim=optim, report_to=[],
                                  gradient_checkpointing=False, use_cpu=device.type == "cpu",
                                  # fp32 master weights train under bf16 autocast, as the Trainer's bf16=True
                                  bf16=cfg.method == "full" and cfg.quant == "fp32",
                                  remove_unused_columns=False, save_strategy="no", logging_strategy="no")
        trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate)
        result = preflight(trainer, gpu=args.gpu, budget_mib=args.budget_mib, max_scan=args.max_scan,
                           ledger=args.ledger, stop=(), stream=sys.stdout if not args.json else sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2), file=json_out or sys.stdout)
    return result


def main(argv=None) -> int:
    from ledger.core.errors import LedgerError, UserError

    from ..recipe import RecipeError

    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    try:
        # With --json, stdout is the JSON alone: whatever a library prints on the way goes to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            result = run(args, stdout)
    except (RecipeError, UserError, LedgerError, ValueError) as exc:
        print(f"preflight: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 3 if result.verdict == "won't fit" else 0


if __name__ == "__main__":
    sys.exit(main())

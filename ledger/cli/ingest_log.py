"""``vram ingest-log``: real-run measurements from training logs, appended to the ledger."""

from __future__ import annotations

import argparse
import sys

from ledger.intake.ingest import RunSpec, ingest, ingest_into
from ledger.answer.predictions import score_predictions
from .options import Command, add_json_option, add_ledger_option, add_recipe_options, dump_json


def add_ingest_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", help="training log files")
    add_ledger_option(p, "ledger to append to")
    p.add_argument("--gpu", help="the card the run trained on (a key of the ledger's gpus, an alias or its name)")
    add_recipe_options(p, defaults=False, skip=("response-len",))
    p.add_argument("--dataset", help="dataset name or date")
    p.add_argument("--examples", type=int, help="training examples")
    p.add_argument("--epochs", type=float, help="epochs")
    p.add_argument("--id", help="measurement id (one log only; default: from the log's name and content)")
    p.add_argument("--replace", action="store_true",
                   help="replace a row this log made before (same id) whose flags were wrong")
    p.add_argument("--dry-run", action="store_true", help="show what would be appended; write nothing")
    add_json_option(p)


def cmd_ingest(args: argparse.Namespace) -> int:
    """Append kind=real measurements read from training logs: the peak (callback line, HF Trainer,
    axolotl, Unsloth, DeepSpeed), or the OOM / crash and the step it happened at. The recipe flags
    describe the run. Source is the log's path and line; measured_on comes from the log's
    timestamps or, failing that, the file's date (flagged inferred). Ingesting a log twice adds
    nothing. A log with nothing to read is an error naming the file; nothing is written."""
    spec = RunSpec(gpu=args.gpu, model=args.model, quant=args.quant, rank=args.rank, alpha=args.alpha,
                   rslora=args.rslora, dropout=args.dropout, dora=args.dora, seq_len=args.seq_len, fixes=args.fixes,
                   dataset=args.dataset, examples=args.examples, epochs=args.epochs)
    if args.dry_run:
        found, report = ingest(args.logs, args.ledger, spec, mid=args.id, replace=args.replace), None
    else:  # one locked read, check and write of the ledger
        found, report = ingest_into(args.logs, args.ledger, spec, mid=args.id, replace=args.replace,
                                    then=score_predictions)
    new, already = found.new + found.replaced, found.already
    if report is not None:
        for pid in report.scored:
            print(f"scored prediction {pid}", file=sys.stderr)
        for line in report.unscorable:
            print(f"note: {line}", file=sys.stderr)
    if args.json:
        key = "would_append" if args.dry_run else "appended"
        dump_json({key: [m.model_dump(mode="json", exclude_none=True) for m in found.new],
                   "replaced" if not args.dry_run else "would_replace":
                       [m.model_dump(mode="json", exclude_none=True) for m in found.replaced],
                   "already_in_ledger": already})
    else:
        replaced = {m.id for m in found.replaced}
        for m in new:
            verb = ("would replace" if args.dry_run else "replaced") if m.id in replaced else (
                "would append" if args.dry_run else "appended")
            o = m.outcome
            figure = (f"peak allocated {o.peak_allocated_mib} MiB" if o.peak_allocated_mib is not None else
                      f"peak reserved {o.peak_reserved_mib} MiB" if o.peak_reserved_mib is not None else
                      f"peak delta {o.peak_delta_mib} MiB" if o.peak_delta_mib is not None else "")
            print(f"{verb} {m.id}: {o.status}" + (f", {figure}" if figure else "")
                  + (f", at step {o.failed_at_step}" if o.failed_at_step is not None else ""))
        for mid in already:
            print(f"{mid}: already in the ledger")
    return 0


COMMANDS = [Command("ingest-log", "append real-run peaks, OOMs and crashes read from training logs",
                    add_ingest_options, cmd_ingest)]

"""``vram calibrate``, ``vram ceiling`` and ``vram predict``: thin commands over ledger.calibration
and ledger.predictions."""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict

from .. import store
from ..calibration import calibrate, ceiling
from ..errors import Issue, UserError
from ..ingest import fixes_option
from ..predictions import make_prediction, score_predictions
from ..recipe import fixes_key, require_gpu
from ..results import Calibration
from .options import Command, add_json_option, add_ledger_option, add_recipe_options, dump_json, parse_date


# -- calibrate --------------------------------------------------------------------------------


def add_calibrate_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    p.add_argument("--as-of", help="use only rows measured on or before this date (YYYY-MM-DD)")
    p.add_argument("--exclude", action="append", default=[], metavar="ID", help="leave this row out (repeatable)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out scores")
    add_json_option(p)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the ledger: probe/real pairs and anchors, the probe's over-estimate (median of the
    anchors, interval from every pair), marginal costs (rank, dropout, DoRA, sequence length,
    real-run rank cost) with the rows each rests on, each card's effective limit, and
    leave-one-out scores (fit/no-fit verdicts of probes; real-run peak errors)."""
    ledger = store.load(args.ledger)
    result = calibrate(ledger, as_of=parse_date(args.as_of, "--as-of"), exclude=args.exclude, with_loo=not args.no_loo)
    if args.json:
        dump_json(Calibration.model_validate(result).document())
        return 0
    o = result["overestimate_pct"]
    print(f"over-estimate of the probe: {o['median']}% (pairs {o['low']}–{o['high']}%)")
    for a in result["anchors"]:
        print(f"  anchor {a['probe']} {a['probe_mib']} MiB vs {a['real_mib']} MiB real ({', '.join(a['reals'])}): "
              f"{a['overestimate_pct']}%")
    c = result["costs"]
    print(f"dropout > 0 costs {c['dropout']['median_mib']} MiB (range {c['dropout']['min_mib']}–"
          f"{c['dropout']['max_mib']}, {len(c['dropout']['pairs'])} pairs); DoRA {c['dora']['median_mib']} MiB")
    for r in c["rank"]:
        print(f"  {r['gpu']} {r['quant']} seq {r['seq_len']}{' dropout' if r['dropout'] else ''}"
              f"{' DoRA' if r['dora'] else ''} fixes {r['fixes']}: {r['mib_per_rank']} MiB per rank")
    for lim in result["limits"]:
        print(f"limit {lim['gpu']} ({lim['kind']}s): {lim['low_mib']}–{lim['high_mib']} MiB allocated")
    loo = result["loo"]
    if loo:
        print(f"leave-one-out: verdicts {loo['verdict_correct']}/{loo['verdict_total']} correct "
              f"({loo['verdict_unaddressed']} probes unaddressable); real runs median |error| "
              f"{loo['real_median_abs_err_pct']}% over {loo['real_n']}")
    return 0


# -- ceiling ---------------------------------------------------------------------------------


def add_ceiling_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    p.add_argument("--gpu", required=True, help="the card (key, alias or name)")
    add_recipe_options(p, required=("seq-len",), skip=("rank", "alpha", "rslora", "response-len"))
    p.add_argument("--budget-mib", type=float, help="use this limit instead of the card's")
    p.add_argument("--real", action="store_true", help="for a real run (calibrated), not a probe")
    p.add_argument("--step", type=int, default=8, help="rank step (default 8)")
    p.add_argument("--max-rank", type=int, default=512, help="largest rank searched (default 512)")
    p.add_argument("--margin-mib", type=float, default=0.0, help="stay this far under the limit (default 0)")
    add_json_option(p)


def cmd_ceiling(args: argparse.Namespace) -> int:
    """The largest LoRA rank (a multiple of --step) whose predicted peak fits the card: at most the
    largest peak known to fit there, minus --margin-mib. Observed probes of the same configuration
    override predictions; a configuration with no data near it answers unknown."""
    if args.step <= 0 or args.max_rank < args.step:
        raise UserError(Issue("--step", "", "needs 0 < --step <= --max-rank"))
    ledger = store.load(args.ledger)
    gpu = require_gpu(ledger, args.gpu)
    fixes = fixes_key(fixes_option(args.fixes))
    c = ceiling(ledger, ledger.measurements, gpu=gpu, seq_len=args.seq_len, model=args.model, quant=args.quant,
                dropout=args.dropout > 0, dora=args.dora, fixes=fixes, budget_mib=args.budget_mib, real=args.real,
                step=args.step, max_rank=args.max_rank, margin_mib=args.margin_mib)
    doc = {"rank": c.rank, "gpu": gpu, **{k: v for k, v in asdict(c).items() if k != "rank"}}
    if args.json:
        dump_json(doc)
        return 0
    what = "a real run" if args.real else "a probe"
    if c.status == "unknown":
        print(f"unknown: {c.note}")
    elif c.rank is None:
        print(f"no rank fits {what} on {gpu} at {args.seq_len} tokens" + (f" ({c.note})" if c.note else ""))
    else:
        lim = c.limit or {}
        print(f"rank {c.rank} fits {what} on {gpu} at {args.seq_len} tokens (limit {lim.get('low_mib')}–"
              f"{lim.get('high_mib')} MiB, margin {c.margin_mib} MiB)"
              + (f"; up to {c.possible_rank} may fit" if c.possible_rank and c.possible_rank != c.rank else "")
              + (f"; {c.note}" if c.note else ""))
    return 0


# -- predict -----------------------------------------------------------------------------------


def add_predict_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    p.add_argument("--gpu", required=True, help="the card")
    add_recipe_options(p, required=("rank",), skip=("response-len",))
    p.add_argument("--probe", help="predict from this probe's peak (default: the latest matching probe, "
                                   "else the peak model)")
    p.add_argument("--id", help="prediction id (default: from the configuration and date)")
    p.add_argument("--date", help="the date the prediction is made (default: today)")
    p.add_argument("--dry-run", action="store_true", help="print it; do not store it")
    add_json_option(p)


def cmd_predict(args: argparse.Namespace) -> int:
    """Record a prospective prediction of a real run's peak in the ledger's predictions (config,
    predicted peak and interval, calibration hash, date). When a matching real run is ingested
    later, the prediction is scored and stays in the ledger."""
    ledger = store.load(args.ledger)
    gpu = require_gpu(ledger, args.gpu)
    made_on = parse_date(args.date, "--date") or dt.date.today()
    pred, probe_mib, basis = make_prediction(
        ledger, gpu=gpu, rank=args.rank, made_on=made_on, quant=args.quant, model=args.model, alpha=args.alpha,
        rslora=args.rslora, dropout=args.dropout, dora=args.dora, seq_len=args.seq_len,
        fixes=fixes_option(args.fixes), probe_id=args.probe, pid=args.id)
    if not args.dry_run:
        def change(lg):
            if any(p.id == pred.id for p in lg.predictions):
                raise UserError(Issue(args.ledger, "predictions", f"a prediction {pred.id!r} exists already "
                                      "(give --id)"))
            lg.predictions.append(pred)
            score_predictions(lg)

        store.update(args.ledger, change)
    if args.json:
        dump_json(pred.model_dump(mode="json", exclude_none=True))
    else:
        print(f"{pred.id}: predicted real peak {pred.predicted_peak_mib} MiB ({pred.interval_low_mib}–"
              f"{pred.interval_high_mib}) from {probe_mib} MiB ({', '.join(basis)})"
              + (" [not stored: --dry-run]" if args.dry_run else ""))
        print(pred.provenance.notes[-1])
    return 0


COMMANDS = [
    Command("calibrate", "fit probe-vs-real over-estimate, marginal costs, card limits, leave-one-out",
            add_calibrate_options, cmd_calibrate),
    Command("ceiling", "the largest LoRA rank that fits a card at a sequence length", add_ceiling_options,
            cmd_ceiling),
    Command("predict", "record a prospective prediction of a real run's peak", add_predict_options, cmd_predict),
]

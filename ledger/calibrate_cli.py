"""``vram calibrate``, ``vram ceiling`` and ``vram predict``: thin commands over ledger.calibration."""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict

from . import store
from .calibration import (PeakModel, before, calibrate, calibration_hash, ceiling, ok_peak, overestimate,
                          predict_real)
from .cli import dump_json, register
from .errors import Issue, UserError
from .ingest import fixes_option
from .recipe import GroupKey, RecipeKey, fixes_key, recipe_key, require_gpu
from .models import Lora, Prediction, Provenance
from .paths import DEFAULT_LEDGER, shown
from .predictions import score_predictions


def _date(text: str | None, flag: str) -> dt.date | None:
    if text is None:
        return None
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise UserError(Issue(flag, "", f"must be a date as YYYY-MM-DD, got {text!r}")) from None


def _ledger_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", default=shown(DEFAULT_LEDGER), help="ledger file (default: %(default)s)")


# -- calibrate --------------------------------------------------------------------------------


def add_calibrate_options(p: argparse.ArgumentParser) -> None:
    _ledger_option(p)
    p.add_argument("--as-of", help="use only rows measured on or before this date (YYYY-MM-DD)")
    p.add_argument("--exclude", action="append", default=[], metavar="ID", help="leave this row out (repeatable)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out scores")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the ledger: probe/real pairs and anchors, the probe's over-estimate (median of the
    anchors, interval from every pair), marginal costs (rank, dropout, DoRA, sequence length,
    real-run rank cost) with the rows each rests on, each card's effective limit, and
    leave-one-out scores (fit/no-fit verdicts of probes; real-run peak errors)."""
    ledger = store.load(args.ledger)
    result = calibrate(ledger, as_of=_date(args.as_of, "--as-of"), exclude=args.exclude, with_loo=not args.no_loo)
    if args.json:
        dump_json(result)
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
    _ledger_option(p)
    p.add_argument("--gpu", required=True, help="the card (key, alias or name)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens in the longest example")
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout (any value > 0 costs the same)")
    p.add_argument("--dora", action="store_true", help="DoRA")
    p.add_argument("--quant", default="4bit", choices=["4bit", "bf16"], help="base weights (default 4bit)")
    p.add_argument("--fixes", default="all", help="memory fixes (default all)")
    p.add_argument("--model", help="model (default: the card's only model in the ledger)")
    p.add_argument("--budget-mib", type=float, help="use this limit instead of the card's")
    p.add_argument("--real", action="store_true", help="for a real run (calibrated), not a probe")
    p.add_argument("--step", type=int, default=8, help="rank step (default 8)")
    p.add_argument("--max-rank", type=int, default=512, help="largest rank searched (default 512)")
    p.add_argument("--margin-mib", type=float, default=0.0, help="stay this far under the limit (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


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
    _ledger_option(p)
    p.add_argument("--gpu", required=True, help="the card")
    p.add_argument("--rank", type=int, required=True, help="LoRA rank")
    p.add_argument("--alpha", type=float, help="lora_alpha")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised LoRA")
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout")
    p.add_argument("--dora", action="store_true", help="DoRA")
    p.add_argument("--quant", default="4bit", choices=["4bit", "bf16"], help="base weights (default 4bit)")
    p.add_argument("--seq-len", type=int, help="tokens in the longest example")
    p.add_argument("--fixes", default="all", help="memory fixes (default all)")
    p.add_argument("--model", help="model id")
    p.add_argument("--probe", help="predict from this probe's peak (default: the latest matching probe, "
                                   "else the peak model)")
    p.add_argument("--id", help="prediction id (default: from the configuration and date)")
    p.add_argument("--date", help="the date the prediction is made (default: today)")
    p.add_argument("--dry-run", action="store_true", help="print it; do not store it")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_predict(args: argparse.Namespace) -> int:
    """Record a prospective prediction of a real run's peak in the ledger's predictions (config,
    predicted peak and interval, calibration hash, date). When a matching real run is ingested
    later, the prediction is scored and stays in the ledger."""
    ledger = store.load(args.ledger)
    gpu = require_gpu(ledger, args.gpu)
    made_on = _date(args.date, "--date") or dt.date.today()
    ms = before(ledger.measurements, made_on)
    fixes = fixes_option(args.fixes)
    fixes_text = fixes_key(fixes)
    lora = Lora(rank=args.rank, alpha=args.alpha, rslora=args.rslora or None, dropout=args.dropout,
                dora=args.dora or None)
    if args.probe:
        probe = next((m for m in ms if m.id == args.probe), None)
        if probe is None or ok_peak(probe) is None:
            raise UserError(Issue("--probe", "", f"no ok probe {args.probe!r} in the ledger"))
        probe_mib, basis = ok_peak(probe), [probe.id]
    else:
        want = RecipeKey(gpu, None, args.quant, args.rank, args.dropout > 0, args.dora, fixes_text)
        same = [m for m in ms if m.kind == "probe" and m.lora and ok_peak(m) is not None
                and (args.seq_len is None or m.seq_len == args.seq_len)
                and recipe_key(m).without_model() == want
                and (args.model is None or m.model == args.model)]
        if same:
            probe = max(same, key=lambda m: (m.provenance.measured_on or dt.date.min, m.id))
            probe_mib, basis = ok_peak(probe), [probe.id]
        else:
            if args.seq_len is None:
                raise UserError(Issue("--seq-len", "", "no matching probe: give --seq-len (or --probe)"))
            models = sorted({m.model for m in ms if m.kind == "probe" and m.gpu == gpu and m.model})
            model = args.model or (models[0] if len(models) == 1 else None)
            probe_mib, basis = PeakModel(ms).predict(gpu, GroupKey(model, args.quant, args.seq_len, args.dropout > 0,
                                                                    args.dora, fixes_text), args.rank)
            if probe_mib is None:
                raise UserError(Issue("predict", "", "unknown: no probes near this configuration in the ledger"))
    over = overestimate(ms)
    if over.pct is None:
        raise UserError(Issue("predict", "", "no probe/real pairs in the ledger to calibrate the probe against"))
    pr = predict_real(probe_mib, over)
    pid = args.id or f"pred-{gpu}-r{args.rank}{'-drop' if args.dropout else ''}{'-dora' if args.dora else ''}" \
                     f"-{made_on.isoformat()}"
    pred = Prediction(
        id=pid, gpu=gpu, model=args.model, quant=args.quant, lora=lora, seq_len=args.seq_len, memory_fixes=fixes,
        made_on=made_on, predicted_peak_mib=pr["predicted_mib"], interval_low_mib=pr["low_mib"],
        interval_high_mib=pr["high_mib"], basis=list(basis),
        method=(f"probe peak {probe_mib} MiB x (1 - {over.pct}%): the median over-estimate of the anchors "
                f"({', '.join(a.probe for a in over.anchors)}); interval from every pair ({over.low_pct}–"
                f"{over.high_pct}%)"),
        calibration_hash=calibration_hash(ms),
        provenance=Provenance(source="vram predict", measured_on=made_on),
    )
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
    return 0


register("calibrate", "fit probe-vs-real over-estimate, marginal costs, card limits, leave-one-out",
         add_calibrate_options)(cmd_calibrate)
register("ceiling", "the largest LoRA rank that fits a card at a sequence length", add_ceiling_options)(cmd_ceiling)
register("predict", "record a prospective prediction of a real run's peak", add_predict_options)(cmd_predict)

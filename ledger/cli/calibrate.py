"""``vram calibrate``, ``vram predict`` and ``vram cards``: thin commands over ledger.fit.calibration,
ledger.answer.predictions and the card table."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

from ledger.storage import store
from ledger.report.calibration_report import calibrate
from ledger.core.errors import Issue, UserError
from ledger.intake.ingest import fixes_option
from ledger.answer.predictions import make_prediction, score_predictions
from ledger.vocab.recipe import capacity_mib
from ledger.core.results import Calibration
from .question import (add_card_option, add_dry_runs_option, card_from, dry_rows, predictor_for, recipe_from,
                       require_model)
from .options import (Command, add_batch_option, add_json_option, add_ledger_option, add_method_option,
                      add_optimizer_option,
                      add_recipe_options, dump_json, parse_date)


# -- calibrate --------------------------------------------------------------------------------


def add_calibrate_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    p.add_argument("--as-of", help="use only rows measured on or before this date (YYYY-MM-DD)")
    p.add_argument("--exclude", action="append", default=[], metavar="ID", help="leave this row out (repeatable)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out scores")
    add_dry_runs_option(p)
    add_json_option(p)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the ledger: probe/real pairs and anchors, the probe's over-estimate (median of the
    anchors, interval from every pair), marginal costs (rank, dropout, DoRA, sequence length,
    real-run rank cost) with the rows each rests on, each card's effective limit, and
    leave-one-out scores (fit/no-fit verdicts of probes; real-run peak errors)."""
    ledger = store.load(args.ledger)
    result = calibrate(ledger, as_of=parse_date(args.as_of, "--as-of"), exclude=args.exclude, with_loo=not args.no_loo,
                       dry_runs=dry_rows(args))
    if args.json:
        dump_json(Calibration.model_validate(result).document())
        return 0
    o = result["overestimate_pct"]
    if o["median"] is None:
        print("over-estimate of the probe's core: unknown (no probe is paired with a real run of its recipe)")
    else:
        print(f"over-estimate of the probe's core: {o['median']}% (pairs {o['low']}–{o['high']}%; core = peak less "
              f"the fp32 logits of the positions it kept" + (f", up to {o['kept_positions_max']}"
                                                             if o.get("kept_positions_max") else "") + ")")
    for a in result["anchors"]:
        core = (f"core {a['core_mib']} MiB after {a['logits_mib']} MiB of logits for {a['kept_positions']} kept "
                f"positions" if a.get("logits_mib") is not None else "kept positions unknown: core = peak")
        print(f"  anchor {a['probe']} {a['probe_mib']} MiB ({core}) vs {a['real_mib']} MiB real "
              f"({', '.join(a['reals'])}): {a['overestimate_pct']}% (on the raw peak {a['raw_overestimate_pct']}%)")
    c = result["costs"]
    print(f"dropout > 0 costs {_cost(c['dropout'])}; DoRA costs {_cost(c['dora'])}")
    for r in c["rank"]:
        print(f"  {r['gpu']} {r['quant']} seq {r['seq_len']}{' dropout' if r['dropout'] else ''}"
              f"{' DoRA' if r['dora'] else ''} fixes {r['fixes']}: {r['mib_per_rank']} MiB per rank")
    for lim in result["limits"]:
        print(f"limit {lim['gpu']} ({lim['kind']}s): {lim['low_mib']}–{lim['high_mib']} MiB allocated")
    loo = result["loo"]
    if loo and loo["real_median_abs_err_pct"] is None and not loo["verdict_total"]:
        print("leave-one-out: nothing to score (no probe with a verdict, no real run with a prediction)")
    elif loo:
        print(f"leave-one-out: {loo['verdict_correct']}/{loo['verdict_total']} decisive verdicts correct, "
              f"{loo['verdict_costly']} 'fits' for a probe that ran out of memory, {loo['verdict_tight']} tight, "
              f"{loo['verdict_unaddressed']} unknown; " + (
                  f"real runs median |error| {loo['real_median_abs_err_pct']}% over {loo['real_n']}"
                  if loo["real_median_abs_err_pct"] is not None else "no real run to score"))
    return 0


def _cost(cost: dict) -> str:
    """'173.7 MiB (range 170.1–175.2, 3 pairs)', or what is missing to measure it."""
    n = len(cost["pairs"])
    if cost["median_mib"] is None:
        return "unknown (no pair of rows that differ in it alone)"
    return f"{cost['median_mib']} MiB (range {cost['min_mib']}–{cost['max_mib']}, {n} pair{'s' if n != 1 else ''})"


# -- predict -----------------------------------------------------------------------------------


def add_predict_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_card_option(p)
    add_recipe_options(p, required=("seq-len",))
    add_method_option(p)
    add_optimizer_option(p)
    add_batch_option(p)
    p.add_argument("--id", help="prediction id (default: from the configuration and date)")
    p.add_argument("--date", help="the date the prediction is made: only rows measured on or before it are used "
                                  "(default: today)")
    p.add_argument("--exclude", action="append", default=[], metavar="ID",
                   help="leave this row out (repeatable): e.g. the run being predicted, to replay a prediction")
    p.add_argument("--allow-over", action="store_true",
                   help="store a prediction whose verdict is \"won't fit\" (refused without it)")
    p.add_argument("--dry-run", action="store_true", help="print it; do not store it")
    add_json_option(p)


def cmd_predict(args: argparse.Namespace) -> int:
    """Record a prospective prediction of a real run's peak in the ledger's predictions: the one
    predictor's answer for a real run (point, interval, method, evidence, verdict) from the rows
    measured on or before --date, with the calibration hash. A prediction the predictor says
    will not fit the card is refused unless --allow-over. A card of the card table that the ledger
    does not hold yet is added with the prediction. Dry-run rows the answer rests on are copied
    into it, so the ledger holds its whole basis. When a matching real run is ingested later, the
    prediction is scored and stays in the ledger."""
    if not os.path.lexists(args.ledger) and not args.model:
        raise UserError(Issue(str(args.ledger), "", "no such ledger: give --model to start one with this prediction "
                              "(as `vram init` would), or --ledger an existing file"))
    ledger = store.load_or_new(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    if not os.path.lexists(args.ledger) and not args.dry_run:
        print(f"{args.ledger}: no ledger there yet: this prediction starts a new one (as `vram init` would)",
              file=sys.stderr)
    made_on = parse_date(args.date, "--date") or dt.date.today()
    if made_on > dt.date.today():
        raise UserError(Issue("--date", "", f"{made_on} is in the future: a prediction is made from what is "
                              "measured by then"))
    if args.method == "lora" and args.rank is not None and args.rank <= 0:
        raise UserError(Issue("--rank", "", f"must be > 0, got {args.rank}"))
    recipe = recipe_from(args, args.rank)
    pred, answer = make_prediction(ledger, predictor_for(args, ledger, as_of=made_on, exclude=args.exclude), gpu=gpu,
                                   recipe=recipe, made_on=made_on, alpha=args.alpha,
                                   rslora=args.rslora, dropout=args.dropout, fixes=fixes_option(args.fixes),
                                   pid=args.id, entry=entry)
    if answer.verdict == "won't fit" and not args.allow_over and not args.dry_run:
        raise UserError(Issue("predict", "", f"won't fit: {answer.why}; not stored (give --allow-over to record it)"))
    if not args.dry_run:
        def change(lg):
            if any(p.id == pred.id for p in lg.predictions):
                raise UserError(Issue(args.ledger, "predictions", f"a prediction {pred.id!r} exists already "
                                      "(give --id)"))
            # A card from the card table joins the ledger with the prediction made for it.
            lg.gpus.setdefault(gpu, entry)
            lg.predictions.append(pred)
            score_predictions(lg)

        store.update(args.ledger, change, create=True)
    if args.json:
        dump_json({"prediction": pred.model_dump(mode="json", exclude_none=True),
                   "answer": answer.model_dump(mode="json")})
    else:
        print(f"for a real run of {recipe.describe()}" + (" (the program's preset)" if recipe.fixes == "all" else
                                                           " (stock)" if recipe.fixes == "none" else ""))
        print(f"{pred.id}: {answer.verdict} on {gpu}: predicted real peak {pred.predicted_peak_mib} MiB allocated "
              f"({pred.interval_low_mib}–{pred.interval_high_mib} MiB) by {answer.method}"
              + (" [not stored: --dry-run]" if args.dry_run else ""))
        print(f"  {answer.method_text}")
        print(f"  verdict: {answer.verdict}: {answer.why} ({answer.limit_source})")
    return 0


def add_cards_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_json_option(p)


def cmd_cards(args: argparse.Namespace) -> int:
    """The cards --gpu accepts: the ledger's (limit measured there) and the common cards of the
    card table (ledger/cards.json: total MiB, what PyTorch reports as usable, where that figure
    comes from), each with the effective limit for peak allocated the predictor judges against."""
    from ledger.vocab.cards import card_table, derives_usable, is_mac, usable_ratio

    ledger = store.load(args.ledger)
    p = predictor_for(args, ledger)
    rows = []
    table = card_table()
    for key in sorted(set(ledger.gpus) | set(table)):
        entry = ledger.gpus.get(key) or table[key].gpu
        low, high, source = p.card_limit(key, entry, "probe")
        usable = high_usable = capacity_mib(entry)
        if derives_usable(entry):  # no PyTorch report: from the total by the rule --gpu-mib uses
            usable, high_usable = usable_ratio().usable_mib(entry.total_mib)
        rows.append({"key": key, "name": entry.name, "aliases": list(entry.aliases), "total_mib": entry.total_mib,
                     "usable_mib": usable, "usable_high_mib": high_usable, "usable_derived": derives_usable(entry),
                     "unified": is_mac(entry), "in_ledger": key in ledger.gpus, "limit_low_mib": low,
                     "limit_high_mib": high, "limit_source": source,
                     "usable_source": None if key in ledger.gpus else table[key].source})
    if args.json:
        dump_json(rows)
        return 0
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        usable = (f"usable {r['usable_mib']}–{r['usable_high_mib']} MiB (from its total)" if r["usable_derived"]
                  else f"unified {r['usable_mib']} MiB, shared with the OS and apps" if r["unified"]
                  else f"usable {r['usable_mib']} MiB")
        print(f"{r['key']:<{width}}  {r['name']:<32} {usable}; limit {r['limit_low_mib']}–"
              f"{r['limit_high_mib']} MiB allocated ({'measured in the ledger' if r['in_ledger'] else 'derived'})")
    print(f"\n{len(rows)} cards. Another card: --gpu-mib TOTAL (the total nvidia-smi shows), usable derived as for "
          f"the cards above marked 'from its total': {usable_ratio().describe()}.")
    return 0


COMMANDS = [
    Command("calibrate", "fit probe-vs-real over-estimate, marginal costs, card limits, leave-one-out",
            add_calibrate_options, cmd_calibrate),
    Command("predict", "record a prospective prediction of a real run's peak", add_predict_options, cmd_predict),
    Command("cards", "the cards --gpu accepts, with the limit each is judged against", add_cards_options, cmd_cards),
]

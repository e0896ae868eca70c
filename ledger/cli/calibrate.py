"""``vram calibrate``, ``vram ceiling`` and ``vram predict``: thin commands over ledger.calibration
and ledger.predictions."""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import replace
from typing import Optional

from .. import store
from ..calibration_report import calibrate
from ..errors import Issue, UserError
from ..ingest import fixes_option
from ..predictions import make_prediction, score_predictions
from ..recipe import capacity_mib, fixes_key
from ..results import Calibration
from ..paths import shown
from .options import (Command, add_batch_option, add_json_option, add_ledger_option, add_optimizer_option,
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


# -- ceiling ---------------------------------------------------------------------------------


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
    from ..cards import card_of_total, require_card
    from ..models import MAX_MIB

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
    from ..predictor import Predictor

    return Predictor(ledger, dry_rows(args), as_of=as_of, exclude=exclude)


def dry_rows(args: argparse.Namespace) -> list:
    """The dry-run rows a command answers from: --dry-runs, then those computed into --cache."""
    from ..dry_runs import load_dry_runs

    from .compute import fresh_rows

    cache = getattr(args, "cache", None)
    return fresh_rows(load_dry_runs(getattr(args, "dry_runs", None), cache=cache), getattr(args, "model", None), cache)


def add_dry_runs_option(p: argparse.ArgumentParser) -> None:
    from ..dry_runs import user_cache_dir
    from ..paths import DRY_RUNS

    p.add_argument("--dry-runs", default=shown(DRY_RUNS),
                   help="dry-run rows the predictor may use (default: %(default)s)")
    p.add_argument("--cache", default=str(user_cache_dir()), metavar="DIR",
                   help="where dry runs computed by `vram fit --compute` are kept and read from, beside --dry-runs "
                        "(default: %(default)s; VRAM_LEDGER_CACHE sets it)")


def add_ceiling_options(p: argparse.ArgumentParser) -> None:
    from .compute import add_compute_option

    add_ledger_option(p)
    add_dry_runs_option(p)
    add_compute_option(p)
    add_card_option(p, budget=True)
    add_recipe_options(p, skip=("rank", "alpha", "rslora"))
    p.add_argument("--rank", type=int, help="instead of --seq-len: the longest sequence that fits at this rank (a length "
                                            "ceiling, the form of published context tables)")
    p.add_argument("--max-seq-len", type=int, help="with --rank: the longest length searched (default: the model's "
                                                   f"max_position_embeddings, at most {MAX_SEARCHED_LEN})")
    p.add_argument("--seq-step", type=int, default=256, help="with --rank: the length step (default 256)")
    p.add_argument("--real", action="store_true", help="for a real run (calibrated), not a probe")
    add_optimizer_option(p)
    add_batch_option(p)
    p.add_argument("--step", type=int, default=8, help="rank step (default 8)")
    p.add_argument("--max-rank", type=int, default=512, help="largest rank searched (default 512)")
    p.add_argument("--margin-mib", type=float, default=0.0, help="stay this far under the limit, MiB (default 0)")
    add_json_option(p)


def require_model(model: Optional[str], ledger=None) -> None:
    """A model the command can answer for, or a one-line error: its config must be found (a path
    or folder, a shipped name, a Hub id in the local Hugging Face cache) unless the ledger measured
    it; a mixture-of-experts config is refused with the reason, not mis-modelled."""
    from ..model_configs import config_path, model_name, moe_experts, where_looked

    if not model:
        return
    if config_path(model) is None:
        if ledger is not None and any(model_name(m.model) == model_name(model) for m in ledger.measurements):
            return
        raise UserError(Issue("--model", "", where_looked(model)))
    experts = moe_experts(model)
    if experts:
        raise UserError(Issue("--model", "", f"{model} is a mixture-of-experts config ({experts} experts per layer): "
                              "not modelled yet (every expert's weights sit on the card, the routed activations and "
                              "LoRA on each expert's projections are not what the dense dry run and formulas count), "
                              "so no answer rather than a wrong one"))


def recipe_from(args: argparse.Namespace, rank: int = 16):
    from ..recipe import Recipe

    if args.seq_len is not None and args.seq_len <= 0:
        raise UserError(Issue("--seq-len", "", f"must be > 0, got {args.seq_len}"))
    if getattr(args, "response_len", None) is not None and (args.response_len <= 0 or (
            args.seq_len and args.response_len >= args.seq_len)):
        raise UserError(Issue("--response-len", "", "must be in [1, --seq-len)"))
    if not 0 <= (args.dropout or 0) < 1:
        raise UserError(Issue("--dropout", "", f"must be in [0, 1), got {args.dropout}"))
    fixes = fixes_key(fixes_option(args.fixes))
    return Recipe(model=args.model, rank=rank, quant=args.quant, dropout=(args.dropout or 0) > 0, dora=args.dora,
                  seq_len=args.seq_len, fixes=fixes, response_len=getattr(args, "response_len", None),
                  optimizer=optimizer_of(args, fixes), batch=getattr(args, "batch_size", 1) or 1,
                  checkpointing=not getattr(args, "no_gradient_checkpointing", False), targets=targets_of(args),
                  dropout_rate=args.dropout, alpha=getattr(args, "alpha", None), rslora=bool(getattr(args, "rslora", False)))


def targets_of(args: argparse.Namespace) -> tuple:
    """--target-modules as the projections it names, or a one-line error."""
    from ..adapter import parse_targets

    try:
        return parse_targets(getattr(args, "target_modules", None) or "all-linear")
    except ValueError as exc:
        raise UserError(Issue("--target-modules", "", str(exc))) from None


def optimizer_of(args: argparse.Namespace, fixes: str):
    """--optim; unset: a stock recipe (any fixes but the program's full set) steps STOCK_OPTIMIZER,
    whose state a real run adds, and the program's preset (--fixes all) counts none beyond what its
    measured runs hold."""
    from ..optimizers import STOCK_OPTIMIZER

    if not hasattr(args, "optim"):
        return None
    return args.optim or (None if fixes == "all" else STOCK_OPTIMIZER)


#: The longest sequence a length ceiling searches unless told (128k tokens).
MAX_SEARCHED_LEN = 131072
#: Lengths dry runs are computed at when a length ceiling needs rows the committed ones lack (a
#: model without rows, or past the grid's 16384 tokens): doublings, each asked only while the
#: previous still fits.
LENGTH_LADDER = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def cmd_ceiling(args: argparse.Namespace) -> int:
    """The largest LoRA rank (a multiple of --step) whose verdict is "fits" on the card, and the
    largest that is "tight" (the predicted interval reaches past the card's limit): from the one
    predictor (ledger.predictor: measured real runs, probes, interpolation, the calibrated dry run,
    other cards), judged against the low end of the card's effective limit less --margin-mib.
    With --rank instead of --seq-len: the longest sequence that fits at that rank."""
    if args.step <= 0 or args.max_rank < args.step:
        raise UserError(Issue("--step", "", "needs 0 < --step <= --max-rank"))
    if (args.seq_len is None) == (args.rank is None):
        raise UserError(Issue("--seq-len", "", "give --seq-len N (the largest rank at that length) or --rank N (the "
                              "longest sequence at that rank)" + (", not both" if args.seq_len is not None else "")))
    ledger = store.load(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    if args.rank is not None:
        return _length_ceiling(args, ledger, gpu, entry)
    recipe = recipe_from(args)
    from .compute import ensure_dry_runs

    predictor = predictor_for(args, ledger)
    if ensure_dry_runs(args, predictor, recipe):
        predictor = predictor_for(args, ledger)
    c = predictor.ceiling(recipe, gpu, entry=entry, run="real" if args.real else "probe",
                                            margin_mib=args.margin_mib, budget_mib=args.budget_mib, step=args.step,
                                            max_rank=args.max_rank)
    if args.json:
        dump_json(c.model_dump(mode="json"))
        return 0
    what = "a real run" if args.real else "a one-step probe"
    where = f"{'a budget' if gpu == BUDGET_CARD else gpu} at {args.seq_len} tokens" + (
        f", judged against --budget-mib {args.budget_mib:g} MiB of peak allocated (no CUDA context or allocator "
        "overhead taken off)" if args.budget_mib is not None else "")
    # The first line names the whole recipe the answer is for.
    shown = replace(recipe, rank=0, optimizer=recipe.optimizer if args.real else None)
    print(f"for {what} of {shown.describe().replace(' r0', '')}"
          + (" (the program's preset)" if recipe.fixes == "all" else " (stock)" if recipe.fixes == "none" else "")
          + ((", optimizer state as in the program's measured runs" if recipe.optimizer is None else "") if args.real
             else ", no optimizer step"))
    limit = (f"limit {c.limit_low_mib}–{c.limit_high_mib} MiB allocated" + (f", margin {c.margin_mib} MiB"
                                                                           if c.margin_mib else ""))
    if c.status == "unknown":
        print(f"unknown: {c.note or 'no evidence near this recipe'} ({where})")
        return 0
    if c.fits_rank is None:
        print(f"no rank fits {what} on {where} for sure" + (f"; up to rank {c.tight_rank} is tight"
                                                            if c.tight_rank else "") + f" ({limit})")
    else:
        print(f"rank {c.fits_rank} fits {what} on {where}" + ("" if c.tight_rank == c.fits_rank else
                                                               f"; up to rank {c.tight_rank} is tight") + f" ({limit})")
    for r in c.ranks:
        if r["rank"] in (c.fits_rank, c.tight_rank) or r["verdict"] == "won't fit":
            span = f"up to {r['high_mib']} MiB" if r["high_mib"] is not None else "a lower bound: the step needs more"
            print(f"  r{r['rank']}: {r['verdict']}, {r['mib']} MiB ({span}) by {r['method']}"
                  + (f" [{', '.join(r['evidence'][:3])}]" if r["evidence"] else ""))
    if c.note:
        print(f"  {c.note}")
    return 0


def _length_ceiling(args: argparse.Namespace, ledger, gpu: str, entry) -> int:
    """``vram ceiling --rank N``: the longest sequence (a multiple of --seq-step) that fits at the
    rank, computing the dry runs of the lengths no row reaches (``LENGTH_LADDER``, within the model's
    context) while the longest answered still fits, unless --no-compute."""
    from ..ceilings import longest
    from ..model_configs import max_length
    from .compute import ensure_dry_runs

    if args.rank <= 0 or args.seq_step <= 0:
        raise UserError(Issue("--rank", "", "--rank and --seq-step must be > 0"))
    limit = args.max_seq_len or min(max_length(args.model or "") or MAX_SEARCHED_LEN, MAX_SEARCHED_LEN)
    if limit < args.seq_step:
        raise UserError(Issue("--max-seq-len", "", f"must be at least --seq-step ({args.seq_step})"))
    recipe = recipe_from(args, args.rank)
    run = "real" if args.real else "probe"
    predictor = predictor_for(args, ledger)

    def ask():
        return longest(predictor, recipe, gpu, entry=entry, run=run, margin_mib=args.margin_mib,
                       budget_mib=args.budget_mib, step=args.seq_step, max_len=limit)

    c = ask()
    for _ in LENGTH_LADDER:
        length = next((n for n in LENGTH_LADDER if c.unknown_from is not None and c.unknown_from <= n <= limit), None)
        if length is None or args.no_compute or not ensure_dry_runs(args, predictor, replace(recipe, seq_len=length)):
            break
        predictor = predictor_for(args, ledger)
        c = ask()
    if args.json:
        dump_json(c.model_dump(mode="json"))
        return 0
    what = "a real run" if args.real else "a one-step probe"
    shown = replace(recipe, optimizer=recipe.optimizer if args.real else None)
    print(f"for {what} of {shown.describe()}"
          + (" (the program's preset)" if recipe.fixes == "all" else " (stock)" if recipe.fixes == "none" else "")
          + ((", optimizer state as in the program's measured runs" if recipe.optimizer is None else "") if args.real
             else ", no optimizer step"))
    where = ("a budget" if gpu == BUDGET_CARD else gpu) + (
        f", judged against --budget-mib {args.budget_mib:g} MiB of peak allocated (no CUDA context or allocator "
        "overhead taken off)" if args.budget_mib is not None else "")
    lim = (f"limit {c.limit_low_mib}–{c.limit_high_mib} MiB allocated" + (f", margin {c.margin_mib} MiB"
                                                                         if c.margin_mib else ""))
    if c.status == "unknown":
        print(f"unknown: {c.note or 'no evidence near this recipe'} ({where})")
        return 0
    if c.fits_len is None:
        print(f"no length fits {what} at rank {args.rank} on {where} for sure"
              + (f"; up to {c.tight_len} tokens is tight" if c.tight_len else "") + f" ({lim})")
    else:
        print(f"{c.fits_len} tokens fit {what} at rank {args.rank} on {where}"
              + ("" if c.tight_len == c.fits_len else f"; up to {c.tight_len} tokens is tight") + f" ({lim})")
    for r in c.lengths:
        span = f"up to {r['high_mib']} MiB" if r["high_mib"] is not None else "a lower bound: the step needs more"
        first = r.get("from_seq_len")
        print(f"  {f'{first}–' if first else ''}{r['seq_len']} tokens: {r['verdict']}"
              + (f" (at {r['seq_len']}: " if first else " (") + f"{r['mib']} MiB, {span}) by {r['method']}"
              + (f" [{', '.join(r['evidence'][:3])}]" if r["evidence"] else ""))
    if c.note:
        print(f"  {c.note}")
    return 0


# -- predict -----------------------------------------------------------------------------------


def add_predict_options(p: argparse.ArgumentParser) -> None:
    add_ledger_option(p)
    add_dry_runs_option(p)
    add_card_option(p)
    add_recipe_options(p, required=("rank", "seq-len"))
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
    ledger = store.load_or_new(args.ledger)
    require_model(args.model, ledger)
    gpu, entry = card_from(args, ledger)
    made_on = parse_date(args.date, "--date") or dt.date.today()
    if made_on > dt.date.today():
        raise UserError(Issue("--date", "", f"{made_on} is in the future: a prediction is made from what is "
                              "measured by then"))
    if args.rank <= 0:
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
    from ..cards import card_table, derives_usable, usable_ratio

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
                     "in_ledger": key in ledger.gpus, "limit_low_mib": low,
                     "limit_high_mib": high, "limit_source": source,
                     "usable_source": None if key in ledger.gpus else table[key].source})
    if args.json:
        dump_json(rows)
        return 0
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        usable = (f"{r['usable_mib']}–{r['usable_high_mib']} MiB (from its total)" if r["usable_derived"]
                  else f"{r['usable_mib']} MiB")
        print(f"{r['key']:<{width}}  {r['name']:<32} usable {usable}; limit {r['limit_low_mib']}–"
              f"{r['limit_high_mib']} MiB allocated ({'measured in the ledger' if r['in_ledger'] else 'derived'})")
    print(f"\n{len(rows)} cards. Another card: --gpu-mib TOTAL (the total nvidia-smi shows), usable derived as for "
          f"the cards above marked 'from its total': {usable_ratio().describe()}.")
    return 0


COMMANDS = [
    Command("calibrate", "fit probe-vs-real over-estimate, marginal costs, card limits, leave-one-out",
            add_calibrate_options, cmd_calibrate),
    Command("ceiling", "the largest LoRA rank that fits a card (and that is tight) at a sequence length",
            add_ceiling_options, cmd_ceiling),
    Command("predict", "record a prospective prediction of a real run's peak", add_predict_options, cmd_predict),
    Command("cards", "the cards --gpu accepts, with the limit each is judged against", add_cards_options, cmd_cards),
]

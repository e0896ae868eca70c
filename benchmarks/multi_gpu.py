"""One rank of a multi-GPU run: the dry run against real gloo runs, and a 70B rank's cost.

    python benchmarks/multi_gpu.py [--json] [--big llama-3.3-70b]

1. Accuracy: for tiny configs of several model families, every strategy (DeepSpeed's ZeRO-2 and
   ZeRO-3 among them), 2 and 4 ranks, 4-bit, bf16 and full fine-tuning, with and without an
   optimizer step: the dry run of rank 0 (fake tensors, torch's fake process group) against every
   rank of a real run of CPU processes over gloo, both measured by the tracker meter. Prints the
   largest |error| of peak, pre-step and after-load over all ranks (target: 1%), and with FSDP's CPU offload, of the host RAM the offloaded
   state takes. ZeRO's ranks can differ (its partitions end where they end): for its cases the dry
   run of each rank too, against that rank, and whether rank 0 (the answers') holds the most.
2. Cost: the dry run of one rank of a 70B QLoRA run under FSDP on 2 GPUs (2,048 tokens, the stock
   recipe), its process CPU seconds (target: 60 s).
3. With ``--unsloth``: Unsloth Studio's multi-GPU rule (each GPU past the first adds 85% of its free
   memory to one pool that its one-GPU estimate must fit in) against the per-GPU answer of
   ``vram estimate --gpus N --strategy fsdp`` (the rank's dry run, calibrated), 7B to 72B QLoRA
   r16 at 2,048 tokens on 2, 4 and 8 RTX 4090s: its share per GPU (the estimate over 1 + 0.85 (N - 1))
   against the rank's figure, and where the two verdicts differ.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time

from probe_kit.dry_run import _fake_step, dry_run
from probe_kit.gloo_run import real_run
from probe_kit.recipe import ProbeConfig, load_config

#: (model, weights, strategy, ranks, optimizer): what the accuracy table covers.
CASES = [
    ("tiny-llama", "bf16", "ddp", 2, None),
    ("tiny-llama", "4bit", "ddp", 2, "adamw_torch"),
    ("tiny-llama", "4bit", "fsdp", 2, "adamw_torch"),
    ("tiny-llama", "bf16", "fsdp-shard-grad-op", 2, None),
    ("tiny-llama", "full", "fsdp", 2, "adamw_torch"),
    ("tiny-qwen2", "4bit", "fsdp", 4, "adamw_torch"),
    ("tiny-qwen2", "bf16", "fsdp-shard-grad-op", 4, None),
    ("tiny-gemma3", "bf16", "ddp", 4, "adamw_torch"),
    ("tiny-gemma3", "4bit", "fsdp", 4, None),
    ("tiny-qwen3moe", "bf16", "fsdp", 2, None),
    ("tiny-mixtral", "full", "ddp", 2, "adamw_torch"),
    ("tiny-llama", "full", "zero2", 2, "adamw_torch"),
    ("tiny-llama", "full", "zero3", 2, "adamw_torch"),
    ("tiny-qwen2", "4bit", "zero3", 4, "adamw_torch"),
    ("tiny-gemma3", "bf16", "zero2", 4, "adamw_torch"),
    # FSDP's CPU offload: the card's figures and the host RAM the offloaded state takes.
    ("tiny-llama", "4bit", "fsdp", 2, "adamw_torch", "cpu-offload"),
    ("tiny-qwen2", "full", "fsdp-shard-grad-op", 4, "adamw_torch", "cpu-offload"),
    ("tiny-gemma3", "bf16", "fsdp", 2, None, "cpu-offload"),
]


def config(model: str, weights: str, strategy: str, gpus: int, optimizer, offload: str = "") -> ProbeConfig:
    full = weights == "full"
    return ProbeConfig(model=model, rank=None if full else 8, method="full" if full else "lora",
                       quant="bf16" if full else weights, seq_len=256, response_len=32, fixes=[], random_weights=True,
                       gpus=gpus, strategy=strategy, optimizer=optimizer, cpu_offload=offload == "cpu-offload")


def fake_rank(cfg: ProbeConfig, rank: int = 0) -> dict:
    with contextlib.redirect_stderr(io.StringIO()):
        raw = _fake_step(cfg, load_config(cfg.model), None, world_rank=rank)
    return {k: raw[k] for k in ("after_load_mib", "pre_step_mib", "peak_mib", "host_peak_mib")}


def accuracy() -> list[dict]:
    """Each dry run in a fresh process, as each rank of the real run is: a process allocates a few
    KiB once, on its first step (transformers' caches), which a second step in it does not."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    out = []
    for case in CASES:
        cfg = config(*case)
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            fake = pool.submit(fake_rank, cfg).result()
        with contextlib.redirect_stderr(io.StringIO()):
            real = real_run(cfg, cfg.strategy, cfg.gpus)
        # (Every rank's figures are taken once its start-up collectives' buffers are freed: gloo_run.settle.)
        errs = {key: max(abs(fake[f"{key}_mib"] - r[f"{key}_mib"]) / r[f"{key}_mib"] * 100 for r in real)
                for key in ("peak", "pre_step", "after_load")}
        if cfg.cpu_offload:  # the host RAM the offloaded state takes
            errs["host_peak"] = max(abs(fake["host_peak_mib"] - r["host_peak_mib"]) / r["host_peak_mib"] * 100
                                    for r in real)
        each = {}
        if cfg.strategy.startswith("zero"):  # ZeRO's partitions end where they end: each rank's own dry run too
            fakes = [fake]
            for rank in range(1, cfg.gpus):
                with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
                    fakes.append(pool.submit(fake_rank, cfg, rank).result())
            each = {"fake_rank_peaks_mib": [round(f["peak_mib"], 4) for f in fakes],
                    "rank_by_rank_peak_abs_err_pct": round(max(abs(f["peak_mib"] - r["peak_mib"]) / r["peak_mib"] * 100
                                                               for f, r in zip(fakes, real)), 4),
                    "rank0_holds_most": fakes[0]["peak_mib"] >= max(f["peak_mib"] for f in fakes)}
        out.append({"case": " ".join(str(x) for x in case if x), "fake_peak_mib": round(fake["peak_mib"], 4),
                    "real_peak_mib": [round(r["peak_mib"], 4) for r in real],
                    **({"fake_host_peak_mib": round(fake["host_peak_mib"], 4),
                        "real_host_peak_mib": [round(r["host_peak_mib"], 4) for r in real]} if cfg.cpu_offload else {}),
                    **{f"{k}_abs_err_pct": round(v, 4) for k, v in errs.items()}, **each})
        print(f"{out[-1]['case']:<45} dry {fake['peak_mib']:9.3f} MiB  real {min(out[-1]['real_peak_mib']):9.3f}–"
              f"{max(out[-1]['real_peak_mib']):9.3f} MiB  |err| peak {errs['peak']:.3f}% pre-step "
              f"{errs['pre_step']:.3f}% after-load {errs['after_load']:.3f}%"
              + (f" host RAM {errs['host_peak']:.3f}%" if "host_peak" in errs else "")
              + (f"; each rank's own dry run {each['rank_by_rank_peak_abs_err_pct']:.3f}%, rank 0 holds the most: "
                 f"{each['rank0_holds_most']}" if each else ""), file=sys.stderr, flush=True)
    return out


def cost(model: str) -> dict:
    cfg = ProbeConfig(model=model, rank=16, quant="4bit", seq_len=2048, response_len=256, fixes=[],
                      random_weights=True, gpus=2, strategy="fsdp")
    t0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stderr(io.StringIO()):
        raw = dry_run(cfg)
    return {"model": model, "recipe": cfg.label(), "cpu_s": round(time.process_time() - c0, 2),
            "wall_s": round(time.perf_counter() - t0, 2), "rank_peak_mib": round(raw["peak_mib"], 1),
            "rank_after_load_mib": round(raw["after_load_mib"], 1), "depth": raw["depth"]["method"]}


#: The models and GPU counts Unsloth Studio's multi-GPU rule is scored on.
UNSLOTH_MODELS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "llama-3.3-70b", "qwen2.5-72b")
UNSLOTH_GPUS = (2, 4, 8)
UNSLOTH_CARD = "rtx-4090"


def unsloth(cache: str) -> dict:
    """Unsloth Studio's 85% rule against the dry runs of one rank under FSDP (module docstring)."""
    from ledger import cli
    from ledger.report.estimators import UnslothStudio
    from ledger.vocab.cards import card_table
    from ledger.vocab.model_configs import load_arch
    from ledger.vocab.recipe import Recipe, capacity_mib

    usable = capacity_mib(card_table()[UNSLOTH_CARD].gpu)
    rows = []
    for model in UNSLOTH_MODELS:
        recipe = Recipe(model=model, rank=16, quant="4bit", seq_len=2048, fixes="none")
        one_gpu = UnslothStudio().estimate(load_arch(model), recipe).mib
        for n in UNSLOTH_GPUS:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                code = cli.main(["estimate", "--model", model, "--rank", "16", "--seq-len", "2048", "--gpu",
                                 UNSLOTH_CARD, "--gpus", str(n), "--strategy", "fsdp", "--cache", cache, "--json"])
            if code:
                raise SystemExit(f"vram estimate exited {code} for {model} on {n} GPUs")
            a = json.loads(out.getvalue())["answer"]
            mine = a["probe_allocated"]["mib"]
            share = one_gpu / (1 + 0.85 * (n - 1))
            theirs = "fits" if one_gpu <= usable * (1 + 0.85 * (n - 1)) else "won't fit"
            rows.append({"model": model, "gpus": n, "unsloth_one_gpu_mib": round(one_gpu, 1),
                         "unsloth_share_mib": round(share, 1), "dry_run_per_gpu_mib": mine,
                         "share_err_pct": round((share - mine) / mine * 100, 1), "unsloth_verdict": theirs,
                         "dry_run_verdict": a["verdict"]})
            print(f"{model:<14} x{n}: Unsloth {one_gpu:9.1f} MiB in all, {share:8.1f} MiB a GPU ({theirs}); dry run "
                  f"{mine:8.1f} MiB a GPU ({a['verdict']}); share {rows[-1]['share_err_pct']:+.1f}%",
                  file=sys.stderr, flush=True)
    errs = [abs(r["share_err_pct"]) for r in rows]
    optimistic = [f"{r['model']} x{r['gpus']}" for r in rows
                  if r["unsloth_verdict"] == "fits" and r["dry_run_verdict"] == "won't fit"]
    return {"card": UNSLOTH_CARD, "rows": rows, "median_abs_share_err_pct": round(sorted(errs)[len(errs) // 2], 1),
            "max_abs_share_err_pct": max(errs), "unsloth_fits_dry_run_wont": optimistic}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--big", default="llama-3.3-70b", help="the model of the cost check (default llama-3.3-70b)")
    p.add_argument("--unsloth", action="store_true", help="also score Unsloth Studio's 85%% multi-GPU rule")
    p.add_argument("--cache", help="with --unsloth: the dry-run cache the ranks' dry runs go to (default: a "
                                   "temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args(argv)
    rows = accuracy()
    big = cost(args.big)
    doc = {"cases": rows, "max_peak_abs_err_pct": max(r["peak_abs_err_pct"] for r in rows),
           "max_pre_step_abs_err_pct": max(r["pre_step_abs_err_pct"] for r in rows),
           "max_after_load_abs_err_pct": max(r["after_load_abs_err_pct"] for r in rows),
           "max_host_peak_abs_err_pct": max((r["host_peak_abs_err_pct"] for r in rows if "host_peak_abs_err_pct" in r),
                                            default=None),
           "zero_rank_by_rank_max_abs_err_pct": max((r["rank_by_rank_peak_abs_err_pct"] for r in rows
                                                     if "rank_by_rank_peak_abs_err_pct" in r), default=None),
           "zero_rank0_holds_most": all(r.get("rank0_holds_most", True) for r in rows), "cost": big}
    if args.unsloth:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            doc["unsloth"] = unsloth(args.cache or tmp)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"dry run of a rank vs real gloo runs, {len(rows)} cases: max |error| peak "
              f"{doc['max_peak_abs_err_pct']}%, pre-step {doc['max_pre_step_abs_err_pct']}%, after-load "
              f"{doc['max_after_load_abs_err_pct']}% (target 1%); host RAM under CPU offload "
              f"{doc['max_host_peak_abs_err_pct']}%; ZeRO, each rank's own dry run against that rank: "
              f"{doc['zero_rank_by_rank_max_abs_err_pct']}% (rank 0, the answers', holds the most in every ZeRO "
              f"case: {doc['zero_rank0_holds_most']})")
        print(f"{big['recipe']}: {big['cpu_s']} s CPU ({big['wall_s']} s wall; depth {big['depth']}), rank peak "
              f"{big['rank_peak_mib']} MiB, after load {big['rank_after_load_mib']} MiB (target 60 s)")
        if args.unsloth:
            u = doc["unsloth"]
            print(f"Unsloth Studio's 85% rule on {len(u['rows'])} FSDP QLoRA cases ({u['card']}): its share a GPU "
                  f"against the rank's dry run, median |error| {u['median_abs_share_err_pct']}%, worst "
                  f"{u['max_abs_share_err_pct']}%; it says fits where the dry run says won't fit: "
                  f"{', '.join(u['unsloth_fits_dry_run_wont']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

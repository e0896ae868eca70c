"""Full fine-tuning: the dry run against the real CPU step, and the bytes a parameter it holds.

    python benchmarks/full_ft_accuracy.py [--seq-len 512] [--families tiny-llama,tiny-qwen2,tiny-gemma3]
    python benchmarks/full_ft_accuracy.py --chord [--models qwen2.5-0.5b,llama-3.2-1b,qwen2.5-7b,llama-3.1-8b]

For each family's tiny config, both precisions full fine-tuning runs in (``--quant bf16``: bf16
weights, gradients and optimizer state; ``--quant fp32``: fp32 master weights under bf16
autocast), every optimizer the Trainer names here (adamw_torch, adamw_8bit, paged_adamw_32bit,
adafactor, sgd) and gradient checkpointing on and off: the real training step on the CPU
(``run_probe``, tracker meter: an optimizer step first, then forward, backward and a step) and the
dry run of the same recipe. Printed: both peaks in MiB, the error, the worst |error| against the 1%
target, and for AdamW the state's bytes a parameter (pre-step less after-load, over the
parameters: 4 in bf16, 8 in fp32 — the FT01 rule's 16 bytes a parameter are fp32's 4 + 4 + 8;
about 2 for 8-bit AdamW; a paged optimizer's buffers of 100,000 elements or more live in unified
memory, which the allocator and so the meter do not count; Adafactor's factored moments little).

``--chord``: the fit table's full fine-tuning figures between the grid's lengths are the chord of
the committed dry runs either side (``ledger.fit.full_table``); here each shipped model given is
dry-run at lengths the table interpolates (``CHORD_LENGTHS``: between the grid's, where a length
ceiling's scan reads the chord; both precisions, AdamW) and the chord compared with it. Printed: both in MiB and the chord's error (never below the step: the
peak is convex in the length).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_PCT = 1.0
#: Lengths between the grid's (512, 2,048, 4,096, ...): where a length ceiling's scan reads a chord.
CHORD_LENGTHS = (1280, 3072, 6144, 12288)
OPTIMIZERS = ("adamw_torch", "adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--families", default="tiny-llama,tiny-qwen2,tiny-gemma3")
    ap.add_argument("--chord", action="store_true", help="the full table's chord between grid lengths instead")
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b,qwen2.5-7b,llama-3.1-8b")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.chord:
        chord(args.models.split(","))
        return
    import torch
    from transformers import AutoModelForCausalLM

    from probe_kit.dry_run import dry_run
    from probe_kit.probe_vram import run_probe
    from probe_kit.recipe import ProbeConfig, load_config

    worst = 0.0
    print(f"{'model':<12} {'quant':<5} {'optimizer':<18} {'ckpt':<4} {'real MiB':>9} {'dry MiB':>9} {'error':>8}  state B/param")
    for model in args.families.split(","):
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(load_config(model)).parameters())
        for quant in ("bf16", "fp32"):
            for optimizer in OPTIMIZERS:
                for ckpt in (True, False):
                    cfg = ProbeConfig(model=model, method="full", quant=quant, random_weights=True,
                                      seq_len=args.seq_len, response_len=min(64, args.seq_len // 2), fixes=[],
                                      optimizer=optimizer, gradient_checkpointing=ckpt)
                    real = run_probe(cfg, device="cpu")[0].outcome
                    dry = dry_run(cfg)
                    err = (dry["peak_mib"] - real.peak_allocated_mib) / real.peak_allocated_mib * 100
                    worst = max(worst, abs(err))
                    state = (real.pre_step_mib - real.after_load_mib) * 2**20 / n
                    print(f"{model:<12} {quant:<5} {optimizer:<18} {'on' if ckpt else 'off':<4} "
                          f"{real.peak_allocated_mib:>9.2f} {dry['peak_mib']:>9.2f} {err:>+7.2f}%  {state:.2f}")
    print(f"worst |error| {worst:.2f}% (target <= {TARGET_PCT:g}%: {'met' if worst <= TARGET_PCT else 'NOT met'})")


def chord(models: list[str]) -> None:
    from ledger.fit.full_table import FullTable
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.vocab.recipe import full_recipe
    from probe_kit.dry_run import predict
    from probe_kit.recipe import ProbeConfig

    table = FullTable(load_dry_runs())
    worst, low = 0.0, 0.0
    print(f"{'model':<14} {'quant':<5} {'tokens':>6} {'dry run MiB':>12} {'chord MiB':>10} {'error':>8}")
    for model in models:
        for quant in ("bf16", "fp32"):
            for seq in CHORD_LENGTHS:
                r = full_recipe(model=model, quant=quant, seq_len=seq, fixes="none", optimizer="adamw_torch")
                fig = table.figure(r, "adamw_torch")
                if fig is None or fig.how != "chord":
                    continue
                cfg = ProbeConfig(model=model, method="full", quant=quant, random_weights=True, seq_len=seq,
                                  response_len=256, fixes=[], optimizer="adamw_torch")
                exact = predict(cfg)[0]["peak_allocated_mib"]
                err = (fig.mib - exact) / exact * 100
                worst, low = max(worst, abs(err)), min(low, err)
                print(f"{model:<14} {quant:<5} {seq:>6} {exact:>12.1f} {fig.mib:>10.1f} {err:>+7.3f}%")
    print(f"worst |error| {worst:.3f}%, lowest {low:+.3f}% (a chord at or above the step: lowest >= 0)")


if __name__ == "__main__":
    main()

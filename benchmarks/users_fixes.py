"""The memory settings people set (Liger's fused linear cross-entropy, TRL's activation offloading):
the dry run against the real CPU step, and what each does to a real model's step.

    python benchmarks/users_fixes.py [--skip-real] [--skip-models]

1. For tiny Llama, Qwen2 and Gemma 3 configs (384 tokens, rank 8, micro-batch 2): the real step
   on CPU tensors (Liger's and TRL's own Python, only what needs a GPU stood in; the tracker
   meter) and the dry run under fake tensors; printed: both peaks and their difference. Liger in
   bf16 and 4-bit with checkpointing; TRL in bf16 with checkpointing and without.
2. Dry runs of llama-3.2-1b and qwen2.5-7b (4-bit, r16, 2,048 tokens), checkpointing on and off:
   the one-step probe's peak, stock and with each fix.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig, parse_fixes  # noqa: E402

TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
CASES = [("fused_linear_ce", q, True) for q in ("bf16", "4bit")] + \
        [("activation_offloading", "bf16", c) for c in (True, False)]


def real_against_dry() -> float:
    print(f"{'model':<12} {'fixes':<22} {'quant':<5} {'ckpt':<4} {'real MiB':>9} {'dry MiB':>9} {'diff':>7}")
    worst = 0.0
    for fixes, quant, ckpt in CASES:
        for model in TINY:
            cfg = ProbeConfig(model=model, rank=8, quant=quant, seq_len=384, response_len=16, random_weights=True,
                              fixes=parse_fixes(fixes), batch_size=2, gradient_checkpointing=ckpt)
            real = run_probe(cfg, device="cpu")[0].outcome.peak_allocated_mib
            dry = dry_run(cfg)["peak_mib"]
            diff = dry / real - 1
            worst = max(worst, abs(diff))
            print(f"{model:<12} {fixes:<22} {quant:<5} {'on' if ckpt else 'off':<4} {real:>9.1f} {dry:>9.2f} "
                  f"{diff:>+7.2%}", flush=True)
    print(f"largest difference: {worst:.2%} (target 1%)")
    return worst


def models() -> None:
    print(f"\n{'model':<14} {'ckpt':<4} {'stock':>8} {'fused_linear_ce':>16} {'activation_offloading':>22}  (peak MiB)")
    for model in ("llama-3.2-1b", "qwen2.5-7b"):
        for ckpt in (True, False):
            peaks = [dry_run(ProbeConfig(model=model, rank=16, quant="4bit", seq_len=2048, response_len=256,
                                         fixes=parse_fixes(f), gradient_checkpointing=ckpt))["peak_mib"]
                     for f in ("none", "fused_linear_ce", "activation_offloading")]
            print(f"{model:<14} {'on' if ckpt else 'off':<4} {peaks[0]:>8,.0f} {peaks[1]:>16,.0f} {peaks[2]:>22,.0f}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-real", action="store_true", help="skip the tiny real-against-dry table")
    ap.add_argument("--skip-models", action="store_true", help="skip the real models' table")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if not args.skip_real:
        real_against_dry()
    if not args.skip_models:
        models()


if __name__ == "__main__":
    main()

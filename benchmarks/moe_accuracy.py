"""Mixtures of experts: the dry run against the real CPU step, and the cost of a large one's dry run.

    python benchmarks/moe_accuracy.py [--seq-len 512] [--skip-large]

1. For the tiny config of every MoE family shipped (``ledger/model_configs/tiny-qwen3moe.json``,
   ``tiny-mixtral.json``, ``tiny-gpt-oss.json``), each LoRA target the family accepts (attention
   only; attention and the fused experts through peft's ``target_parameters``), 4-bit and bf16, a
   one-step probe without an optimizer and a training step with AdamW: the real step on the CPU
   (``run_probe``, tracker meter) and the dry run (fake tensors) of the same recipe. Printed: both
   peaks in MiB, the error of the dry run, and the worst |error| against the 1% target.
2. Qwen3-30B-A3B at 4,096 tokens (stock QLoRA, rank 16, AdamW): one dry run's CPU seconds
   (``time.process_time``) against the 60 s target, with its peak and how its depth was computed.

An unlisted MoE config's one-card fit table is timed by ``benchmarks/unlisted_model.py --config
qwen3-30b-a3b``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ledger.vocab.adapter import ALL_LINEAR  # noqa: E402

TARGET_PCT = 1.0
LARGE_TARGET_S = 60.0
FAMILIES = ("tiny-qwen3moe", "tiny-mixtral", "tiny-gpt-oss")
TARGETS = {"attention": list(ALL_LINEAR[:4]), "attention+experts": list(ALL_LINEAR)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--skip-large", action="store_true", help="the tiny families only")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    from probe_kit.dry_run import dry_run
    from probe_kit.probe_vram import run_probe
    from probe_kit.recipe import ProbeConfig

    worst = 0.0
    print(f"{'model':<15} {'targets':<18} {'quant':<5} {'step':<9} {'real MiB':>9} {'dry MiB':>9} {'error':>8}")
    for model in FAMILIES:
        for label, targets in TARGETS.items():
            for quant in ("4bit", "bf16"):
                for optimizer in (None, "adamw_torch"):
                    cfg = ProbeConfig(model=model, random_weights=True, rank=16, quant=quant, seq_len=args.seq_len,
                                      response_len=min(64, args.seq_len // 2), fixes=[], target_modules=targets,
                                      optimizer=optimizer)
                    real = run_probe(cfg, device="cpu")[0].outcome.peak_allocated_mib
                    dry = dry_run(cfg)["peak_mib"]
                    err = (dry - real) / real * 100
                    worst = max(worst, abs(err))
                    print(f"{model:<15} {label:<18} {quant:<5} {'training' if optimizer else 'probe':<9} "
                          f"{real:>9.2f} {dry:>9.2f} {err:>+7.2f}%")
    print(f"worst |error| {worst:.2f}% (target <= {TARGET_PCT:g}%: {'met' if worst <= TARGET_PCT else 'NOT met'})")
    if args.skip_large:
        return
    cfg = ProbeConfig(model="qwen3-30b-a3b", random_weights=True, rank=16, quant="4bit", seq_len=4096,
                      response_len=256, fixes=[], optimizer="adamw_torch")
    t0 = time.process_time()
    d = dry_run(cfg)
    cpu = time.process_time() - t0
    print(f"qwen3-30b-a3b 4bit r16 4096 tokens, AdamW: peak {d['peak_mib']:.1f} MiB "
          f"(depth {d['depth']['method']}, from {d['depth'].get('from_layers', d['depth'].get('layers'))} layers); "
          f"{cpu:.1f} s CPU / target {LARGE_TARGET_S:.0f} s: {cpu / LARGE_TARGET_S:.2f} "
          f"({'met' if cpu <= LARGE_TARGET_S else 'NOT met'})")


if __name__ == "__main__":
    main()

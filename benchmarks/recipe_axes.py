"""The recipe axes (micro-batch, gradient checkpointing, the optimizer's step): the dry run under
fake tensors against the real step on CPU tensors, both measured by the tracker meter.

    python benchmarks/recipe_axes.py [--seq-len 384] [--rank 8]

For tiny Llama, Qwen2 and Gemma 3 configs at batch 1, 2, 4 x checkpointing on, off x no optimizer
step, adamw_torch, adamw_8bit (54 cases, bf16, no memory fixes): the real step's peak allocated
(``probe_vram`` on the CPU, rounded to 0.1 MiB as recorded), the dry run's, the signed difference,
and the largest |difference| (target: every case within 1%). Also each axis's cost: the peak at
batch 4 over batch 1, without checkpointing over with, with AdamW's state over without.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    worst = 0.0
    print(f"{'model':>12} {'batch':>5} {'ckpt':>5} {'optimizer':>12} {'real MiB':>9} {'dry MiB':>9} {'diff':>7}")
    for model, batch, ckpt, optim in itertools.product(("tiny-llama", "tiny-qwen2", "tiny-gemma3"), (1, 2, 4),
                                                       (True, False), (None, "adamw_torch", "adamw_8bit")):
        cfg = ProbeConfig(model=model, rank=args.rank, quant="bf16", seq_len=args.seq_len, response_len=16, fixes=[],
                          random_weights=True, batch_size=batch, gradient_checkpointing=ckpt, optimizer=optim)
        real = run_probe(cfg, device="cpu")[0].outcome.peak_allocated_mib
        fake = dry_run(cfg)["peak_mib"]
        diff = (fake - real) / real * 100
        worst = max(worst, abs(diff))
        print(f"{model:>12} {batch:>5} {'on' if ckpt else 'off':>5} {optim or '-':>12} {real:>9.1f} {fake:>9.2f} "
              f"{diff:>+6.2f}%", flush=True)
    print(f"largest |dry - real|: {worst:.2f}% over 54 cases (target <= 1%: {'met' if worst <= 1 else 'NOT met'})")


if __name__ == "__main__":
    main()

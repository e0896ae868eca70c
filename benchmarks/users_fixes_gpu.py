"""The memory settings users set, on a card and on the CPU: Liger Kernel's fused linear
cross-entropy against the stock step, each run for real on ``--device`` (Liger's Triton kernels
on a GPU) and on the CPU (the same Python with the kernels stood in, ``probe_kit/liger.py``).

    python benchmarks/users_fixes_gpu.py [--device cuda] [--models tiny-gemma3,qwen2.5-0.5b] [--seq-len 2048]
        [--batch-size 2] [--json]

Prints each peak allocated (MiB) and what the fix saved on the card and on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="tiny-gemma3,qwen2.5-0.5b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--fixes", default="fused_linear_ce")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from probe_kit.probe_vram import run_probe
    from probe_kit.recipe import ProbeConfig

    rows = []
    for model in args.models.split(","):
        for fixes in ([], args.fixes.split(",")):
            cfg = ProbeConfig(model=model, random_weights=True, rank=16, seq_len=args.seq_len, response_len=32,
                              quant="bf16", batch_size=args.batch_size, fixes=fixes,
                              gradient_checkpointing="activation_offloading" not in fixes)
            card, _ = run_probe(cfg, device=args.device)
            cpu, _ = run_probe(cfg, device="cpu")
            row = {"model": model, "fixes": fixes or ["none"], "device_peak_mib": card.outcome.peak_allocated_mib,
                   "device_reserved_mib": card.outcome.peak_reserved_mib, "cpu_peak_mib": cpu.outcome.peak_allocated_mib,
                   "device": card.environment.device if card.environment else args.device}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['model']:14} {','.join(r['fixes']):18} device {r['device_peak_mib']:>9.1f} MiB   cpu {r['cpu_peak_mib']:>9.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A training run's optimizer step: the real step against the dry run and the modelled floor.

    python benchmarks/optimizer_step.py [--device cuda|cpu] [--models qwen2.5-0.5b] [--ranks 8,512]
        [--optims none,adamw_torch,adamw_torch_fused,adafactor,sgd] [--seq-len 1024] [--quant bf16]
        [--no-dry-run] [--json]

For each recipe (random weights, LoRA on the 7 projections, checkpointing on, micro-batch 1) it
runs the probe on ``--device`` (on a GPU: ``torch.cuda.max_memory_allocated`` and ``_reserved``;
on a CPU: the tracker meter), the one-step probe without an optimizer and the steady state with
each optimizer (an optimizer step first, then forward, backward and a step), and the dry run of the
same recipe under fake tensors. It prints each peak (MiB), the dry run's difference from the real
step (% of the real step), and the floor ``ledger.fit.response_span`` models for a training run (the
weights and adapter before the step, its gradients and the step's temporaries, plus the state):
on a GPU, torch's AdamW steps every tensor at once, and its ``_foreach_sqrt`` temporary is the size
of every trainable parameter together.
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
    p.add_argument("--models", default="qwen2.5-0.5b")
    p.add_argument("--ranks", default="8,512")
    p.add_argument("--optims", default="none,adamw_torch,adamw_torch_fused,adafactor,sgd")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--quant", default="bf16", choices=("bf16", "4bit"))
    p.add_argument("--no-dry-run", action="store_true", help="the real step alone")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from ledger.vocab.adapter import adapter_mib
    from ledger.vocab.optimizers import state_bytes, transient_bytes
    from ledger.vocab.adapter import arch_of, trainable_shape_counts
    from probe_kit.dry_run import dry_run
    from probe_kit.probe_vram import run_probe
    from probe_kit.recipe import ProbeConfig

    rows = []
    for model in args.models.split(","):
        for rank in map(int, args.ranks.split(",")):
            for optim in args.optims.split(","):
                cfg = ProbeConfig(model=model, rank=rank, quant=args.quant, seq_len=args.seq_len, response_len=64,
                                  fixes=[], random_weights=True, optimizer=None if optim == "none" else optim)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                m, _ = run_probe(cfg, device=args.device)
                real = m.outcome.peak_allocated_mib
                dry = None if args.no_dry_run else dry_run(cfg)
                shapes = trainable_shape_counts(arch_of(model), rank)
                row = {"model": model, "rank": rank, "optim": optim, "status": m.outcome.status,
                       "real_peak_mib": real, "real_reserved_mib": m.outcome.peak_reserved_mib,
                       "real_pre_step_mib": m.outcome.pre_step_mib,
                       "dry_peak_mib": None if dry is None else round(dry["peak_mib"], 1),
                       "dry_pre_step_mib": None if dry is None else round(dry["pre_step_mib"], 1),
                       "adapter_mib": round(adapter_mib(model, rank), 1)}
                if optim != "none":
                    row["state_mib"] = round(state_bytes(optim, shapes).device / 2**20, 1)
                    row["transient_mib"] = round(transient_bytes(optim, shapes) / 2**20, 1)
                if dry is not None and real:
                    row["dry_minus_real_pct"] = round((dry["peak_mib"] - real) / real * 100, 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':14} {'rank':>4} {'optim':18} {'real peak':>10} {'reserved':>10} {'dry run':>10} {'dry-real':>8}"
          f" {'state':>8} {'transient':>9}")
    for r in rows:
        print(f"{r['model']:14} {r['rank']:>4} {r['optim']:18} {r['real_peak_mib'] or 0:>10.1f} "
              f"{r['real_reserved_mib'] or 0:>10.1f} {r['dry_peak_mib'] or 0:>10.1f} "
              f"{r.get('dry_minus_real_pct', 0):>7.2f}% {r.get('state_mib', 0):>8.1f} {r.get('transient_mib', 0):>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

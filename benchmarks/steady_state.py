"""A training run's steady-state step against the one-step probe plus the optimizer's state.

    python benchmarks/steady_state.py [--models qwen2.5-0.5b,llama-3.2-1b] [--ranks 8,512] [--seq-len 512]

For each model (a shipped config, random weights), rank, and weights (4-bit and bf16), the dry run
(the real step under fake tensors, tracker meter) of the one-step probe (no optimizer step) and of
the steady state with ``--optim`` adamw_torch and adamw_8bit (an optimizer step first, so its state
exists, then forward, backward and a step: ``probe_kit.recipe``), no memory fixes. Printed: both
peaks (MiB), the state ``ledger.vocab.optimizers`` computes for the adapter, and the steady state's
difference from probe + state, as a % of the steady state. The predictor models a stock training
run as probe + state (``ledger.fit.response_span.STEADY_STATE_ERR_PCT`` is the largest |difference|
this printed).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.vocab.adapter import ALL_LINEAR, trainable_shape_counts  # noqa: E402
from ledger.vocab.model_configs import load_arch  # noqa: E402
from ledger.vocab.optimizers import state_bytes  # noqa: E402
from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.recipe import ProbeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--ranks", default="8,512")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    worst = 0.0
    print(f"{'model':>14} {'quant':>5} {'rank':>5} {'optimizer':>11} {'probe MiB':>10} {'steady MiB':>11} "
          f"{'state MiB':>10} {'diff':>7}", flush=True)
    for model in args.models.split(","):
        arch = load_arch(model)
        for quant in ("4bit", "bf16"):
            for rank in map(int, args.ranks.split(",")):
                def peak(optim):
                    cfg = ProbeConfig(model=model, rank=rank, quant=quant, seq_len=args.seq_len, response_len=256,
                                      fixes=[], random_weights=True, optimizer=optim)
                    return dry_run(cfg)["peak_mib"]

                probe = peak(None)
                for optim in ("adamw_torch", "adamw_8bit"):
                    steady = peak(optim)
                    state = state_bytes(optim, trainable_shape_counts(arch, rank, ALL_LINEAR)).device_mib
                    diff = (steady - probe - state) / steady * 100
                    worst = max(worst, abs(diff))
                    print(f"{model:>14} {quant:>5} {rank:>5} {optim:>11} {probe:>10.1f} {steady:>11.1f} {state:>10.1f} "
                          f"{diff:>+6.2f}%", flush=True)
    print(f"largest |steady - (probe + state)|: {worst:.2f}% of the steady state")


if __name__ == "__main__":
    main()

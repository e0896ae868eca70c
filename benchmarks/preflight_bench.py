"""What preflight costs: the length scan and the measured step, as ratios to one training step.

    python benchmarks/preflight_bench.py [--rows 10000,200000]

1. The worst-batch scan over a tokenised training set of N rows (lengths 16..2048), as a
   ``datasets.Dataset`` (an Arrow ``input_ids`` column, measured without reading it into Python)
   and as a plain list of dicts.
2. preflight (a tiny Llama with LoRA, batch 4, accumulation 2, on the CPU, tracker meter) against
   one plain training step of the same trainer on the same worst batch: preflight runs an optimizer
   step, then the run's accumulation (two micro-steps) and another, under the tracker meter, and
   restores everything, so it costs a few training steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from probe_kit.preflight import find_worst_batch, preflight  # noqa: E402
from test_preflight import collate, tiny_model, trainer_for  # noqa: E402


def scan(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 2048, (rows,), generator=g).tolist()
    data = [{"input_ids": [1] * n} for n in lengths]
    t0 = time.perf_counter()
    find_worst_batch(data, collate, 4, max_scan=None)
    plain = time.perf_counter() - t0
    line = f"scan {rows:>8,} rows: list of dicts {plain:6.2f} s"
    try:
        import datasets

        ds = datasets.Dataset.from_list(data)
        t0 = time.perf_counter()
        find_worst_batch(ds, collate, 4, max_scan=None)
        line += f", datasets.Dataset {time.perf_counter() - t0:6.2f} s"
    except ImportError:
        line += ", datasets.Dataset: not installed"
    print(line, flush=True)


def step_cost() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_for(Path(tmp), tiny_model(), batch=4, accumulation=2)
        t0 = time.perf_counter()
        result = preflight(trainer, budget_mib=1000, stream=open("/dev/null", "w"))
        pre = time.perf_counter() - t0
        trainer.create_optimizer()
        inputs = trainer._prepare_inputs(find_worst_batch(trainer.train_dataset, collate, 4).inputs)
        model = trainer.model
        model.train()
        trainer.current_gradient_accumulation_steps = 1
        t0 = time.perf_counter()
        for _ in range(3):
            trainer.training_step(model, dict(inputs))
            trainer.optimizer.step()
            model.zero_grad(set_to_none=True)
        one = (time.perf_counter() - t0) / 3
    print(f"preflight (tiny Llama, batch 4 x 120 tokens, accumulation 2, CPU): {pre:.2f} s "
          f"= {pre / one:.1f}x one training step ({one:.3f} s); verdict {result.verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="10000,200000")
    args = ap.parse_args()
    for n in map(int, args.rows.split(",")):
        scan(n)
    step_cost()


if __name__ == "__main__":
    main()

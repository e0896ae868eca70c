"""How fast ``vram ingest-log`` reads a training log: MB of log per second of CPU.

    python benchmarks/ingest_bench.py [--mb 200] [--repeat 1] [--check]

The log is what a long HF Trainer run leaves behind: tqdm progress bars redrawn with carriage
returns (most of the bytes), the Trainer's loss dicts, timestamped INFO lines, a few warnings,
one restart after an OOM (two runs), and the memory metrics at the end. ``ledger.intake.logs.parse_runs``
reads it (what ``vram ingest-log`` calls); the rate is the log's size over the CPU seconds of that
call. ``--check`` also reads the same log with the line-by-line reader (``parse_runs`` with the
fast scan off) and fails unless both give the same runs. The target is at least 30 MB/s on a
2-core machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_log(mb: float, seed: int = 0) -> str:
    """A synthetic training log of about ``mb`` MB (see the module's text)."""
    rng = random.Random(seed)
    target = int(mb * 1e6)
    parts: list[str] = []
    size = 0
    total = 1172
    run = 0
    while size < target:
        run += 1
        header = ("[INFO|trainer.py:2405] 2026-11-30 10:00:00,001 >> ***** Running training *****\n"
                  f"[INFO|trainer.py:2406] 2026-11-30 10:00:00,002 >>   Num examples = {total}\n"
                  "  warnings.warn(\n/usr/lib/python3/site-packages/torch/utils/checkpoint.py:87: UserWarning: None "
                  "of the inputs have requires_grad=True. Gradients will be None\n")
        parts.append(header)
        size += len(header)
        for step in range(1, total + 1):
            elapsed = step * 3
            bar = "█" * (step * 20 // total)
            for sub in range(12):  # tqdm redraws the same line many times between steps
                line = (f"\r {step * 100 // total:3d}%|{bar:<20}| {step}/{total} [{elapsed // 60:02d}:{elapsed % 60:02d}"
                        f"<{(total - step) * 3 // 60:02d}:{(total - step) * 3 % 60:02d}, {rng.uniform(2.5, 3.5):.2f}s/it]")
                parts.append(line)
                size += len(line)
            if step % 10 == 0:
                line = (f"\n{{'loss': {rng.uniform(0.5, 2.0):.4f}, 'grad_norm': {rng.uniform(0.1, 2):.4f}, "
                        f"'learning_rate': {rng.uniform(1e-5, 2e-4):.3e}, 'epoch': {step / total:.2f}}}\n")
                parts.append(line)
                size += len(line)
            if step % 200 == 0:
                line = f"\n[INFO|trainer.py:3000] 2026-11-30 10:{step % 60:02d}:00,000 >> Saving model checkpoint\n"
                parts.append(line)
                size += len(line)
            if size >= target:
                break
        if run == 1 and size < target:
            oom = ("\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 248.00 MiB. GPU 0 has a total "
                   "capacity of 7.66 GiB of which 58.00 MiB is free. Of the allocated memory 6.98 GiB is allocated "
                   "by PyTorch, and 394.00 MiB is reserved by PyTorch but unallocated.\n")
            parts.append(oom)
            size += len(oom)
    parts.append("\n{'train_runtime': 3600.0, 'train_mem_gpu_alloc_delta': 1048576, "
                 "'train_mem_gpu_peaked_delta': 6442450944}\n***** train metrics *****\n")
    return "".join(parts)


def cpu() -> float:
    return time.process_time()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--check", action="store_true", help="compare with the line-by-line reader")
    args = p.parse_args(argv)

    from ledger.intake import logs

    text = make_log(args.mb)
    size = len(text.encode("utf-8")) / 1e6
    best = None
    for _ in range(args.repeat):
        t0 = cpu()
        runs = logs.parse_runs(text, "bench.log")
        spent = cpu() - t0
        best = spent if best is None else min(best, spent)
    print(f"log: {size:.1f} MB, {text.count(chr(10)) + text.count(chr(13))} lines, {len(runs)} runs")
    print(f"parse_runs: {best:.2f} s of CPU = {size / best:.1f} MB/s (target >= 30 MB/s)")
    if args.check:
        t0 = cpu()
        slow = logs.parse_runs(text, "bench.log", fast=False)
        spent = cpu() - t0
        print(f"line by line: {spent:.2f} s of CPU = {size / spent:.1f} MB/s")
        same = [vars(a) for a in runs] == [vars(b) for b in slow]
        print("same runs: " + ("yes" if same else "NO"))
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The unlisted-model path, timed: a model whose config nobody has dry-run, answered from scratch.

    python benchmarks/unlisted_model.py [--config llama-3.1-8b] [--gpu "RTX 4090"] [--skip-fit]

A shipped config is copied under a new name into a temporary folder (so no committed row is its),
then, each with an empty cache of its own and timed in wall seconds as a user runs them:
  estimate : vram estimate --model COPY --rank 16 --seq-len 4096 --gpu GPU   (2 dry runs)
  ceiling  : vram ceiling --model COPY --rank 16 --gpu GPU                   (the longest length at rank 16)
  fit      : vram fit --model COPY --gpu GPU                                 (its stock grid: 26 dry runs for a 128k context)
Printed: each command's wall seconds, how many dry runs it ran, and the fit's ratio to the target
(issue "any model, any card, any length": a new 8B config's one-card table in <= 3 min on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ledger.core.paths import MODEL_CONFIGS  # noqa: E402

FIT_TARGET_S = 180.0


def timed(argv: list[str], cache: Path) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ledger.cli", *argv, "--cache", str(cache)], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    rows = cache / "dry-runs.json"
    n = len(json.loads(rows.read_text())["measurements"]) if rows.exists() else 0
    return wall, n, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama-3.1-8b", help="a shipped config to copy (default llama-3.1-8b)")
    ap.add_argument("--gpu", default="RTX 4090")
    ap.add_argument("--skip-fit", action="store_true", help="time estimate and ceiling only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / f"unlisted-{args.config}.json"
        shutil.copy(MODEL_CONFIGS / f"{args.config}.json", copy)
        print(f"{copy.name} on {args.gpu}, {os.cpu_count()} cores")
        runs = [("estimate", ["estimate", "--model", str(copy), "--rank", "16", "--seq-len", "4096", "--gpu", args.gpu]),
                ("ceiling", ["ceiling", "--model", str(copy), "--rank", "16", "--gpu", args.gpu])]
        if not args.skip_fit:
            runs.append(("fit", ["fit", "--model", str(copy), "--gpu", args.gpu]))
        for name, argv in runs:
            wall, n, out = timed(argv, Path(tmp) / f"cache-{name}")
            first = next((line for line in out.splitlines() if line.strip() and not line.startswith("for ")), "")
            print(f"{name:>9}: {wall:7.1f} s wall, {n} dry runs; {first.strip()[:150]}")
            if name == "fit":
                print(f"{'':>9}  fit / target ({FIT_TARGET_S:.0f} s): {wall / FIT_TARGET_S:.2f} "
                      f"({'met' if wall <= FIT_TARGET_S else 'NOT met'})")


if __name__ == "__main__":
    main()

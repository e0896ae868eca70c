"""Every answer against the project's own dry run of the same recipe, over the shipped models.

    python benchmarks/self_consistency.py [--n 60] [--seed 0] [--models qwen2.5-0.5b,...] [--gpu rtx-4090]
        [--max-tokens 8192] [--json]

Draws ``--n`` random recipes (``probe_kit.self_check.sample_recipes``: rank 8-512, lengths 256
up to the model's context, both quants, every optimizer, micro-batch 1-8, checkpointing on and
off, dropout, DoRA, the stock recipe and Liger's and TRL's settings) over the shipped dense models,
answers each as ``vram estimate --gpu`` does (a training run; the dry runs an answer lacks computed
first, ranks 8 and 64 at its length), runs the dry run of the recipe itself (with its optimizer's
step) plus the card's remainder, and prints the distribution of (dry run - answer's top) / answer's
top. Above 0 the answer is below its own dry run: the benchmark exits 1 if any is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_MODELS = ("qwen2.5-0.5b,gemma-3-1b-it,llama-3.2-1b,qwen2.5-1.5b,qwen2.5-3b,llama-3.2-3b,phi-3.5-mini,"
                  "qwen3-4b,gemma-3-4b-it,mistral-7b,qwen2.5-7b,llama-3.1-8b")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--gpu", default="rtx-4090")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import numpy as np

    from ledger.storage import store
    from ledger.vocab.cards import require_card
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.core.paths import DEFAULT_LEDGER
    from probe_kit.self_check import check, sample_recipes

    ledger = store.load(DEFAULT_LEDGER)
    gpu, entry, _ = require_card(ledger, args.gpu)
    recipes = sample_recipes(args.models.split(","), args.n, args.seed, args.max_tokens)
    t0 = time.perf_counter()
    done = [0]

    def progress():
        done[0] += 1
        print(f"\r{done[0]} dry runs, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    checks = check(ledger, load_dry_runs(), recipes, gpu, entry, progress)
    print(file=sys.stderr)
    gaps = np.array([c.gap for c in checks if c.gap is not None])
    below = [c for c in checks if c.below]
    doc = {"n": len(checks), "answered": int(len(gaps)), "below": len(below),
           "gap_pct": {q: round(float(np.percentile(gaps, q)) * 100, 2) for q in (0, 5, 25, 50, 75, 95, 100)}
           if len(gaps) else None,
           "seconds": round(time.perf_counter() - t0, 1),
           "below_cases": [{"recipe": str(c.recipe), "answer_top_mib": c.answer_top_mib, "dry_mib": c.dry_mib,
                            "method": c.method} for c in below]}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{doc['n']} recipes on {gpu}, {doc['answered']} answered with a figure, {doc['seconds']} s")
        print("(dry run - answer's top) / answer's top, %: " + ", ".join(
            f"p{q} {v:+.2f}" for q, v in (doc["gap_pct"] or {}).items()))
        print(f"answers below their own dry run: {doc['below']}")
        for c in doc["below_cases"]:
            print(f"  {c['recipe']}: answer's top {c['answer_top_mib']} MiB < dry run {c['dry_mib']:.1f} MiB "
                  f"({c['method']})")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())

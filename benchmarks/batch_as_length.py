"""A micro-batch as one longer sequence: the dry run of B sequences of L tokens against the dry run of
one sequence of B x L tokens, which is how the predictor answers a batch (``ledger.fit.response_span.
answerable``), without memory fixes and with the program's.

    python benchmarks/batch_as_length.py [--models qwen2.5-0.5b,llama-3.2-1b,gemma-3-1b-it,qwen2.5-1.5b]
                                         [--no-gradient-checkpointing] [--fixes F]...

Printed per model, quantisation, fixes and (B, L): both dry runs' peak allocated (MiB, fake tensors,
tracker meter) and the single sequence's difference; then the largest |difference| without fixes
(``BATCH_AS_LENGTH_ERR`` must be at least that) and with them (why a batch with fixes is not derived).
Rank 16, response 64 tokens per sequence. With ``--no-gradient-checkpointing`` the same for the
stock step without checkpointing (``BATCH_AS_LENGTH_ERR_NO_CKPT``; the preset always has it on).
``--fixes`` (repeatable): other memory fixes to check (default: none, and the preset with
checkpointing); a set whose largest |difference| the width covers, with the single sequence never
below the batch, is one ``response_span.PER_TOKEN_FIXES`` may list.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.vocab.recipe import fixes_key, fixes_value, parse_fixes  # noqa: E402
from ledger.fit.response_span import BATCH_AS_LENGTH_ERR, BATCH_AS_LENGTH_ERR_NO_CKPT  # noqa: E402
from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.recipe import ProbeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b,gemma-3-1b-it,qwen2.5-1.5b")
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument("--fixes", action="append", help="memory fixes to check (repeatable)")
    args = ap.parse_args()
    ckpt = not args.no_gradient_checkpointing
    err = BATCH_AS_LENGTH_ERR if ckpt else BATCH_AS_LENGTH_ERR_NO_CKPT
    warnings.simplefilter("ignore")
    settings = [fixes_key(fixes_value(parse_fixes(f))) for f in args.fixes or (["none", "all"] if ckpt else ["none"])]
    worst = {f: 0.0 for f in settings}
    lowest = {f: 0.0 for f in settings}
    for model in args.models.split(","):
        for quant in ("4bit", "bf16") if model == "gemma-3-1b-it" else ("4bit",):
            for fixes in settings:
                for b, n in ((2, 1024), (4, 512), (8, 512)):
                    on = parse_fixes(fixes)
                    batch = dry_run(ProbeConfig(model=model, rank=16, quant=quant, seq_len=n, response_len=64, fixes=on,
                                                random_weights=True, batch_size=b,
                                                gradient_checkpointing=ckpt))["peak_mib"]
                    one = dry_run(ProbeConfig(model=model, rank=16, quant=quant, seq_len=b * n, response_len=64 * b,
                                              fixes=on, random_weights=True, gradient_checkpointing=ckpt))["peak_mib"]
                    diff = (one - batch) / batch * 100
                    worst[fixes] = max(worst[fixes], abs(diff))
                    lowest[fixes] = min(lowest[fixes], diff)
                    print(f"{model:>14} {quant:>4} fixes {fixes:>4} {b} x {n:>5}: {batch:>9.1f} MiB; one sequence of "
                          f"{b * n:>5}: {one:>9.1f} MiB ({diff:+.2f}%)", flush=True)
    name = "BATCH_AS_LENGTH_ERR" if ckpt else "BATCH_AS_LENGTH_ERR_NO_CKPT"
    for fixes in settings:
        print(f"fixes {fixes}, checkpointing {'on' if ckpt else 'off'}: largest |difference| {worst[fixes]:.2f}% "
              f"({name} {err:.2%}: {'covers it' if worst[fixes] <= err * 100 + 1e-9 else 'does NOT cover it'}); "
              f"lowest signed {lowest[fixes]:+.2f}% (the single sequence below the batch: never, if >= 0)")


if __name__ == "__main__":
    main()

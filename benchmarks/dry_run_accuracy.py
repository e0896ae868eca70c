"""The dry run against the bundled ledger's probes, and what it costs.

    python benchmarks/dry_run_accuracy.py [--limit N]

For every probe in the ledger with memory fixes "all" on the RX 7900 XTX and the RTX 3060 Ti
(4-bit and bf16, ranks 16-256, dropout, DoRA, seq 2048-16384), the dry run of the same
configuration (the multimodal class, as the program loaded unsloth/gemma-3-4b-it) predicts peak
allocated. A constant for what fake tensors cannot see (kernel workspaces, the CUDA context's
allocations through the allocator) is fitted leave-one-out: for each row, the median of
(measured - dry run) over the other ok rows. Printed: each row's measured, raw and fitted
prediction and signed % error, the median |error| and the worst row; for OOM rows whether the
prediction exceeds the card's limit; and the cost of one 4B dry run at 7177 tokens (seconds and
peak RSS of a fresh process).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ledger.storage import store  # noqa: E402
from ledger.fit.calibration import card_mib, limit_for, limits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, help="only the first N configurations")
    args = ap.parse_args()
    from probe_kit.dry_run import predict
    from probe_kit.recipe import ProbeConfig, parse_fixes

    lg = store.load(REPO / "ledger" / "vram.json")
    rows = [m for m in lg.measurements if m.kind == "probe" and m.gpu in ("rx-7900-xtx", "rtx-3060-ti")
            and m.memory_fixes == "all" and m.outcome.status in ("ok", "oom")]
    rows = rows[: args.limit] if args.limit else rows
    cache: dict[tuple, float] = {}
    results = []
    for m in rows:
        key = (m.quant, m.lora.rank, bool(m.lora.dropout), bool(m.lora.dora), m.seq_len, m.response_len)
        if key not in cache:
            cfg = ProbeConfig(model="gemma-3-4b-it", random_weights=True, rank=m.lora.rank, dropout=m.lora.dropout or 0.0,
                              dora=bool(m.lora.dora), quant=m.quant, seq_len=m.seq_len, response_len=m.response_len,
                              fixes=parse_fixes("all"))
            with contextlib.redirect_stdout(io.StringIO()):
                outcome, _ = predict(cfg, multimodal=True)
            cache[key] = outcome["peak_allocated_mib"]
            print(f"  dry run {key}: {cache[key]} MiB", file=sys.stderr, flush=True)
        results.append((m, cache[key]))
    ok = [(m, d) for m, d in results if m.outcome.status == "ok"]
    print(f"{'row':<48} {'measured':>9} {'dry':>9} {'fitted':>9} {'raw %':>7} {'fit %':>7}")
    errors_raw, errors_fit = [], []
    for m, d in ok:
        others = [x.outcome.peak_allocated_mib - dd for x, dd in ok if x.id != m.id]
        offset = statistics.median(others) if others else 0.0
        measured = m.outcome.peak_allocated_mib
        raw = (d - measured) / measured * 100
        fit = (d + offset - measured) / measured * 100
        errors_raw.append(raw)
        errors_fit.append(fit)
        print(f"{m.id:<48} {measured:>9.1f} {d:>9.1f} {d + offset:>9.1f} {raw:>+7.2f} {fit:>+7.2f}")
    print(f"median |error|: raw {statistics.median(abs(e) for e in errors_raw):.2f}%, "
          f"fitted (leave-one-out offset) {statistics.median(abs(e) for e in errors_fit):.2f}%")
    worst = max(zip(ok, errors_fit), key=lambda t: abs(t[1]))
    print(f"worst row (fitted): {worst[0][0].id} {worst[1]:+.2f}%")
    lims = limits(lg, lg.measurements)
    for m, d in results:
        if m.outcome.status == "oom":
            lim = limit_for(lims, m.gpu)
            card = card_mib(lg, m.gpu)
            print(f"OOM row {m.id}: dry run {d} MiB vs the card's limit {lim.low_mib}-{lim.high_mib} MiB "
                  f"(capacity {card}): {'exceeds the largest fit' if d > lim.low_mib else 'does NOT exceed'}")
    # Cost: one 4B dry run at 7177 tokens in a fresh process.
    code = ("import resource, time, contextlib, io\n"
            "from probe_kit.dry_run import dry_run\nfrom probe_kit.recipe import ProbeConfig\n"
            "t = time.perf_counter()\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    dry_run(ProbeConfig(model='gemma-3-4b-it', random_weights=True, rank=16, seq_len=7177, "
            "response_len=237), multimodal=True)\n"
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    seconds, rss = (float(x) for x in out.stdout.split())
    print(f"cost: 4B model at 7177 tokens: {seconds:.1f} s, peak RSS {rss:.0f} MiB (targets: <= 30 s, <= 1024 MiB)")


if __name__ == "__main__":
    main()

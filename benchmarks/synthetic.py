"""Synthetic ledgers of any size for the benchmarks: realistic shapes, deterministic values."""

from __future__ import annotations

import random

from ledger.core.models import (
    SCHEMA_VERSION,
    Dataset,
    Gpu,
    Ledger,
    Lora,
    Measurement,
    Oom,
    Outcome,
    Provenance,
)

GPUS = {
    "rtx-3070-ti": Gpu(name="NVIDIA GeForce RTX 3070 Ti", vendor="nvidia", total_mib=8192),
    "rx-7900-xtx": Gpu(name="AMD Radeon RX 7900 XTX", vendor="amd", total_mib=24560),
    "rtx-4090": Gpu(name="NVIDIA GeForce RTX 4090", vendor="nvidia", total_mib=24564),
}


def synthetic_ledger(n: int, seed: int = 0) -> Ledger:
    """A ledger of n probe/real measurements across three cards, ranks, dropout, DoRA and lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gpu = rng.choice(list(GPUS))
        rank = rng.choice([8, 16, 32, 64, 96, 112, 128, 192, 256])
        seq = rng.choice([2048, 4096, 7177, 8192, 16384])
        dropout = rng.choice([0.0, 0.1])
        dora = rng.random() < 0.1
        peak = 3000 + rank * 15 + seq * 0.35 + (170 if dropout else 0) + (1800 if dora else 0) + rng.gauss(0, 20)
        total = GPUS[gpu].total_mib
        if peak * 1.05 > total:  # what the allocator reserves decides an OOM (a fit never holds more than the card)
            outcome = Outcome(status="oom", pre_step_mib=round(peak * 0.55, 1),
                              oom=Oom(tried_mib=70.0, free_mib=48.0, message="CUDA out of memory."))
        else:
            outcome = Outcome(status="ok", after_load_mib=3079.8, pre_step_mib=round(peak * 0.55, 1),
                              peak_allocated_mib=round(peak, 1), peak_reserved_mib=round(peak * 1.05, 1),
                              step_s=round(rng.uniform(4, 60), 2))
        out.append(
            Measurement(
                id=f"syn-{i:06d}", kind=rng.choice(["probe", "probe", "real"]), gpu=gpu,
                model="unsloth/gemma-3-4b-it", quant=rng.choice(["4bit", "bf16"]),
                lora=Lora(rank=rank, alpha=float(rank * 2), rslora=rng.random() < 0.5, dropout=dropout, dora=dora),
                seq_len=seq, response_len=237, memory_fixes="all",
                dataset=Dataset(name="synthetic", examples=1000, longest_example_tokens=seq),
                outcome=outcome,
                provenance=Provenance(source=f"synthetic.log:{i + 1}", measured_on="2026-10-15"),
            )
        )
    return Ledger(schema_version=SCHEMA_VERSION, about="Synthetic benchmark ledger.", gpus=dict(GPUS),
                  measurements=out)


def realistic_ledger(n: int, base=None) -> Ledger:
    """A ledger of n measurements made of the bundled ledger's rows and clones of them with new
    ids (what a user's ledger looks like after a few sweeps of the same recipes: a third of the rows
    pair with a committed dry run, against a few percent of the synthetic ones). The bundled
    findings and predictions are kept (they cite the original rows, which stay)."""
    from ledger.storage import store
    from ledger.core.paths import DEFAULT_LEDGER

    base = base or store.load(DEFAULT_LEDGER)
    rows = list(base.measurements)
    out = list(rows)
    k = 0
    while len(out) < n:
        k += 1
        for m in rows:
            if len(out) >= n:
                break
            out.append(m.model_copy(update={"id": f"{m.id}-c{k}"}))
    return base.model_copy(update={"measurements": out[:n] if n >= len(rows) else out})

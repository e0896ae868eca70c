"""The plots' data (``plots/*.svg``): peak against rank per card, against sequence length, probe
against real; a point that did not fit is never drawn like one that did."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from ledger.core.models import Ledger, Measurement
from ledger.vocab.recipe import capacity_mib, seq_len_of
from .index_page import fixes_text, gpu_label
from .views import Plot, PlotPoint, PlotSeries

# -- plots --------------------------------------------------------------------------------


def _natural(key: tuple) -> tuple:
    """A sort key that orders numbers as numbers (2048 before 12288) and the rest as text."""
    return tuple((0, float(x), "") if isinstance(x, (int, float)) and not isinstance(x, bool) else (1, 0.0, str(x))
                 for x in key)


def _series_label(key: tuple) -> str:
    quant, fixes, dropout, dora, seq = key
    bits = [quant, f"fixes {fixes}", "dropout" if dropout else "no dropout"]
    if dora:
        bits.append("DoRA")
    if seq:
        bits.append(f"{seq} tokens")
    return ", ".join(bits)


def _keep_highest(points: dict, x: float, m: Measurement, limit: Optional[float]) -> None:
    """Keep, per x, the highest peak of a series; an OOM (drawn at the card's limit as
    'exceeded') outranks any peak that fit. Readable at any ledger size."""
    o = m.outcome
    if o.status == "oom":
        if limit is None:
            return
        cand = (True, limit, m.id, "oom")
    elif o.peak_allocated_mib is not None and o.status in ("ok", "spilled", None):
        cand = (False, o.peak_allocated_mib, m.id, o.status or "ok")
    else:
        return
    old = points.get(x)
    if old is None or cand[:2] > old[:2]:
        points[x] = cand


def _points(points: dict) -> list[PlotPoint]:
    return [PlotPoint(x=x, y=v[1], id=v[2], status=v[3], exceeded=v[0]) for x, v in sorted(points.items())]


def make_plots(ledger: Ledger) -> list[Plot]:
    """Peak vs rank per card, peak vs sequence length, probe vs real: one pass over the rows."""
    limits = {key: capacity_mib(gpu) for key, gpu in ledger.gpus.items()}
    by_rank: dict[str, dict[tuple, dict]] = defaultdict(lambda: defaultdict(dict))
    by_seq: dict[tuple, dict] = defaultdict(dict)
    probe_real: dict[str, dict[tuple, dict]] = defaultdict(lambda: defaultdict(dict))
    has_real: set[str] = set()
    for m in ledger.measurements:
        gpu, lora = m.gpu, m.lora
        if not gpu or not lora:
            continue
        limit, rank = limits[gpu], float(lora.rank)
        dropout, dora = bool(lora.dropout), bool(lora.dora)
        ok = m.outcome.status == "ok" and m.outcome.peak_allocated_mib is not None
        if m.kind == "probe":
            fixes = fixes_text(m)
            seq = seq_len_of(m)
            _keep_highest(by_rank[gpu][(m.quant or "?", fixes or "?", dropout, dora, seq)], rank, m, limit)
            if m.seq_len:
                _keep_highest(by_seq[(gpu, m.quant, lora.rank, dropout, dora, fixes)], float(m.seq_len), m, limit)
            if ok:
                _keep_highest(probe_real[gpu][(0, dropout)], rank, m, limit)
        elif m.kind == "real" and ok:
            has_real.add(gpu)
            _keep_highest(probe_real[gpu][(1, dropout)], rank, m, limit)

    plots: list[Plot] = []
    for key, gpu in ledger.gpus.items():
        series = by_rank.get(key)
        if not series:
            continue
        plots.append(
            Plot(
                id=f"peak-vs-rank-{key}", file=f"plots/peak-vs-rank-{key}.svg",
                title=f"Probe peak allocated vs LoRA rank on the {gpu.name}",
                caption=(f"One-step probes on the {gpu.name}: peak allocated (MiB) by rank, one line per quant × "
                         "memory fixes × dropout × DoRA × sequence length (the highest value per rank). An OOM is "
                         "drawn as a red × on the card's line: the step needed more than the card could give; a run "
                         "that finished only by spilling past the card is an orange ▲ just above the line, its real "
                         "peak written beside it. Hover a point for its id and peak."),
                alt=(f"Line chart of probe peak allocated memory in MiB against LoRA rank on the {gpu.name}, "
                     f"{len(series)} series; OOM probes are marked at the card limit."),
                xlabel="LoRA rank", ylabel="peak allocated (MiB)",
                series=[PlotSeries(_series_label(k), _points(v)) for k, v in sorted(series.items(),
                                                                                     key=lambda kv: _natural(kv[0]))],
                limit_mib=limits[key], limit_label="card limit (torch)" if gpu.usable_gib_torch else "card total",
            )
        )
    seq_series = {k: v for k, v in by_seq.items() if len(v) >= 2}
    if seq_series:
        plots.append(
            Plot(
                id="peak-vs-seq-len", file="plots/peak-vs-seq-len.svg",
                title="Probe peak allocated vs sequence length",
                caption=("One-step probes: peak allocated (MiB) by sequence length, one line per card × quant × rank × "
                         "dropout × DoRA × memory fixes. The growth is not linear over long sequences."),
                alt="Line chart of probe peak allocated memory in MiB against sequence length in tokens.",
                xlabel="sequence length (tokens)", ylabel="peak allocated (MiB)",
                series=[
                    PlotSeries(
                        f"{gpu_label(ledger, k[0])}, {k[1]}, r{k[2]}"
                        + (", dropout" if k[3] else "") + (", DoRA" if k[4] else "") + f", fixes {k[5]}",
                        _points(v),
                    )
                    for k, v in sorted(seq_series.items(), key=lambda kv: _natural(kv[0]))
                ],
            )
        )
    names = ("probes (one step)", "real runs")
    for key, gpu in ledger.gpus.items():
        if key not in has_real:
            continue
        groups = probe_real[key]
        plots.append(
            Plot(
                id=f"probe-vs-real-{key}", file=f"plots/probe-vs-real-{key}.svg",
                title=f"Probe vs real-run peaks on the {gpu.name}",
                caption=("Peak allocated (MiB) by rank for one-step probes and for real training runs on the same card "
                         "(highest value per rank). The probe has no optimizer step and over-estimates the real peak."),
                alt=f"Scatter chart comparing probe and real-run peak allocated memory by LoRA rank on the {gpu.name}.",
                xlabel="LoRA rank", ylabel="peak allocated (MiB)",
                series=[PlotSeries(f"{names[k[0]]}, {'dropout' if k[1] else 'no dropout'}", _points(groups[k]))
                        for k in sorted(groups)],
                limit_mib=limits[key], limit_label="card limit (torch)" if gpu.usable_gib_torch else "card total",
            )
        )
    return plots

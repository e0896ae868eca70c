"""What a ledger must also be that its JSON Schema cannot say: every id it cites exists, and
every figure is physically possible.

Both run wherever a ledger is read or written (``store``), so ``validate``, ``merge``, ``build``,
``predict`` and every append refuse the same files, each problem as one located line.

Physics, each rule a property of the instruments, not of this ledger:

- an out-of-memory row has no peak (``torch.cuda.max_memory_allocated`` read after an OOM is a
  lower bound of what the step needed, and lives in ``outcome.oom.max_allocated_mib``);
- the allocator's reserved memory includes what it allocated: peak reserved >= peak allocated;
- nothing is measured after today (one day's grace for time zones);
- a run that fit (``ok``) never held more than its card has; one that finished past the card
  ``spilled``, and a driver spills into shared host memory only, which is at most half of a
  host's RAM (Windows' shared GPU memory, the amdgpu GTT): ``MAX_SPILL_MIB`` past the card total
  is a unit mistake, not a spill;
- a full fine-tuning row (``finetune: full``) trains every weight: no LoRA settings, and no 4-bit
  weights (they cannot be trained);
- a rank of a multi-GPU run names both its world (``world_size`` of 2 or more) and its strategy;
  CPU offload is a sharded run's (FSDP, ZeRO);
  one GPU has neither;
- the allocator's simulation (``outcome.allocator``) is a dry run's, and its reserved includes its
  allocated too.
"""

from __future__ import annotations

import datetime as dt
from typing import Iterable, Optional, Sequence

from .errors import Issue
from .models import Ledger, Measurement

#: Half of the largest host RAM a single-card training box holds (512 GiB), in MiB: the most a
#: driver can spill past a card.
MAX_SPILL_MIB = 256 * 1024.0
#: Measurement dates may run one day ahead of this machine's clock (a box in another time zone).
DATE_GRACE = dt.timedelta(days=1)


def reference_issues(ledger: Ledger, name: str) -> list[Issue]:
    """Cross-references the schema cannot express: unique ids, known gpus, known evidence. A
    prediction's basis may cite the dry-run rows it carries in ``dry_run_rows``."""
    issues: list[Issue] = []

    def unique(section: str, items: Sequence) -> set[str]:
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            if item.id in first:
                issues.append(
                    Issue(name, f"{section}[{i}].id", f"duplicate id {item.id!r} (first at {section}[{first[item.id]}])")
                )
            else:
                first[item.id] = i
        return set(first)

    ids = unique("measurements", ledger.measurements)
    unique("findings", ledger.findings)
    unique("predictions", ledger.predictions)
    known = ", ".join(sorted(ledger.gpus)) or "none"

    for section, items in (("measurements", ledger.measurements), ("predictions", ledger.predictions)):
        for i, item in enumerate(items):
            if item.gpu is not None and item.gpu not in ledger.gpus:
                issues.append(Issue(name, f"{section}[{i}].gpu", f"unknown gpu {item.gpu!r} (known: {known})"))
    for i, finding in enumerate(ledger.findings):
        for j, ref in enumerate(finding.evidence):
            if ref not in ids:
                issues.append(Issue(name, f"findings[{i}].evidence[{j}]", f"unknown measurement id {ref!r}"))
    for i, pred in enumerate(ledger.predictions):
        carried = {d.id for d in pred.dry_run_rows}
        for j, d in enumerate(pred.dry_run_rows):
            if d.kind != "dry_run":
                issues.append(Issue(name, f"predictions[{i}].dry_run_rows[{j}].kind",
                                    f"a carried row must be a dry run, got {d.kind!r}"))
        for j, ref in enumerate(pred.basis):
            if ref not in ids and ref not in carried:
                issues.append(Issue(name, f"predictions[{i}].basis[{j}]", f"unknown measurement id {ref!r}"))
        if pred.score is not None and pred.score.measurement not in ids:
            issues.append(
                Issue(name, f"predictions[{i}].score.measurement", f"unknown measurement id {pred.score.measurement!r}")
            )
    return issues


def _future(day: Optional[dt.date], today: dt.date) -> bool:
    return day is not None and day > today + DATE_GRACE


def _card_total(ledger: Ledger, m: Measurement) -> Optional[float]:
    gpu = ledger.gpus.get(m.gpu) if m.gpu else None
    return gpu.total_mib if gpu is not None else None


def measurement_issues(ledger: Ledger, m: Measurement, where: str, name: str, today: dt.date) -> Iterable[Issue]:
    """Every physically impossible figure of one measurement."""
    o = m.outcome
    peaks = [(k, v) for k, v in (("peak_allocated_mib", o.peak_allocated_mib), ("peak_reserved_mib",
                                                                                o.peak_reserved_mib)) if v is not None]
    if o.status == "oom":
        for k, _ in peaks:
            yield Issue(name, f"{where}.outcome.{k}", "an out-of-memory row has no peak: what was read after the "
                        "OOM is a lower bound (outcome.oom.max_allocated_mib)")
    if o.peak_allocated_mib is not None and o.peak_reserved_mib is not None and o.peak_reserved_mib < o.peak_allocated_mib:
        yield Issue(name, f"{where}.outcome.peak_reserved_mib", f"{o.peak_reserved_mib} MiB reserved is below the "
                    f"{o.peak_allocated_mib} MiB allocated (the allocator's reserved memory includes what it allocated)")
    if m.finetune == "full" and m.lora is not None:
        yield Issue(name, f"{where}.lora", "a full fine-tuning row (finetune: full) trains every weight: it has no "
                    "LoRA settings")
    if m.finetune == "full" and m.quant == "4bit":
        yield Issue(name, f"{where}.quant", "a full fine-tuning row cannot have 4-bit weights: they are not trainable")
    if (m.world_size or 1) > 1 and m.strategy is None:
        yield Issue(name, f"{where}.strategy", f"a rank of a {m.world_size}-GPU run names its strategy (ddp, fsdp, "
                    "fsdp-shard-grad-op, zero2, zero3)")
    if m.strategy is not None and (m.world_size or 1) == 1:
        yield Issue(name, f"{where}.world_size", f"strategy {m.strategy} is a multi-GPU run's: world_size must be 2 "
                    "or more")
    if m.cpu_offload and m.strategy in (None, "ddp"):
        yield Issue(name, f"{where}.cpu_offload", "CPU offload is a sharded run's (FSDP's, DeepSpeed ZeRO's): "
                    f"{m.strategy or 'one GPU'} has none")
    sim = o.allocator
    if sim is not None and m.kind != "dry_run":
        yield Issue(name, f"{where}.outcome.allocator", "the allocator's simulation is a dry run's (kind dry_run); "
                    f"a {m.kind} row's reserved figure is measured (outcome.peak_reserved_mib)")
    if sim is not None and sim.peak_reserved_mib < sim.peak_allocated_mib:
        yield Issue(name, f"{where}.outcome.allocator.peak_reserved_mib", f"{sim.peak_reserved_mib} MiB reserved is "
                    f"below the {sim.peak_allocated_mib} MiB allocated (reserved includes what is allocated)")
    if _future(m.provenance.measured_on, today):
        yield Issue(name, f"{where}.provenance.measured_on", f"{m.provenance.measured_on} is in the future "
                    f"(today is {today})")
    total = _card_total(ledger, m)
    if total is not None and peaks:
        key, peak = max(peaks, key=lambda kv: kv[1])
        if peak > total + MAX_SPILL_MIB:
            yield Issue(name, f"{where}.outcome.{key}", f"{peak} MiB is more than {m.gpu}'s {total} MiB and all a "
                        f"driver can spill past it ({MAX_SPILL_MIB:.0f} MiB): a unit mistake, or the wrong card?")
        elif o.status == "ok" and peak > total:
            yield Issue(name, f"{where}.outcome.{key}", f"{peak} MiB is more than {m.gpu}'s {total} MiB: a run that "
                        "finished past its card spilled (status spilled), else the figure or the card is wrong")


def _suspect(m: Measurement, latest: dt.date, totals: dict) -> bool:
    """A cheap test that passes every possible row: only a row it flags is examined in full."""
    if m.finetune == "full":
        return True
    o = m.outcome
    a, r = o.peak_allocated_mib, o.peak_reserved_mib
    if a is None and r is None:
        day = m.provenance.measured_on
        return day is not None and day > latest
    if o.status == "oom" or (a is not None and r is not None and r < a):
        return True
    day = m.provenance.measured_on
    if day is not None and day > latest:
        return True
    total = totals.get(m.gpu)
    return total is not None and max(a or 0.0, r or 0.0) > total


def physical_issues(ledger: Ledger, name: str, today: Optional[dt.date] = None) -> list[Issue]:
    """Figures no instrument can have produced (see the module's rules), one located Issue each."""
    today = today or dt.date.today()
    latest = today + DATE_GRACE
    totals = {key: gpu.total_mib for key, gpu in ledger.gpus.items() if gpu.total_mib is not None}
    issues: list[Issue] = []
    for i, m in enumerate(ledger.measurements):
        if _suspect(m, latest, totals):  # a ledger of 100k rows is read on every write: keep the pass cheap
            issues += measurement_issues(ledger, m, f"measurements[{i}]", name, today)
    for i, p in enumerate(ledger.predictions):
        where = f"predictions[{i}]"
        if _future(p.made_on, today):
            issues.append(Issue(name, f"{where}.made_on", f"{p.made_on} is in the future (today is {today})"))
        if (p.interval_low_mib is not None and p.interval_high_mib is not None
                and p.interval_low_mib > p.interval_high_mib):
            issues.append(Issue(name, f"{where}.interval_low_mib", f"{p.interval_low_mib} MiB is above the interval's "
                                f"top, {p.interval_high_mib} MiB"))
        for j, d in enumerate(p.dry_run_rows):
            issues += measurement_issues(ledger, d, f"{where}.dry_run_rows[{j}]", name, today)
    for key, gpu in ledger.gpus.items():
        if _future(gpu.provenance.measured_on, today):
            issues.append(Issue(name, f"gpus.{key}.provenance.measured_on",
                                f"{gpu.provenance.measured_on} is in the future (today is {today})"))
    for i, f in enumerate(ledger.findings):
        if _future(f.provenance.measured_on, today):
            issues.append(Issue(name, f"findings[{i}].provenance.measured_on",
                                f"{f.provenance.measured_on} is in the future (today is {today})"))
    return issues


def ledger_issues(ledger: Ledger, name: str) -> list[Issue]:
    """Cross-references, then physics: everything the models cannot say."""
    return reference_issues(ledger, name) + physical_issues(ledger, name)

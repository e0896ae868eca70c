"""Real-run evidence from training logs (no torch): peaks, OOMs, crashes, when and at which step.

What is read, line by line:

- this project's callback line: ``vram-ledger: {"event": "train_end" | "oom", ...}`` (JSON);
- PyTorch OOM messages in every form (``ledger.intake.oom``), and the step they happened at when the log
  shows progress (``236/1172``);
- crashes: ``illegal memory access``, ``Xid NN``, other ``CUDA error:`` / ``HIP error:`` lines;
- HF Trainer memory metrics (``train_mem_gpu_peaked_delta`` and friends): deltas over the memory
  at the stage's start, not absolute peaks, and recorded as such (``peak_delta_mib``);
- axolotl's ``memory/max_mem_allocated(gib)``, ``memory/max_mem_active(gib)`` and
  ``memory/device_mem_reserved(gib)``;
- Unsloth's ``Peak reserved memory = X GB.``;
- DeepSpeed's ``see_memory_usage`` lines (``MA .. Max_MA .. CA .. Max_CA ..``).

Peaks are the highest value seen in a run. A line that looks like one of these but cannot be
read is skipped with a warning naming its line; a log with nothing to go on is an error.

**One log, several runs.** A log often holds a run restarted after an OOM (the script run again
with a smaller rank, appending to the same file). ``parse_runs`` splits it: a new run starts at a
training banner (``***** Running training *****``, ``starting run``), where the progress counter
of the same total goes back, or, once a run has ended (an OOM, a crash, the callback's
``train_end``), at the next timestamped line, progress line or peak. Each run keeps its own line
range and date; a run with no evidence (a banner and nothing else) is dropped.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from bisect import bisect_right
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Optional

from ledger.core.models import Oom
from .oom import find_oom, parse_oom_message
from ledger.core.units import round_mib, to_mib

CALLBACK_PREFIX = "vram-ledger:"

_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_PROGRESS = re.compile(r"(?<![\d/.])(\d+)/(\d+)\s*\[")  # tqdm: " 236/1172 [12:01<..."
# Progress without tqdm's bracket: "31/1000" standing alone at the start of a line, after a bar
# or a "step" word, or before "it/s" / "steps" (plain loggers, other progress bars). Not a date
# or a path ("2026/11/30", "a/b/31/1000"): no '/' or digit on either side.
_PROGRESS_PLAIN = re.compile(
    r"(?:^\s*|\|\s*|\bsteps?\s*[:=]?\s*|\bStep\s*)(?<![\d/.])(\d+)/(\d+)(?![\d/.])"
    r"|(?<![\d/.])(\d+)/(\d+)(?![\d/.])(?=\s*(?:[\d.]+\s*)?(?:it/s|s/it|steps?\b|\|))",
    re.I,
)
_RUN_START = re.compile(r"\*{3,}\s*Running training\s*\*{3,}|\bstarting (?:a )?(?:new )?(?:training )?run\b", re.I)
_STEP_WORD = re.compile(r"\b(?:global_)?step[\s=:]+(\d+)\b", re.I)
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[T ]\d{2}:\d{2}(?::\d{2})?")
_XID = re.compile(r"\bXid\s*(?:\([^)]*\))?:?\s*(\d+)", re.I)
_CRASH = re.compile(r"illegal memory access|\bXid\b|(?:CUDA|HIP) error:|Segmentation fault|core dumped|"
                    r"device-side assert|misaligned address", re.I)
_HF = re.compile(r"['\"]?((?:init|train|eval|test|predict)_mem_(?:gpu|cpu)_(?:alloc|peaked)_delta)['\"]?"
                 r"\s*[:=]\s*" + _NUM + r"\s*(MB|B)?", re.I)
_AXOLOTL = re.compile(r"['\"]?memory/(max_mem_allocated|max_mem_active|device_mem_reserved)\(gib\)['\"]?\s*[:=]\s*"
                      r"([^,}\s]+)", re.I)
_UNSLOTH = re.compile(r"Peak reserved memory\s*=\s*([^\s]+)\s*GB", re.I)
_UNSLOTH_TRAINING = re.compile(r"Peak reserved memory for training", re.I)
_PEAK_SIZE = r"(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|KiB|KB|bytes|B)\b"
# torch's own names printed by a script: "max_memory_allocated=6635.52 MB", "max_memory_reserved: 7.1 GiB"
_TORCH_NAMES = re.compile(r"\b(?:torch\.cuda\.)?max_memory_(allocated|reserved)(?:\(\))?\s*[:=]?\s*" + _PEAK_SIZE,
                          re.I)
# Plain loggers: "Peak GPU memory: 6.48 GiB allocated", "peak memory reserved = 7.2 GB"
_PEAK_PLAIN = re.compile(r"\bpeak\s+(?:gpu\s+|cuda\s+|vram\s+|device\s+)?mem(?:ory)?(?:\s+(allocated|reserved))?"
                         r"\s*[:=]\s*" + _PEAK_SIZE + r"(?:\s+(allocated|reserved))?", re.I)
# A line that reports a peak in some other form: warned about, never silently skipped.
_PEAK_HINT = re.compile(r"\b(?:peak|max(?:imum)?)[_ ]?(?:gpu|cuda|vram|device|mem)", re.I)
_DEEPSPEED = re.compile(r"\bMA\s+" + _NUM + r"\s*GB\s+Max_MA\s+" + _NUM + r"\s*GB\s+CA\s+" + _NUM + r"\s*GB\s+"
                        r"Max_CA\s+" + _NUM + r"\s*GB", re.I)


class LogError(Exception):
    """A log with no evidence in it."""


@dataclass
class RunEvidence:
    """What one log says about one run."""

    status: Optional[str] = None
    peak_allocated_mib: Optional[float] = None
    peak_reserved_mib: Optional[float] = None
    peak_delta_mib: Optional[float] = None
    oom: Optional[Oom] = None
    failed_at_step: Optional[int] = None
    xid: Optional[int] = None
    crash_text: Optional[str] = None
    last_step: Optional[int] = None
    total_steps: Optional[int] = None
    measured_on: Optional[dt.date] = None
    evidence_line: Optional[int] = None
    kinds: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    callback: dict = field(default_factory=dict)
    per_device_peak_mib: Optional[dict[str, float]] = None
    first_line: int = 1
    last_line: Optional[int] = None

    @property
    def ended(self) -> bool:
        """The run died (OOM, crash) or the callback recorded its end: what follows is another run."""
        return self.oom is not None or self.crash_text is not None or self.callback.get("event") == "train_end"

    @property
    def has_evidence(self) -> bool:
        return (self.oom is not None or self.crash_text is not None or self.peak_allocated_mib is not None
                or self.peak_reserved_mib is not None or self.peak_delta_mib is not None)

    def _peak(self, name: str, mib: float, line: int, kind: str) -> None:
        if getattr(self, name) is None or mib > getattr(self, name):
            setattr(self, name, round_mib(mib))
            if self.evidence_line is None or self.oom is None:
                self.evidence_line = line
        if kind not in self.kinds:
            self.kinds.append(kind)


def _float(text: str) -> float:
    value = float(text.strip().strip("'\""))
    if value != value or value < 0:  # NaN or negative
        raise ValueError(text)
    return value


def parse_log(text: str, name: str = "log") -> RunEvidence:
    """Read a log of one run. Raises LogError naming what was missing when the log holds no
    evidence, or naming each run's lines when it holds several (``parse_runs`` reads those)."""
    runs = parse_runs(text, name)
    if len(runs) > 1:
        raise LogError(f"{len(runs)} runs in one log (" + "; ".join(
            f"lines {r.first_line}-{r.last_line}" for r in runs) + ")")
    return runs[0]


def _new_run(ev: RunEvidence, line: str) -> bool:
    """Does this line start another run than ``ev``'s?"""
    if _RUN_START.search(line):
        return ev.has_evidence or ev.last_step is not None
    progress = _progress(line)
    if progress and ev.last_step is not None and ev.total_steps == progress[1] and progress[0] < ev.last_step:
        return True
    if not ev.ended:
        return False
    if progress or _TIMESTAMP.search(line):
        return True
    if CALLBACK_PREFIX in line:
        return '"event": "oom"' not in line.replace("'", '"')  # the callback's record of the OOM just read
    return bool(_HF.search(line) or _AXOLOTL.search(line) or _UNSLOTH.search(line) or _DEEPSPEED.search(line)
                or _TORCH_NAMES.search(line) or _PEAK_PLAIN.search(line))


#: What a line must hold for anything but a progress counter to be read off it: a short trigger of
#: every pattern ``_read_line`` and ``_new_run`` read (a necessary condition, never spanning a line).
#: The lines without one are read for their progress alone (``parse_runs``' fast scan): most of a
#: long log is progress bars redrawn. Literals are found with ``str.find`` on the lower-cased text;
#: the two that are patterns are checked where their literal part is.
_TRIGGER_WORDS = ("running training", "starting ", "step", "vram-ledger:", "out of memory", "_status_alloc_failed",
                  "xid", "error:", "illegal memory", "segmentation fault", "core dumped", "device-side", "misaligned",
                  "_mem_", "memory/", "peak", "max_ma", "max_memory")
_TRIGGER_DATE = re.compile(r"\d{4}-\d\d-\d\d")  # checked at each '-' (four places before it)
_TRIGGER_MAX = re.compile(r"max(?:imum)?[_ ]?(?:gpu|cuda|vram|device|mem)")  # checked at each 'max'
_TRIGGER_LITERAL = re.compile("|".join([re.escape(w) for w in _TRIGGER_WORDS] + ["max"]))  # on lower-cased text
_TRIGGER = re.compile("|".join([re.escape(w) for w in _TRIGGER_WORDS] + [_TRIGGER_DATE.pattern, _TRIGGER_MAX.pattern]),
                      re.I)


def _trigger_positions(text: str) -> list[int]:
    """Where a ``_TRIGGER`` starts in the text (at least one place on every line that holds one)."""
    low = text.lower()
    if len(low) != len(text):  # a character whose lower case is longer: offsets would drift
        return [m.start() for m in _TRIGGER.finditer(text)]
    hits = [m.start() for m in _TRIGGER_LITERAL.finditer(low)
            if low[m.start():m.start() + 3] != "max" or _TRIGGER_MAX.match(low, m.start())]
    at = low.find("-")
    while at >= 0:
        if at >= 4 and _TRIGGER_DATE.match(low, at - 4):
            hits.append(at - 4)
        at = low.find("-", at + 1)
    return hits


def _special_lines(text: str, ends: list[int]) -> set[int]:
    """The numbers (from 1) of the lines of ``text`` that hold a ``_TRIGGER`` (``ends``: where
    each line ends, its separator included)."""
    return {bisect_right(ends, at) + 1 for at in _trigger_positions(text)}


#: ``_PROGRESS`` from its '/' (a literal first: found fast), and the step just before that '/'.
_TQDM_TAIL = re.compile(r"/(\d+)\s*\[")
_STEP_TAIL = re.compile(r"\d+\Z")
_STEP_WINDOW = 24  # characters looked at before the '/' for the step; a longer number is read by _PROGRESS


def _last_tqdm(line: str) -> tuple[Optional[tuple[str, str]], int]:
    """``_PROGRESS.findall(line)[-1]`` (or None) and where that match ends: each '/' with digits and
    a '[' after it, and before it a run of digits that does not follow a digit, '/' or '.'."""
    found, end = None, 0
    m = _TQDM_TAIL.search(line)
    while m:
        at = m.start()
        step = _STEP_TAIL.search(line, max(0, at - _STEP_WINDOW), at)
        if step is not None:
            first = step.start()
            if first == 0 or line[first - 1] not in "/.0123456789":
                found, end = (step[0], m[1]), m.end()
            elif line[first - 1] not in "/.":  # a step longer than the window: as the pattern reads it
                every = list(_PROGRESS.finditer(line))
                return (every[-1].groups(), every[-1].end()) if every else (None, 0)
        m = _TQDM_TAIL.search(line, m.end())
    return found, end


def parse_runs(text: str, name: str = "log", fast: bool = True) -> list[RunEvidence]:
    """Read every run a log holds, each with its line range (``first_line``, ``last_line``).
    Raises LogError naming what was missing when no run holds evidence. ``fast``: a line with no
    ``_TRIGGER`` is read for its progress counter alone, as the whole reading would read it
    (``benchmarks/ingest_bench.py --check`` compares the two)."""
    runs: list[RunEvidence] = []
    ev = RunEvidence()
    lineno = 0
    lines = text.splitlines()
    special = None
    if fast:
        special = _special_lines(text, list(accumulate(map(len, text.splitlines(keepends=True)))))
    # A progress bar is redrawn many times at one step: a line that starts with the last one's
    # text up to the end of its tqdm counter, with no other counter after that, has the same counter.
    seen_head, seen = None, None
    for lineno, line in enumerate(lines, start=1):
        if special is not None and lineno not in special:
            # Only a progress counter can be read here: a new run where it goes back (or after
            # a run ended), else the run's last step (as ``_progress`` reads it).
            if "/" not in line:
                continue
            if seen_head is not None and line.startswith(seen_head) and not _TQDM_TAIL.search(line, len(seen_head)):
                progress = seen
            else:
                found, end = _last_tqdm(line)
                if found is None:
                    seen_head = None
                    progress = _plain_progress(line)
                else:
                    step, total = int(found[0]), int(found[1])
                    progress = (step, total) if step <= total and total > 1 else None
                    seen_head, seen = line[:end], progress
            if progress is None:
                continue
            if lineno > ev.first_line and (ev.ended or (ev.last_step is not None and ev.total_steps == progress[1]
                                                         and progress[0] < ev.last_step)):
                ev.last_line = lineno - 1
                runs.append(ev)
                ev = RunEvidence(first_line=lineno)
            ev.last_step, ev.total_steps = progress
            continue
        if lineno > ev.first_line and _new_run(ev, line):
            ev.last_line = lineno - 1
            runs.append(ev)
            ev = RunEvidence(first_line=lineno)
        _read_line(ev, line, lineno, name)
    ev.last_line = max(lineno, ev.first_line)
    runs.append(ev)
    found = [r for r in runs if r.has_evidence]
    if not found:
        _finish(ev if len(runs) == 1 else _merged_warnings(runs))
    return [_finish(r) for r in found]


def _merged_warnings(runs: list[RunEvidence]) -> RunEvidence:
    out = RunEvidence()
    for r in runs:
        out.warnings += r.warnings
    return out


def evidence_from_callback(doc: dict) -> RunEvidence:
    """What one callback record says (the dict the callback prints after ``vram-ledger:``),
    without a round trip through text."""
    ev = RunEvidence()
    _apply_callback(ev, doc, 1)
    return _finish(ev)


def _finish(ev: RunEvidence) -> RunEvidence:
    """The run's status from what was read; LogError when nothing was."""
    if ev.oom is not None:
        ev.status = "oom"
        if ev.failed_at_step is None:
            ev.failed_at_step = ev.last_step
    elif ev.crash_text is not None:
        ev.status = "crashed"
        if ev.failed_at_step is None:
            ev.failed_at_step = ev.last_step
    elif ev.peak_allocated_mib is not None or ev.peak_reserved_mib is not None:
        ev.status = "ok"
    elif ev.peak_delta_mib is not None:
        ev.status = "ok"
    else:
        raise LogError("no peak-memory line (vram-ledger callback, HF Trainer memory metrics, axolotl, Unsloth, "
                       "DeepSpeed, torch.cuda.max_memory_*, 'Peak GPU memory: X GiB'), OOM message or crash found"
                       + "".join(f"; {w}" for w in ev.warnings))
    return ev


def _progress(line: str) -> Optional[tuple[int, int]]:
    """(step, total) of the last progress counter on a line, if it is one: tqdm's, else a plain one."""
    found = _PROGRESS.findall(line)
    if not found:
        return _plain_progress(line)
    step, total = int(found[-1][0]), int(found[-1][1])
    return (step, total) if step <= total and total > 1 else None


def _plain_progress(line: str) -> Optional[tuple[int, int]]:
    """``_progress`` of a line with no tqdm counter."""
    found = _PROGRESS_PLAIN.findall(line)
    if not found:
        return None
    a, b, c, d = found[-1]
    step, total = int(a or c), int(b or d)
    return (step, total) if step <= total and total > 1 else None


def _read_line(ev: RunEvidence, line: str, lineno: int, name: str) -> None:
    ts = _TIMESTAMP.search(line)
    if ts:
        try:
            ev.measured_on = dt.date.fromisoformat(ts[1])
        except ValueError:
            pass
    progress = _progress(line)
    if progress:
        ev.last_step, ev.total_steps = progress
    else:
        sw = _STEP_WORD.search(line)
        if sw:
            ev.last_step = int(sw[1])

    if CALLBACK_PREFIX in line:
        _read_callback(ev, line, lineno, name)
        return
    if find_oom(line):
        oom = parse_oom_message(line)
        if oom is not None and ev.oom is None:
            ev.oom = oom
            ev.evidence_line = lineno
            ev.failed_at_step = ev.last_step
        return
    if ev.xid is None and ev.crash_text is not None:
        xid = _XID.search(line)  # the kernel's Xid line often follows the CUDA error
        if xid:
            ev.xid = int(xid[1])
    if _CRASH.search(line) and ev.crash_text is None and "out of memory" not in line.lower():
        ev.crash_text = line.strip()[:500]
        xid = _XID.search(line)
        if xid:
            ev.xid = int(xid[1])
        if ev.oom is None:
            ev.evidence_line = lineno
        ev.failed_at_step = ev.last_step
        return
    for m in _HF.finditer(line):
        try:
            value = _float(m[2])
        except ValueError:
            ev.warnings.append(f"{name}:{lineno}: skipped: cannot read {m[1]} = {m[2]!r}")
            continue
        mib = value if (m[3] or "").upper() == "MB" else to_mib(value, "B")
        if m[1].lower().endswith("gpu_peaked_delta") and m[1].lower().startswith("train"):
            ev._peak("peak_delta_mib", mib, lineno, "hf-trainer")
    for m in _AXOLOTL.finditer(line):
        try:
            gib = _float(m[2])
        except ValueError:
            ev.warnings.append(f"{name}:{lineno}: skipped: cannot read memory/{m[1]}(gib) = {m[2]!r}")
            continue
        target = {"max_mem_allocated": "peak_allocated_mib", "device_mem_reserved": "peak_reserved_mib"}.get(m[1])
        if target:
            ev._peak(target, gib * 1024, lineno, "axolotl")
    m = _UNSLOTH.search(line)
    if m and not _UNSLOTH_TRAINING.search(line):
        try:
            ev._peak("peak_reserved_mib", _float(m[1]) * 1024, lineno, "unsloth")  # Unsloth's GB are GiB
        except ValueError:
            ev.warnings.append(f"{name}:{lineno}: skipped: cannot read Unsloth's peak {m[1]!r}")
    read = bool(_HF.search(line) or _AXOLOTL.search(line) or (m and not _UNSLOTH_TRAINING.search(line)))
    m = _DEEPSPEED.search(line)
    if m:
        ev._peak("peak_allocated_mib", float(m[2]) * 1024, lineno, "deepspeed")  # Max_MA, GiB
        ev._peak("peak_reserved_mib", float(m[4]) * 1024, lineno, "deepspeed")  # Max_CA
        return
    for m in _TORCH_NAMES.finditer(line):  # torch divides by 2**20 and prints "MB": read as MiB
        ev._peak(f"peak_{m[1].lower()}_mib", to_mib(m[2], m[3]), lineno, "torch.cuda.max_memory_*")
        read = True
    m = _PEAK_PLAIN.search(line)
    if m and not read:
        which = (m[1] or m[4] or "allocated").lower()
        ev._peak(f"peak_{which}_mib", to_mib(m[2], m[3]), lineno, "peak memory line")
        if not (m[1] or m[4]):
            ev.warnings.append(f"{name}:{lineno}: read {m[0].strip()!r} as peak allocated (the line does not say "
                               "allocated or reserved)")
        read = True
    if not read and _PEAK_HINT.search(line) and re.search(_PEAK_SIZE, line, re.I):
        ev.warnings.append(f"{name}:{lineno}: skipped: a memory figure in a form this version does not read: "
                           f"{line.strip()[:160]!r}")


def _read_callback(ev: RunEvidence, line: str, lineno: int, name: str) -> None:
    try:
        doc = json.loads(line.split(CALLBACK_PREFIX, 1)[1])
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except ValueError:
        ev.warnings.append(f"{name}:{lineno}: skipped: the vram-ledger line is not valid JSON")
        return
    _apply_callback(ev, doc, lineno)


def _apply_callback(ev: RunEvidence, doc: dict, lineno: int) -> None:
    ev.callback.update(doc)
    for key in ("peak_allocated_mib", "peak_reserved_mib"):
        value = doc.get(key)
        if isinstance(value, (int, float)) and value >= 0:
            ev._peak(key, float(value), lineno, "callback")
    per_device = doc.get("per_device_peak_mib")
    if isinstance(per_device, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in per_device.values()):
        ev.per_device_peak_mib = {str(k): round_mib(float(v)) for k, v in per_device.items()}
    if doc.get("event") == "oom" and isinstance(doc.get("message"), str):
        oom = parse_oom_message(doc["message"]) or Oom(message=doc["message"])
        if isinstance(doc.get("peak_allocated_mib"), (int, float)):
            oom.max_allocated_mib = round_mib(doc["peak_allocated_mib"])
            ev.peak_allocated_mib = None  # an OOM has no peak: what was read is a lower bound
        ev.oom = oom
        ev.evidence_line = lineno
        if isinstance(doc.get("step"), int):
            ev.failed_at_step = doc["step"]
    if isinstance(doc.get("date"), str):
        try:
            ev.measured_on = dt.date.fromisoformat(doc["date"])
        except ValueError:
            pass

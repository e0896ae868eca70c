"""PyTorch out-of-memory messages, parsed into the ledger's structured OOM figures.

One parser for every place an OOM is read: the probe kit's own OOMs and trainer logs.
It reads the message forms users meet:

- current CUDA (torch >= 2.2): ``CUDA out of memory. Tried to allocate X. GPU N has a total
  capacity of T of which F is free. [Process P has M memory in use. ...] Including non-PyTorch
  memory, this process has U memory in use. Of the allocated memory A is allocated by PyTorch,
  and R is reserved by PyTorch but unallocated. ...``
- torch 2.1, the same with its ``total capacty`` typo;
- legacy (torch <= 2.0): ``Tried to allocate X (GPU N; T total capacity; A already allocated;
  F free; R reserved in total by PyTorch)``;
- HIP (ROCm): ``HIP out of memory. ...`` in any of the forms above;
- a raw allocation that failed outside the caching allocator: ``CUDA error: out of memory``,
  ``HIP error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED`` (no figures, the text is kept);

behind any prefix (``RuntimeError:``, ``torch.cuda.OutOfMemoryError:``,
``torch.OutOfMemoryError:``, ``OutOfMemoryError:``). Sizes in bytes, KiB, MiB or GiB.
Figures that cannot be true (a per-process figure larger than the card) are kept in the
message and listed in ``untrusted``, not stored as figures.
"""

from __future__ import annotations

import re
from typing import Optional

from ledger.core.models import Oom, OomProcess
from ledger.core.units import SIZE, round_mib, to_mib

_START = re.compile(
    r"(?:(?:torch\.(?:cuda\.)?)?OutOfMemoryError:\s*|RuntimeError:\s*)?"
    r"(?:(?:CUDA|HIP) out of memory\.?"
    # A raw allocation outside the caching allocator (a kernel's workspace, a library's handle)
    # fails with the runtime's own error text, not torch's message: an OOM all the same.
    r"|(?:CUDA|HIP) error: out of memory|(?:CUBLAS|HIPBLAS|CUBLASLT|HIPBLASLT)_STATUS_ALLOC_FAILED)",
    re.I,
)


def _size(pattern: str) -> re.Pattern:
    return re.compile(pattern.replace("{SIZE}", SIZE), re.I)


_FIELDS = {
    "tried_mib": _size(r"Tried to allocate {SIZE}"),
    "total_mib": _size(r"total capac(?:i)?ty of {SIZE}"),
    "free_mib": _size(r"of which {SIZE} is free"),
    "in_use_mib": _size(r"this process has {SIZE} memory in use"),
    "allocated_mib": _size(r"Of the allocated memory {SIZE} is allocated by PyTorch"),
    "reserved_unallocated_mib": _size(r"{SIZE} is reserved by PyTorch but unallocated"),
}
_LEGACY = {
    "total_mib": _size(r"{SIZE} total capacity"),
    "allocated_mib": _size(r"{SIZE} already allocated"),
    "free_mib": _size(r"{SIZE} free"),
    "reserved_mib": _size(r"{SIZE} reserved in total by PyTorch"),
}
_DEVICE = re.compile(r"\b(GPU\s*\d+)", re.I)
_PROCESS = _size(r"Process (?P<pid>\d+) has {SIZE} memory in use")


def find_oom(text: str) -> Optional[re.Match]:
    """The start of an OOM message in text, or None."""
    return _START.search(text)


def parse_oom_message(text: str) -> Optional[Oom]:
    """Structured figures of a PyTorch OOM message, or None when the text holds none."""
    start = find_oom(text)
    if start is None:
        return None
    message = text[start.start():].strip()
    legacy = "total capacity;" in message or re.search(r"\(GPU\s*\d+;", message) is not None
    figures: dict[str, float] = {}
    for name, pattern in (_LEGACY if legacy else _FIELDS).items():
        m = pattern.search(message)
        if m:
            figures[name] = round_mib(to_mib(m["num"], m["unit"]))
    if legacy and "tried_mib" not in figures:
        m = _FIELDS["tried_mib"].search(message)
        if m:
            figures["tried_mib"] = round_mib(to_mib(m["num"], m["unit"]))
    processes = [OomProcess(pid=int(m["pid"]), in_use_mib=round_mib(to_mib(m["num"], m["unit"])))
                 for m in _PROCESS.finditer(message)]
    untrusted: list[str] = []
    total = figures.get("total_mib")
    other = _other_processes_mib(processes, figures.get("in_use_mib"))
    if other is not None:
        if total is not None and other > total:
            untrusted.append("other_processes_mib")  # more than the card: cannot be true
        else:
            figures["other_processes_mib"] = other
    if total is not None:
        for name in ("free_mib", "in_use_mib", "allocated_mib", "reserved_mib", "reserved_unallocated_mib"):
            if figures.get(name, 0) > total:
                untrusted.append(name)
                del figures[name]
    device = _DEVICE.search(message)
    return Oom(device=re.sub(r"\s+", " ", device[1]) if device else None, untrusted=untrusted, message=message,
               processes=processes, **figures)


def _other_processes_mib(processes: list[OomProcess], this_process_mib: Optional[float]) -> Optional[float]:
    """What the listed processes other than this one held. The list includes the failing process
    itself when it is the one holding the card: the entry whose figure is this process's
    in-use figure is taken to be it. Without that figure the two cannot be told apart: None."""
    if not processes:
        return None
    if this_process_mib is None:
        return None
    rest = list(processes)
    for i, p in enumerate(rest):
        if abs(p.in_use_mib - this_process_mib) <= max(0.5, 0.001 * this_process_mib):
            del rest[i]
            break
    return round_mib(sum(p.in_use_mib for p in rest))

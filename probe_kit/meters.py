"""Peak-memory meters behind one interface.

- ``AllocatorMeter``: the caching allocator's own counters (``torch.cuda``; ROCm builds expose
  HIP through the same API). Assumptions: figures are read after ``synchronize``; "allocated"
  excludes the CUDA context, but includes the cuBLAS/cuBLASLt workspaces, which come from the
  caching allocator, one per handle and stream (the forward's thread and autograd's: two in a
  training step; larger on Hopper and on ROCm; the probe records the size per handle);
  "reserved" includes the allocator's cache and is what decides an OOM.
- ``TrackerMeter``: a ``TorchDispatchMode`` that keeps the set of live tensor storages (a
  storage counts once however many views share it), each rounded up to 512 bytes like the CUDA
  allocator's blocks. Tensors that exist before it starts (parameters, buffers, gradients,
  bitsandbytes ``quant_state`` tensors, which are neither parameters nor buffers) are
  registered explicitly. Deterministic run to run; used on CPU and under fake tensors. With a
  budget it raises ``torch.OutOfMemoryError`` (in the CUDA message form) when live bytes would
  exceed it, so the OOM path runs end to end without a GPU. Storages resized in place (FSDP's
  unsharded parameters) and the tensors inside wrapper subclasses (``DTensor``) are counted.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, Optional, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

MIB = 2**20
BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


def round_block(nbytes: int) -> int:
    return (nbytes + BLOCK - 1) // BLOCK * BLOCK


class Meter(Protocol):
    """What a probe reads: bytes allocated now, and the peaks since the last reset."""

    name: str

    def allocated_mib(self) -> float: ...

    def reset_peak(self) -> None: ...

    def peak_allocated_mib(self) -> float: ...

    def peak_reserved_mib(self) -> Optional[float]: ...


class AllocatorMeter:
    """torch.cuda memory statistics for one device (CUDA or ROCm/HIP)."""

    name = "allocator"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def _sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated_mib(self) -> float:
        self._sync()
        return torch.cuda.memory_allocated(self.device) / MIB

    def reset_peak(self) -> None:
        self._sync()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated_mib(self) -> float:
        self._sync()
        return torch.cuda.max_memory_allocated(self.device) / MIB

    def peak_reserved_mib(self) -> Optional[float]:
        self._sync()
        return torch.cuda.max_memory_reserved(self.device) / MIB


def _fmt(nbytes: float) -> str:
    # The units and two decimals of PyTorch's own OOM message.
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


class TrackerMeter(TorchDispatchMode):
    """Live tensor storages seen by the dispatcher, counted once each, 512-byte blocks."""

    name = "tracker"

    def __init__(self, budget_mib: Optional[float] = None):
        super().__init__()
        self.budget = None if budget_mib is None else int(budget_mib * MIB)
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        #: (label, peak bytes) of each window ``mark`` closed since the last reset; the dry run's
        #: depth extrapolation reads the peaks of a step's phases from them.
        self.windows: list[tuple[object, int]] = []
        self.window_peak = 0
        #: Storages made in host RAM (``host()``, ``never_count``): never counted on the device,
        #: whatever op returns them later; their bytes are the host's (``host_bytes``, its peak
        #: ``host_peak_bytes``: what a run's offloaded tensors take of host RAM).
        self.host_storages: dict[int, tuple[weakref.ref, int]] = {}
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self._on_host = False
        #: With ``record_trace()``: the allocations and frees of counted storages in order, as
        #: ``probe_kit.allocator.replay`` reads them (a size in bytes allocates; ``-(k + 1)`` frees
        #: the k-th allocation), and each live storage's allocation number.
        self.trace: Optional[list[int]] = None
        self._trace_ids: dict[int, int] = {}
        self._allocations = 0

    # -- bookkeeping ------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> int:
        """Start counting t's storage if it is new; return the bytes added. A weak reference to
        the storage object (one Python object per live storage) drops it the moment it is freed.
        A wrapper subclass (a ``DTensor``: FSDP2's sharded parameters and their gradients and
        optimizer state) owns no memory of its own: the tensors it wraps are counted, which its
        own dispatch makes where this mode does not see them."""
        if t.is_meta:  # a placeholder with a size and no memory (a model built on the meta device)
            return 0
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            inner = (getattr(t, name) for name in names)
            return sum(self._add(x) for x in inner if isinstance(x, torch.Tensor))
        st = t.untyped_storage()
        return self._count(st, st.nbytes())

    def _count(self, st: torch.UntypedStorage, nbytes: int) -> int:
        key = st._cdata
        if self.host_storages and self._is_host(key, st):
            return 0
        if self._on_host:
            self._to_host(st, nbytes)
            return 0
        entry = self.live.get(key)
        if entry is not None and entry[0]() is st:
            return 0
        if entry is not None:  # the address was reused after a free we had not seen yet
            self.live_bytes -= entry[1]
            self._traced_free(key)
        size = round_block(nbytes)

        def freed(ref: weakref.ref, key: int = key) -> None:
            current = self.live.get(key)
            if current is not None and current[0] is ref:
                del self.live[key]
                self.live_bytes -= current[1]
                self._traced_free(key)

        self.live[key] = (weakref.ref(st, freed), size)
        self.live_bytes += size
        if self.trace is not None and nbytes > 0:  # a zero-byte storage takes no block
            self._trace_ids[key] = self._allocations
            self._allocations += 1
            self.trace.append(nbytes)
        return size

    def record_trace(self) -> None:
        """From now on, record the allocations and frees of counted storages in ``trace`` (the
        storages counted already first, in the order they were counted)."""
        self.trace, self._trace_ids, self._allocations = [], {}, 0
        for key, (ref, _) in self.live.items():
            st = ref()
            if st is not None and st.nbytes() > 0:
                self._trace_ids[key] = self._allocations
                self._allocations += 1
                self.trace.append(st.nbytes())

    def trace_event(self, code: int) -> None:
        """Record an allocator event that is neither an allocation nor a free (``probe_kit.
        allocator.EMPTY_CACHE``, ``RESET_PEAK``) where the step makes it."""
        if self.trace is not None:
            self.trace.append(code)

    def _traced_free(self, key: int) -> None:
        if self.trace is not None:
            k = self._trace_ids.pop(key, None)
            if k is not None:
                self.trace.append(-(k + 1))

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resized in place (FSDP frees an unsharded parameter's memory with
        ``resize_(0)`` and allocates it again with ``resize_(n)``, outside the dispatcher): the
        old block is freed and a block of the new size allocated, as the allocator does."""
        key = st._cdata
        if self._on_host or self._is_host(key, st):
            return
        entry = self.live.get(key)
        if entry is not None and entry[0]() is st:
            del self.live[key]
            self.live_bytes -= entry[1]
            self._traced_free(key)
        added = self._count(st, nbytes) if nbytes > 0 else 0
        self._raise_peak(added)

    def __enter__(self):
        # ``UntypedStorage.resize_`` does not go through the dispatcher: followed while active.
        resize, meter = torch.UntypedStorage.resize_, self

        def resize_(st, size):
            out = resize(st, size)
            meter._resized(st, int(size))
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before tracking started (weights, buffers, quant state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self._add(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak = max(self.window_peak, self.live_bytes)

    def register_module(self, module: torch.nn.Module) -> None:
        """Parameters, buffers, gradients and bitsandbytes quant_state tensors of a module."""
        tensors: list[torch.Tensor] = []
        for p in module.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
            tensors.extend(quant_state_tensors(p))
        tensors.extend(module.buffers())
        self.register(tensors)

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Storages made inside this block are host RAM (an offloader's copies): never counted,
        not even for the moment between their allocation and their exclusion."""
        outer, self._on_host = self._on_host, True
        try:
            yield
        finally:
            self._on_host = outer

    def exclude(self, t: torch.Tensor) -> None:
        """Stop counting t's storage: it lives off the device (e.g. offloaded to host RAM)."""
        key = t.untyped_storage()._cdata
        entry = self.live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]
            self._traced_free(key)

    def never_count(self, t: torch.Tensor) -> None:
        """``exclude`` t's storage for good: ops that write it in place later do not count it again
        (a paged optimizer's state, in CUDA unified memory on a GPU)."""
        self.exclude(t)
        st = t.untyped_storage()
        if not self._is_host(st._cdata, st):
            self._to_host(st, st.nbytes())

    def _is_host(self, key: int, st: torch.UntypedStorage) -> bool:
        entry = self.host_storages.get(key)
        return entry is not None and entry[0]() is st

    def _to_host(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count st as host RAM (its bytes as they are, no device rounding) until it is freed."""
        key = st._cdata

        def freed(ref: weakref.ref, key: int = key) -> None:
            current = self.host_storages.get(key)
            if current is not None and current[0] is ref:
                del self.host_storages[key]
                self.host_bytes -= current[1]

        old = self.host_storages.get(key)
        if old is not None:  # the address was reused after a free not seen yet
            self.host_bytes -= old[1]
        self.host_storages[key] = (weakref.ref(st, freed), nbytes)
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def host_mib(self) -> float:
        """Host RAM the run's offloaded tensors hold now (MiB)."""
        return self.host_bytes / MIB

    def host_peak_mib(self) -> float:
        """The most host RAM the run's offloaded tensors held at once since the last reset (MiB)."""
        return self.host_peak_bytes / MIB

    # -- the dispatch hook --------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: one tensor out, no tree to walk
            added = self._add(out)
        else:
            added = 0
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    added += self._add(t)
        self._raise_peak(added)
        return out

    def _raise_peak(self, added: int) -> None:
        live = self.live_bytes
        if live > self.window_peak:  # never above peak_bytes: both are raised here, reset together
            self.window_peak = live
            if live > self.peak_bytes:
                if self.budget is not None and live > self.budget:
                    self._raise_oom(added)
                self.peak_bytes = live

    def _raise_oom(self, tried: int) -> None:
        held = self.live_bytes - tried
        free = max(self.budget - held, 0)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_fmt(tried)}. GPU 0 has a total capacity of "
            f"{_fmt(self.budget)} of which {_fmt(free)} is free. Including non-PyTorch memory, this process has "
            f"{_fmt(held)} memory in use. Of the allocated memory {_fmt(held)} is allocated by PyTorch, and "
            "0 bytes is reserved by PyTorch but unallocated. (simulated by the tracker meter's budget)"
        )

    # -- the Meter interface -------------------------------------------------------------
    def allocated_mib(self) -> float:
        return self.live_bytes / MIB

    def reset_peak(self) -> None:
        self.peak_bytes = self.window_peak = self.live_bytes
        self.host_peak_bytes = self.host_bytes
        self.windows = []

    def mark(self, label: object) -> None:
        """Close the current window: record ``(label, the peak bytes since the last mark or
        reset)`` in ``windows`` and start the next one at the bytes live now."""
        self.windows.append((label, max(self.window_peak, self.live_bytes)))
        self.window_peak = self.live_bytes

    def peak_allocated_mib(self) -> float:
        return self.peak_bytes / MIB

    def peak_reserved_mib(self) -> Optional[float]:
        return None  # a tracker has no allocator cache


def quant_state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """bitsandbytes keeps absmax, the code book and the nested (double-quant) state on
    ``param.quant_state``: not parameters, not buffers, but device memory all the same."""
    qs = getattr(p, "quant_state", None)
    out: list[torch.Tensor] = []
    while qs is not None:
        for name in ("absmax", "code", "offset"):
            t = getattr(qs, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
        qs = getattr(qs, "state2", None)
    return out

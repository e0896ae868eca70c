"""TRL's activation offloading (the ``activation_offloading`` memory fix): ``SFTConfig(
activation_offloading=True)``. ``SFTTrainer`` builds TRL's own context
(``trl.models.activation_offloading.get_act_offloading_ctx_manager(model)``: pinned host copies, a
second stream, saved tensors of 1,024 bytes or more moved to host RAM, the last five kept on the
card until their copy is done, the output head's saved tensors left on the card) and runs each
training step, forward and backward, inside it; its gradient checkpointing is non-reentrant
(TRL's default), so what the checkpointed layers save stays in the checkpoints and what is
offloaded is what the step saves outside them.

On a GPU (CUDA, and ROCm through the same device type) that context is used as it is. Elsewhere
the same class runs its own pack and unpack logic with the CPU standing in for the accelerator
(``torch.accelerator`` has none on a CPU build): streams and events become no-ops (a CPU runs in
order), host copies are not pinned and, under the tracker meter, live in host RAM (never
counted), a copy brought back for backward is a new device tensor (on a CPU ``.to('cpu')``
would return the host copy itself), and ``record_stream`` (the allocator keeping a block from reuse
until the compute stream is done with it) does nothing. TRL's deduplication names a storage by a
serial number rather than by its address (see ``_StorageSerials``), the same in a real step and
under fake tensors, which have no data pointers.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Iterator, Optional

import torch


class TrlMissing(Exception):
    """trl is not installed (``pip install 'vram-ledger[trl]'``)."""


class _Stream:
    """A stream on a device that runs in order: waiting and recording do nothing."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self):
        return None

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _InOrder:
    """The device module TRL asks for (``torch.get_device_module``), for the CPU."""

    _current = _Stream()
    Stream = _Stream

    @classmethod
    def current_stream(cls) -> _Stream:
        return cls._current

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def empty_cache() -> None:
        pass


class _HostCopy:
    """A host copy TRL holds for backward; ``.to(device)`` brings it back as a new device tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.tensor.clone()


class _StorageSerials:
    """TRL's deduplication key for a saved tensor: (its storage, offset, dtype). TRL names the
    storage by its address, which a later storage can take once the first is freed (TRL keeps the
    key of an offloaded tensor that it copied first, so the freed original's address stays in its
    map): on a CPU, whether a new storage then lands on that address, and so whether it is
    offloaded or kept, would depend on the heap's history. Here each storage is named by a serial
    number, given when TRL first asks about it and never given again: the same step makes the
    same decisions in every run, real or under fake tensors. A storage has one Python object for
    its whole life, so a weak reference on it drops the name the moment it is freed."""

    def __init__(self, fallback) -> None:
        self.fallback = fallback
        self.serials: dict[int, int] = {}
        self.next = 0

    def key(self, tensor: torch.Tensor) -> tuple:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, AttributeError):
            return self.fallback(tensor)
        ident = id(storage)
        serial = self.serials.get(ident)
        if serial is None:
            serial = self.serials[ident] = self.next
            self.next += 1
            weakref.finalize(storage, self.serials.pop, ident, None)
        return (serial, tensor.storage_offset(), tensor.dtype)


def _import():
    try:
        from trl.models import activation_offloading
    except ImportError as exc:
        raise TrlMissing(f"activation_offloading needs trl ({exc}); pip install 'vram-ledger[trl]'") from None
    return activation_offloading


def offloader(model: torch.nn.Module, device: torch.device, meter=None) -> contextlib.AbstractContextManager:
    """The context SFTTrainer runs each training step in with ``activation_offloading=True``."""
    ao = _import()
    if device.type == "cuda":
        return ao.get_act_offloading_ctx_manager(model=model)
    accelerator, device_module = torch.accelerator.current_accelerator, torch.get_device_module
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    torch.get_device_module = lambda d=None: _InOrder if str(d) == "cpu" else device_module(d)
    try:
        with warnings.catch_warnings():
            # TRL notes the parameters' data pointers, which fake tensors do not have (it then tells
            # parameters apart by their type): torch's warning about asking, and only it, is silenced.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            ctx = ao.get_act_offloading_ctx_manager(model=model, use_pin_memory=False, warn_if_no_head=False)
    finally:
        torch.accelerator.current_accelerator, torch.get_device_module = accelerator, device_module
    return _OnCpu(ao, ctx, meter)


class _OnCpu(contextlib.AbstractContextManager):
    def __init__(self, ao, ctx, meter) -> None:
        self.ao, self.ctx, self.meter = ao, ctx, meter
        pack, unpack = ctx.pack_hook, ctx.unpack_hook

        def pack_hook(activation: torch.Tensor) -> int:
            with self._host_allocations():
                tid = pack(activation)
            entry = ctx.tracker.get(tid)
            if entry is not None and entry[1]:  # offloaded: its host copy, brought back as a new tensor
                ctx.tracker[tid] = (_HostCopy(entry[0]), *entry[1:])
            return tid

        ctx.pack_hook, ctx.unpack_hook = pack_hook, unpack
        self._stack: Optional[contextlib.ExitStack] = None

    @contextlib.contextmanager
    def _host_allocations(self) -> Iterator[None]:
        """TRL makes each host copy with ``torch.empty_like(..., pin_memory=..., device='cpu')``:
        under the tracker meter those are host RAM."""
        if self.meter is None:
            yield
            return
        empty_like, meter = torch.empty_like, self.meter

        def host_empty_like(*args, **kwargs):
            if "pin_memory" in kwargs:
                with meter.host():
                    return empty_like(*args, **kwargs)
            return empty_like(*args, **kwargs)

        torch.empty_like = host_empty_like
        try:
            yield
        finally:
            torch.empty_like = empty_like

    def __enter__(self):
        stack = contextlib.ExitStack()
        key = self.ao._get_unique_tensor_key
        self.ao._get_unique_tensor_key = _StorageSerials(key).key
        stack.callback(setattr, self.ao, "_get_unique_tensor_key", key)
        # A brought-back tensor still in use when its node ends is kept from reuse until the compute
        # stream is done with it (record_stream); a device that runs in order is done already.
        record_stream = torch.Tensor.record_stream
        torch.Tensor.record_stream = lambda tensor, stream: None
        stack.callback(setattr, torch.Tensor, "record_stream", record_stream)
        stack.enter_context(self.ctx)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)

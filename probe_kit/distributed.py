"""Past one card: the step of one rank of a data-parallel or sharded run.

The strategies, as accelerate and the Trainer launch them:

- ``ddp``: ``DistributedDataParallel`` (its defaults: 25 MiB gradient buckets, the first bucket
  1 MiB, gradients copied into the buckets, allreduce in place). Every rank holds the whole model.
- ``fsdp``: FSDP2's ``fully_shard`` on every module of a class the model names in
  ``_no_split_modules`` (accelerate's ``TRANSFORMER_BASED_WRAP``, its default for a transformers
  model) and on the root, ``reshard_after_forward=True`` (FULL_SHARD): parameters, gradients and
  optimizer state sharded over the ranks, a unit's parameters all-gathered for its forward and
  again for its backward.
- ``fsdp-shard-grad-op``: the same with ``reshard_after_forward=False`` (SHARD_GRAD_OP): a unit's
  gathered parameters are kept from its forward to its backward.

The dry run runs one rank's step under fake tensors with torch's fake process group (``fake``
backend: collectives that move no data) of ``world_size`` ranks: the sharded parameters, the
gathered units and their prefetch, the buckets and the reduce-scatter outputs are what the real
code allocates. ``probe_kit.gloo_run`` runs the same step in real processes over gloo on the CPU,
which is what the dry run is checked against (``tests/test_distributed.py``).

QLoRA under FSDP: the stock recipe sets ``bnb_4bit_quant_storage`` to the compute dtype so that
FSDP can flatten the packed 4-bit weights beside the rest; the bytes are the same as the packed
uint8 storage the dry run's 4-bit stand-in keeps, which FSDP2 shards as it is. The quantisation
state (absmax, code books) is buffers: FSDP2 does not shard buffers, every rank keeps them.

Not modelled here: DeepSpeed's ZeRO stages (its own buffers and thresholds), CPU offload of
parameters, and NCCL's own buffers outside the caching allocator (a few hundred MiB on a card,
part of what the card's measured overhead holds).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .recipe import RecipeError

@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[object]:
    """Rank 0 of a fake process group of ``world_size`` ranks, and its one-dimensional device mesh
    (made with real tensors: a mesh reads its ranks' values). Torn down on the way out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RecipeError("a process group is initialised already: the dry run makes its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def unit_classes(model: torch.nn.Module) -> set[str]:
    """The class names a transformers model keeps whole (``_no_split_modules``): FSDP's units."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard(model: torch.nn.Module, strategy: str, mesh, *, fake: bool) -> torch.nn.Module:
    """The model as ``strategy`` runs it on one rank of ``mesh``. Returns the module to step
    (DDP's wrapper, or the model itself with FSDP's hooks)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Under fake tensors the start-up broadcast has nothing to copy, and the fake group's
        # allreduce yields no tensor: the hook returns the bucket, reduced in place as the default
        # hook reduces it (the same buffers).
        ddp = DistributedDataParallel(model, process_group=mesh.get_group(), init_sync=not fake)
        if fake:
            ddp.register_comm_hook(None, _in_place_allreduce)
            ddp.reducer = _KeepBuckets(ddp.reducer)
        return ddp
    from torch.distributed.fsdp import fully_shard

    reshard = strategy == "fsdp"
    classes = unit_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in classes]
    if not units:
        raise RecipeError(f"--strategy {strategy}: the model names no layer class to shard by "
                          "(_no_split_modules)")
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


class _KeepBuckets:
    """DDP's reducer, but for the rebuild of its buckets before the second step's forward, which
    broadcasts rank 0's order of the gradients and reads it back (values a fake tensor does not
    have). The rebuilt buckets hold the same gradients, capped alike, and the old ones are freed
    before the forward: the step's memory is the same (checked against real runs)."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    @staticmethod
    def _rebuild_buckets() -> bool:
        return False


def _in_place_allreduce(state, bucket):
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future

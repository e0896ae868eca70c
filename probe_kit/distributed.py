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

QLoRA under FSDP: the stock recipe sets ``bnb_4bit_quant_storage`` to the compute dtype so that
FSDP can flatten the packed 4-bit weights beside the rest; the bytes are the same as the packed
uint8 storage the dry run's 4-bit stand-in keeps, which FSDP2 shards as it is. The quantisation
state (absmax, code books) is buffers: FSDP2 does not shard buffers, every rank keeps them.

- ``zero2`` / ``zero3``: DeepSpeed's ZeRO stage 2 (gradients and optimizer state partitioned)
  and stage 3 (parameters too), DeepSpeed's own engine with the configuration the transformers
  documentation gives for each stage, its "auto" values filled as the Trainer fills them
  (``deepspeed_config``): bf16, overlap_comm, contiguous_gradients, reduce_bucket_size =
  hidden², stage3_prefetch_bucket_size = 0.9 hidden², stage3_param_persistence_threshold =
  10 hidden, stage 3's max live parameters and reuse distance 1e9, sub_group_size 1e9; the
  Trainer's optimizer handed to it (no optimizer in the config). Its buckets, its fp32 master
  partitions, its prefetch and persistence thresholds are what DeepSpeed allocates, not a bound.
  Needs DeepSpeed (the ``deepspeed`` extra).

The dry run runs one rank's step under fake tensors with torch's fake process group (``fake``
backend: collectives that move no data) of ``world_size`` ranks: the sharded parameters, the
gathered units and their prefetch, the buckets and the reduce-scatter outputs are what the real
code allocates. ``probe_kit.gloo_run`` runs the same step in real processes over gloo on the CPU,
which is what the dry run is checked against (``tests/test_distributed.py``). Under fake tensors
DeepSpeed's engine needs three things (``deepspeed_fakes``): a scalar it reads off a tensor (its
overflow and gradient-norm checks, its trace checks) reads as zero (finite: the step is taken, as
on a run that does not overflow); its check that every rank traced the same modules is skipped (it
compares values); the module stays where the fake tensors are (``module.to(device)`` would copy
fake tensors into real ones).

CPU offload (``--cpu-offload``), FSDP's: FSDP2's ``CPUOffloadPolicy``, as accelerate's
``fsdp_offload_params: true`` sets it. Each rank's sharded parameters live in host RAM, a unit's
shard is copied to the card for its all-gather (the copy freed once gathered), the reduce-scattered
gradient shard is copied back to host RAM (the card's copy freed), and the optimizer steps on the
host with its state there. The dry run and the gloo run have one device, the CPU, so the card's and
the host's tensors are told apart by what FSDP does with them (``fsdp_offload``): the sharded
parameters and gradients and everything the optimizer step makes are counted as host RAM (the
tracker meter's ``host_peak_mib``), the copy to the card is made as the card makes it. The pinning
of host pages is the card's driver's (host RAM all the same): not made off a GPU.

Not modelled here: DeepSpeed's CPU offload (``offload_optimizer`` / ``offload_param``: refused in
one line), and NCCL's own buffers outside the caching allocator (a few hundred MiB on a card, part
of what the card's measured overhead holds).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings
from typing import Callable, Iterator, Optional

import torch

from .recipe import RecipeError

@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[object]:
    """Rank ``rank`` (the answers' is 0) of a fake process group of ``world_size`` ranks, and its
    one-dimensional device mesh (made with real tensors: a mesh reads its ranks' values). Torn down on the way out, with what
    ZeRO leaves behind in the process (``torch.nn.functional.linear``, which ZeRO-3 swaps for its
    own for good, so that a later dry run in the same process would run it too; ``LOCAL_RANK``)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RecipeError("a process group is initialised already: the dry run makes its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    linear, local_rank = F.linear, os.environ.get("LOCAL_RANK")
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        F.linear = linear
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        dist.destroy_process_group()


def unit_classes(model: torch.nn.Module) -> set[str]:
    """The class names a transformers model keeps whole (``_no_split_modules``): FSDP's units."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard(model: torch.nn.Module, strategy: str, mesh, *, fake: bool, optimizer: Optional[str] = None,
          batch: int = 1, unified=None, cpu_offload: bool = False) -> torch.nn.Module:
    """The model as ``strategy`` runs it on one rank of ``mesh``. Returns the module to step
    (DDP's wrapper, the model itself with FSDP's hooks, or DeepSpeed's engine over the Trainer's
    ``optimizer``, which ZeRO partitions: ``recipe.train_step`` steps an engine its own way).
    ``cpu_offload``: FSDP's ``CPUOffloadPolicy`` (``fsdp_offload`` then tells host from card)."""
    if is_zero(strategy):
        if optimizer is None:
            raise RecipeError(f"--strategy {strategy}: ZeRO partitions the optimizer's state, so its step is a "
                              "training run's: give --optim (the Trainer's default is adamw_torch)")
        from .recipe import make_optimizer

        require_deepspeed(strategy)
        return zero_engine(model, make_optimizer(model, optimizer, fake, unified), strategy, batch, fake=fake)
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
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if cpu_offload and not strategy.startswith("fsdp"):
        raise RecipeError(f"--cpu-offload: {strategy} has no CPU offload (FSDP's and DeepSpeed's ZeRO do)")
    # Off a GPU there is no page to pin (pinning is the card driver's; the pages are host RAM either way).
    policy = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
    reshard = strategy == "fsdp"
    classes = unit_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in classes]
    if not units:
        raise RecipeError(f"--strategy {strategy}: the model names no layer class to shard by "
                          "(_no_split_modules)")
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    return model


def fsdp_params(model: torch.nn.Module) -> list:
    """Every ``FSDPParam`` of a model FSDP2 shards (its sharded parameters' bookkeeping)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    out = []
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            out.extend(group.fsdp_params)
    return out


@contextlib.contextmanager
def fsdp_offload(model: torch.nn.Module, host: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """FSDP's CPU offload on a run whose one device is the CPU, as it runs with a card: ``host(t)``
    is told of each tensor that lives in host RAM (the tracker meter's ``never_count``) — every
    sharded parameter, and each gradient shard once reduce-scattered (the card's copy then freed:
    FSDP copies it to the host and keeps no reference) — and a unit's shard is copied for its
    all-gather (``.to(device)`` of a host tensor makes a new one on a card; on the CPU it would
    return the host tensor itself). Wrap the step, not the optimizer's: it runs on the host
    (``recipe.train_step``'s ``optimizer_context``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState, _to_dtype_if_needed

    params = [p for p in fsdp_params(model) if p.offload_to_cpu]
    for p in params:
        host(p._sharded_param_data)
    gather_inputs, reduce = FSDPParam.all_gather_inputs, _fsdp_param_group.foreach_reduce

    def all_gather_inputs(self) -> list[torch.Tensor]:
        if (self.offload_to_cpu and self.sharded_state == ShardedState.SHARDED
                and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")):
            return [_to_dtype_if_needed(self._sharded_param_data.clone(), self.param_dtype)]  # the copy to the card
        return gather_inputs.fget(self)

    def foreach_reduce(fsdp_params_, *args, **kwargs):
        out = reduce(fsdp_params_, *args, **kwargs)
        for p in fsdp_params_:
            grad = p.sharded_param.grad
            if p.offload_to_cpu and grad is not None:
                host(grad._local_tensor if hasattr(grad, "_local_tensor") else grad)
        return out

    FSDPParam.all_gather_inputs = property(all_gather_inputs)
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = gather_inputs
        _fsdp_param_group.foreach_reduce = reduce


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


# -- DeepSpeed's ZeRO ---------------------------------------------------------------------------

#: The ZeRO stages by strategy name.
ZERO_STAGES = {"zero2": 2, "zero3": 3}


def is_zero(strategy: Optional[str]) -> bool:
    return strategy in ZERO_STAGES


def require_deepspeed(strategy: str):
    """DeepSpeed, imported with its CPU accelerator (the dry run and the gloo run are on the CPU),
    or a one-line error naming the extra."""
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"  # (else it guesses, and says so)
    try:
        # Its logger writes to the stdout it finds when first imported: stderr, not into a --json answer.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    except ImportError:
        raise RecipeError(f"--strategy {strategy}: DeepSpeed's ZeRO runs DeepSpeed's own engine, which is not "
                          "installed: pip install -e '.[deepspeed]'") from None
    finally:
        if saved is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = saved
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)  # its start-up and per-step notices are a run's, not a dry run's
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):  # DeepSpeed's calls, not ours to change
        warnings.filterwarnings("ignore", message=f"`torch.distributed.{name}` is deprecated", category=FutureWarning)
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if get_accelerator().device_name() != "cpu":
        set_accelerator(CPU_Accelerator())
    # (by its module's name: the package's attribute ``torch`` is torch itself)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    # Its shared-memory allreduce kernel (compiled on first use) is for a CPU run's speed only:
    # the collectives go through torch.distributed, as on GPUs through NCCL.
    ds_torch.build_shm_op = lambda: None
    return deepspeed


def deepspeed_config(model: torch.nn.Module, strategy: str, batch: int) -> dict:
    """The DeepSpeed configuration of a stage as the transformers documentation gives it, its
    "auto" values filled as the Trainer fills them from the model's hidden size."""
    hidden = model.config.hidden_size
    zero: dict = {"stage": ZERO_STAGES[strategy], "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": hidden * hidden}
    if zero["stage"] == 2:
        zero.update(allgather_partitions=True, allgather_bucket_size=int(2e8), reduce_scatter=True)
    else:
        zero.update(sub_group_size=int(1e9), stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                    stage3_param_persistence_threshold=10 * hidden, stage3_max_live_parameters=int(1e9),
                    stage3_max_reuse_distance=int(1e9), stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31,
            "wall_clock_breakdown": False, "gradient_clipping": 1.0}


@contextlib.contextmanager
def deepspeed_fakes(model: torch.nn.Module) -> Iterator[None]:
    """What DeepSpeed's engine needs under fake tensors (the module docstring): scalars read as
    zero, the ranks' trace check skipped, the module left where its fake tensors are."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import torch._subclasses.fake_impls as impls
    from torch._prims_common import is_boolean_dtype, is_float_dtype

    def zero(mode, func, arg):
        return 0.0 if is_float_dtype(arg.dtype) else False if is_boolean_dtype(arg.dtype) else 0

    ops = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    saved = [impls.op_implementations_dict[op] for op in ops]
    same, to = coordinator.assert_ints_same_as_other_ranks, model.to
    for op in ops:
        impls.op_implementations_dict[op] = zero
    coordinator.assert_ints_same_as_other_ranks = lambda *a, **k: None
    model.to = lambda *a, **k: model
    try:
        yield
    finally:
        for op, impl in zip(ops, saved):
            impls.op_implementations_dict[op] = impl
        coordinator.assert_ints_same_as_other_ranks = same
        model.to = to


def zero_engine(model: torch.nn.Module, optimizer, strategy: str, batch: int, *, fake: bool):
    """DeepSpeed's engine of ``strategy`` over ``model`` and the Trainer's ``optimizer``, on the
    process group already initialised (the fake one under fake tensors, gloo in a real run)."""
    import torch.distributed as dist

    deepspeed = require_deepspeed(strategy)
    groups = importlib.import_module("deepspeed.utils.groups")

    # DeepSpeed keeps the process groups it made at module level; a dry run makes a fresh fake group
    # for each stack of layers it runs, so they are made again (the module's own initial state).
    importlib.reload(groups)
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed reads it, as a launcher sets it
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed_fakes(model) if fake else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=deepspeed_config(model, strategy, batch))
    return engine


def rank_train_step(model, ids: torch.Tensor, cfg, forward_context=None, *, fake: bool, warmed=None,
                    backward_context=None, **kw) -> Optional[torch.Tensor]:
    """One rank's training step: ``recipe.train_step``, or under DeepSpeed its engine's own
    (``zero_train_step``) with the same forward and loss."""
    from . import recipe

    if not getattr(model, "zero_optimization_stage", None):
        return recipe.train_step(model, ids, cfg, forward_context, fake=fake, warmed=warmed,
                                 backward_context=backward_context, **kw)
    context = forward_context or contextlib.nullcontext

    def forward() -> torch.Tensor:
        with recipe.gpu_dropout(), recipe._kernels(cfg, ids.device, fake), context(), recipe.autocast(cfg, ids.device):
            return recipe._forward_loss(model, ids, cfg)
    zero_train_step(model, forward, fake=fake, warmed=warmed, backward_context=backward_context)
    return None


def zero_train_step(engine, run_step: Callable[[], torch.Tensor], *, fake: bool, warmed=None,
                    backward_context=None) -> None:
    """A training run's steady state under DeepSpeed, as ``recipe.train_step`` makes it: one step
    first (the optimizer's state then exists), ``warmed()``, then the measured step; each step the
    engine's forward (``run_step()``: the loss), its backward and its optimizer step (which frees
    the gradients, as the Trainer's DeepSpeed path does)."""
    with deepspeed_fakes(engine.module) if fake else contextlib.nullcontext():
        for i in range(2):
            loss = run_step()
            with backward_context() if backward_context is not None else contextlib.nullcontext():
                engine.backward(loss)
            engine.step()
            if i == 0 and warmed is not None:
                warmed()

"""One real data-parallel or sharded step over gloo, in CPU processes: what the dry run of a rank
(``probe_kit.distributed``) is checked against. Each process builds the model with random weights
(4-bit: the dry run's stand-in, with real tensors), applies the recipe and the strategy, and runs
the probe's step measured by the tracker meter.

    python -m probe_kit.gloo_run --model tiny-llama --rank 8 --seq-len 256 --gpus 2 --strategy fsdp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

import torch

from .distributed import fsdp_offload, rank_train_step, shard
from .dry_run import stand_in_4bit
from .meters import TrackerMeter
from .probe_vram import add_recipe_options, config_from_args, run_cli
from .recipe import RecipeError, checkpointing_as_asked, load_config, prepare, synthetic_batch, \
    weights_dtype


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settle(meter: TrackerMeter, barrier=None, quiet_s: float = 0.06, limit_s: float = 5.0) -> None:
    """Wait until what the strategy's start-up collectives used is freed. DDP's start-up broadcast
    (``init_sync``) flattens the module's states into one buffer a dtype; the main thread usually
    frees it as the broadcast returns, but when the process group's worker thread still holds the
    collective then, the worker frees it a moment later (seen under load: 0.25 MiB of LoRA weights
    still counted at one rank's pre-step). After a barrier, the count must stay unchanged for
    ``quiet_s`` (at most ``limit_s`` in all). ``barrier``: the group's (``dist.barrier``)."""
    if barrier is None:
        import torch.distributed as dist

        barrier = dist.barrier
    barrier()
    start = quiet_since = time.monotonic()
    last = meter.live_bytes
    while time.monotonic() - quiet_since < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.01)
        if meter.live_bytes != last:
            last, quiet_since = meter.live_bytes, time.monotonic()


def real_step(rank: int, world_size: int, port: int, cfg, strategy: str, out) -> None:
    """One rank of a real run over gloo on the CPU (``torch.multiprocessing.spawn``'s target): the
    model built with random weights (4-bit: the dry run's stand-in, real tensors), the recipe, the
    strategy, and the probe's step, measured by the tracker meter; puts (rank, figures) on ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(load_config(cfg.model), dtype=weights_dtype(cfg))
        if cfg.quant == "4bit":
            stand_in_4bit(model, cfg.double_quant)
        vocab = model.get_input_embeddings().num_embeddings
        meter = TrackerMeter()
        meter.register_module(model)
        with meter:
            model = prepare(model, cfg)
            checkpointing_as_asked(model, cfg)
            ids = synthetic_batch(cfg, vocab, torch.device("cpu"))
            model = shard(model, strategy, mesh, fake=False, optimizer=cfg.optimizer, batch=cfg.batch_size,
                          cpu_offload=cfg.cpu_offload)
            settle(meter)
            with fsdp_offload(model, meter.never_count) if cfg.cpu_offload else contextlib.nullcontext():
                after_load = meter.allocated_mib()  # what the rank holds once the strategy has the model (and the batch)
                meter.reset_peak()
                figures = {}

                def warmed() -> None:
                    figures["pre_step"] = meter.allocated_mib()

                rank_train_step(model, ids, cfg, fake=False, warmed=warmed,
                                optimizer_context=meter.host if cfg.cpu_offload else None)
        out.put((rank, {"after_load_mib": after_load, "pre_step_mib": figures.get("pre_step"),
                        "peak_mib": meter.peak_allocated_mib(), "host_peak_mib": meter.host_peak_mib()}))
    finally:
        dist.destroy_process_group()
    # Figures put, group gone: leave without the interpreter's teardown, where a library's thread
    # still joinable aborts the process now and then ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def real_run(cfg, strategy: str, world_size: int) -> list[dict]:
    """Every rank's figures of a real gloo run of ``world_size`` CPU processes, in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(real_step, args=(world_size, free_port(), cfg, strategy, queue), nprocs=world_size,
                               join=False, start_method="spawn")
    got: dict = {}
    try:
        while not procs.join():
            pass
    except mp.ProcessExitedException as exc:
        # A rank killed by a signal once every rank had put its figures (a library's thread torn
        # down at exit) leaves a whole run: its figures stand. Anything else is the run's failure.
        while not queue.empty():
            rank, figures = queue.get()
            got[rank] = figures
        if exc.signal_name is None or len(got) < world_size:
            raise
    while len(got) < world_size:
        rank, figures = queue.get()
        got[rank] = figures
    return [got[r] for r in range(world_size)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m probe_kit.gloo_run", description=__doc__.split("\n\n")[0],
                                epilog="Prints one JSON list: each rank's after-load, pre-step and peak MiB "
                                       "and the host RAM its offloaded tensors held at most (tracker meter). Exit codes: 0 ok, 1 bad input.")
    add_recipe_options(p)
    args = p.parse_args(argv)
    args.random_weights = True
    out: dict = {}

    def work() -> None:
        cfg = config_from_args(args)
        if cfg.gpus < 2:
            raise RecipeError("--gpus: a gloo run needs 2 or more processes")
        out["ranks"] = real_run(cfg, cfg.strategy, cfg.gpus)

    code = run_cli("gloo_run", work, json_out=True)
    if code:
        return code
    print(json.dumps(out["ranks"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

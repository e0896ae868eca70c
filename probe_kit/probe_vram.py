"""One probe: one forward+backward of the training recipe on the worst-case shape -> one Measurement.

    python -m probe_kit.probe_vram --model gemma-3-4b-it --random-weights --rank 16 --seq-len 7177 \
        --response-len 237 --device cuda --ledger ledger/vram.json

Semantics (each cost the program GPU-hours): model.train() with gradient checkpointing verified
active before the step (refused otherwise); synthetic tokens of seq_len with the loss on the last
response_len; no optimizer step (a probe over-estimates a real run: calibration turns probes into
predictions). An OOM is data: status oom with the message's figures, never a made-up peak. Peak
reserved above the card's total means the driver spilled: status spilled. Host RAM is capped by a
watchdog: status host_oom.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import signal
import sys
import threading
import time
from typing import Iterator, Optional

from ledger.storage import store
from ledger.vocab.recipe import slug, vendor_of
from ledger.core.errors import UserError
from ledger.core.models import Environment, Gpu, Measurement, Oom, Outcome, Provenance
from ledger.intake.oom import find_oom, parse_oom_message
from ledger.vocab.optimizers import OPTIMIZERS
from ledger.core.units import round_mib

from .recipe import ProbeConfig, RecipeError, parse_fixes

MIB = 2**20
#: Exit codes. Refused input is 1 and nothing else may exit 1: every other failure (an illegal
#: memory access, a device-side assert, a missing native library) is caught and exits 70, so a
#: sweep records it as crashed instead of taking it for a refusal.
EXIT_REFUSED = 1
EXIT_CRASHED = 70


# -- host RAM -----------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_host_cap_gib() -> float:
    """Three quarters of the machine's RAM (the probe must never take the box down)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 32.0
    return round(total * 0.75 / 2**30, 1)


class HostRamExceeded(Exception):
    """Raised in the main thread when the probe's RSS passes the host-RAM cap."""


#: The signal the watchdog raises in the main thread. It is never sent to the process: the
#: watchdog simulates it with ``_thread.interrupt_main(signum)``, which runs our handler in the
#: main thread. SIGINT is not used because a background job (CI, nohup, ``cmd &``) ignores it,
#: and then the simulated SIGINT does nothing.
_WATCHDOG_SIGNAL = signal.SIGUSR1


def _raise_host_ram_exceeded(signum, frame) -> None:
    raise HostRamExceeded()


class HostWatchdog:
    """Stops the main thread with HostRamExceeded when RSS passes the cap; the probe records
    host_oom. The interruption lands between Python bytecodes, so a long native call finishes
    first (as with Ctrl-C)."""

    def __init__(self, cap_gib: Optional[float], interval_s: float = 0.05):
        self.cap = None if not cap_gib else int(cap_gib * 2**30)
        self.interval = interval_s
        self.fired = False
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous_handler = None

    def _sample(self) -> bool:
        """Read RSS once; True when it is past the cap."""
        rss = rss_bytes()
        self.peak_rss = max(self.peak_rss, rss)
        return self.cap is not None and rss > self.cap

    def _run(self) -> None:
        # The first sample is taken at once, not an interval in: a step shorter than the interval
        # is still watched.
        while True:
            if self._sample() and not self.fired:
                self.fired = True
                _thread.interrupt_main(_WATCHDOG_SIGNAL)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "HostWatchdog":
        if self.cap is not None:
            if threading.current_thread() is not threading.main_thread():
                raise RecipeError("the host-RAM cap needs the probe in the main thread (or pass a cap of 0)")
            self._previous_handler = signal.signal(_WATCHDOG_SIGNAL, _raise_host_ram_exceeded)
        self._thread = threading.Thread(target=self._run, name="host-ram-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            # A last sample on the way out, and a fire whose interruption has not landed yet (the
            # block ended first): the cap was passed inside the block either way.
            over = self._sample()
            if self.cap is not None and exc_type is None and (over or self.fired):
                raise HostRamExceeded()
        finally:
            if self._previous_handler is not None:
                signal.signal(_WATCHDOG_SIGNAL, self._previous_handler)


# -- the probe ----------------------------------------------------------------------------


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", None)
        except Exception:  # a library that fails to import is reported as missing
            out[name] = None
    return out


def environment(device, meter_name: str) -> Environment:
    """Versions, the device and what shapes the allocator's figures beyond the model: the cuBLAS
    workspaces, the attention backends and the allocator's configuration."""
    import torch

    v = versions()
    env = Environment(
        python=v["python"], torch=v["torch"], transformers=v["transformers"], peft=v["peft"],
        bitsandbytes=v["bitsandbytes"], cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
        device=str(device), meter=meter_name,
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.device_name = props.name
        env.device_total_mib = round_mib(props.total_memory / MIB)
        env.driver = driver_version()
        env.cublas_workspace_mib, env.cublaslt_workspace_mib = blas_workspaces_mib()
        env.sdpa_backends = sdpa_backends()
        env.alloc_conf = alloc_conf()
    else:
        env.device_name = platform.processor() or platform.machine()
    return env


def blas_workspaces_mib() -> tuple[Optional[float], Optional[float]]:
    """Per-handle cuBLAS and cuBLASLt workspace sizes (bytes from torch, in MiB), where readable."""
    import torch

    out: list[Optional[float]] = []
    for name in ("cublas_workspace_size", "cublaslt_workspace_size"):
        fn = getattr(torch.backends.cuda, name, None)
        try:
            out.append(round_mib(fn() / MIB) if fn is not None else None)
        except (RuntimeError, AttributeError, TypeError):
            out.append(None)
    return out[0], out[1]


def sdpa_backends() -> list[str]:
    import torch

    b = torch.backends.cuda
    checks = {"flash": "flash_sdp_enabled", "mem_efficient": "mem_efficient_sdp_enabled",
              "cudnn": "cudnn_sdp_enabled", "math": "math_sdp_enabled"}
    return [name for name, fn in checks.items() if getattr(b, fn, lambda: False)()]


def alloc_conf() -> Optional[str]:
    """The caching allocator's settings from the environment (CUDA's name, else HIP's)."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        if os.environ.get(key):
            return f"{key}={os.environ[key]}"
    return None


def card_entry(props, gpu_key: Optional[str], hip: Optional[str], torch_version: str,
               cuda: Optional[str] = None) -> tuple[str, Gpu]:
    """The ledger's entry for a card from ``torch.cuda.get_device_properties`` (dated today). It is
    added to a ledger only where the key is missing: a card already there is kept as it is."""
    key = gpu_key or slug(props.name)
    return key, Gpu(
        name=props.name, vendor=vendor_of(props.name) or ("amd" if hip else None),
        total_mib=round_mib(props.total_memory / MIB), usable_gib_torch=round(props.total_memory / 2**30, 2),
        stack=f"torch {torch_version}" + (f", HIP {hip}" if hip else f", CUDA {cuda}" if cuda else ""),
        provenance=Provenance(source="torch.cuda.get_device_properties", measured_on=dt.date.today()),
    )


def describe_device(device: str, gpu_key: Optional[str] = None) -> dict:
    """The card's ledger key and entry as JSON (for a sweep that records a crashed child under
    the same key the child's own measurements use)."""
    import torch

    dev = torch.device(device)
    key, gpu = card_entry(torch.cuda.get_device_properties(dev.index or 0), gpu_key, torch.version.hip,
                          torch.__version__, torch.version.cuda)
    return {"key": key, "gpu": gpu.model_dump(mode="json", exclude_defaults=True)}


def spill_status(peak_reserved_mib: Optional[float], free_at_start_mib: Optional[float],
                 reserved_at_start_mib: float = 0.0) -> Optional[str]:
    """'spilled' when the step reserved more than the device could give when the probe started:
    on Linux with a discrete card that cannot happen (an OOM comes first); the Windows driver's
    system-memory fallback and unified-memory devices let it happen, and the step then ran on
    host memory. None otherwise."""
    if peak_reserved_mib is None or free_at_start_mib is None:
        return None
    return "spilled" if peak_reserved_mib > free_at_start_mib + reserved_at_start_mib else None


def driver_version() -> Optional[str]:
    """The GPU driver version from nvidia-smi (its exit status checked) or rocm-smi's JSON."""
    from .doctor import rocm_driver_version, run_smi

    text = run_smi(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if text and text.strip():
        return text.strip().splitlines()[0].strip()
    return rocm_driver_version()


def probe_id(cfg: ProbeConfig, device: str, gpu_key: Optional[str]) -> str:
    """A readable id that is the same for the same configuration (what --resume relies on)."""
    digest = hashlib.sha256(json.dumps([cfg.key(), device, gpu_key], sort_keys=True).encode()).hexdigest()[:8]
    parts = ["probe", gpu_key or device.split(":")[0], cfg.quant, f"r{cfg.rank}" if cfg.method == "lora" else "full"]
    if cfg.dropout:
        parts.append(f"drop{cfg.dropout:g}")
    if cfg.dora:
        parts.append("dora")
    parts += [f"seq{cfg.seq_len}", digest]
    return "-".join(parts)


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and find_oom(str(exc)) is not None)


@contextlib.contextmanager
def _maybe(ctx) -> Iterator[None]:
    if ctx is None:
        yield
    else:
        with ctx:
            yield


def run_probe(
    cfg: ProbeConfig,
    *,
    device: str = "cpu",
    budget_mib: Optional[float] = None,
    host_cap_gib: Optional[float] = None,
    gpu_key: Optional[str] = None,
    mid: Optional[str] = None,
) -> tuple[Measurement, Optional[tuple[str, Gpu]]]:
    """Run one probe and return its Measurement (and, on a GPU, the card's ledger entry)."""
    import torch

    if cfg.gpus > 1:
        raise RecipeError(f"--gpus {cfg.gpus}: a probe measures one card's step; a rank of a multi-GPU run is "
                          "answered by the dry run (python -m probe_kit.dry_run ... --gpus N --strategy S)")

    from .meters import AllocatorMeter, TrackerMeter
    from .recipe import build_model, checkpointing_as_asked, offload, prepare, step_offloader, synthetic_batch, \
        train_step

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError("--device cuda: no CUDA or ROCm GPU is visible (see `vram doctor`)")
        if budget_mib is not None:
            raise RecipeError("--budget-mib simulates an OOM with the CPU tracker meter; use it with --device cpu")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        meter = AllocatorMeter(dev)
        mode = None
    elif dev.type == "cpu":
        meter = TrackerMeter(budget_mib)
        mode = meter
    else:
        raise RecipeError(f"--device must be cuda or cpu, got {device!r}")

    gpu_entry = None
    free_at_start = reserved_at_start = None
    if dev.type == "cuda":
        # Make the probe's device current: peft's empty_cache, pinned host buffers and every
        # library call that says "cuda" act on the current device, not on the one probed.
        torch.cuda.set_device(dev)
        gpu_entry = card_entry(torch.cuda.get_device_properties(dev), gpu_key, torch.version.hip, torch.__version__,
                               torch.version.cuda)
        gpu_key = gpu_entry[0]
        free_at_start = torch.cuda.mem_get_info(dev)[0] / MIB
        reserved_at_start = torch.cuda.memory_reserved(dev) / MIB

    out: dict = {}
    oom: Optional[Oom] = None
    status = "ok"
    torch.manual_seed(cfg.seed)
    dog = HostWatchdog(host_cap_gib)
    try:  # the watchdog may fire between the step and leaving the block: still host_oom
        with dog:
            try:
                if dev.type == "cuda":
                    meter.reset_peak()
                model = build_model(cfg, dev)
                if isinstance(meter, TrackerMeter):
                    meter.register_module(model)
                out["after_load_mib"] = round_mib(meter.allocated_mib())
                with _maybe(mode):
                    model = prepare(model, cfg)
                    checkpointing_as_asked(model, cfg)
                    ids = synthetic_batch(cfg, model.get_input_embeddings().num_embeddings, dev)
                    meter.reset_peak()  # an optimizer's first step (making its state) is inside the peak too
                    t0 = time.perf_counter()

                    def warmed() -> None:  # before the measured step: with an optimizer, its state is made
                        nonlocal t0
                        out["pre_step_mib"] = round_mib(meter.allocated_mib())
                        t0 = time.perf_counter()

                    exclude = meter.exclude if isinstance(meter, TrackerMeter) else None
                    train_step(model, ids, cfg, lambda: offload(cfg, dev, exclude), warmed=warmed,
                               offloader=step_offloader(model, cfg, dev, meter if exclude else None),
                               unified=meter.never_count if exclude else None)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    out["step_s"] = round(time.perf_counter() - t0, 3)
                out["peak_allocated_mib"] = round_mib(meter.peak_allocated_mib())
                reserved = meter.peak_reserved_mib()
                if reserved is not None:
                    out["peak_reserved_mib"] = round_mib(reserved)
                    status = spill_status(reserved, free_at_start, reserved_at_start or 0.0) or status
            except RecipeError:
                raise
            except BaseException as exc:  # an OOM is data; anything else propagates
                if not _is_oom(exc):
                    raise
                status = "oom"
                oom = parse_oom_message(str(exc)) or Oom(message=str(exc))
                oom.max_allocated_mib = round_mib(meter.peak_allocated_mib())
                out.pop("step_s", None)
    except HostRamExceeded:
        status, oom = "host_oom", None
        out = {k: v for k, v in out.items() if k in ("after_load_mib", "pre_step_mib")}
        out["result_text"] = f"host RAM passed the cap of {host_cap_gib} GiB (RSS {dog.peak_rss / 2**30:.2f} GiB)"
    if dev.type == "cuda":
        out["free_at_start_mib"] = round_mib(free_at_start)
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info(dev)
            out["outside_allocator_mib"] = round_mib(max(total - free - torch.cuda.memory_reserved(dev), 0) / MIB)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()

    notes = []
    if isinstance(meter, TrackerMeter):
        notes.append("Measured on the CPU by the tracker meter (live tensor storages, 512-byte blocks); "
                     "no allocator cache, so no reserved figure.")
    measurement = cfg.measurement(
        id=mid or probe_id(cfg, str(dev.type), gpu_key), kind="probe", gpu=gpu_key,
        outcome=Outcome(status=status, oom=oom, **out),
        environment=environment(dev, meter.name),
        provenance=Provenance(
            source=f"probe_kit.probe_vram on {dev}",
            measured_on=dt.date.today(),
            simulated=budget_mib is not None,
            notes=notes + ([f"Simulated OOM: the tracker meter's budget was {budget_mib} MiB."]
                           if budget_mib is not None else []),
        ),
    )
    return measurement, gpu_entry


# -- command line -------------------------------------------------------------------------


def add_recipe_options(p: argparse.ArgumentParser) -> None:
    """The recipe flags, shared by probe_vram, run_sweep points and dry_run."""
    p.add_argument("--model", required=True, help="model id or directory (real weights), or a config JSON "
                   "(a path, or a shipped name such as gemma-3-4b-it) with --random-weights")
    p.add_argument("--method", choices=["lora", "full"], default="lora",
                   help="lora (the default; QLoRA is lora with --quant 4bit) or full: every weight trained, no "
                        "adapter, in --quant bf16 or fp32 (fp32 master weights under bf16 autocast)")
    p.add_argument("--rank", type=int, help="LoRA rank (required with --method lora)")
    p.add_argument("--alpha", type=float, help="lora_alpha (default: the rank)")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised scaling")
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout (default 0: no masks stored)")
    p.add_argument("--dora", action="store_true", help="DoRA (weight-decomposed LoRA)")
    p.add_argument("--quant", choices=["4bit", "bf16", "fp32"], default=None,
                   help="4bit = bitsandbytes nf4 (the default with LoRA); bf16 = plain (the default with --method "
                        "full); fp32 = fp32 master weights under bf16 autocast (--method full only)")
    p.add_argument("--no-double-quant", action="store_true", help="4bit without double quantisation")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens in the probed sequence (the longest example)")
    p.add_argument("--response-len", type=int, default=256, help="tokens the loss is computed on")
    p.add_argument("--fixes", default="none", help="memory fixes: none (stock transformers + peft, the default), all "
                   "(the program's preset), or a comma list of chunked_mlp, save_on_cpu, bf16_lm_head, logits_to_keep, "
                   "fused_linear_ce (Liger's fused linear cross-entropy: pip install 'vram-ledger[liger]'), "
                   "activation_offloading (TRL's, SFTConfig(activation_offloading=True))")
    p.add_argument("--logits-to-keep", type=int, help="response positions to keep logits for (default: response-len)")
    p.add_argument("--mlp-chunk", type=int, default=1024, help="tokens per chunk of the chunked MLP (default 1024)")
    p.add_argument("--target-modules", help="comma list of LoRA target modules (default: the 7 projections)")
    p.add_argument("--random-weights", action="store_true", help="build from the config with random weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens and random weights")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences in the step, each of --seq-len tokens (the worst micro-batch, padded to the "
                        "longest; default 1)")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="run the step without gradient checkpointing (every activation kept for backward)")
    p.add_argument("--optim", metavar="NAME", choices=OPTIMIZERS,
                   help="step this optimizer (a TrainingArguments name: " + ", ".join(OPTIMIZERS) + "): the "
                        "steady state is measured, an optimizer step first so its state exists (default: no "
                        "optimizer step, a one-step probe)")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs of one data-parallel or sharded run (default 1); the figures are one rank's")
    p.add_argument("--strategy", metavar="NAME",
                   help="how --gpus N split the model: ddp (every GPU holds it whole), fsdp (FSDP2 fully_shard, "
                        "FULL_SHARD), fsdp-shard-grad-op (SHARD_GRAD_OP), zero2 or zero3 (DeepSpeed's ZeRO stages: "
                        "the deepspeed extra, with --optim), as accelerate and the Trainer launch them")
    p.add_argument("--cpu-offload", action="store_true",
                   help="FSDP's CPU offload (accelerate's fsdp_offload_params): each rank's sharded parameters, "
                        "gradients and optimizer state in host RAM, the optimizer stepping there; the answer adds "
                        "the host RAM they take")


def config_from_args(args: argparse.Namespace) -> ProbeConfig:
    kwargs = dict(
        model=args.model, rank=args.rank, alpha=args.alpha, rslora=args.rslora, dropout=args.dropout, dora=args.dora,
        quant=args.quant or ("bf16" if args.method == "full" else "4bit"), method=args.method, seq_len=args.seq_len,
        response_len=args.response_len, fixes=parse_fixes(args.fixes),
        logits_to_keep=args.logits_to_keep, double_quant=not args.no_double_quant, mlp_chunk=args.mlp_chunk,
        random_weights=args.random_weights, seed=args.seed, batch_size=args.batch_size,
        gradient_checkpointing=not args.no_gradient_checkpointing, optimizer=args.optim,
        gpus=args.gpus, strategy=args.strategy, cpu_offload=args.cpu_offload,
    )
    if args.target_modules:
        kwargs["target_modules"] = [t.strip() for t in args.target_modules.split(",") if t.strip()]
    return ProbeConfig(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m probe_kit.probe_vram", description=__doc__.split("\n\n")[0],
                                epilog="Exit codes: 0 ok (an OOM is a result, not a failure), 1 refused input (nothing "
                                       "recorded), 2 bad usage, 70 crashed (traceback on stderr), 130 interrupted.")
    add_recipe_options(p)
    p.add_argument("--device", default="cuda", help="cuda (CUDA or ROCm) or cpu (default: cuda)")
    p.add_argument("--budget-mib", type=float, help="with --device cpu: simulate an OOM above this many MiB")
    p.add_argument("--host-ram-cap-gib", type=float, default=default_host_cap_gib(),
                   help="host RAM cap watched during the probe (default: 3/4 of RAM, %(default)s GiB; 0 = none)")
    p.add_argument("--gpu", help="the card's key in the ledger (default: from its name)")
    p.add_argument("--ledger", help="append the measurement to this ledger (locked, atomic)")
    p.add_argument("--id", help="measurement id (default: derived from the configuration)")
    p.add_argument("--json", action="store_true", help="print the measurement as one JSON document")
    return p


def run_cli(prog: str, work, json_out: bool = False) -> int:
    """Run ``work()`` for a command-line tool of the probe kit and return its exit code: 0 done;
    EXIT_REFUSED (1) for a user mistake, printed as one line per problem; 130 on Ctrl-C or
    SIGINT, one line; EXIT_CRASHED (70) for anything else, with its traceback. Nothing else exits
    1, so a sweep can tell refused input from a crash. ``json_out``: the command prints JSON on
    stdout afterwards, so whatever a library prints on stdout during the work (DeepSpeed's logger,
    where it is installed) goes to stderr."""
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext():
            work()
        return 0
    except RecipeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    except UserError as exc:
        for issue in exc.issues:
            print(str(issue), file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing recorded", file=sys.stderr)
        return 130
    except Exception:  # anything but refused input is a crash: its own exit code, traceback kept
        import traceback

        traceback.print_exc()
        print(f"{prog}: crashed (the traceback above); nothing recorded", file=sys.stderr)
        return EXIT_CRASHED
    return EXIT_REFUSED


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    done: dict = {}

    def work() -> None:
        cfg = config_from_args(args)
        with contextlib.redirect_stdout(sys.stderr):  # libraries print banners on import; stdout is ours
            done["m"], gpu = run_probe(cfg, device=args.device, budget_mib=args.budget_mib,
                                       host_cap_gib=args.host_ram_cap_gib or None, gpu_key=args.gpu, mid=args.id)
        if args.ledger:
            # The card's entry is added when its key is missing and never blocks the measurement:
            # the measurement's own environment records this run's device and versions.
            store.append(args.ledger, [done["m"]], gpus_if_missing=dict([gpu]) if gpu else None, create=True)

    code = run_cli("probe_vram", work, json_out=args.json)
    if code:
        return code
    measurement = done["m"]
    if args.json:
        print(measurement.model_dump_json(exclude_none=True))
    else:
        o = measurement.outcome
        figure = (f"peak allocated {o.peak_allocated_mib} MiB" if o.status != "oom"
                  else f"OOM ({o.oom.message.splitlines()[0][:160] if o.oom and o.oom.message else ''})")
        print(f"{measurement.id}: {o.status}; after load {o.after_load_mib} MiB, pre-step {o.pre_step_mib} MiB, "
              f"{figure}" + (f", step {o.step_s} s" if o.step_s else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

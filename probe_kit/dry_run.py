"""The GPU-free dry run: the real probe step under fake tensors, measured by the tracker meter.

    python -m probe_kit.dry_run --model gemma-3-4b-it --rank 16 --seq-len 7177 --response-len 237 \
        --gpu rx-7900-xtx --json

The model class is built from its config under ``FakeTensorMode`` on device 'cpu' (fake 'cpu'
picks the flash-style CPU attention kernel, as a GPU does; 'meta' would pick the math path), then
the recipe is applied exactly as the probe applies it (``probe_kit.recipe``: LoRA, kbit
preparation, memory fixes, checkpointing) and the probe step runs. No weights exist: a 4B model
runs in seconds in a few hundred MiB.

4-bit: bitsandbytes' ``Params4bit`` cannot wrap a fake tensor, so each quantised Linear is a
stand-in with bnb's storage (packed nf4 uint8, the absmax, the double-quant state and code book)
and bnb's compute: a dequantised bf16 copy of the weight in forward and again in backward.

What fake tensors cannot see is modelled explicitly and shown in the breakdown: the cuBLAS
workspaces (two handles, forward and autograd threads, each of the size the card's probes recorded
or PyTorch's default; through the caching allocator), the vision tower when the recipe
loads the multimodal class (chosen from the config, as the training code loads it: a config with a
``vision_config`` brings its tower; ``--text-only`` for a recipe that loads the text class), and
reserved vs allocated (the ratio fitted from the
card's ledger rows). Allocator rounding (512-byte blocks) is in the tracker.

Three library behaviours are adjusted while the fake step runs, each because the real run decides
them from tensor values a fake tensor does not have: transformers' packed-sequence detection (one
sequence per batch, as in the probe), and ``Module._apply``'s tensor swap (the fake-tensor
converter's memo holds a weak reference that blocks it; it is cleared first). And one check that
is PyTorch's shape function's alone: the meta kernel of ``torch._grouped_mm`` (the grouped matmul
transformers runs a mixture of experts' fused 3-D expert weights with) accepts bf16 only, while
the kernels take the fp32 that ``prepare_model_for_kbit_training`` casts those weights to under
4-bit (bitsandbytes quantises ``nn.Linear`` layers, not 3-D parameters); the fake run computes the
output's shape as for bf16 and gives it the inputs' dtype, as the kernels do.

Mixture of experts: transformers' default experts implementation (``grouped_mm``) sorts the S =
tokens x top-k routed pairs by expert and runs one grouped matmul over all of them, so every
tensor it makes has a shape set by S, never by how the router spreads the tokens: the fake step's
memory is the real step's for any routing (``tests/test_moe.py`` routes every token to the same
experts on the CPU to show it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import sys
import time
from typing import Callable, Iterator, Optional

import torch
import torch._meta_registrations as _meta

from ledger.storage import store
from ledger.core.paths import DEFAULT_LEDGER
from ledger.vocab.recipe import fixes_key, fixes_value
from ledger.core.models import MAX_MIB, Environment, Measurement, Outcome, Provenance, SimulatedAllocator

from .allocator import EMPTY_CACHE, RESET_PEAK
from .depth import depth_plan, extrapolate, phase_marks, phase_peaks, trace_stacks, with_layers
from .meters import MIB, TrackerMeter
from .probe_vram import add_recipe_options, config_from_args, probe_id, rss_bytes, run_cli, versions
from .recipe import ProbeConfig, RecipeError, checkpointing_as_asked, load_config, offload, prepare, step_offloader, \
    resolve_config_path, synthetic_batch, train_step, weights_dtype

#: PyTorch's default cuBLAS workspace per handle (CUBLAS_WORKSPACE_CONFIG ":4096:8"): 4096 KiB x 2
#: + 16 KiB x 8. Workspaces come from the caching allocator, so they are inside peak allocated.
CUBLAS_WORKSPACE_MIB = (4096 * 2 + 16 * 8) / 1024
#: One cuBLAS handle (and workspace) per thread and stream that runs matmuls: the forward runs on
#: the main thread, backward on autograd's device thread.
CUBLAS_HANDLES = 2


def cublas_workspace_mib(rows: list[Measurement], gpu: Optional[str]) -> tuple[float, str]:
    """Per-handle workspace: the size the card's probes recorded (larger on Hopper and ROCm),
    else PyTorch's default; with where it came from."""
    if gpu:
        sizes = [m.environment.cublas_workspace_mib for m in rows
                 if m.gpu == gpu and m.environment is not None and m.environment.cublas_workspace_mib]
        if sizes:
            return statistics.median(sizes), f"recorded by {len(sizes)} probes on {gpu} (median)"
    return CUBLAS_WORKSPACE_MIB, "PyTorch's default CUBLAS_WORKSPACE_CONFIG :4096:8 (none recorded for this card)"


class _Dequant4bit(torch.autograd.Function):
    """bnb's MatMul4Bit for a frozen weight: a dequantised copy in forward and in backward; the
    input is not saved (no weight gradient)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        w = module.dequantize()
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.module.dequantize()
        return grad @ w, None


class Linear4bitStandIn(torch.nn.Linear):
    """A Linear with bitsandbytes nf4 storage and compute (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, double_quant: bool,
                 compute_dtype=torch.bfloat16, device=None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        n = in_features * out_features
        blocks = (n + 63) // 64
        self.weight = torch.nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device),
                                         requires_grad=False)
        if double_quant:  # absmax quantised to 8 bits, per 256-block group an fp32 absmax, and code books
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
            self.register_buffer("absmax2", torch.empty((blocks + 255) // 256, dtype=torch.float32, device=device))
            self.register_buffer("code2", torch.empty(256, dtype=torch.float32, device=device))
        else:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=device))
        self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device))
        # zeros, not empty: a real run (gloo_run) adds it to every output, and uninitialised memory
        # can be NaN, which DeepSpeed's overflow check answers by skipping the optimizer's step.
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                        requires_grad=False) if bias else None)

    @property
    def W_q(self) -> torch.Tensor:  # peft's DoRA dequantises a module that has W_q through dequantize()
        return self.weight

    def dequantize(self) -> torch.Tensor:
        return torch.zeros((self.out_features, self.in_features), dtype=self.compute_dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = _Dequant4bit.apply(x.to(self.compute_dtype), self)
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype)


def stand_in_4bit(model: torch.nn.Module, double_quant: bool, device: Optional[torch.device] = None) -> None:
    """Replace every nn.Linear but the lm_head by the 4-bit stand-in (weights are not needed),
    on ``device`` (default: where each Linear's weight is)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                setattr(parent, name, Linear4bitStandIn(child.in_features, child.out_features, child.bias is not None,
                                                        double_quant, device=device or child.weight.device))
    model.is_loaded_in_4bit = True


@contextlib.contextmanager
def fake_world() -> Iterator[object]:
    """FakeTensorMode on 'cpu' with the adjustments described in the module docstring."""
    import importlib

    import torch.utils
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensorMode

    # peft's modules and the bitsandbytes it loads make constant tensors as they load (a default
    # argument's ``torch.tensor(1)``, the 4-bit code tables): loaded first inside the fake world,
    # they would be fake, counted by the first dry run of a process and by no later one.
    importlib.import_module("peft")

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swap, packed = torch.utils.swap_tensors, masking.find_packed_sequence_indices

    def swap_tensors(a, b):
        mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        return swap(a, b)

    torch.utils.swap_tensors = swap_tensors
    masking.find_packed_sequence_indices = lambda position_ids: None
    grouped = _meta.__dict__["_meta_grouped_mm_common"]
    _meta._meta_grouped_mm_common = _grouped_mm_any_float(grouped)
    try:
        with mode:
            yield mode
    finally:
        torch.utils.swap_tensors = swap
        masking.find_packed_sequence_indices = packed
        _meta._meta_grouped_mm_common = grouped


def _grouped_mm_any_float(meta: Callable) -> Callable:
    """``torch._grouped_mm``'s shape function for fp32 and fp16 operands too (see the module
    docstring): the bf16 shape, in the operands' own dtype."""
    def shape(mat_a, mat_b, *args, **kwargs):
        dtype = mat_a.dtype
        if kwargs.get("scale_a") is None and kwargs.get("out_dtype") in (None, dtype) and dtype == mat_b.dtype \
                and dtype in (torch.float32, torch.float16):
            kwargs["out_dtype"] = None
            return meta(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs).to(dtype)
        return meta(mat_a, mat_b, *args, **kwargs)
    return shape


def vision_mib(model: str, quant: str) -> float:
    """Memory of the vision tower a multimodal config declares (SigLIP-style encoder and projector):
    its Linear layers in nf4 (with the double-quant absmax) under 4-bit, everything else in bf16."""
    path = resolve_config_path(model)
    if path is None:
        return 0.0
    data = json.loads(path.read_text(encoding="utf-8"))
    v = data.get("vision_config")
    if not v:
        return 0.0
    h, i, n = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    linear = n * (4 * h * h + 2 * h * i)
    other = n * (4 * h + h + i + 4 * h) + 3 * v["patch_size"] ** 2 * h + h + patches * h + 2 * h
    other += h * data.get("text_config", {}).get("hidden_size", h) + h  # the projector (not an nn.Linear)
    if quant == "4bit":
        return (linear * 0.5 + linear / 64 + other * 2) / MIB
    return (linear + other) * 2 / MIB


def reserved_ratio(rows: list[Measurement], gpu: Optional[str], exclude: str = "") -> tuple[Optional[float], int]:
    """Median peak reserved / peak allocated of the card's ok probes (fitted, leaving out one id)."""
    if not gpu:
        return None, 0
    ratios = [m.outcome.peak_reserved_mib / m.outcome.peak_allocated_mib for m in rows
              if m.gpu == gpu and m.kind == "probe" and m.id != exclude and m.outcome.status == "ok"
              and m.outcome.peak_reserved_mib and m.outcome.peak_allocated_mib]
    return (statistics.median(ratios), len(ratios)) if ratios else (None, 0)


def loads_multimodal(model: str) -> bool:
    """Whether the training code loads the multimodal class, as it does for a config that declares a
    vision tower (Gemma 3 4B/12B): the tower then sits on the card beside the text model."""
    path = resolve_config_path(model)
    if path is None:
        return False
    return bool(json.loads(path.read_text(encoding="utf-8")).get("vision_config"))


def dry_run(cfg: ProbeConfig, *, multimodal: Optional[bool] = None, budget_mib: Optional[float] = None,
            full_depth: bool = False) -> dict:
    """One fake probe step. Returns the tracker's figures (MiB), the step's wall time, peak RSS and
    how its depth was run: a deep model's step is extrapolated from short stacks of its layers
    (``probe_kit.depth``) unless ``full_depth``, a budget (an OOM is simulated on the whole model)
    or unlike layers ask for every layer."""
    config = load_config(cfg.model)
    t0 = time.perf_counter()
    rss0 = rss_bytes()
    plan = None if full_depth or budget_mib is not None else depth_plan(config)
    raw = None
    why = "the short stacks' phases did not extrapolate (the layers are not alike)"
    if plan is not None:
        try:
            # The base stack last: what a process allocates once, on its first step, then falls on
            # a stack with more layers, so a slope can only come out larger (the safe side).
            runs = {stack: _fake_step(cfg, with_layers(config, stack), None, marks=len(stack))
                    for stack in reversed(plan.stacks())}
            samples = [runs[stack] for stack in plan.stacks()]
        except Exception as exc:  # a config the library will not build shorter: the whole depth it is
            samples, why = None, f"a short stack could not be built ({type(exc).__name__})"
        raw = extrapolate(plan, samples) if samples else None
        if raw is not None:
            raw["oom"] = None
    if raw is None:
        raw = _fake_step(cfg, config, budget_mib)
        raw["depth"] = {"method": "every layer", "layers": getattr(config, "num_hidden_layers", None)}
        if plan is not None:
            raw["depth"]["why"] = why
    if multimodal is None:
        multimodal = loads_multimodal(cfg.model)
    extra_vision = vision_mib(cfg.model, cfg.quant) if multimodal else 0.0
    return {"after_load_mib": raw["after_load_mib"], "pre_step_mib": raw["pre_step_mib"], "peak_mib": raw["peak_mib"],
            "host_peak_mib": raw.get("host_peak_mib", 0.0), "vision_mib": extra_vision, "seconds": time.perf_counter() - t0,
            "rss_growth_mib": (rss_bytes() - rss0) / MIB, "oom": raw["oom"], "depth": raw["depth"]}


def _fake_step(cfg: ProbeConfig, config, budget_mib: Optional[float], marks: Optional[int] = None,
               trace: bool = False, world_rank: int = 0) -> dict:
    """The model built from ``config`` under fake tensors, the recipe applied, the step run and
    measured. With ``marks`` (the config's number of layers), each phase's peak too; with
    ``trace``, the device allocations and frees in order (``TrackerMeter.record_trace``); on
    several GPUs, the step of rank ``world_rank`` (the answers' is rank 0; ZeRO's partitions end
    where they end, so its ranks can differ: ``benchmarks/multi_gpu.py`` runs each)."""
    from transformers import AutoModelForCausalLM

    from .distributed import fake_group, fsdp_offload, rank_train_step, shard

    group = fake_group(cfg.gpus, world_rank) if cfg.gpus > 1 else contextlib.nullcontext()
    with group as mesh, fake_world(), contextlib.ExitStack() as offloading:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(cfg))
        if cfg.quant == "4bit":
            stand_in_4bit(model, cfg.double_quant)
        meter = TrackerMeter(budget_mib)
        if trace:
            meter.record_trace()
        meter.register_module(model)
        loaded_at = len(meter.trace) if trace else None
        after_load = meter.allocated_mib()
        oom = None
        with meter:
            model = prepare(model, cfg)
            if cfg.quant == "4bit" and cfg.method == "lora" and not cfg.sharded:
                # On a card, peft's prepare_model_for_kbit_training empties the allocator's cache
                # after its casts (auto_clear_cache); a fake run has no CUDA to call.
                meter.trace_event(EMPTY_CACHE)
            checkpointing_as_asked(model, cfg)
            ids = synthetic_batch(cfg, model.get_input_embeddings().num_embeddings, torch.device("cpu"))
            if mesh is not None:  # one rank: what it holds of the model once the strategy has it (and the batch)
                model = shard(model, cfg.strategy, mesh, fake=True, optimizer=cfg.optimizer, batch=cfg.batch_size,
                              unified=meter.never_count, cpu_offload=cfg.cpu_offload)
                if cfg.cpu_offload:  # the shards in host RAM, their copies to the card, the optimizer on the host
                    offloading.enter_context(fsdp_offload(model, meter.never_count))
                after_load = meter.allocated_mib()
            meter.reset_peak()
            meter.trace_event(RESET_PEAK)  # the probe resets the card's peak statistics here
            figures = {}

            def warmed() -> None:  # before the measured step: with an optimizer, its state is made
                figures["pre_step"] = meter.allocated_mib()
                meter.mark("warmed")

            with phase_marks(model, marks, meter) if marks else contextlib.nullcontext() as backward:
                try:
                    (rank_train_step if mesh is not None else train_step)(
                        model, ids, cfg, lambda: offload(cfg, torch.device("cpu"), meter.exclude), fake=True,
                               warmed=warmed, backward_context=backward,
                               offloader=step_offloader(model, cfg, torch.device("cpu"), meter), unified=meter.never_count,
                               optimizer_context=meter.host if cfg.cpu_offload else None)
                except torch.OutOfMemoryError as exc:
                    oom = str(exc)
                meter.mark("end")
            pre_step = figures.get("pre_step", meter.allocated_mib())
        peak = meter.peak_allocated_mib()
    out = {"after_load_mib": after_load, "pre_step_mib": pre_step, "peak_mib": peak, "oom": oom,
           "host_peak_mib": meter.host_peak_mib(), "trace": meter.trace, "loaded_at": loaded_at}
    if marks:
        out.update(phases=phase_peaks(meter.windows, meter.peak_bytes) if backward else None)
    return out


def allocation_trace(cfg: ProbeConfig, workspace_mib: float = CUBLAS_WORKSPACE_MIB,
                     vision: bool = False, full_depth: bool = False) -> tuple[list[int], dict]:
    """The step's device allocations and frees in order at the model's whole depth: the weights
    as loaded, then the cuBLAS workspaces (``CUBLAS_HANDLES`` of ``workspace_mib``, made through
    the caching allocator when the step's first matmuls run, and kept), then the recipe's
    preparation and the step. A deep model's trace is the traces of four short stacks extended
    period by period (``probe_kit.trace_depth``, checked event for event on the fourth stack)
    unless ``full_depth``, or the stacks would cost as much as every layer, or they are not
    periodic: then every layer runs. ``vision``: a multimodal config's vision tower
    (``vision_mib``; loaded, never run) as the first allocation, as the dry run's figure counts
    it. With how its depth was found (``depth``) and, when every layer ran, the tracker's
    figures."""
    from .allocator import with_first
    from .trace_depth import whole_depth

    config = load_config(cfg.model)
    layers = getattr(config, "num_hidden_layers", None)
    depth: dict = {"method": "every layer", "layers": layers}
    trace = None
    stacks = None if full_depth or cfg.gpus > 1 else trace_stacks(config)
    if stacks is not None:
        types, periods = stacks
        try:
            short = [_traced_step(cfg, with_layers(config, t), workspace_mib)[0] for t in types]
        except Exception as exc:  # a config the library will not build shorter: the whole depth it is
            short, how = None, f"a short stack could not be built ({type(exc).__name__})"
        if short is not None:
            trace, how = whole_depth(short, periods)
        if trace is not None:
            depth = {"method": "extended", "layers": layers, "from_layers": [len(t) for t in types], "how": how}
        else:
            depth["why"] = how
    raw: dict = {}
    if trace is None:
        trace, raw = _traced_step(cfg, config, workspace_mib)
    raw["depth"] = depth
    if vision:
        trace = with_first(trace, int(vision_mib(cfg.model, cfg.quant) * MIB))
    return trace, raw


def _traced_step(cfg: ProbeConfig, config, workspace_mib: float) -> tuple[list[int], dict]:
    """``allocation_trace`` of one config, every layer run (no vision tower)."""
    raw = _fake_step(cfg, config, None, trace=True)
    trace, loaded = raw.pop("trace"), raw.pop("loaded_at")
    made = sum(1 for e in trace[:loaded] if e >= 0)  # allocations before the workspaces keep their numbers
    shifted = [e if e >= 0 or e <= RESET_PEAK or -e - 1 < made else e - CUBLAS_HANDLES for e in trace[loaded:]]
    return trace[:loaded] + [int(round(workspace_mib * MIB))] * CUBLAS_HANDLES + shifted, raw


def predict(cfg: ProbeConfig, *, gpu: Optional[str] = None, ledger: Optional[str] = None,
            multimodal: Optional[bool] = None,
            budget_mib: Optional[float] = None, exclude: str = "", full_depth: bool = False) -> tuple[dict, dict]:
    """The dry run plus the modelled terms: (outcome figures, breakdown)."""
    raw = dry_run(cfg, multimodal=multimodal, budget_mib=budget_mib, full_depth=full_depth)
    rows = store.load(ledger).measurements if ledger and gpu else []  # read once for both fitted terms
    workspace, workspace_source = cublas_workspace_mib(rows, gpu)
    extra = CUBLAS_HANDLES * workspace + raw["vision_mib"]
    ratio, n_ratio = reserved_ratio(rows, gpu, exclude)
    allocated = raw["peak_mib"] + extra
    breakdown = {
        "tracker_after_load_mib": round(raw["after_load_mib"], 1),
        "tracker_pre_step_mib": round(raw["pre_step_mib"], 1),
        "tracker_peak_mib": round(raw["peak_mib"], 1),
        "allocator_rounding": "in the tracker: every storage rounded up to 512 bytes",
        "cublas_workspace_mib": round(CUBLAS_HANDLES * workspace, 1),
        "cublas_workspace_source": f"{CUBLAS_HANDLES} handles (forward and autograd threads) x {workspace:.1f} MiB: "
                                   + workspace_source,
        "vision_tower_mib": round(raw["vision_mib"], 1),
        "vision_tower_source": ("the config's vision_config (the multimodal class is loaded), nf4 linears under "
                                "4-bit, else bf16" if raw["vision_mib"]
                                else "not loaded (text model class)"),
        "reserved_over_allocated": round(ratio, 4) if ratio else None,
        "reserved_source": (f"median of {n_ratio} ok probes on {gpu} in the ledger (fitted; excluding {exclude})"
                            if ratio and exclude else f"median of {n_ratio} ok probes on {gpu} in the ledger (fitted)"
                            if ratio else "no ledger rows with both figures for this card"),
        "seconds": round(raw["seconds"], 2),
        "rss_growth_mib": round(raw["rss_growth_mib"], 1),
        "depth": raw["depth"],
    }
    # Past what any device holds (the ledger's bound, 16 TiB: e.g. eager attention's fp32 scores of
    # a 131,072-token sequence in every layer): no card runs it, recorded as an OOM with the figure.
    beyond = not raw["oom"] and allocated > MAX_MIB
    outcome = {"status": "oom" if raw["oom"] or beyond else "ok",
               "after_load_mib": round(raw["after_load_mib"] + raw["vision_mib"], 1),
               "pre_step_mib": round(raw["pre_step_mib"] + raw["vision_mib"], 1),
               "peak_allocated_mib": None if raw["oom"] or beyond else round(allocated, 1),
               "peak_reserved_mib": round(allocated * ratio, 1) if ratio and not (raw["oom"] or beyond) else None,
               "oom_message": raw["oom"],
               "host_peak_mib": round(raw["host_peak_mib"], 1) if cfg.cpu_offload else None,
               "result_text": (f"the dry run's step needs {allocated / 2**20:.1f} TiB allocated, past the "
                               f"{MAX_MIB / 2**20:.0f} TiB any device holds" if beyond else None)}
    for key in ("after_load_mib", "pre_step_mib"):
        if outcome[key] > MAX_MIB:
            outcome[key] = None
    return outcome, breakdown


def dry_id(cfg: ProbeConfig) -> str:
    """A readable id, the same for the same recipe (what a dry-run sweep's --resume relies on):
    the dry run does not depend on the card, so the card is not in it."""
    digest = probe_id(cfg, "dry", None).rsplit("-", 1)[1]
    parts = ["dry", cfg.model.split("/")[-1].removesuffix(".json"), cfg.quant,
             f"r{cfg.rank}" if cfg.method == "lora" else "full"]
    if cfg.dropout:
        parts.append(f"drop{cfg.dropout:g}")
    if cfg.dora:
        parts.append("dora")
    fixes = fixes_key(fixes_value(cfg.fixes))  # 'all', 'none' or a comma list
    if fixes != "all":
        parts.append("fixes-" + fixes.replace(",", "+").replace("_", ""))
    if cfg.batch_size != 1:
        parts.append(f"b{cfg.batch_size}")
    parts.append(f"seq{cfg.seq_len}")
    if not cfg.gradient_checkpointing:
        parts.append("nockpt")
    if cfg.optimizer:
        parts.append(cfg.optimizer.replace("_", ""))
    if cfg.gpus > 1:
        parts.append(f"{cfg.gpus}gpus-{cfg.strategy}" + ("-offload" if cfg.cpu_offload else ""))
    parts.append(digest)
    return "-".join(parts)


def measurement(cfg: ProbeConfig, outcome: dict, breakdown: dict, gpu: Optional[str], mid: Optional[str]) -> Measurement:
    from ledger.intake.oom import parse_oom_message

    v = versions()
    return cfg.measurement(
        id=mid or dry_id(cfg), kind="dry_run", gpu=gpu,
        outcome=Outcome(status=outcome["status"], after_load_mib=outcome["after_load_mib"],
                        pre_step_mib=outcome["pre_step_mib"], peak_allocated_mib=outcome["peak_allocated_mib"],
                        peak_reserved_mib=outcome["peak_reserved_mib"], result_text=outcome.get("result_text"),
                        host_peak_mib=outcome.get("host_peak_mib"), allocator=simulated(breakdown.get("allocator")),
                        oom=parse_oom_message(outcome["oom_message"]) if outcome["oom_message"] else None),
        environment=Environment(python=v["python"], torch=v["torch"], transformers=v["transformers"], peft=v["peft"],
                                bitsandbytes=v["bitsandbytes"], device="fake cpu", meter="tracker"),
        provenance=Provenance(source="probe_kit.dry_run (fake tensors)", measured_on=dt.date.today(), inferred=True,
                              notes=["Predicted under fake tensors, not measured. Breakdown: " + json.dumps(breakdown)]),
    )


def simulated(sim: Optional[dict]) -> Optional[SimulatedAllocator]:
    """``simulate_allocator``'s figures as a dry-run row records them (nothing held: a card's
    remainder is the answer's, per card)."""
    if not sim or sim.get("held_mib"):
        return None
    return SimulatedAllocator(conf=sim["conf"] or None, peak_allocated_mib=sim["peak_allocated_mib"],
                              peak_reserved_mib=sim["peak_reserved_mib"], oom_below_mib=sim["oom_below_mib"])


def _predictor(ledger: Optional[str]):
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor

    return Predictor(store.load(ledger or DEFAULT_LEDGER), load_dry_runs())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m probe_kit.dry_run", description=__doc__.split("\n\n")[0],
                                epilog="Exit codes: 0 ok, 1 bad input, 2 bad usage.")
    add_recipe_options(p)
    p.add_argument("--gpu", help="the card: a ledger key or a common card ('RTX 4090', a100-40gb); its remainder, "
                                 "reserved ratio and limit")
    p.add_argument("--text-only", action="store_true",
                   help="the recipe loads the text-only class of a multimodal config (default: the class the config "
                        "declares, as the training code loads it: a vision tower when it has a vision_config)")
    p.add_argument("--full-depth", action="store_true",
                   help="run every decoder layer (default: a deep model's step is extrapolated from short stacks of "
                        "its layers, phase by phase: the same figures, several times faster; see probe_kit/depth.py)")
    p.add_argument("--ledger", help="ledger the calibration is fitted on (default: the bundled ledger/vram.json), and "
                                    "the one --append writes to")
    p.add_argument("--append", action="store_true", help="append the dry run to --ledger (kind dry_run)")
    p.add_argument("--find-ceiling", metavar="AXIS", help="bisect AXIS (rank) for the largest whose verdict is fits")
    p.add_argument("--budget-mib", type=float, help="the memory to fit in, MiB (default: the card's limit)")
    p.add_argument("--id", help="measurement id")
    p.add_argument("--simulate-allocator", action="store_true",
                   help="also replay the step's allocations through a model of PyTorch's CUDA caching allocator "
                        "(every layer run, its trace recorded; probe_kit/allocator.py): the simulated peak reserved, "
                        "the largest free cached block at that peak, and the card size below which the step raises "
                        "an OOM; the row (--append, --json) records them as outcome.allocator")
    p.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF for the simulation (e.g. expandable_segments:True, "
                        "max_split_size_mb:128, roundup_power2_divisions:4, garbage_collection_threshold:0.8); "
                        "implies --simulate-allocator")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args(argv)
    args.random_weights = True
    result: dict = {}

    def work() -> None:
        cfg = config_from_args(args)
        conf = _alloc_conf(args.alloc_conf)
        if args.find_ceiling:
            cfg.refuse_rank_search()
        predictor = _predictor(args.ledger)
        gpu = entry = None
        if args.gpu:
            from ledger.vocab.cards import known_card_names, resolve_card

            found = resolve_card(predictor.ledger, args.gpu)
            if found is None:
                raise RecipeError(f"--gpu: unknown gpu {args.gpu!r} (known: {', '.join(known_card_names(predictor.ledger))})")
            gpu, entry = found[0], found[1]
            if entry.vendor == "apple" and cfg.gpus > 1:
                raise RecipeError(f"--gpus {cfg.gpus}: {gpu} is a Mac, one GPU sharing the unified memory")
        if args.append and not args.ledger:
            raise RecipeError("--append needs --ledger")
        multimodal = False if args.text_only else None
        with contextlib.redirect_stdout(sys.stderr):
            if args.find_ceiling:
                if args.find_ceiling != "rank":
                    raise RecipeError(f"--find-ceiling: only rank is searched, got {args.find_ceiling!r}")
                if args.budget_mib is None and gpu is None:
                    raise RecipeError("--find-ceiling needs --budget-mib or --gpu")
                result["doc"] = find_ceiling(cfg, predictor, gpu=gpu, entry=entry, budget_mib=args.budget_mib,
                                             multimodal=multimodal)
                return
            outcome, breakdown = predict(cfg, multimodal=multimodal, full_depth=args.full_depth)
            if args.simulate_allocator or args.alloc_conf:
                breakdown["allocator"] = simulate_allocator(cfg, conf, args.alloc_conf or "",
                                                            vision=multimodal is not False)
            m = measurement(cfg, outcome, breakdown, None, args.id)
            if cfg.method == "full":  # judged as every full fine-tuning answer is, from this very row
                from ledger.answer.full_ft import FullAnswers

                answer = FullAnswers(predictor, [m]).judged(
                    cfg.recipe(), gpu or "", entry, "real" if cfg.optimizer else "probe", 0.0, args.budget_mib, True)
            else:
                answer = predictor.judge_dry(cfg.recipe(), outcome["peak_allocated_mib"], gpu, entry=entry,
                                             budget_mib=args.budget_mib) if outcome["peak_allocated_mib"] else None
            result["doc"] = {"measurement": m.model_dump(mode="json", exclude_none=True), "breakdown": breakdown,
                             "answer": answer.model_dump(mode="json") if answer else None}
            if args.append:
                store.append(args.ledger, [m])

    code = run_cli("dry_run", work, json_out=args.json)
    if code:
        return code
    doc = result["doc"]
    if args.json:
        print(json.dumps(doc, indent=2))
    elif "ceiling" in doc:
        print(f"ceiling: rank {doc['ceiling']} fits (tight up to {doc['tight']}) within {doc['limit']} "
              f"({doc['probes']} dry runs; calibrated as ledger.answer.predictor does)")
    else:
        o, b, a = doc["measurement"]["outcome"], doc["breakdown"], doc["answer"]
        d = b["depth"]
        depth = (f"{d['layers']} layers extrapolated from stacks of {', '.join(map(str, d['from_layers']))}"
                 if d["method"] == "extrapolated" else f"every one of {d['layers']} layers")
        print(f"dry run: peak allocated {o.get('peak_allocated_mib')} MiB raw (tracker {b['tracker_peak_mib']} + "
              f"cuBLAS {b['cublas_workspace_mib']} + vision {b['vision_tower_mib']} MiB); after load "
              f"{o.get('after_load_mib')} MiB, pre-step {o.get('pre_step_mib')} MiB; {depth}; {b['seconds']} s")
        if o.get("host_peak_mib") is not None:
            print(f"host RAM: CPU offload holds up to {o['host_peak_mib']} MiB on each rank (its sharded parameters, "
                  "gradients and optimizer state; the process itself not counted)")
        sim = b.get("allocator")
        if sim:
            print(f"allocator simulated ({sim['conf'] or 'PyTorch defaults'}; {sim['events']} allocations and frees, "
                  f"every layer): peak reserved {sim['peak_reserved_mib']} MiB for {sim['peak_allocated_mib']} MiB "
                  f"allocated (x{sim['reserved_over_allocated']}), largest free cached block at that peak "
                  f"{sim['largest_free_at_peak_mib']} MiB; an OOM on any card whose memory free for PyTorch is "
                  f"{sim['oom_below_mib']} MiB or less")
        if a and (a["probe_allocated"] or a["real_allocated"]):
            iv = a["probe_allocated"] or a["real_allocated"]
            print(f"predicted peak allocated {iv['mib']} MiB ({iv['low_mib']}–{iv['high_mib']} MiB): {a['method_text']}")
            ranks = doc["measurement"].get("world_size")
            each = f" (each of {ranks} GPUs, {doc['measurement']['strategy']}: one rank's step)" if ranks else ""
            print(f"verdict{' on ' + a['gpu'] if a['gpu'] else ''}{each}: {a['verdict']}: {a['why']}")
            if ranks:
                print("not in the figure: the collectives' own buffers outside PyTorch's allocator (NCCL's, on the "
                      "card), which a card's measured overhead holds only for one GPU")
    return 0


def _alloc_conf(text: Optional[str]):
    from .allocator import AllocConf, AllocConfError

    try:
        return AllocConf.parse(text)
    except AllocConfError as exc:
        raise RecipeError(f"--alloc-conf: {exc}") from None


def simulate_allocator(cfg: ProbeConfig, conf, text: str = "", trace: Optional[list[int]] = None,
                       held_mib: float = 0.0, vision: bool = True) -> dict:
    """The step's allocation trace replayed through the caching allocator's model: peak reserved,
    the largest free cached block at that peak, and (by bisection on the simulated device's
    capacity, in 2 MiB steps) the largest memory free for PyTorch at which the step raises an
    OOM. ``trace``: the step's, made already (``allocation_trace``); ``held_mib``: memory the card
    holds through the step that the trace does not show (a card's remainder), one allocation from
    the step's start; ``vision``: a multimodal config's vision tower loaded (``allocation_trace``).
    The figures are the caching allocator's alone: the CUDA context and other
    processes' memory come on top."""
    from .allocator import oom_capacity, with_held

    t0 = time.process_time()
    if trace is None:
        trace, _ = allocation_trace(cfg, vision=vision)
    trace = with_held(trace, int(held_mib * MIB))
    fails_at, sim = oom_capacity(trace, conf)
    return {"conf": text, "held_mib": round(max(held_mib, 0.0), 1), "events": len(trace),
            "peak_allocated_mib": round(sim.peak_allocated / MIB, 1),
            "peak_reserved_mib": round(sim.peak_reserved / MIB, 1),
            "reserved_over_allocated": round(sim.peak_reserved / sim.peak_allocated, 4) if sim.peak_allocated else None,
            "largest_free_at_peak_mib": round(sim.largest_free_at_peak / MIB, 1), "segments": sim.segments,
            "oom_below_mib": round(fails_at / MIB, 1), "cpu_s": round(time.process_time() - t0, 2)}


def find_ceiling(cfg: ProbeConfig, predictor, *, gpu: Optional[str] = None, entry=None,
                 budget_mib: Optional[float] = None, multimodal: Optional[bool] = None,
                 progress: bool = True) -> dict:
    """Bisect the rank (steps of 8 up to 512) for the largest whose calibrated dry run (the
    predictor's remainder and interval) is judged "fits" against the budget or the card's limit;
    also the largest that is at worst "tight". With ``progress``, one line on stderr per dry run."""
    from dataclasses import replace

    from .bisect import find_ceiling as bisect

    ranks = list(range(8, 513, 8))
    answers: dict[int, dict] = {}

    def verdict(rank: int) -> str:
        if rank not in answers:
            outcome, _ = predict(replace(cfg, rank=rank), multimodal=multimodal)
            raw = outcome["peak_allocated_mib"]
            a = predictor.judge_dry(replace(cfg, rank=rank).recipe(), raw, gpu, entry=entry, budget_mib=budget_mib) \
                if raw is not None else None
            answers[rank] = {"verdict": a.verdict if a else "won't fit", "raw_mib": raw,
                             "mib": a.probe_allocated.mib if a else None,
                             "high_mib": a.probe_allocated.high_mib if a else None,
                             "limit": f"{a.limit_low_mib} MiB ({a.limit_source})" if a else ""}
            if progress:  # a dry run of a large model takes seconds to minutes: say each one
                got = answers[rank]
                print(f"dry run {len(answers)}: {replace(cfg, rank=rank).label()}: {got['verdict']}"
                      + (f", {got['mib']} MiB" if got["mib"] is not None else ""), file=sys.stderr, flush=True)
        return answers[rank]["verdict"]

    best, probes = bisect(ranks, lambda r: verdict(r) == "fits")
    tight, more = bisect([r for r in ranks if best is None or r > best], lambda r: verdict(r) != "won't fit")
    limit = next((a["limit"] for a in answers.values() if a["limit"]), "")
    return {"ceiling": best, "tight": tight or best, "limit": limit, "probes": len(answers),
            "ranks": {str(k): v for k, v in sorted(answers.items())}}


if __name__ == "__main__":
    sys.exit(main())

"""The ledger's data model: pydantic v2 models, the single source of truth.

``schema/ledger.schema.json`` is generated from these models (``vram schema``)
and a test fails when it drifts. Units live in field names: ``*_mib`` are
mebibytes (2**20 bytes), ``*_gib`` gibibytes, ``*_s`` seconds. A figure that is
unknown is ``null`` (or absent), never 0.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

#: The version of the ledger format these models describe. Bump it with a
#: migration in ``ledger.storage.store.MIGRATIONS`` whenever a saved file would change.
SCHEMA_VERSION = 1

SCHEMA_ID = "urn:vram-ledger:schema:ledger"

Id = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=200,
        description="Stable identifier: letters, digits, '.', '_' and '-'.",
    ),
]
#: Plausible bounds of physical quantities: beyond these a figure is a typo or a unit mistake
#: (a peak of 1e300 MiB, a rank of 1e29), refused with a located message.
MAX_MIB = float(2**24)  # 16 TiB: no device or host this ledger describes holds more
MAX_RANK = 65536
MAX_TOKENS = 10_000_000
MAX_STEPS = 10**9
#: Bounds of text: a line (a name, a version, a source) and a Markdown text (a note, a claim, an
#: OOM message with its process list). A longer one is a paste gone wrong; pages show a shortened
#: text and vram.json the whole.
MAX_LINE = 2_000
MAX_TEXT = 20_000
Line = Annotated[str, Field(max_length=MAX_LINE)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
MiB = Annotated[float, Field(ge=0, le=MAX_MIB, description="Mebibytes (2**20 bytes), at most 16 TiB.")]
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _parse_date(value: object) -> object:
    # Strict mode refuses strings for dates in Python input; accept exactly YYYY-MM-DD.
    if isinstance(value, str):
        if not _ISO_DATE.match(value):
            raise ValueError("must be a date as YYYY-MM-DD")
        return _dt.date.fromisoformat(value)
    return value


Date = Annotated[_dt.date, BeforeValidator(_parse_date)]

Kind = Literal["probe", "real", "load", "computed", "dry_run"]
Status = Literal["ok", "oom", "spilled", "crashed", "host_oom"]
Quant = Literal["4bit", "8bit", "bf16", "fp16", "fp32"]
#: Memory fixes a probe or run can switch on, in the recipe's order (ledger.vocab.recipe.FIX_NAMES): the
#: program's preset ('all': the first four), a fused linear cross-entropy (Liger's) and TRL's
#: activation offloading.
FixName = Literal["chunked_mlp", "save_on_cpu", "bf16_lm_head", "logits_to_keep", "fused_linear_ce",
                  "activation_offloading"]


class _Model(BaseModel):
    # allow_inf_nan=False: JSON has no Infinity or NaN, and a figure is finite.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=False, allow_inf_nan=False)

    def __eq__(self, other: object) -> bool:
        """BaseModel's equality, its common case first: a dump without defaults compares every
        row's outcome and provenance with a new default one (a load, a save and a build each make
        such a dump). Same class, no extra fields (forbidden): equal when the fields and the
        private attributes are; unequal fields that are all model fields decide at once; anything
        else is BaseModel's to decide (40k such pairs: 0.08 s against BaseModel's 0.09-0.12 s)."""
        if other is None:  # a model field that may be None, against its default (every dump)
            return NotImplemented
        if other.__class__ is not self.__class__:
            return super().__eq__(other)
        mine, theirs = self.__dict__, other.__dict__
        if mine == theirs:
            return self.__pydantic_private__ == other.__pydantic_private__
        fields = self.__class__.__pydantic_fields__
        if mine.keys() <= fields.keys() and theirs.keys() <= fields.keys():
            return False
        return super().__eq__(other)


def _default_of(cls: type[BaseModel]):
    """A factory of ``cls``'s default instance that skips validation: a dump without defaults
    (every save, every load's check, the site's vram.json) makes one per row for each such field
    to compare with, and validating one costs as much as the rest of the row's dump. The
    instance is what ``cls()`` makes: the same fields (empty lists new for each), no field set."""
    made = cls()
    template = dict(made.__dict__)
    lists = tuple(k for k, v in template.items() if type(v) is list)
    if any(template[k] for k in lists) or any(isinstance(v, (dict, set, BaseModel)) for v in template.values()):
        raise TypeError(f"{cls.__name__}'s defaults are not all immutable or empty lists")
    new, setattr_ = object.__new__, object.__setattr__

    def default() -> BaseModel:
        obj = new(cls)
        values = template.copy()
        for k in lists:
            values[k] = []
        setattr_(obj, "__dict__", values)
        setattr_(obj, "__pydantic_fields_set__", set())
        setattr_(obj, "__pydantic_extra__", None)
        setattr_(obj, "__pydantic_private__", None)
        return obj

    default.__name__ = default.__qualname__ = f"{cls.__name__}_default"
    return default


class Provenance(_Model):
    """Where a figure came from, and how much to trust it."""

    source: Optional[Line] = Field(
        None, description="Where the figure was read: a file with line numbers, a log, a command."
    )
    measured_on: Optional[Date] = Field(None, description="Date of the measurement (YYYY-MM-DD).")
    inferred: bool = Field(
        False, description="True when the figure was derived or assumed rather than read off an instrument."
    )
    inferred_fields: list[Line] = Field(
        default_factory=list,
        description="Names of fields filled from a stated default or derivation rather than from the record itself.",
    )
    simulated: bool = Field(
        False, description="True when an outcome was simulated (e.g. a CPU probe with a memory budget)."
    )
    notes: list[Text] = Field(default_factory=list, description="Free-text notes, in Markdown (raw HTML is not rendered).")


_default_provenance = _default_of(Provenance)


class Gpu(_Model):
    """One graphics card the ledger has measurements on."""

    name: Line = Field(description="Marketing name as the driver reports it, e.g. 'NVIDIA GeForce RTX 3070 Ti'.")
    vendor: Optional[Literal["nvidia", "amd", "intel", "apple", "other"]] = Field(None, description="Vendor.")
    arch: Optional[Line] = Field(None, description="Architecture or ISA name, e.g. 'gfx1100', 'sm_86'.")
    total_mib: Optional[float] = Field(
        None, gt=0, le=MAX_MIB, description="Card memory in MiB as the vendor tool reports it (more than 0)."
    )
    usable_gib_torch: Optional[float] = Field(
        None, gt=0, le=MAX_MIB / 1024, description="Total capacity in GiB as torch reports it (what OOM messages print)."
    )
    os: Optional[Line] = Field(None, description="Operating system of the box the card was measured in.")
    driver: Optional[Line] = Field(None, description="Driver version.")
    stack: Optional[Line] = Field(None, description="Compute stack: CUDA/ROCm version, torch build.")
    libraries: Optional[Line] = Field(None, description="Library versions as recorded (transformers, peft, ...).")
    python: Optional[Line] = Field(None, description="Python version.")
    aliases: list[Line] = Field(
        default_factory=list, description="Other names that refer to this card (short names, older keys)."
    )
    provenance: Provenance = Field(default_factory=_default_provenance, description="Where these facts came from.")


class Lora(_Model):
    """LoRA adapter settings."""

    rank: int = Field(gt=0, le=MAX_RANK, description="LoRA rank r (at most 65536).")
    alpha: Optional[float] = Field(None, gt=0, le=1e6, description="lora_alpha.")
    rslora: Optional[bool] = Field(None, description="Rank-stabilised LoRA scaling (alpha / sqrt(r)).")
    dropout: Optional[float] = Field(
        None, ge=0, lt=1, description="lora_dropout; any value > 0 stores dropout masks for backward."
    )
    dora: Optional[bool] = Field(None, description="Weight-decomposed LoRA (DoRA).")
    target_modules: Optional[list[Line]] = Field(None, description="Module names LoRA is applied to.")


class Dataset(_Model):
    """The training data a run or probe used."""

    name: Optional[Line] = Field(None, description="Name or date of the corpus.")
    examples: Optional[int] = Field(None, ge=0, le=10**12, description="Number of training examples.")
    longest_example_tokens: Optional[int] = Field(
        None, gt=0, le=MAX_TOKENS, description="Tokens in the longest example."
    )
    epochs: Optional[float] = Field(None, gt=0, le=1e6, description="Training epochs.")


class OomProcess(_Model):
    """One process the OOM message listed on the card (torch >= 2.1 prints them)."""

    pid: int = Field(ge=0, description="Process id as printed.")
    in_use_mib: MiB = Field(description="Memory the message says that process had in use.")


class SimulatedAllocator(_Model):
    """A dry run's step replayed through a model of PyTorch's CUDA caching allocator
    (``probe_kit.allocator``): its allocations and frees in order, every layer run, nothing held but
    what the step holds (a card's remainder and CUDA context come on top)."""

    conf: Optional[Line] = Field(
        None, description="The PYTORCH_CUDA_ALLOC_CONF simulated; null: PyTorch's defaults."
    )
    peak_allocated_mib: MiB = Field(description="The simulation's peak allocated (every layer run, 512-byte blocks).")
    peak_reserved_mib: MiB = Field(description="The simulation's peak reserved: allocated plus the cached free blocks.")
    oom_below_mib: MiB = Field(
        description="The most memory free for PyTorch at which the simulated step raises an OOM (2 MiB steps): a "
                    "card must leave PyTorch more than this."
    )


class Oom(_Model):
    """What an out-of-memory message said. Figures the message did not give are null."""

    tried_mib: Optional[MiB] = Field(None, description="Size of the allocation that failed.")
    free_mib: Optional[MiB] = Field(None, description="Free device memory when it failed.")
    total_mib: Optional[MiB] = Field(None, description="Device total capacity the message printed.")
    in_use_mib: Optional[MiB] = Field(None, description="Memory this process had in use (incl. non-PyTorch).")
    allocated_mib: Optional[MiB] = Field(None, description="Memory allocated by PyTorch when it failed.")
    reserved_unallocated_mib: Optional[MiB] = Field(
        None, description="Reserved by PyTorch but unallocated (allocator cache; fragmentation)."
    )
    reserved_mib: Optional[MiB] = Field(None, description="Reserved in total by PyTorch (legacy message form).")
    other_processes_mib: Optional[MiB] = Field(
        None,
        description=(
            "Memory other processes held on the card: the listed processes less the one that is this process "
            "(its figure equals 'this process has ... in use'); null when that cannot be told."
        ),
    )
    processes: list[OomProcess] = Field(
        default_factory=list, description="Every process the message listed, as printed (this one may be among them)."
    )
    max_allocated_mib: Optional[MiB] = Field(
        None,
        description="torch.cuda.max_memory_allocated read after the OOM: a lower bound of what the step needed.",
    )
    device: Optional[Line] = Field(None, description="Device the message named, e.g. 'GPU 0'.")
    untrusted: list[Line] = Field(
        default_factory=list, description="Fields whose printed values cannot be true (kept, not trusted)."
    )
    message: Optional[Text] = Field(None, description="The message text as printed.")


class Outcome(_Model):
    """What happened and what was measured."""

    status: Optional[Status] = Field(
        None,
        description=(
            "ok: ran and fit; oom: out of device memory; spilled: finished only because the driver spilled "
            "past the card (not a fit); crashed: died of something else; host_oom: hit the host RAM cap. "
            "Null when the source does not say."
        ),
    )
    after_load_mib: Optional[MiB] = Field(None, description="Allocated after the model loaded.")
    pre_step_mib: Optional[MiB] = Field(None, description="Allocated just before the measured step.")
    peak_allocated_mib: Optional[MiB] = Field(None, description="torch.cuda.max_memory_allocated over the step/run.")
    peak_reserved_mib: Optional[MiB] = Field(
        None, description="torch.cuda.max_memory_reserved (allocator cache included; what decides an OOM)."
    )
    peak_delta_mib: Optional[float] = Field(
        None, ge=-MAX_MIB, le=MAX_MIB, description="A peak reported as a delta over a baseline (e.g. HF Trainer's *_peaked_delta)."
    )
    per_device_peak_mib: Optional[dict[str, MiB]] = Field(
        None, description="Peaks per device when a model was split across several."
    )
    step_s: Optional[float] = Field(
        None, ge=0, le=1e7, description="Wall time of the measured step in seconds."
    )
    free_at_start_mib: Optional[MiB] = Field(
        None,
        description=(
            "Device memory free when the probe started (torch.cuda.mem_get_info). Spilling (the Windows driver's "
            "system-memory fallback, unified memory) starts past this, not past the card's total."
        ),
    )
    outside_allocator_mib: Optional[MiB] = Field(
        None,
        description=(
            "Device memory in use outside this process's caching allocator after the step: total - free - "
            "reserved (the CUDA context, other processes)."
        ),
    )
    host_peak_mib: Optional[MiB] = Field(
        None,
        description=(
            "Host RAM that CPU offload (cpu_offload) held at most on one rank: the sharded parameters, gradients "
            "and optimizer state, with the optimizer step's temporaries (a dry run's tracker meter). Not counted: "
            "the process, its libraries, the loading of the model."
        ),
    )
    allocator: Optional[SimulatedAllocator] = Field(
        None, description="A dry run's step replayed through the caching allocator's model (dry_run rows only)."
    )
    failed_at_step: Optional[int] = Field(
        None, ge=0, le=MAX_STEPS, description="Training step at which the run died."
    )
    xid: Optional[int] = Field(None, description="NVIDIA Xid error code of a crash.")
    oom: Optional[Oom] = Field(None, description="Structured figures of the OOM message, when status is oom.")
    peak_as_reported: Optional[Line] = Field(
        None, description="The peak exactly as the source printed it, with its unit."
    )
    result_text: Optional[Text] = Field(None, description="The result as the source described it.")


_default_outcome = _default_of(Outcome)


class Environment(_Model):
    """Software and device a probe ran with."""

    python: Optional[Line] = Field(None, description="Python version.")
    torch: Optional[Line] = Field(None, description="torch version (with build suffix).")
    cuda: Optional[Line] = Field(None, description="CUDA runtime version torch was built with.")
    hip: Optional[Line] = Field(None, description="HIP version torch was built with (ROCm).")
    transformers: Optional[Line] = Field(None, description="transformers version.")
    peft: Optional[Line] = Field(None, description="peft version.")
    bitsandbytes: Optional[Line] = Field(None, description="bitsandbytes version.")
    device: Optional[Line] = Field(None, description="Device the probe ran on, e.g. 'cuda:0' or 'cpu'.")
    device_name: Optional[Line] = Field(None, description="Device name.")
    device_total_mib: Optional[MiB] = Field(None, description="Device total memory.")
    driver: Optional[Line] = Field(None, description="Driver version, where readable.")
    meter: Optional[Line] = Field(None, description="Meter that measured the peaks: 'allocator' or 'tracker'.")
    cublas_workspace_mib: Optional[MiB] = Field(
        None,
        description=(
            "cuBLAS workspace per handle (torch.backends.cuda.cublas_workspace_size). Workspaces come from the "
            "caching allocator, one per handle and stream (the forward and the autograd thread): inside peak "
            "allocated."
        ),
    )
    cublaslt_workspace_mib: Optional[MiB] = Field(
        None, description="cuBLASLt workspace per handle (torch.backends.cuda.cublaslt_workspace_size)."
    )
    sdpa_backends: Optional[list[Line]] = Field(
        None, description="Scaled-dot-product attention backends enabled: flash, mem_efficient, cudnn, math."
    )
    alloc_conf: Optional[Line] = Field(
        None, description="PYTORCH_CUDA_ALLOC_CONF / PYTORCH_HIP_ALLOC_CONF as set for the run (null: unset)."
    )


class RecipeFields(_Model):
    """The configuration that decides memory: shared by measurements and predictions."""

    gpu: Optional[Line] = Field(None, description="Key of the card in the ledger's gpus.")
    model: Optional[Line] = Field(None, description="Model id or config name, e.g. 'unsloth/gemma-3-4b-it'.")
    quant: Optional[Quant] = Field(None, description="Base weights: '4bit' = bitsandbytes nf4, 'bf16' = plain bf16.")
    lora: Optional[Lora] = Field(None, description="LoRA settings.")
    seq_len: Optional[int] = Field(None, gt=0, le=MAX_TOKENS, description="Tokens in the measured sequence.")
    response_len: Optional[int] = Field(
        None, gt=0, le=MAX_TOKENS, description="Tokens the loss is computed on (the response span)."
    )
    batch_size: Optional[int] = Field(None, gt=0, le=MAX_RANK, description="Sequences per step.")
    optimizer: Optional[Line] = Field(
        None, description=("The optimizer by its TrainingArguments name (adamw_torch, adamw_8bit, ...): a real run's, "
                           "or a probe's whose measured step included an optimizer step (a preflight); null: not "
                           "recorded, or a probe without an optimizer step.")
    )
    gradient_checkpointing: Optional[bool] = Field(
        None, description="Whether gradient checkpointing was on; null: as the probe kit runs it (on)."
    )
    memory_fixes: Optional[Union[Literal["all", "none"], list[FixName]]] = Field(
        None,
        description="Memory fixes on: 'all' (the program's preset: chunked_mlp, save_on_cpu, bf16_lm_head, "
                    "logits_to_keep), 'none', or a list of those, fused_linear_ce and activation_offloading.",
    )
    logits_to_keep: Optional[int] = Field(
        None, gt=0, le=MAX_TOKENS, description="Positions the lm_head computes logits for."
    )
    dataset: Optional[Dataset] = Field(None, description="Training data.")
    world_size: Optional[int] = Field(
        None, ge=1, le=1024,
        description="GPUs the step ran on (ranks of one data-parallel or sharded run); the figures are one rank's. "
                    "null: one GPU.",
    )
    strategy: Optional[Literal["ddp", "fsdp", "fsdp-shard-grad-op", "zero2", "zero3"]] = Field(
        None, description="How the ranks split the model: 'ddp' (every rank holds it whole), 'fsdp' (FSDP2 "
                          "fully_shard, FULL_SHARD), 'fsdp-shard-grad-op' (reshard_after_forward off), 'zero2' / "
                          "'zero3' (DeepSpeed's ZeRO stage 2 / 3); null: one GPU.",
    )
    cpu_offload: Optional[bool] = Field(
        None, description="CPU offload: FSDP's (FSDP2 CPUOffloadPolicy, accelerate's fsdp_offload_params: each rank's "
                          "sharded parameters, gradients and optimizer state in host RAM, the optimizer stepping "
                          "there) or DeepSpeed ZeRO's (offload_optimizer / offload_param to the CPU or NVMe). "
                          "null: off.",
    )


class Measurement(RecipeFields):
    """One measured (or computed) memory figure with the configuration it belongs to."""

    id: Id
    kind: Kind = Field(
        description=(
            "probe: one forward+backward on the worst-case example; real: a full training run; "
            "load: model load only; computed: arithmetic; dry_run: predicted under fake tensors."
        )
    )
    config_text: Optional[Text] = Field(None, description="The configuration as the source described it.")
    finetune: Optional[Literal["lora", "full"]] = Field(
        None, description="What the step trains: 'full' = every weight, no adapter (lora is then null); "
                          "null or 'lora' = LoRA (its settings in lora, where known).")
    outcome: Outcome = Field(default_factory=_default_outcome, description="The outcome: status and measured figures.")
    environment: Optional[Environment] = Field(None, description="Software and device (probes).")
    provenance: Provenance = Field(default_factory=_default_provenance, description="Where the figures came from.")


class Detail(_Model):
    """A labelled piece of text in a finding."""

    label: Line = Field(description="What the text is about.")
    text: Text = Field(description="The text, in Markdown (raw HTML is not rendered).")


class Figure(_Model):
    """A labelled number (or range, or flag) in a finding."""

    label: Line = Field(description="What the figure is.")
    value: Optional[Union[bool, float]] = Field(None, description="The figure (a number, or a yes/no flag).")
    low: Optional[float] = Field(None, description="Lower end when the figure is a range.")
    high: Optional[float] = Field(None, description="Upper end when the figure is a range.")
    unit: Optional[Line] = Field(None, description="Unit, e.g. 'MiB', '%', 'GB (as reported)'.")
    text: Optional[Line] = Field(None, description="The figure as written in the source, when it was text.")
    provenance: Optional[Provenance] = Field(None, description="Provenance when it differs from the finding's.")


class Finding(_Model):
    """A claim drawn from measurements, with the rows it rests on."""

    id: Id
    title: Line = Field(description="Short title.")
    claim: Optional[Text] = Field(None, description="The claim, in Markdown.")
    details: list[Detail] = Field(default_factory=list, description="Further labelled text.")
    figures: list[Figure] = Field(default_factory=list, description="The figures the claim states.")
    evidence: list[Line] = Field(default_factory=list, description="Ids of the measurements the finding rests on.")
    status: Literal["measured", "inferred", "superseded"] = Field(
        "measured", description="measured: read off measurements; inferred: derived or estimated; superseded: replaced."
    )
    provenance: Provenance = Field(default_factory=_default_provenance, description="Where the finding came from.")


class PredictionScore(_Model):
    """How a prediction did once the real run landed."""

    measurement: Line = Field(description="Id of the real-run measurement the prediction is scored against.")
    actual_peak_mib: MiB = Field(description="The real run's peak allocated.")
    error_pct: float = Field(ge=-1e6, le=1e6, description="(predicted - actual) / actual x 100.")


class Prediction(RecipeFields):
    """A prediction recorded before the real run, scored when it lands."""

    id: Id
    made_on: Optional[Date] = Field(None, description="Date the prediction was made.")
    finetune: Optional[Literal["lora", "full"]] = Field(
        None, description="What the predicted run trains: 'full' = every weight, no adapter (lora is then null); "
                          "null or 'lora' = LoRA.")
    predicted_peak_mib: MiB = Field(description="Predicted real-run peak allocated.")
    interval_low_mib: Optional[MiB] = Field(None, description="Lower end of the prediction interval.")
    interval_high_mib: Optional[MiB] = Field(None, description="Upper end of the prediction interval.")
    basis: list[Line] = Field(
        default_factory=list,
        description="Ids of the measurements the prediction was made from (in measurements, or in dry_run_rows).",
    )
    method: Optional[Text] = Field(None, description="How the figure was predicted.")
    calibration_hash: Optional[Line] = Field(None, description="Hash of the calibration state that made it.")
    dry_run_rows: list[Measurement] = Field(
        default_factory=list,
        description=(
            "The dry-run rows (kind dry_run) the basis cites, copied from the dry-run file the prediction was made "
            "with, so the ledger holds everything a prediction rests on."
        ),
    )
    score: Optional[PredictionScore] = Field(None, description="The score once a matching real run is in the ledger.")
    provenance: Provenance = Field(default_factory=_default_provenance, description="Where the prediction came from.")


class Ledger(_Model):
    """The whole ledger file."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra={"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID},
        title="vram ledger",
    )

    schema_version: int = Field(ge=1, description="Version of the ledger format.")
    about: Optional[Text] = Field(None, description="What this ledger holds, in Markdown.")
    gpus: dict[Id, Gpu] = Field(default_factory=dict, description="Cards, keyed by a slug id.")
    measurements: list[Measurement] = Field(default_factory=list, description="Measured and computed figures.")
    findings: list[Finding] = Field(default_factory=list, description="Claims drawn from measurements.")
    predictions: list[Prediction] = Field(default_factory=list, description="Prospective predictions and their scores.")


#: Key order of a canonical schema node; other keys follow in alphabetical order.
_SCHEMA_KEY_ORDER = (
    "$schema", "$id", "$ref", "title", "description", "type", "const", "enum", "format", "pattern",
    "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength", "items",
    "prefixItems", "minItems", "maxItems", "uniqueItems", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "required", "anyOf", "oneOf", "allOf", "not", "default",
    "examples", "$defs",
)
_SCHEMA_DATA_KEYS = ("default", "examples", "const", "enum")


def canonical_schema(node: object) -> object:
    """One canonical form of a generated JSON Schema, whatever pydantic version produced it.

    Every object schema with named or patterned properties is closed
    (``additionalProperties: false``): every document this project writes is closed at every
    level, and pydantic versions differ in where they say so (2.14 added it to dataclass fields
    that 2.13 left open). Keys are put in one fixed order, ``$defs`` sorted by name, and
    ``properties`` keep the models' field order. Values that are data (defaults, enums) are kept
    as they are."""
    if isinstance(node, list):
        return [canonical_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
        node = {**node, "additionalProperties": False}
    rank = {k: i for i, k in enumerate(_SCHEMA_KEY_ORDER)}
    out: dict = {}
    for key in sorted(node, key=lambda k: (rank.get(k, len(rank)), k)):
        value = node[key]
        if key in ("properties", "patternProperties") and isinstance(value, dict):
            out[key] = {name: canonical_schema(sub) for name, sub in value.items()}
        elif key == "$defs" and isinstance(value, dict):
            out[key] = {name: canonical_schema(value[name]) for name in sorted(value)}
        elif key in _SCHEMA_DATA_KEYS:
            out[key] = value
        else:
            out[key] = canonical_schema(value)
    return out


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a ledger file, generated from the models, in its
    canonical form."""
    return canonical_schema(Ledger.model_json_schema(mode="validation"))  # type: ignore[return-value]

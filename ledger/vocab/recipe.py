"""The recipe vocabulary: the facts about a configuration and a card that every part of the
project reads the same way (calibration, estimators, the site, downloads, estimate, predictions,
the legacy importer and the probe kit). Nothing here does I/O or imports torch.

- ``capacity_mib(gpu)``: what torch can use on a card (its usable GiB as torch reports it, else
  the vendor total), in MiB;
- ``seq_len_of(row)``: the sequence length a row was measured at (its ``seq_len``, else the
  dataset's longest example);
- ``fixes_key(value)``: one canonical text for a memory-fixes value ('all', 'none', a comma list
  in the recipe's order, '?' when unknown); ``parse_fixes(text)`` reads what users type;
- ``RecipeKey`` / ``recipe_key(row)``: the named, typed key of a recipe on a card;
- ``slug``, ``vendor_of``, ``resolve_gpu``: card names and keys (``ledger.vocab.cards`` resolves them);
- ``Recipe`` / ``recipe_of(row)``: the typed recipe every answer is for (a new axis of memory is a
  field here, read by ``recipe_of``, and a term in the rung that models it).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, TypeVar, get_args

from .adapter import ALL_LINEAR
from ledger.core.models import FixName, Gpu, Measurement

#: Memory fixes a probe or run can switch on, in the recipe's order.
FIX_NAMES: tuple[str, ...] = get_args(FixName)
#: The program's preset, what 'all' names: its chunked MLP, activations saved on the CPU, bf16
#: lm_head and logits_to_keep. A fused linear cross-entropy (``fused_linear_ce``) and TRL's
#: ``activation_offloading`` are not part of it.
PRESET: tuple[str, ...] = ("chunked_mlp", "save_on_cpu", "bf16_lm_head", "logits_to_keep")


# -- keys of rows, computed once per row while a long computation runs ---------------------------

T = TypeVar("T")
_KEYS: Optional[dict] = None


@contextmanager
def row_keys_cached() -> Iterator[None]:
    """Within this block a row's keys (``recipe_key``, ``group_key``, ``recipe_of``) are computed
    once and remembered by the row object: the build, the calibration and the scoreboard ask them
    millions of times of rows nobody changes while they run. Rows must not be modified inside the
    block; outside it nothing is remembered."""
    global _KEYS
    outer = _KEYS
    if outer is None:
        _KEYS = {}
    try:
        yield
    finally:
        if outer is None:
            _KEYS = None


def _remembered(kind: str, row, compute: Callable[[], T]) -> T:
    cache = _KEYS
    if cache is None:
        return compute()
    hit = cache.get((kind, id(row)))
    if hit is not None and hit[0] is row:
        return hit[1]
    value = compute()
    cache[(kind, id(row))] = (row, value)  # the row is held, so its id is not reused meanwhile
    return value


def capacity_mib(gpu: Optional[Gpu]) -> Optional[float]:
    """What torch can use on the card, in MiB: usable GiB as torch reports it, else the total."""
    if gpu is None:
        return None
    if gpu.usable_gib_torch:
        return round(gpu.usable_gib_torch * 1024, 1)
    return gpu.total_mib


def seq_len_of(row) -> Optional[int]:
    """Tokens in the measured sequence: ``seq_len``, else the dataset's longest example."""
    if row.seq_len:
        return row.seq_len
    ds = getattr(row, "dataset", None)
    return ds.longest_example_tokens if ds else None


def parse_fixes(text: str) -> list[str]:
    """'all' (the program's preset), 'none' or a comma list of fix names -> the fixes on, in the
    recipe's order. Raises ValueError naming an unknown fix."""
    text = text.strip()
    if text == "all":
        return list(PRESET)
    if text in ("none", ""):
        return []
    fixes = [f.strip().replace("-", "_") for f in text.split(",") if f.strip()]
    unknown = [f for f in fixes if f not in FIX_NAMES]
    if unknown:
        raise ValueError(f"unknown memory fix {unknown[0]!r} (known: all, none, {', '.join(FIX_NAMES)})")
    on = [f for f in FIX_NAMES if f in fixes]
    clash = fixes_clash(on)
    if clash:
        raise ValueError(clash)
    return on


def fixes_clash(fixes) -> Optional[str]:
    """Why a set of fixes cannot run together, or None. The fused linear cross-entropy never calls
    the lm_head (no logits to keep, no input to cast), and Liger's forward fails on a kept slice of
    a batch; TRL's activation offloading and save_on_cpu are two offloaders of the same tensors."""
    if "activation_offloading" in fixes and "save_on_cpu" in fixes:
        return ("activation_offloading cannot be combined with save_on_cpu: both move what the step saves to "
                "host RAM; choose one")
    if "fused_linear_ce" in fixes:
        clash = [f for f in ("logits_to_keep", "bf16_lm_head") if f in fixes]
        if clash:
            return (f"fused_linear_ce cannot be combined with {' or '.join(clash)}: the fused loss never calls the "
                    "lm_head, so there are no logits to keep and no input to cast")
    return None


def fixes_value(fixes: list[str]):
    """How the ledger records a fix list: 'all' (the preset), 'none' or the list."""
    if set(fixes) == set(PRESET):
        return "all"
    return list(fixes) if fixes else "none"


def keeps_logits(fixes: str) -> bool:
    """Whether a fixes key (``fixes_key``) has the lm_head keep only the response's logits."""
    return fixes == "all" or "logits_to_keep" in fixes.split(",")


def fixes_key(value) -> str:
    """One canonical text for a ``memory_fixes`` value: 'all' (the preset), 'none', a comma list
    in the recipe's order, or '?' when the row does not say."""
    if value is None:
        return "?"
    if isinstance(value, str):
        return value
    on = [f for f in FIX_NAMES if f in value]
    if not on:
        return "none"
    return "all" if set(on) == set(PRESET) else ",".join(on)


class RecipeKey(NamedTuple):
    """A recipe on a card: card, model, quant, rank, dropout on, DoRA on, memory fixes."""

    gpu: Optional[str]
    model: Optional[str]
    quant: Optional[str]
    rank: Optional[int]
    dropout: bool
    dora: bool
    fixes: str


class GroupKey(NamedTuple):
    """Rows of one group differ only in rank and card."""

    model: Optional[str]
    quant: Optional[str]
    seq_len: Optional[int]
    dropout: bool
    dora: bool
    fixes: str


def recipe_key(row) -> RecipeKey:
    return _remembered("recipe_key", row, lambda: _recipe_key(row))


def _recipe_key(row) -> RecipeKey:
    lora = row.lora
    return RecipeKey(row.gpu, row.model, row.quant, lora.rank if lora else None, bool(lora and lora.dropout),
                     bool(lora and lora.dora), fixes_key(row.memory_fixes))


def group_key(row) -> GroupKey:
    return _remembered("group_key", row, lambda: _group_key(row))


def _group_key(row) -> GroupKey:
    lora = row.lora
    return GroupKey(row.model, row.quant, seq_len_of(row), bool(lora and lora.dropout), bool(lora and lora.dora),
                    fixes_key(row.memory_fixes))


# -- card names -------------------------------------------------------------------------------

_VENDOR_PREFIX = re.compile(r"^(nvidia\s+geforce|nvidia|amd\s+radeon|amd|intel\s+arc|intel|apple)\s+", re.I)


def short_name(name: str) -> str:
    """A card's name without its vendor prefix: 'NVIDIA GeForce RTX 3070 Ti' -> 'RTX 3070 Ti'."""
    return _VENDOR_PREFIX.sub("", name.strip())


def slug(text: str) -> str:
    """A GPU key from a card name: 'NVIDIA GeForce RTX 3070 Ti' -> 'rtx-3070-ti'."""
    text = short_name(text)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def vendor_of(name: str) -> Optional[str]:
    """The vendor a card's name says, or None."""
    low = name.lower()
    for needle, vendor in (("nvidia", "nvidia"), ("geforce", "nvidia"), ("rtx", "nvidia"), ("amd", "amd"),
                           ("radeon", "amd"), ("intel", "intel"), ("apple", "apple")):
        if needle in low:
            return vendor
    return None


def resolve_gpu(gpus: Mapping[str, Gpu], name: str) -> Optional[str]:
    """The key of the card called ``name``: its key, an alias, its name, or a slug of either."""
    want = slug(name)
    for key, gpu in gpus.items():
        names = {key, gpu.name, *gpu.aliases}
        if name in names or want in {slug(n) for n in names}:
            return key
    return None


@dataclass(frozen=True)
class Recipe:
    """What decides a step's memory (the rank may be left open for a ceiling)."""

    model: Optional[str]
    rank: int = 16
    quant: str = "4bit"
    dropout: bool = False
    dora: bool = False
    seq_len: Optional[int] = None
    fixes: str = "all"
    response_len: Optional[int] = None
    #: The optimizer a real run steps, by its TrainingArguments name; its state is a term of its own
    #: (``ledger.vocab.optimizers``), added to a real run's figure. None: not counted beyond what the
    #: ledger's rows hold (they record no optimizer).
    optimizer: Optional[str] = None
    #: Sequences in a micro-batch, each padded to ``seq_len`` (the worst batch: N sequences of the
    #: longest length). Gradient accumulation does not change it.
    batch: int = 1
    #: Gradient checkpointing, on in every row the fits read (``peaks.modelled``).
    checkpointing: bool = True
    #: The projections LoRA targets (``ledger.vocab.adapter``): every row the fits read trains all 7.
    targets: tuple[str, ...] = ALL_LINEAR
    #: "lora" (an adapter; QLoRA is LoRA on 4-bit weights) or "full" (every weight trained, no
    #: adapter: ``rank`` is ``FULL_RANK``, no dropout or DoRA, weights bf16 or fp32 master weights
    #: under bf16 autocast). Answered by ``ledger.answer.full_ft`` from dry runs of it alone.
    method: str = "lora"
    #: GPUs of one data-parallel or sharded run and how they split the model (``STRATEGIES``): an
    #: answer for more than one is one rank's, from a dry run of that very world (``world_size``
    #: rows are kept out of every one-GPU fit).
    gpus: int = 1
    strategy: Optional[str] = None
    #: FSDP's CPU offload (sharded parameters, gradients and optimizer state in host RAM).
    cpu_offload: bool = False
    #: Named so the recipe is whole, but no memory depends on them, so two recipes that differ only
    #: here are the same question: the dropout rate (any rate above 0 keeps the same masks), lora_alpha
    #: and rsLoRA (they scale the update, not the tensors).
    dropout_rate: Optional[float] = field(default=None, compare=False)
    alpha: Optional[float] = field(default=None, compare=False)
    rslora: bool = field(default=False, compare=False)

    def group(self) -> GroupKey:
        return GroupKey(self.model, self.quant, self.seq_len, self.dropout, self.dora, self.fixes)

    def replace(self, **changes) -> "Recipe":
        """``dataclasses.replace`` for a recipe, without re-running ``__init__`` (a ceiling's scan
        and each answer make some tens of thousands of these: a third of ``predict``'s time)."""
        if not _FIELD_NAMES.issuperset(changes):
            raise TypeError(f"Recipe has no field {sorted(set(changes) - _FIELD_NAMES)[0]!r}")
        new = object.__new__(Recipe)
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return new

    def memory_fields(self) -> dict:
        """The fields memory depends on, by name (what an answer records as its recipe)."""
        out = {name: getattr(self, name) for name in _MEMORY_FIELDS}
        if self.gpus == 1:  # one GPU: as every answer recorded it before the axis
            del out["gpus"], out["strategy"]
        if not self.cpu_offload:  # (likewise)
            del out["cpu_offload"]
        return out

    def span(self) -> Optional[int]:
        """The response length where it changes memory: only the logits_to_keep fix keeps logits for
        the response alone; without it every position's logits are made, whatever the span."""
        return self.response_len if keeps_logits(self.fixes) else None

    def describe(self) -> str:
        world = (f" on each of {self.gpus} GPUs ({self.strategy}" + (", CPU offload" if self.cpu_offload else "") + ")"
                 if self.gpus > 1 else "")
        return self._describe() + world

    def _describe(self) -> str:
        if self.method == "full":
            return (f"{self.model or 'the model'} full fine-tuning {self.quant}"
                    + (f" {self.seq_len} tokens" if self.seq_len else "")
                    + (f" batch {self.batch}" if self.batch != 1 else "")
                    + ("" if self.checkpointing else " no checkpointing")
                    + f" fixes {self.fixes}" + (f" {self.optimizer}" if self.optimizer else ""))
        return (f"{self.model or 'the model'} {self.quant} r{self.rank}" + (" dropout" if self.dropout else "")
                + (" DoRA" if self.dora else "") + (f" {self.seq_len} tokens" if self.seq_len else "")
                + (f" batch {self.batch}" if self.batch != 1 else "")
                + ("" if self.checkpointing else " no checkpointing")
                + ("" if self.targets == ALL_LINEAR else f" LoRA on {','.join(self.targets)}")
                + f" fixes {self.fixes}" + (f" {self.optimizer}" if self.optimizer else ""))


#: How the GPUs of a multi-GPU recipe split the model, as accelerate and the Trainer launch them:
#: DDP (each holds it whole), FSDP2's fully_shard with FULL_SHARD, and with SHARD_GRAD_OP.
STRATEGIES = ("ddp", "fsdp", "fsdp-shard-grad-op", "zero2", "zero3")
#: The most GPUs a recipe may name (the schema's bound on ``world_size``).
MAX_GPUS = 1024


def world_problem(gpus: int, strategy: Optional[str], cpu_offload: bool = False) -> Optional[str]:
    """What is wrong with a world size, strategy and CPU offload, in one line (None: a world a run
    can have)."""
    if gpus < 1:
        return f"--gpus must be at least 1, got {gpus}"
    if gpus > MAX_GPUS:
        return f"--gpus must be at most {MAX_GPUS}, got {gpus}"
    if strategy is not None and strategy not in STRATEGIES:
        return f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
    if strategy is not None and gpus == 1:
        return f"--strategy {strategy} needs --gpus 2 or more (one GPU runs the plain step)"
    if gpus > 1 and strategy is None:
        return f"--gpus {gpus} needs --strategy ({' | '.join(STRATEGIES)})"
    if cpu_offload and strategy in ("zero2", "zero3"):
        return (f"--cpu-offload with --strategy {strategy}: DeepSpeed's offload (offload_optimizer / offload_param) "
                "is not modelled; FSDP's is (--strategy fsdp or fsdp-shard-grad-op)")
    if cpu_offload and not (strategy or "").startswith("fsdp"):
        return ("--cpu-offload needs --gpus 2 or more and --strategy fsdp or fsdp-shard-grad-op (FSDP's CPU "
                f"offload; {strategy or 'one GPU'} has none)")
    return None


#: A full fine-tuning recipe's rank: it has no adapter.
FULL_RANK = 0


def full_recipe(**values) -> Recipe:
    """A full fine-tuning recipe: every weight trained, no adapter settings."""
    return Recipe(method="full", rank=FULL_RANK, dropout=False, dora=False, **values)


def full_recipe_of(m: Measurement) -> Optional[Recipe]:
    """A full fine-tuning row's recipe (None for any other row): ``recipe_of`` reads LoRA rows only,
    so a full row is never taken for an adapter's."""
    if m.finetune != "full":
        return None
    return full_recipe(model=m.model, quant=m.quant or "bf16", seq_len=seq_len_of(m), fixes=fixes_key(m.memory_fixes),
                       response_len=m.response_len, optimizer=m.optimizer, batch=m.batch_size or 1,
                       checkpointing=m.gradient_checkpointing is not False, gpus=m.world_size or 1,
                       strategy=m.strategy, cpu_offload=bool(m.cpu_offload))


#: Recipe's fields that memory depends on (those its equality compares), in order.
_MEMORY_FIELDS = tuple(f.name for f in fields(Recipe) if f.compare)
_FIELD_NAMES = frozenset(f.name for f in fields(Recipe))


def recipe_of(m: Measurement) -> Optional[Recipe]:
    """A row's recipe (None for a row without LoRA settings)."""
    return _remembered("recipe_of", m, lambda: _recipe_of(m))


def _recipe_of(m: Measurement) -> Optional[Recipe]:
    lora = m.lora
    if lora is None:
        return None
    return _whole(model=m.model, rank=lora.rank, quant=m.quant or "4bit", dropout=bool(lora.dropout),
                  dora=bool(lora.dora), seq_len=seq_len_of(m), fixes=fixes_key(m.memory_fixes),
                  response_len=m.response_len, optimizer=m.optimizer, batch=m.batch_size or 1,
                  checkpointing=m.gradient_checkpointing is not False, targets=targets_of_row(lora.target_modules),
                  method="lora", gpus=m.world_size or 1, strategy=m.strategy, cpu_offload=bool(m.cpu_offload),
                  dropout_rate=lora.dropout,
                  alpha=lora.alpha, rslora=bool(lora.rslora))


def _whole(**values) -> Recipe:
    """``Recipe(**values)`` for values of every field, made as ``Recipe.replace`` makes one: the
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, half the cost
    of a row's recipe (a 100k-row ledger's scoreboard reads every row's)."""
    if values.keys() != _FIELD_NAMES:
        return Recipe(**values)
    new = object.__new__(Recipe)
    new.__dict__.update(values)
    return new


def targets_of_row(names: Optional[list[str]]) -> tuple[str, ...]:
    """A row's target modules as the recipe names them: all 7 projections when it does not say
    (every row before the field existed trained them), else its projections in the decoder's order
    (module paths such as 'self_attn.q_proj' read by their last part, fused ones by their parts). Names that are not the
    decoder's projections (an lm_head, a vision tower's) are kept as given, after them."""
    if not names:
        return ALL_LINEAR
    last = set()
    for n in names:
        part = n.rsplit(".", 1)[-1]
        last.update(FUSED_PROJECTIONS.get(part, (part,)))
    known = tuple(t for t in ALL_LINEAR if t in last)
    return known + tuple(sorted(last - set(ALL_LINEAR)))


#: Projections some architectures fuse into one module (Phi-3 and Phi-4): LoRA on the fused module
#: trains the same weights as on its parts.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def module_names(targets: tuple[str, ...], fused: bool) -> list[str]:
    """The modules LoRA targets for these projections, as a model names them: a model that fuses
    its projections (``fused``: Phi-3's ``qkv_proj`` and ``gate_up_proj``) has its fused module
    for the whole set of its parts. Raises ValueError for a part of a fused module without the
    rest (LoRA can wrap only the whole module)."""
    if not fused:
        return list(targets)
    out: list[str] = []
    for name in ALL_LINEAR:
        if name not in targets:
            continue
        whole = next((f for f, parts in FUSED_PROJECTIONS.items() if name in parts), None)
        if whole is None:
            out.append(name)
            continue
        parts = FUSED_PROJECTIONS[whole]
        if not all(p in targets for p in parts):
            raise ValueError(f"this model fuses {', '.join(parts)} into {whole}: target all of them or none")
        if whole not in out:
            out.append(whole)
    return out

"""The training recipe a probe measures: model, quantisation, LoRA, memory fixes, one step.

Shared by the probe (real tensors, on a GPU or the CPU) and the dry run (fake tensors), so the
two can never measure different recipes.

Memory fixes (``--fixes all|none|LIST``):

- ``chunked_mlp``: each decoder MLP runs over the sequence in chunks of ``mlp_chunk`` tokens, so
  the seq × intermediate temporaries of a forward without grad (the checkpointed forward) exist one
  chunk at a time; the recomputed layer in backward keeps what autograd saves, as in the trainer;
- ``save_on_cpu``: tensors autograd saves for backward (with reentrant checkpointing: each
  layer's input) are moved to host RAM and brought back for backward;
- ``bf16_lm_head``: the lm_head (tied to the embedding in Gemma) is cast back to bf16 after
  ``prepare_model_for_kbit_training`` upcast it to fp32;
- ``logits_to_keep``: the lm_head computes logits only for the response positions;
- ``fused_linear_ce``: Liger Kernel's fused linear cross-entropy (``probe_kit.liger``): the loss and
  its gradient computed chunk by chunk in the forward, the sequence's logits never materialised;
- ``activation_offloading``: TRL's (``SFTConfig(activation_offloading=True)``, ``probe_kit.trl_offload``):
  each step, forward and backward, inside TRL's offloading context, with TRL's non-reentrant
  gradient checkpointing.

The first four are the program's preset (``--fixes all``); stock is none.

Methods (``--method``): ``lora`` (the default; QLoRA is LoRA with ``--quant 4bit``) and ``full``:
every weight trainable, no adapter, in the precisions people run it in — ``--quant bf16`` (bf16
weights, gradients and optimizer state in the parameters' dtype) and ``--quant fp32`` (fp32 master
weights, the forward and backward under bf16 autocast: 4 + 4 bytes a parameter, and AdamW's 8).
Tied embeddings are one parameter, counted once, as the model holds them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ledger.vocab import recipe as ledger_recipe
from ledger.core.models import Lora, Measurement
from ledger.vocab.optimizers import OPTIMIZERS
from ledger.vocab.model_configs import config_path
from ledger.core.paths import MODEL_CONFIGS
from ledger.vocab.recipe import FIX_NAMES, PRESET

CONFIG_DIR = MODEL_CONFIGS
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecipeError(Exception):
    """A probe configuration that cannot run (a user mistake, reported in one line)."""


def parse_fixes(text: str) -> list[str]:
    """'all', 'none' or a comma list of fix names -> the list of fixes on (ledger.vocab.recipe's reading)."""
    try:
        return ledger_recipe.parse_fixes(text)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


#: The strategies a multi-GPU recipe may name (``--strategy``).
STRATEGIES = ledger_recipe.STRATEGIES


def check_world(gpus: int, strategy: Optional[str], cpu_offload: bool = False) -> None:
    """One line for a world size, strategy or CPU offload no run can have."""
    problem = ledger_recipe.world_problem(gpus, strategy, cpu_offload)
    if problem:
        raise RecipeError(problem)


@dataclass
class ProbeConfig:
    """Everything that decides a probe's memory."""

    model: str
    rank: Optional[int] = None
    alpha: Optional[float] = None
    rslora: bool = False
    dropout: float = 0.0
    dora: bool = False
    quant: str = "4bit"
    seq_len: int = 2048
    response_len: int = 256
    fixes: list[str] = field(default_factory=lambda: list(PRESET))
    logits_to_keep: Optional[int] = None
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    double_quant: bool = True
    mlp_chunk: int = 1024
    random_weights: bool = False
    seed: int = 0
    #: Sequences in the step (the worst micro-batch: each of seq_len tokens, as padding to the
    #: longest makes it).
    batch_size: int = 1
    gradient_checkpointing: bool = True
    #: An optimizer to step, by its TrainingArguments name: the step measured is then the steady
    #: state (an optimizer step first, so its state exists, then forward, backward and a step).
    optimizer: Optional[str] = None
    #: "lora" (an adapter of ``rank``) or "full" (every weight trainable, no adapter).
    method: str = "lora"
    #: GPUs of one data-parallel or sharded run, and how they split the model
    #: (``STRATEGIES``; ``probe_kit.distributed`` runs them); the step measured is one rank's.
    gpus: int = 1
    strategy: Optional[str] = None
    #: FSDP's CPU offload (``probe_kit.distributed.fsdp_offload``): sharded parameters, gradients
    #: and optimizer state in host RAM, the optimizer stepping there.
    cpu_offload: bool = False

    def label(self) -> str:
        """The recipe in a few words, every axis that changes memory named: 'gemma-3-4b-it 4bit r96
        dropout 0.1 DoRA 7177 tokens fixes all' (progress bars, messages)."""
        fixes = ledger_recipe.fixes_key(ledger_recipe.fixes_value(self.fixes))
        return (f"{self.model.split('/')[-1].removesuffix('.json')} {self.quant} "
                + (f"r{self.rank}" if self.method == "lora" else "full")
                + (f" dropout {self.dropout:g}" if self.dropout else "") + (" DoRA" if self.dora else "")
                + (f" batch {self.batch_size} x" if self.batch_size != 1 else "")
                + f" {self.seq_len} tokens fixes {fixes}"
                + ("" if self.gradient_checkpointing else " no checkpointing")
                + (f" {self.optimizer}" if self.optimizer else "")
                + (f" on {self.gpus} GPUs ({self.strategy}" + (", CPU offload" if self.cpu_offload else "") + ")"
                   if self.gpus > 1 else ""))

    @property
    def sharded(self) -> bool:
        """Whether the model's weights are split over several GPUs (FSDP, ZeRO-3): the stock
        recipe then stores 4-bit weights in a floating dtype, and TRL skips
        ``prepare_model_for_kbit_training``."""
        return self.gpus > 1 and ((self.strategy or "").startswith("fsdp") or self.strategy == "zero3")

    def __post_init__(self) -> None:
        if self.method not in ("lora", "full"):
            raise RecipeError(f"--method must be lora or full, got {self.method!r}")
        if self.method == "full":
            self._full_only()
        elif self.rank is None:
            raise RecipeError("--rank is required for LoRA (--method lora, the default)")
        elif self.rank <= 0:
            raise RecipeError(f"--rank must be > 0, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise RecipeError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.quant not in ("4bit", "bf16") and not (self.method == "full" and self.quant == "fp32"):
            raise RecipeError(f"--quant must be 4bit or bf16, got {self.quant!r}"
                              + (" (fp32 master weights are a full fine-tuning precision: --method full)"
                                 if self.quant == "fp32" else ""))
        if self.seq_len < 2:
            raise RecipeError(f"--seq-len must be at least 2, got {self.seq_len}")
        if not 0 < self.response_len < self.seq_len:
            raise RecipeError(f"--response-len must be in [1, seq_len), got {self.response_len}")
        if self.mlp_chunk <= 0:
            raise RecipeError(f"--mlp-chunk must be > 0, got {self.mlp_chunk}")
        if self.batch_size <= 0:
            raise RecipeError(f"--batch-size must be > 0, got {self.batch_size}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise RecipeError(f"--optim must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        clash = ledger_recipe.fixes_clash(self.fixes)
        if clash:
            raise RecipeError(clash)
        check_world(self.gpus, self.strategy, self.cpu_offload)

    def _full_only(self) -> None:
        """Full fine-tuning trains every weight: no adapter flags, no 4-bit weights."""
        if self.quant == "4bit":
            raise RecipeError("--method full with --quant 4bit: 4-bit weights cannot be trained (QLoRA is LoRA on "
                              "4-bit weights: --method lora); full fine-tuning runs in --quant bf16 or fp32")
        lora = [flag for flag, on in (("--rank", self.rank is not None), ("--alpha", self.alpha is not None),
                                      ("--rslora", self.rslora), ("--dropout", self.dropout > 0), ("--dora", self.dora),
                                      ("--target-modules", list(self.target_modules) != list(DEFAULT_TARGETS)))
                if on]
        if lora:
            raise RecipeError(f"{lora[0]} is a LoRA setting: --method full trains every weight, with no adapter")

    @property
    def keep(self) -> int:
        """Positions whose logits the loss needs: the response, plus the one before it."""
        return (self.logits_to_keep or self.response_len) + 1

    def key(self) -> dict:
        """The configuration as a dict (stable; used for ids and --resume): an axis at the value every
        earlier probe had (micro-batch 1, checkpointing on, no optimizer step) is left out, so their
        ids stay what they were."""
        key = asdict(self)
        for name, default in (("batch_size", 1), ("gradient_checkpointing", True), ("optimizer", None),
                              ("method", "lora"), ("gpus", 1), ("strategy", None), ("cpu_offload", False)):
            if key[name] == default:
                del key[name]
        return key

    def recipe(self) -> ledger_recipe.Recipe:
        """The typed recipe the ledger answers for (``ledger.vocab.recipe.Recipe``), read as ``recipe_of``
        (a full fine-tune: ``full_recipe_of``) reads the row this configuration records: every axis,
        the same way."""
        fixes = ledger_recipe.fixes_key(ledger_recipe.fixes_value(self.fixes))
        if self.method == "full":
            return ledger_recipe.full_recipe(model=self.model, quant=self.quant, seq_len=self.seq_len, fixes=fixes,
                                             response_len=self.response_len, optimizer=self.optimizer,
                                             batch=self.batch_size, checkpointing=self.gradient_checkpointing,
                                             gpus=self.gpus, strategy=self.strategy, cpu_offload=self.cpu_offload)
        return ledger_recipe.Recipe(
            model=self.model, rank=self.rank, quant=self.quant, dropout=self.dropout > 0, dora=self.dora,
            seq_len=self.seq_len, fixes=fixes,
            response_len=self.response_len, optimizer=self.optimizer, batch=self.batch_size,
            checkpointing=self.gradient_checkpointing, targets=ledger_recipe.targets_of_row(list(self.target_modules)),
            dropout_rate=self.dropout, alpha=self.alpha if self.alpha is not None else float(self.rank),
            rslora=self.rslora, gpus=self.gpus, strategy=self.strategy, cpu_offload=self.cpu_offload)

    def refuse_rank_search(self) -> None:
        """A one-line error for a rank search of a full fine-tune (it has no rank)."""
        if self.method == "full":
            raise RecipeError("--find-ceiling rank: full fine-tuning has no rank (`vram ceiling --method full` "
                              "answers the longest sequence that fits)")

    def measurement(self, *, id: str, kind: str, gpu: Optional[str] = None, **fields) -> Measurement:
        """The one place a probe configuration becomes a ledger Measurement (probe, crashed
        sweep point, dry run): the recipe fields from this config, the rest from ``fields``. Full
        fine-tuning has no adapter: ``finetune`` "full", ``lora`` None."""
        full = self.method == "full"
        return Measurement(
            id=id, kind=kind, gpu=gpu, model=self.model, quant=self.quant,
            lora=None if full else Lora(rank=self.rank, alpha=self.alpha if self.alpha is not None else float(self.rank),
                                        rslora=self.rslora, dropout=self.dropout, dora=self.dora,
                                        target_modules=list(self.target_modules)),
            seq_len=self.seq_len, response_len=self.response_len, batch_size=self.batch_size,
            optimizer=self.optimizer, gradient_checkpointing=None if self.gradient_checkpointing else False,
            memory_fixes=ledger_recipe.fixes_value(self.fixes),
            logits_to_keep=self.keep if "logits_to_keep" in self.fixes else None,
            config_text=json.dumps(self.key(), sort_keys=True), finetune="full" if full else None,
            world_size=self.gpus if self.gpus > 1 else None, strategy=self.strategy,
            cpu_offload=True if self.cpu_offload else None, **fields,
        )


# -- model ----------------------------------------------------------------------------------


def resolve_config_path(model: str) -> Optional[Path]:
    """A config JSON (``ledger.vocab.model_configs.config_path``: a path or folder, a shipped name, a Hub
    id in the local Hugging Face cache)."""
    found = config_path(model)
    if found is None and Path(model).suffix == ".json":
        raise RecipeError(f"{model}: no such config file")
    return found


def load_config(model: str):
    """A transformers config from a JSON file (a text-only config is used as is; a multimodal
    one's text part is what the probe builds)."""
    from transformers import AutoConfig

    path = resolve_config_path(model)
    if path is None:
        raise RecipeError(f"{model}: --random-weights needs a config JSON (a path or a shipped name)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise RecipeError(f"{path}: invalid JSON: {exc}") from None
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise RecipeError(f"{path}: no model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise RecipeError(f"{path}: {exc}") from None
    return getattr(config, "text_config", None) or config


def _init_like(p: torch.Tensor, device: torch.device, std: float,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A random stand-in for a weight: normal(0, std) for matrices, ones for vectors (norm
    scales). Memory depends on shapes, not values; the values only need to be finite."""
    t = torch.empty(p.shape, dtype=dtype or p.dtype, device=device)
    return t.normal_(0.0, std) if t.dim() >= 2 else t.fill_(1.0)


def quantize_linear_layers(model: torch.nn.Module, device: torch.device, double_quant: bool,
                           std: float = 0.02) -> None:
    """Replace every nn.Linear but the lm_head by a bitsandbytes nf4 Linear4bit (bf16 compute).
    Each layer's bf16 weight is made on the device (from its meta placeholder, or taken from the
    built layer) and quantised there at once, so at most one layer's bf16 weight exists at a
    time: a 12B model never sits whole in host RAM (~22 GiB) or on a card it would not fit."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None,
                compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=double_quant, device="meta",
            )
            w = child.weight
            data = _init_like(w, device, std, torch.bfloat16) if w.is_meta else w.data.to(device, torch.bfloat16)
            # module=q: bitsandbytes restores quant_state through it if anything re-wraps the weight.
            weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4",
                                       compress_statistics=double_quant, module=q)
            q.weight = weight._quantize(device)
            del data, weight
            if child.bias is not None:
                bias = child.bias
                bias = torch.zeros(bias.shape, device=device) if bias.is_meta else bias.data
                q.bias = torch.nn.Parameter(bias.to(device, torch.bfloat16), requires_grad=False)
            setattr(parent, name, q)
            del child
    model.is_loaded_in_4bit = True  # so peft's prepare_model_for_kbit_training treats it as k-bit


def materialize(model: torch.nn.Module, device: torch.device, std: float = 0.02) -> None:
    """Give every parameter still on the meta device random values on ``device``, keeping tied
    weights tied (one tensor for the embedding and a tied lm_head), then move the buffers."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(_init_like(p, device, std), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    model.to(device)


def weights_dtype(cfg: ProbeConfig) -> torch.dtype:
    """The dtype the model's weights are made in: fp32 master weights for full fine-tuning in
    --quant fp32, else bf16 (4-bit quantises the linear layers from bf16)."""
    return torch.float32 if cfg.quant == "fp32" else torch.bfloat16


def build_model(cfg: ProbeConfig, device: torch.device) -> torch.nn.Module:
    """The base model on the device: random weights from a config, or from_pretrained. With
    random weights the model is built on the meta device (buffers such as rotary frequencies are
    computed for real), then each layer is materialised on the device, quantised one at a time
    under 4-bit, so host RAM holds no copy of the model."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if cfg.random_weights:
        config = load_config(cfg.model)
        torch.manual_seed(cfg.seed)
        std = float(getattr(config, "initializer_range", 0.02) or 0.02)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(cfg))
        if cfg.quant == "4bit":
            quantize_linear_layers(model, device, cfg.double_quant, std)
        materialize(model, device, std)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        return model
    if resolve_config_path(cfg.model) is not None and Path(cfg.model).suffix == ".json":
        raise RecipeError(f"{cfg.model}: a config file has no weights; add --random-weights")
    kwargs: dict = {"dtype": weights_dtype(cfg), "device_map": {"": str(device)}}
    if cfg.quant == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=cfg.double_quant,
        )
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
    except OSError as exc:
        raise RecipeError(f"{cfg.model}: cannot load: {str(exc).splitlines()[0]}") from None


#: The MLP projections of a mixture of experts' fused 3-D expert weights (transformers' ``*Experts``
#: modules: Qwen3-MoE, Mixtral, gpt-oss): LoRA reaches them through peft's ``target_parameters``.
EXPERT_PROJECTIONS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def expert_parameters(model: torch.nn.Module) -> dict[str, str]:
    """A mixture of experts' fused 3-D expert weights, by parameter name, as peft's
    ``target_parameters`` names them in every layer: {'gate_up_proj': 'mlp.experts.gate_up_proj',
    'down_proj': 'mlp.experts.down_proj'}; empty for a dense model."""
    found: dict[str, str] = {}
    for name, p in model.named_parameters():
        if p.dim() == 3 and ".layers." in name:
            path = name.split(".layers.", 1)[1].split(".", 1)[1]  # 'mlp.experts.gate_up_proj'
            found.setdefault(path.rsplit(".", 1)[-1], path)
    return found


def model_targets(model: torch.nn.Module, targets: list[str]) -> tuple[list[str], list[str]]:
    """The LoRA targets as this model names them: (modules for peft's ``target_modules``,
    parameters for its ``target_parameters``). The projections of a model that fuses them (Phi-3's
    ``qkv_proj``, ``gate_up_proj``) as its fused modules; a mixture of experts' MLP projections as
    its fused 3-D expert weights (gate and up share one: both or neither). RecipeError for a target
    that names no module of the model (peft would wrap the others and say nothing)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             or type(m).__name__.startswith("Linear")}
    experts = expert_parameters(model)
    parameters: list[str] = []
    if experts:
        mlp = [t for t in targets if t in EXPERT_PROJECTIONS and t not in names]
        fused = {EXPERT_PROJECTIONS[t] for t in mlp}
        if "gate_up_proj" in fused and not {"gate_proj", "up_proj"} <= set(mlp):
            raise RecipeError("--target-modules: this model's experts fuse gate_proj and up_proj into one weight "
                              "(gate_up_proj): target both or neither")
        missing = sorted(f for f in fused if f not in experts)
        if missing:
            raise RecipeError(f"--target-modules: this model's experts have no {missing[0]} weight "
                              f"(theirs: {', '.join(sorted(experts))})")
        parameters = sorted({experts[f] for f in fused})
        targets = [t for t in targets if t not in mlp]
    fused = any(f in names for f in ledger_recipe.FUSED_PROJECTIONS)
    try:
        wanted = ledger_recipe.module_names(ledger_recipe.targets_of_row(list(targets)), fused) \
            if all(t.rsplit(".", 1)[-1] in set(ledger_recipe.ALL_LINEAR) | set(ledger_recipe.FUSED_PROJECTIONS)
                   for t in targets) else list(targets)
    except ValueError as exc:
        raise RecipeError(f"--target-modules: {exc}") from None
    missing = [t for t in wanted if t.rsplit(".", 1)[-1] not in names]
    if missing:
        raise RecipeError(f"--target-modules: {missing[0]} names no module of this model "
                          f"(its linear modules: {', '.join(sorted(names)[:12])})")
    return wanted, parameters


def prepare(model: torch.nn.Module, cfg: ProbeConfig) -> torch.nn.Module:
    """Freeze the base, enable gradient checkpointing (the library's default, reentrant), LoRA."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    # Reentrant checkpointing (the library default the trainer used): each layer's input is saved
    # through autograd's saved-tensor hooks, which is what save_on_cpu offloads. TRL's SFTTrainer,
    # whose activation offloading is a fix here, sets it non-reentrant: its layer inputs stay in the
    # checkpoints, out of an offloader's reach. (The stock step's peak is the same either way.)
    ckpt = {"use_reentrant": "activation_offloading" not in cfg.fixes}
    on = cfg.gradient_checkpointing
    # Sharded QLoRA (TRL's SFTTrainer when the 4-bit weights' storage is set for FSDP) skips
    # prepare_model_for_kbit_training: no fp32 cast of the unquantised weights, checkpointing and
    # input gradients enabled as for bf16 weights.
    if cfg.quant == "4bit" and not cfg.sharded:
        # peft 0.22 renamed its keyword as transformers 5 did (the old one warns); older peft has
        # only the old one, and calls transformers' older names itself.
        import inspect

        named = ("activation_checkpointing_kwargs" if "activation_checkpointing_kwargs" in
                 inspect.signature(prepare_model_for_kbit_training).parameters else "gradient_checkpointing_kwargs")
        with _deprecated_checkpointing_names():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=on, **{named: ckpt})
    else:
        for p in model.parameters():
            p.requires_grad = cfg.method == "full"
        if on and hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
        elif on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
        if cfg.method == "full":  # every weight trained, the embeddings' output needs its gradient anyway
            apply_fixes(model, cfg)
            model.train()
            return model
        model.enable_input_require_grads()
    modules, parameters = model_targets(model, cfg.target_modules)
    if parameters and (cfg.dropout or cfg.dora):
        raise RecipeError(f"LoRA on a mixture of experts' fused expert weights (peft's target_parameters) takes no "
                          f"{'dropout' if cfg.dropout else 'DoRA'}: drop it, or train attention only "
                          "(--target-modules attn)")
    lora = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha if cfg.alpha is not None else cfg.rank, lora_dropout=cfg.dropout,
        use_rslora=cfg.rslora, use_dora=cfg.dora, target_modules=modules,
        target_parameters=parameters or None, bias="none", task_type="CAUSAL_LM",
    )
    try:
        with _deprecated_checkpointing_names():  # peft reads is_gradient_checkpointing
            model = get_peft_model(model, lora)
    except ValueError as exc:
        raise RecipeError(f"LoRA: {str(exc).splitlines()[0]}") from None
    apply_fixes(model, cfg)
    model.train()
    return model


def _chunked(forward: Callable, chunk: int) -> Callable:
    """The MLP's forward over the sequence in chunks. A mixture of experts' block that also
    returns its router's scores (gpt-oss: one row per token) returns them joined by token."""
    def run(x, *args, **kwargs):
        if x.dim() < 2 or x.shape[1] <= chunk:
            return forward(x, *args, **kwargs)
        outs = [forward(piece, *args, **kwargs) for piece in x.split(chunk, dim=1)]
        if isinstance(outs[0], tuple):
            return (torch.cat([o[0] for o in outs], dim=1),
                    *(torch.cat(parts, dim=0) for parts in list(zip(*outs))[1:]))
        return torch.cat(outs, dim=1)

    return run


def apply_fixes(model: torch.nn.Module, cfg: ProbeConfig) -> None:
    """Switch on the memory fixes the config names (logits_to_keep acts in the step)."""
    if "fused_linear_ce" in cfg.fixes:
        from . import liger

        try:
            liger.apply(model)
        except liger.LigerMissing as exc:
            raise RecipeError(str(exc)) from None
    if "chunked_mlp" in cfg.fixes:
        for name, module in model.named_modules():
            if name.endswith(".mlp") and not getattr(module, "_vram_chunked", False):
                module.forward = _chunked(module.forward, cfg.mlp_chunk)
                module._vram_chunked = True
    if "bf16_lm_head" in cfg.fixes:
        head = model.get_output_embeddings()
        if head is not None:
            head.to(torch.bfloat16)
            # The final norm runs in fp32 after prepare_model_for_kbit_training: feed the head its dtype.
            head.register_forward_pre_hook(lambda mod, args: (args[0].to(mod.weight.dtype), *args[1:]))


@contextlib.contextmanager
def _deprecated_checkpointing_names() -> Iterator[None]:
    """transformers 5 renamed gradient checkpointing (``activation_checkpointing_*``) and warns on
    the old names, which peft's ``prepare_model_for_kbit_training`` still calls: that warning,
    and only it, is silenced around those calls."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(gradient_checkpointing_enable|is_gradient_checkpointing)` is "
                                                  r"deprecated", category=FutureWarning)
        yield


def checkpointing_active(model: torch.nn.Module) -> bool:
    """True when the model is in training mode and gradient checkpointing is on in its layers.
    Without it the step silently stores every activation (and save_on_cpu spills them all to
    host RAM): the program's first probe hit a 32 GB host cap that way."""
    if not model.training:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flagged = [m for m in base.modules() if getattr(m, "gradient_checkpointing", False) is True]
    enabled = getattr(base, "is_activation_checkpointing", None)
    if enabled is None:
        with _deprecated_checkpointing_names():
            enabled = getattr(base, "is_gradient_checkpointing", False)
    return bool(enabled) and bool(flagged) and all(m.training for m in flagged)


# -- the step -------------------------------------------------------------------------------


@contextlib.contextmanager
def offload(cfg: ProbeConfig, device: torch.device, exclude: Optional[Callable[[torch.Tensor], None]] = None
            ) -> Iterator[None]:
    """save_on_cpu for the step when the fix is on. On a GPU: torch's own (pinned host RAM).
    Under the tracker meter (CPU, fake tensors) the same hooks, with the host copy excluded
    from device memory and brought back as a fresh device tensor for backward."""
    if "save_on_cpu" not in cfg.fixes:
        yield
        return
    if device.type != "cpu" or exclude is None:
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            yield
        return

    def pack(t: torch.Tensor):
        host = t.detach().clone()
        exclude(host)
        return host

    def unpack(host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def step_offloader(model: torch.nn.Module, cfg: ProbeConfig, device: torch.device, meter=None
                   ) -> Optional[contextlib.AbstractContextManager]:
    """TRL's activation-offloading context for the recipe's steps (forward and backward), or None
    when the fix is off. ``meter``: the tracker meter on a CPU, whose host RAM the copies go to."""
    if "activation_offloading" not in cfg.fixes:
        return None
    from . import trl_offload

    try:
        return trl_offload.offloader(model, device, meter)
    except trl_offload.TrlMissing as exc:
        raise RecipeError(str(exc)) from None


def synthetic_batch(cfg: ProbeConfig, vocab_size: int, device: torch.device) -> torch.Tensor:
    """batch_size x seq_len random token ids: peak memory depends on shapes, not on what the tokens say."""
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, vocab_size, (cfg.batch_size, cfg.seq_len), generator=g).to(device)


def checkpointing_as_asked(model: torch.nn.Module, cfg: ProbeConfig) -> None:
    """Refuse a step whose checkpointing is not what the recipe says: on and not active, the step
    silently stores every activation (and save_on_cpu spills them all to host RAM: the program's
    first probe hit a 32 GB host cap that way); off and active, it measures another recipe."""
    active = checkpointing_active(model)
    if cfg.gradient_checkpointing and not active:
        raise RecipeError("gradient checkpointing is not active in training mode: refusing to probe "
                          "(every activation would be stored, and offloaded to host RAM)")
    if not cfg.gradient_checkpointing and active:
        raise RecipeError("gradient checkpointing is active although the recipe turns it off")


def make_optimizer(model: torch.nn.Module, name: str, fake: bool = False,
                   unified: Optional[Callable[[torch.Tensor], None]] = None):
    """The optimizer ``transformers.Trainer`` builds for its TrainingArguments name, over the
    trainable parameters (weight decay 0, the Trainer's default learning rate). ``unified``: told
    of each state buffer a paged bitsandbytes optimizer keeps in CUDA unified memory on a GPU (a
    tensor of at least 100,000 elements), which off a GPU it makes as a plain tensor: the tracker
    meter then stops counting it, as the allocator does not count unified memory."""
    import tempfile

    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    # (made inside a rank's process group, the arguments warn that the script was not launched by
    # torch.distributed: they only name the optimizer here)
    logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, optim=name, report_to=[], use_cpu=True)
    finally:
        logging.set_verbosity(verbosity)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith("torch.optim") and not kwargs.get("fused"):
        # On a GPU torch's optimizers step every tensor at once (foreach), with temporaries the size
        # of the parameters (AdamW's sqrt of its second moment); on a CPU they default to one tensor
        # at a time. The step is made as on the card, wherever it runs.
        kwargs = {**kwargs, "foreach": True}
    params = [p for p in model.parameters() if p.requires_grad]
    if fake:
        # bitsandbytes computes its quantile maps from values (``tolist``) when it is made: made
        # with real tensors (two 1 KiB maps), the optimizer then holds the fake parameters.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            opt = cls(params, **kwargs)
    else:
        opt = cls(params, **kwargs)
    if unified is not None and getattr(opt, "is_paged", False) and hasattr(opt, "get_state_buffer"):
        made = opt.get_state_buffer

        def get_state_buffer(p, dtype=torch.float32):
            import warnings

            with warnings.catch_warnings():  # off a GPU bitsandbytes says it makes a plain buffer: known
                warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU",
                                        category=UserWarning)
                buffer = made(p, dtype=dtype)
            if p.numel() >= 1e5:  # what bitsandbytes pages on a GPU
                unified(buffer)
            return buffer
        opt.get_state_buffer = get_state_buffer
    return opt


def optimizer_step(opt, fake: bool = False) -> None:
    """One optimizer step. Under fake tensors a bitsandbytes optimizer's state is made as it makes
    it (``init_state``: the same buffers) without running its CUDA/CPU kernel, which cannot take
    fake tensors; its update works in place, so the buffers are what it adds to the peak."""
    if fake and hasattr(opt, "init_state"):
        for gindex, group in enumerate(opt.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is not None and len(opt.state[p]) == 0:
                    opt.init_state(group, p, gindex, pindex)
        return
    opt.step()


def train_step(model: torch.nn.Module, ids: torch.Tensor, cfg: ProbeConfig,
               forward_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None, *,
               fake: bool = False, warmed: Optional[Callable[[], None]] = None,
               backward_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
               offloader: Optional[contextlib.AbstractContextManager] = None,
               unified: Optional[Callable[[torch.Tensor], None]] = None,
               optimizer_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None) -> torch.Tensor:
    """The step a probe measures: forward and backward (``step``); with ``cfg.optimizer``, the
    steady state of training: one optimizer step first (its state then exists, as from a run's
    second step on), ``warmed()`` called, then forward, backward and an optimizer step, gradients
    freed after each as the Trainer frees them. Each backward runs inside ``backward_context()``
    when given (the dry run marks the step's phases there); each step, forward and backward, inside
    ``offloader`` when given (``step_offloader``: TRL's activation offloading). ``unified``: see
    ``make_optimizer`` (the tracker meter's ``exclude``; None on a GPU, whose allocator is the meter).
    ``optimizer_context()``: where the optimizer steps, when not on the card (FSDP's CPU offload: the
    tracker meter's ``host``)."""
    context = forward_context or contextlib.nullcontext
    if cfg.optimizer is None:
        if warmed is not None:
            warmed()
        return step(model, ids, cfg, context(), backward_context, fake, offloader)
    opt = make_optimizer(model, cfg.optimizer, fake, unified)
    where = optimizer_context or contextlib.nullcontext
    step(model, ids, cfg, context(), backward_context, fake, offloader)
    with where():
        optimizer_step(opt, fake)
    model.zero_grad(set_to_none=True)
    if warmed is not None:
        warmed()
    loss = step(model, ids, cfg, context(), backward_context, fake, offloader)
    with where():
        optimizer_step(opt, fake)
    model.zero_grad(set_to_none=True)
    return loss


def step(model: torch.nn.Module, ids: torch.Tensor, cfg: ProbeConfig,
         forward_context: Optional[contextlib.AbstractContextManager] = None,
         backward_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
         fake: bool = False, offloader: Optional[contextlib.AbstractContextManager] = None) -> torch.Tensor:
    """One forward and backward with the loss on the last response_len tokens. The forward runs
    inside ``forward_context`` (the save_on_cpu offload): what the forward saves goes to host
    RAM; the layers recomputed in backward keep theirs on the device, as in the trainer."""
    with gpu_dropout(), _kernels(cfg, ids.device, fake), offloader or contextlib.nullcontext():
        with forward_context if forward_context is not None else contextlib.nullcontext(), autocast(cfg, ids.device):
            loss = _forward_loss(model, ids, cfg)
        with backward_context() if backward_context is not None else contextlib.nullcontext():
            loss.backward()
    return loss.detach()


def autocast(cfg: ProbeConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast over the forward (its backward follows it) for fp32 master weights, as the
    Trainer runs ``bf16=True`` on fp32 weights; nothing for bf16 or 4-bit weights."""
    if cfg.quant != "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _kernels(cfg: ProbeConfig, device: torch.device, fake: bool) -> contextlib.AbstractContextManager:
    """Liger's Triton kernels stood in off a GPU when the recipe has its fused linear cross-entropy."""
    if "fused_linear_ce" not in cfg.fixes:
        return contextlib.nullcontext()
    from . import liger

    return liger.kernels(device, fake)


@contextlib.contextmanager
def gpu_dropout() -> Iterator[None]:
    """Dropout as a GPU runs it, on every device. On CUDA and ROCm ``F.dropout`` is the fused
    ``native_dropout``, which keeps a bool mask (1 byte per element) for backward; on the CPU it
    multiplies by a mask of the input's dtype (2 bytes in bf16), so the CPU tracker and the dry
    run charged dropout twice the mask memory a card keeps. Routing training-mode dropout to
    ``native_dropout`` makes the CPU step keep what the GPU keeps (on a GPU it changes nothing)."""
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and input.numel() > 0 and not inplace:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def _forward_loss(model: torch.nn.Module, ids: torch.Tensor, cfg: ProbeConfig) -> torch.Tensor:
    k = cfg.response_len
    if "fused_linear_ce" in cfg.fixes and "logits_to_keep" in cfg.fixes:
        # Liger's forward keeps the last `keep` positions' hidden states; each predicts the next
        # kept token (the first kept token is only ever a position, never a target).
        return model(input_ids=ids, labels=ids[:, -cfg.keep:].clone(), logits_to_keep=cfg.keep, use_cache=False).loss
    if "logits_to_keep" in cfg.fixes:
        logits = model(input_ids=ids, logits_to_keep=cfg.keep, use_cache=False).logits
        # positions seq-k-1 .. seq-2 predict tokens seq-k .. seq-1
        logits = logits[:, -(k + 1):-1, :]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, -k:].reshape(-1))
    else:
        labels = ids.clone()
        labels[:, :-k] = -100
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    return loss

"""The shipped model configs (``ledger/model_configs/*.json``, public facts) and what the library
reads off them: a model's short name, its architecture, its vocabulary. Below everything that
reads a config (calibration, the predictor, the estimators); no I/O beyond those files, the
user's config files and the local Hugging Face cache (never the network)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from ledger.core.paths import MODEL_CONFIGS

CONFIG_DIR = MODEL_CONFIGS


@lru_cache(maxsize=4096)
def model_name(model: Optional[str]) -> Optional[str]:
    """A model's short name, as configs ship: 'unsloth/gemma-3-4b-it' -> 'gemma-3-4b-it'."""
    if not model:
        return None
    name = model.split("/")[-1].lower()
    return name[:-5] if name.endswith(".json") else name


@dataclass
class Arch:
    """What the formulas need to know about a decoder model. A mixture of experts (every decoder
    layer sparse) has ``experts`` > 0: each layer's MLP is that many experts of ``intermediate``
    features (the expert's, for Qwen3-MoE its ``moe_intermediate_size``), ``top_k`` of them per
    token, and a router of ``experts`` x ``hidden``."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    family: str
    experts: int = 0
    top_k: int = 0

    @property
    def linear_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate * max(self.experts, 1) + self.experts * self.hidden
        return (q + kv + o + mlp) * self.layers

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: every weight of a dense model; of a mixture of
        experts, its ``top_k`` experts' and the rest."""
        if not self.experts:
            return self.total_params
        return self.total_params - 3 * self.hidden * self.intermediate * (self.experts - self.top_k) * self.layers

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        norms = (4 * self.hidden + 2 * self.head_dim) * self.layers + self.hidden
        return self.linear_params + self.embedding_params + norms


# -- where a model's config is ----------------------------------------------------------------


def hub_cache_dirs() -> list[Path]:
    """The Hugging Face hub caches a Hub id is looked up in, as huggingface_hub finds them:
    ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``XDG_CACHE_HOME``/huggingface/hub, else
    ~/.cache/huggingface/hub (the legacy ``HUGGINGFACE_HUB_CACHE`` too). Nothing is downloaded."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        dirs = [Path(env["HF_HUB_CACHE"])]
    elif env.get("HUGGINGFACE_HUB_CACHE"):
        dirs = [Path(env["HUGGINGFACE_HUB_CACHE"])]
    elif env.get("HF_HOME"):
        dirs = [Path(env["HF_HOME"]) / "hub"]
    else:
        base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
        dirs = [base / "huggingface" / "hub"]
    return [d.expanduser() for d in dirs]


def _from_hub_cache(model_id: str) -> Optional[Path]:
    """config.json of a Hub id in a local cache: the snapshot refs/main names, else the newest."""
    for cache in hub_cache_dirs():
        repo = cache / ("models--" + model_id.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            path = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
            if path.is_file():
                return path
        found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            return found[0]
    return None


def config_path(model: str) -> Optional[Path]:
    """A model's config.json: a path to one (or to the folder holding it), the name of one shipped
    in ledger/model_configs ('unsloth/gemma-3-4b-it' -> gemma-3-4b-it.json), or a Hub id
    ('Qwen/Qwen2.5-32B') found in the local Hugging Face cache. None when none of them has it."""
    path = Path(model).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    shipped = CONFIG_DIR / f"{model.split('/')[-1]}.json"
    if shipped.is_file():
        return shipped
    if _hub_id(model) and not path.exists():
        return _from_hub_cache(model)
    return None


def _hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hub id ORG/NAME (not a path or a file name)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) is not None and not model.endswith(".json")


def where_looked(model: str) -> str:
    """What ``config_path`` tried, for a one-line error, with how to get a config."""
    tried = [f"a config file or folder {model!r}", f"{CONFIG_DIR}/{model.split('/')[-1].removesuffix('.json')}.json"]
    if _hub_id(model):
        tried += [f"{d}/models--{model.replace('/', '--')}/snapshots/*/config.json" for d in hub_cache_dirs()]
        how = (f"fetch just its config with `huggingface-cli download {model} config.json` (or "
               f"hf_hub_download('{model}', 'config.json')), or give --model the path of its config.json")
    else:
        how = "give --model a shipped name (ls ledger/model_configs), a config.json path or folder, or a Hub id ORG/NAME"
    return f"no config for {model}: looked in {'; '.join(tried)}; {how}"


def _config(model: Optional[str]) -> Optional[tuple[Path, dict, dict]]:
    """(path, the config, its text model's part) of a model ``config_path`` finds, else None."""
    path = config_path(model) if model else None
    if path is None:
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return path, data, data.get("text_config", data)


def model_type(model: str) -> Optional[str]:
    """The config's model_type (its text model's for a multimodal config), or None."""
    found = _config(model)
    return (found[2].get("model_type") or found[1].get("model_type")) if found else None


def max_length(model: Optional[str]) -> Optional[int]:
    """The longest sequence the model's config allows (max_position_embeddings), or None."""
    found = _config(model)
    value = found[2].get("max_position_embeddings") if found else None
    return int(value) if value else None


def full_attention(model: Optional[str]) -> bool:
    """Whether every layer of the model attends to the whole sequence: its config sets no sliding
    window (Gemma 3 does: its sliding layers hold a window, not the sequence, so its step's
    memory does not grow in proportion to the length)."""
    found = _config(model)
    return bool(found) and found[2].get("sliding_window") is None


def _experts(text: dict) -> Optional[int]:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if text.get(key):
            return int(text[key])
    return None


def moe_experts(model: str) -> Optional[int]:
    """The experts per layer of a mixture-of-experts config (Mixtral, Qwen2/3-MoE, gpt-oss, ...),
    else None."""
    found = _config(model)
    return _experts(found[2]) if found else None


#: A mixture of experts' config fields that put dense decoder layers among the sparse ones (or
#: experts beside a shared one), with the value that leaves every layer alike and sparse.
_MIXED_LAYERS = {"first_k_dense_replace": 0, "moe_layer_freq": 1, "mlp_only_layers": [], "decoder_sparse_step": 1,
                 "n_shared_experts": 0, "shared_expert_intermediate_size": 0}


def moe_unsupported(model: str) -> Optional[str]:
    """Why the project cannot answer this mixture-of-experts config, or None: it answers those whose
    every decoder layer is sparse with fused expert weights (transformers' ``*Experts`` modules:
    Qwen3-MoE, Mixtral, gpt-oss); dense layers among sparse ones, or a shared expert, are not
    modelled."""
    found = _config(model)
    text = found[2] if found else {}
    for key, alike in _MIXED_LAYERS.items():
        if text.get(key) not in (None, alike):
            return f"its {key} is {text[key]!r} (dense layers or a shared expert beside the routed ones)"
    return None


def _name_of(path: Path) -> str:
    """A config's model name: the file's stem, its folder's name for a config.json, the Hub name
    (lowercase, as ``model_name`` reads a Hub id) for a cached snapshot."""
    if path.name != "config.json":
        return path.stem
    if path.parent.parent.name == "snapshots":
        return path.parent.parent.parent.name.split("--")[-1].lower()
    return path.parent.name


def load_arch(model: str) -> Optional[Arch]:
    """The architecture of a model (a config ``config_path`` finds). None when unknown."""
    found = _config(model)
    if found is None:
        return None
    path, data, text = found
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    model_type = str(text.get("model_type", data.get("model_type", "")))
    family = "gemma" if "gemma" in model_type else ("qwen2" if "qwen" in model_type else
                                                     ("mistral" if "mistral" in model_type else "llama"))
    experts = _experts(text) or 0
    return Arch(
        name=_name_of(path), hidden=hidden, layers=text["num_hidden_layers"], heads=heads,
        kv_heads=text.get("num_key_value_heads", heads), head_dim=text.get("head_dim") or hidden // heads,
        intermediate=text.get("moe_intermediate_size") or text["intermediate_size"] if experts
        else text["intermediate_size"], vocab=text["vocab_size"],
        tied=bool(text.get("tie_word_embeddings", data.get("tie_word_embeddings", True))), family=family,
        experts=experts, top_k=int(text.get("num_experts_per_tok") or text.get("experts_per_token") or 0) if experts
        else 0,
    )




@lru_cache(maxsize=64)
def vocab_size(model: Optional[str]) -> Optional[int]:
    """The vocabulary of a model whose config ships with the package (None: unknown)."""
    arch = load_arch(model) if model else None
    return arch.vocab if arch else None

"""The shipped model configs (``ledger/model_configs/*.json``, public facts) and what the library
reads off them: a model's short name, its architecture, its vocabulary. Below everything that
reads a config (calibration, the predictor, the estimators); no I/O beyond those files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from .paths import MODEL_CONFIGS

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
    """What the formulas need to know about a decoder model."""

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

    @property
    def linear_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return (q + kv + o + mlp) * self.layers

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        norms = (4 * self.hidden + 2 * self.head_dim) * self.layers + self.hidden
        return self.linear_params + self.embedding_params + norms


def load_arch(model: str) -> Optional[Arch]:
    """The architecture of a model: a config JSON path, or a model id / name whose config ships in
    ledger/model_configs ('unsloth/gemma-3-4b-it' -> gemma-3-4b-it.json). None when unknown."""
    path = Path(model)
    if not (path.suffix == ".json" and path.is_file()):
        path = CONFIG_DIR / f"{model.split('/')[-1]}.json"
        if not path.is_file():
            return None
    data = json.loads(path.read_text(encoding="utf-8"))
    text = data.get("text_config", data)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    model_type = str(text.get("model_type", data.get("model_type", "")))
    family = "gemma" if "gemma" in model_type else ("qwen2" if "qwen" in model_type else
                                                     ("mistral" if "mistral" in model_type else "llama"))
    return Arch(
        name=path.stem, hidden=hidden, layers=text["num_hidden_layers"], heads=heads,
        kv_heads=text.get("num_key_value_heads", heads), head_dim=text.get("head_dim") or hidden // heads,
        intermediate=text["intermediate_size"], vocab=text["vocab_size"],
        tied=bool(text.get("tie_word_embeddings", data.get("tie_word_embeddings", True))), family=family,
    )




@lru_cache(maxsize=64)
def vocab_size(model: Optional[str]) -> Optional[int]:
    """The vocabulary of a model whose config ships with the package (None: unknown)."""
    arch = load_arch(model) if model else None
    return arch.vocab if arch else None

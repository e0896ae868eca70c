"""The LoRA adapter's trainable tensors, exactly, from a model's config: what the optimizer keeps
state for and the gradients an optimizer step reads. No torch, no I/O beyond the config.

For a target ``Linear(in, out)`` peft adds ``lora_A`` (rank × in) and ``lora_B`` (out × rank); DoRA
adds a magnitude vector (out). Targets are module names of the decoder's attention and MLP
projections, in every layer of the text model (the probe kit builds a multimodal config's text part,
and so is this counted); ``TARGET_PRESETS`` names the two sets people use. A mixture of experts'
MLP projections are its fused 3-D expert weights (``gate_up_proj``: gate and up together, and
``down_proj``), which peft adapts through ``target_parameters`` with one adapter over all E experts:
``lora_A`` (rank·E × in) and ``lora_B`` (out × rank·E), no DoRA. Tested against peft's own models for
Llama, Qwen2, Gemma 3, Qwen3-MoE, Mixtral and gpt-oss configs (``tests/test_optimizers.py``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache
from typing import Iterable, Optional

from .model_configs import Arch, load_arch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: What ``--target-modules`` accepts besides a comma list: peft's ``all-linear`` (every projection of
#: the decoder; the lm_head is left out, as peft leaves it out) and attention only.
TARGET_PRESETS: dict[str, tuple[str, ...]] = {"all-linear": ALL_LINEAR, "attn": ALL_LINEAR[:4]}


def parse_targets(text: str) -> tuple[str, ...]:
    """'all-linear', 'attn' or a comma list of projection names -> the target modules, in the
    decoder's order. Raises ValueError naming an unknown module."""
    text = text.strip()
    if text in TARGET_PRESETS:
        return TARGET_PRESETS[text]
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in ALL_LINEAR]
    if unknown or not names:
        raise ValueError(f"unknown target module {unknown[0] if unknown else text!r} "
                         f"(known: {', '.join(TARGET_PRESETS)}, or a comma list of {', '.join(ALL_LINEAR)})")
    return tuple(t for t in ALL_LINEAR if t in names)


def projection_shapes(arch: Arch) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one decoder layer."""
    q = arch.heads * arch.head_dim
    kv = arch.kv_heads * arch.head_dim
    return {"q_proj": (arch.hidden, q), "k_proj": (arch.hidden, kv), "v_proj": (arch.hidden, kv),
            "o_proj": (q, arch.hidden), "gate_proj": (arch.hidden, arch.intermediate),
            "up_proj": (arch.hidden, arch.intermediate), "down_proj": (arch.intermediate, arch.hidden),
            # Phi-3's fused projections, as that family names them
            "qkv_proj": (arch.hidden, q + 2 * kv), "gate_up_proj": (arch.hidden, 2 * arch.intermediate)}


def trainable_shapes(arch: Arch, rank: int, targets: Iterable[str] = ALL_LINEAR, dora: bool = False
                     ) -> list[tuple[int, ...]]:
    """The shape of every trainable tensor of the adapter (one entry per tensor, every layer)."""
    shapes = projection_shapes(arch)
    layer: list[tuple[int, ...]] = []
    targets = list(targets)
    if arch.experts:  # the experts' fused weights: one adapter each over every expert
        mlp = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
        targets = [t for t in targets if t not in mlp]
        r = rank * arch.experts
        if "gate_proj" in mlp or "up_proj" in mlp:
            layer += [(r, arch.hidden), (2 * arch.intermediate, r)]
        if "down_proj" in mlp:
            layer += [(r, arch.intermediate), (arch.hidden, r)]
    for name in targets:
        fan_in, fan_out = shapes[name]
        layer += [(rank, fan_in), (fan_out, rank)] + ([(fan_out,)] if dora else [])
    return layer * arch.layers


def trainable_shape_counts(arch: Arch, rank: int, targets: Iterable[str] = ALL_LINEAR, dora: bool = False
                           ) -> Counter:
    """``trainable_shapes`` as shape -> how many tensors have it (what a sum over them needs)."""
    layer = Counter(trainable_shapes(replace(arch, layers=1), rank, targets, dora))
    return Counter({shape: k * arch.layers for shape, k in layer.items()})


def trainable_params(arch: Arch, rank: int, targets: Iterable[str] = ALL_LINEAR, dora: bool = False) -> int:
    """How many parameters the adapter trains."""
    total = 0
    for shape in trainable_shapes(arch, rank, targets, dora):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


#: A model's architecture read once per process (the fit table asks it per rank and recipe).
arch_of = lru_cache(maxsize=256)(load_arch)

#: The MLP projections, which a mixture of experts holds as its fused expert weights.
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def experts_adapted(model: Optional[str], targets: Iterable[str] = ALL_LINEAR) -> bool:
    """Whether LoRA on these targets reaches a mixture of experts' fused expert weights (peft's
    ``target_parameters``, which takes no dropout and no DoRA)."""
    arch = arch_of(model) if model else None
    return bool(arch and arch.experts and any(t in MLP_PROJECTIONS for t in targets))


def experts_refuse(model: Optional[str], targets: Iterable[str], dropout: bool, dora: bool) -> Optional[str]:
    """Why peft cannot build this adapter (dropout or DoRA on fused expert weights), or None."""
    if not (dropout or dora) or not experts_adapted(model, tuple(targets)):
        return None
    return (f"LoRA on a mixture of experts' fused expert weights (peft's target_parameters) takes no "
            f"{'dropout' if dropout else 'DoRA'}: drop it, or train attention only (--target-modules attn)")


@lru_cache(maxsize=65536)
def adapter_mib(model: Optional[str], rank: int, targets: tuple[str, ...] = ALL_LINEAR, dora: bool = False
                ) -> Optional[float]:
    """MiB of the adapter's trainable tensors in fp32 (peft's adapter: its weights, and as much
    again for their gradients), each a block rounded up to 512 bytes as the allocator holds it;
    None without a config for the model."""
    arch = arch_of(model) if model else None
    if arch is None:
        return None
    layer = Counter(trainable_shapes(replace(arch, layers=1), rank, targets, dora))
    total = 0
    for shape, k in layer.items():
        n = 1
        for d in shape:
            n *= d
        total += k * ((n * 4 + 511) // 512 * 512)
    return total * arch.layers / 2**20

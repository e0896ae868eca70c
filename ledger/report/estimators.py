"""The VRAM estimators people use, behind one interface, scored against the ledger's measured peaks.

Each estimator takes an architecture and a recipe and returns bytes with a breakdown and the
quantity it claims to predict ("allocated" = torch's peak allocated; "reserved" = the allocator's
peak reserved, nearest to what a card must hold). No torch.

- ``canifinetune``: the package from the package index (an optional dependency: ``pip install
  canifinetune``), called offline through its Python API with the architecture passed explicitly
  (``override``, ``use_network=False``). Its own target is "process torch peak reserved"; its
  total includes a 5% safety margin that it says to leave out when comparing, so the figure here
  is total minus margin.
- ``unsloth-studio``: Unsloth Studio's published formula (VRAM_ESTIMATION.md), implemented here.
- ``ft01``: the FT01 course's rule of thumb (QLoRA: 4-bit weights + 6–10 GB; LoRA: 2–3 x the
  16-bit model), as a range and its midpoint.
The scoreboard (``ledger.report.scoreboard``) scores them, with this project's own held-out answer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional

from ledger.vocab.model_configs import Arch
from ledger.vocab.recipe import Recipe, recipe_of, seq_len_of
from ledger.core.models import Ledger, Measurement

GIB = 2**30
MIB = 2**20
GB = 1e9


@dataclass
class Estimate:
    estimator: str
    bytes: float
    predicts: str  # "allocated" | "reserved"
    breakdown: dict[str, float] = field(default_factory=dict)
    low_bytes: Optional[float] = None
    high_bytes: Optional[float] = None
    note: str = ""

    @property
    def mib(self) -> float:
        return round(self.bytes / MIB, 1)


class Estimator:
    name = ""
    predicts = "reserved"
    leaves_out = ""

    def estimate(self, arch: Arch, recipe: Recipe, gpu_total_mib: Optional[float] = None) -> Optional[Estimate]:
        raise NotImplementedError


# -- Unsloth Studio ------------------------------------------------------------------------------


class UnslothStudio(Estimator):
    """Unsloth Studio's formula (studio/backend/utils/hardware/VRAM_ESTIMATION.md), with its defaults:
    adamw_8bit, HF gradient checkpointing, double quant, the seven projections, SDPA attention."""

    name = "unsloth-studio"
    predicts = "reserved"
    leaves_out = ("the logits chain (seq x vocab fp32 upcast and gradient), dropout masks, DoRA's weight-norm "
                  "step, the recipe's memory fixes, and any multimodal tower; its 1.4 GB CUDA overhead is a "
                  "constant calibrated on one card.")

    def estimate(self, arch, recipe, gpu_total_mib=None):
        if recipe.method == "full":
            return self._full(arch, recipe)
        H, L, V, M, r, B, S = arch.hidden, arch.layers, arch.vocab, arch.intermediate, recipe.rank, recipe.batch, \
            recipe.seq_len
        K = (H // arch.heads) * arch.kv_heads  # the write-up's K: (H / heads) x kv_heads
        E = max(arch.experts, 1)  # the write-up's E: 1 for a dense model
        qkvo = (H + K + K + H) * H
        mlp = H * M * 3 * E + (E * H if E > 1 else 0)
        quantizable = (qkvo + mlp) * L
        non_quantizable = 2 * H * L + V * H + (0 if arch.tied else V * H)
        if recipe.quant == "4bit":
            weights = quantizable * 2 / 3.6 + non_quantizable * 2  # double quant: the 3.6 factor
        else:
            weights = (quantizable + non_quantizable) * 2
        # its LoRA table, the MLP modules multiplied by E for a mixture of experts
        lora_params = (H * r + r * H) + 2 * (H * r + r * K) + (H * r + r * H) + (2 * (H * r + r * M) + (M * r + r * H)) * E
        lora_params *= L
        lora_b = lora_params * 2
        optimizer = lora_params * 4  # adamw_8bit
        per_layer = (S * B * (H + K + K) + S * B * 2 + S * B * (M + M)) * 2 * 1.25
        activations = per_layer * 1.0  # gradient checkpointing (HF), LoRA: one layer
        raw_grad = lora_params * 2
        grad = max(raw_grad, min(weights * 0.15, max(activations, optimizer)))
        cuda = 1.4 * GB
        total = weights + lora_b + optimizer + grad + activations + cuda
        return Estimate(self.name, total, self.predicts, breakdown={
            "weights": weights, "lora": lora_b, "optimizer": optimizer, "gradients": grad,
            "activations": activations, "cuda_overhead": cuda})


    #: Its optimizer table, bytes per trainable parameter (adafactor is not in it).
    OPTIMIZER_BYTES = {"adamw_8bit": 4, "paged_adamw_8bit": 4, "adamw_torch": 6, "adamw_torch_fused": 6,
                       "paged_adamw_32bit": 8, "sgd": 4}

    def _full(self, arch, recipe):
        """Its full fine-tuning mode: every parameter trainable (optimizer and 2-byte gradients for
        all), the 15% gradient floor, fp16 weights (the write-up has no fp32 row: ``--quant fp32``
        is charged as it charges any full fine-tune), HF checkpointing keeping 2 layers'
        activations (every layer without it)."""
        per_param = self.OPTIMIZER_BYTES.get(recipe.optimizer or "adamw_torch")
        if per_param is None:
            return None
        H, L, V, M, B, S = arch.hidden, arch.layers, arch.vocab, arch.intermediate, recipe.batch, recipe.seq_len
        K = (H // arch.heads) * arch.kv_heads
        E = max(arch.experts, 1)
        quantizable = ((H + K + K + H) * H + H * M * 3 * E + (E * H if E > 1 else 0)) * L
        non_quantizable = 2 * H * L + V * H + (0 if arch.tied else V * H)
        params = quantizable + non_quantizable
        weights = params * 2
        optimizer = params * per_param
        grad = max(params * 2, weights * 0.15)
        per_layer = (S * B * (H + K + K) + S * B * 2 + S * B * (M + M)) * 2 * 1.25
        activations = per_layer * (2.0 if recipe.checkpointing else L)
        cuda = 1.4 * GB
        total = weights + optimizer + grad + activations + cuda
        return Estimate(self.name, total, self.predicts, breakdown={
            "weights": weights, "optimizer": optimizer, "gradients": grad, "activations": activations,
            "cuda_overhead": cuda})


# -- FT01 rule of thumb --------------------------------------------------------------------------


class FT01(Estimator):
    """FT01 — VRAM Math: QLoRA = 4-bit weights (0.5 B/param) + 6–10 GB overhead; LoRA (16-bit
    base) = 2–3 x the FP16 model size. The midpoint of the range is the figure scored."""

    name = "ft01"
    predicts = "reserved"
    leaves_out = ("everything that depends on the recipe beyond model size and method: sequence length, rank, "
                  "dropout, DoRA, the logits chain and the memory fixes all fall inside one fixed range.")

    def estimate(self, arch, recipe, gpu_total_mib=None):
        params = arch.total_params
        if recipe.method == "full":
            # ~16 bytes per trainable parameter (weights, gradients, AdamW's master copy and moments)
            # plus activations: its 7B range, 100-160 GB, is 16 B/param x 7B = 112 GB and up to 160.
            low = params * 16.0
            high = low * 160 / 112
            return Estimate(self.name, (low + high) / 2, self.predicts,
                            breakdown={"weights_grads_adamw_16_bytes": low}, low_bytes=low, high_bytes=high)
        if recipe.quant == "4bit":
            weights = params * 0.5
            low, high = weights + 6 * GB, weights + 10 * GB
        else:
            fp16 = params * 2.0
            low, high = 2 * fp16, 3 * fp16
        return Estimate(self.name, (low + high) / 2, self.predicts, breakdown={"weights_4bit_or_fp16": params * (
            0.5 if recipe.quant == "4bit" else 2.0)}, low_bytes=low, high_bytes=high)


# -- canifinetune ----------------------------------------------------------------------------------


class Canifinetune(Estimator):
    """The canifinetune package's own estimate(), offline, with the architecture given explicitly."""

    name = "canifinetune"
    predicts = "reserved"
    #: The optimizers its full mode takes (paged_adamw_32bit and adafactor are not among them).
    FULL_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "sgd")
    leaves_out = ("the recipe's memory fixes: it charges the full logits chain (seq x vocab x 14 B) and fp32 "
                  "embeddings that logits_to_keep and the bf16 lm_head remove; dropout masks and DoRA are not "
                  "modelled; 8% of the card is added as overhead.")

    @staticmethod
    def available() -> bool:
        try:
            importlib.import_module("canifinetune.estimator.memory")
        except Exception:  # not installed, or broken: the scoreboard says so
            return False
        return True

    def estimate(self, arch, recipe, gpu_total_mib=None):
        if not self.available():
            return None
        from canifinetune.estimator.memory import EstimateRequest, estimate

        override = dict(hidden_size=arch.hidden, num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                        num_key_value_heads=arch.kv_heads, intermediate_size=arch.intermediate,
                        vocab_size=arch.vocab, total_params=arch.total_params, family=arch.family,
                        tie_word_embeddings=arch.tied, num_local_experts=max(arch.experts, 1),
                        num_experts_per_tok=max(arch.top_k, 1))
        if recipe.method == "full":  # its full mode: the weights' dtype, the optimizer asked where it has it
            optimizer = recipe.optimizer or "adamw_torch"
            if optimizer not in self.FULL_OPTIMIZERS:
                return None
            req = EstimateRequest(
                model_id=arch.name, seq_len=recipe.seq_len, micro_batch_size=recipe.batch, method="full",
                base_dtype=recipe.quant, optimizer=optimizer, gradient_checkpointing=recipe.checkpointing,
                gpu_vram_gb=(gpu_total_mib or 80 * 1024) / 1024, override=override, use_network=False)
        else:
            req = EstimateRequest(
                model_id=arch.name, seq_len=recipe.seq_len, micro_batch_size=recipe.batch,
                method="qlora" if recipe.quant == "4bit" else "lora", lora_rank=recipe.rank,
                lora_dropout=min(recipe.dropout_rate or 0.0, 0.99), lora_target_scope="all_linear",
                optimizer="adamw_torch", gpu_vram_gb=(gpu_total_mib or 24 * 1024) / 1024, override=override,
                use_network=False,
            )
        e = estimate(req).memory
        total = (e.total_estimated_gb - e.safety_margin_gb) * GIB
        # canifinetune's fields are GB (its GiB); here they are bytes, printed as MiB under
        # breakdown_mib, so its "_gb" suffix is dropped from the names.
        parts = {k.removesuffix("_gb"): getattr(e, k) * GIB
                 for k in ("static_model_gb", "quantization_overhead_gb", "gradients_gb", "optimizer_gb",
                           "activations_gb", "logits_gb", "cuda_overhead_gb")}
        return Estimate(self.name, total, self.predicts, breakdown=parts,
                        note="total minus the 5% safety margin, as canifinetune says to compare")


ESTIMATORS: list[Estimator] = [Canifinetune(), UnslothStudio(), FT01()]

# -- reading a row ---------------------------------------------------------------------------------------


def scored_recipe(m: Measurement) -> Optional[Recipe]:
    """A row's recipe (``ledger.vocab.recipe.recipe_of``) when an estimator can be asked for it: LoRA
    settings, a known length and a quantisation the estimators model (4-bit or bf16)."""
    r = recipe_of(m)
    if r is None or r.seq_len is None or m.quant not in ("4bit", "bf16"):
        return None
    return r


def estimate_all(arch: Arch, recipe: Recipe, gpu_total_mib: Optional[float] = None) -> list[dict]:
    """Every estimator's figure for one configuration (``vram estimate``)."""
    out = []
    for est in ESTIMATORS:
        e = est.estimate(arch, recipe, gpu_total_mib)
        if e is None:
            installed = not isinstance(est, Canifinetune) or est.available()
            out.append({"estimator": est.name, "available": False, "installed": installed,
                        "note": "" if not installed else "it does not model this recipe (its optimizer)"})
            continue
        out.append({"estimator": est.name, "available": True, "estimate_mib": e.mib, "predicts": e.predicts,
                    "low_mib": round(e.low_bytes / MIB, 1) if e.low_bytes else None,
                    "high_mib": round(e.high_bytes / MIB, 1) if e.high_bytes else None,
                    "breakdown_mib": {k: round(v / MIB, 1) for k, v in e.breakdown.items()}, "note": e.note})
    return out


def nearest_row(ledger: Ledger, model: str, recipe: Recipe, gpu: Optional[str]) -> Optional[Measurement]:
    """The ledger's closest measured row: same model family and quant, nearest rank and length;
    on the requested card whenever it has such a row, another card's only when it has none. A
    dry-run row is a prediction, not a measurement: never the nearest measured row."""
    best: dict[bool, tuple[float, Measurement]] = {}
    if recipe.method == "full":  # no LoRA row is near a full fine-tune
        return None
    for m in ledger.measurements:
        if m.kind == "dry_run" or m.lora is None or m.outcome.peak_allocated_mib is None or m.quant != recipe.quant:
            continue
        if m.model and model.split("/")[-1].replace(".json", "") not in m.model:
            continue
        seq = seq_len_of(m)
        if seq is None:
            continue
        d = (abs(seq - recipe.seq_len) / recipe.seq_len + abs(m.lora.rank - recipe.rank) / recipe.rank
             + (bool(m.lora.dropout) != bool(recipe.dropout)) + (bool(m.lora.dora) != recipe.dora))
        same_card = gpu is None or m.gpu == gpu
        if same_card not in best or d < best[same_card][0]:
            best[same_card] = (d, m)
    pick = best.get(True) or best.get(False)
    return pick[1] if pick else None

"""The dry run's depth extrapolation: short stacks of a model's layers give the whole depth's
figures, phase by phase, for three families; the guards refuse what they cannot extrapolate."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ledger.core.paths import MODEL_CONFIGS as CONFIGS
from probe_kit.depth import DepthPlan, depth_plan, phase_peaks
from probe_kit.dry_run import dry_run
from probe_kit.meters import MIB, TrackerMeter
from probe_kit.recipe import ProbeConfig



def deeper(tmp_path, name: str, layers: int, **extra) -> str:
    """A shipped tiny config with more decoder layers (and any other fields), as a file."""
    data = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    data.update(num_hidden_layers=layers, **extra)
    path = tmp_path / f"{name}-{layers}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def warmed():
    """A step first: what a process allocates once, on its first step (a few KiB), then falls on no
    case, so each compares the extrapolation with the full depth alone. (The dry run runs its base
    stack last, so in a fresh process that allocation can only raise the extrapolated figure.)"""
    dry_run(ProbeConfig(model="tiny-llama", random_weights=True, seq_len=64, response_len=16, rank=8, fixes=[]))


CASES = [
    ("tiny-llama", 8, {}, dict(quant="4bit", rank=16)),
    ("tiny-llama", 8, {}, dict(quant="4bit", rank=64, dora=True, fixes=["chunked_mlp", "save_on_cpu",
                                                                      "bf16_lm_head", "logits_to_keep"])),
    ("tiny-qwen2", 7, {}, dict(quant="bf16", rank=32, gradient_checkpointing=False, optimizer="adamw_torch",
                               batch_size=2)),
    ("tiny-qwen2", 7, {}, dict(quant="4bit", rank=8, dropout=0.1, optimizer="adamw_8bit")),
    # Gemma 3's two layer types, the top one global: stacks of 2, 3 and 3 layers for 10
    ("tiny-gemma3", 10, {"layer_types": ["sliding_attention", "full_attention"] * 5},
     dict(quant="4bit", rank=16, dropout=0.1)),
    ("tiny-gemma3", 10, {"layer_types": ["sliding_attention", "full_attention"] * 5},
     dict(quant="bf16", rank=16, gradient_checkpointing=False)),
    # The fixes users set: Liger's fused loss; TRL's offloading, with checkpointing and without
    ("tiny-llama", 8, {}, dict(quant="4bit", rank=16, fixes=["fused_linear_ce"], batch_size=2)),
    ("tiny-qwen2", 7, {}, dict(quant="bf16", rank=16, fixes=["activation_offloading"])),
    ("tiny-gemma3", 10, {"layer_types": ["sliding_attention", "full_attention"] * 5},
     dict(quant="4bit", rank=8, fixes=["activation_offloading"], gradient_checkpointing=False)),
    # Mixtures of experts, every layer sparse: LoRA on the fused experts, the router's aux loss
    ("tiny-qwen3moe", 6, {"output_router_logits": True}, dict(quant="4bit", rank=8, optimizer="adamw_torch")),
    ("tiny-mixtral", 6, {}, dict(quant="bf16", rank=16, gradient_checkpointing=False)),
    ("tiny-gpt-oss", 10, {"layer_types": ["sliding_attention", "full_attention"] * 5},
     dict(quant="4bit", rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
]


@pytest.mark.parametrize("name,layers,extra,recipe", CASES)
def test_extrapolated_depth_gives_the_full_depths_figures(tmp_path, name, layers, extra, recipe):
    cfg = ProbeConfig(model=deeper(tmp_path, name, layers, **extra), random_weights=True, seq_len=256,
                      response_len=64, **{"fixes": [], **recipe})
    got, full = dry_run(cfg), dry_run(cfg, full_depth=True)
    assert got["depth"]["method"] == "extrapolated", got["depth"]
    assert full["depth"] == {"method": "every layer", "layers": layers}
    assert sum(got["depth"]["from_layers"]) < layers
    # TRL's offloading keeps its last five offloaded tensors on the device while their copies run:
    # which five they are at the peak depends on the layers around it, a few KiB on a stack's edge
    # (tiny Gemma 3 without checkpointing: +0.16%; gemma-3-1b-it at 2,048 tokens: -0.004%).
    rel = 2e-3 if "activation_offloading" in recipe.get("fixes", []) else 1e-4
    for key in ("after_load_mib", "pre_step_mib", "peak_mib"):
        assert got[key] == pytest.approx(full[key], rel=rel, abs=0.01), key


def test_a_budget_or_a_shallow_model_runs_every_layer():
    cfg = ProbeConfig(model="tiny-llama", random_weights=True, seq_len=256, response_len=64, rank=8, fixes=[])
    assert dry_run(cfg)["depth"]["method"] == "every layer"  # two layers: nothing to save


def test_depth_plan_of_one_type_two_types_and_unlike_layers():
    one = depth_plan(SimpleNamespace(num_hidden_layers=28))
    assert one.stacks() == [("decoder",) * 2, ("decoder",) * 3]
    gemma = depth_plan(SimpleNamespace(num_hidden_layers=34,
                                       layer_types=(["sliding"] * 5 + ["full"]) * 5 + ["sliding"] * 4))
    assert gemma.base == ("sliding", "full", "sliding")  # bottom, the other type, top
    assert gemma.stacks()[1:] == [("sliding", "sliding", "full", "sliding"), ("sliding", "full", "full", "sliding")]
    assert gemma.counts == {"sliding": 29, "full": 5}
    # a mixture of experts: every layer sparse is alike; dense layers among sparse ones are not
    assert depth_plan(SimpleNamespace(num_hidden_layers=28, num_local_experts=8)).stacks() == one.stacks()
    assert depth_plan(SimpleNamespace(num_hidden_layers=28, num_experts=8, decoder_sparse_step=1,
                                      mlp_only_layers=[])).stacks() == one.stacks()
    assert depth_plan(SimpleNamespace(num_hidden_layers=28, num_experts=8, mlp_only_layers=[0])) is None
    assert depth_plan(SimpleNamespace(num_hidden_layers=28, num_experts=8, decoder_sparse_step=2)) is None
    assert depth_plan(SimpleNamespace(num_hidden_layers=28, n_routed_experts=8, first_k_dense_replace=1)) is None
    assert depth_plan(SimpleNamespace(num_hidden_layers=8, intermediate_size=[64] * 8)) is None  # per-layer sizes
    assert depth_plan(SimpleNamespace(num_hidden_layers=5)) is None  # stacks of 2 and 3 save nothing


def test_phase_peaks_refuse_a_middle_layer_above_both_ends():
    alike = [("warmed", 10), ("forward", 50), (3, 60), (2, 58), (1, 56), (0, 54), ("end", 30)]
    assert phase_peaks(alike, 60) == {("warmed", 0): 10, ("forward", 1): 50, ("first layer", 1): 60,
                                      ("last layer", 1): 54, ("end", 1): 30}
    unlike = [("warmed", 10), ("forward", 50), (3, 55), (2, 61), (1, 56), (0, 54), ("end", 30)]
    assert phase_peaks(unlike, 61) is None
    # the bottom layer's gradients closing several windows as they accumulate: one phase
    grads = [("forward", 50), (1, 60), (0, 52), (0, 57), ("end", 30)]
    assert phase_peaks(grads, 60)[("last layer", 1)] == 57
    assert phase_peaks([("forward", 50), ("end", 30)], 50) is None  # no layer marked


def test_extrapolation_is_affine_per_layer_type():
    from probe_kit.depth import extrapolate

    plan = DepthPlan(types=("s", "f", "s", "f", "s"), base=("s", "f", "s"), counts={"s": 3, "f": 2})
    key = ("first layer", 1)

    def sample(load: float, peak: int) -> dict:
        return {"after_load_mib": load, "pre_step_mib": load + 1, "phases": {key: peak}}

    # base 100 MiB; one more s adds 10, one more f adds 30: the model has one s and one f more
    got = extrapolate(plan, [sample(100, 100 * MIB), sample(110, 110 * MIB), sample(130, 130 * MIB)])
    assert got["after_load_mib"] == 140 and got["pre_step_mib"] == 141 and got["peak_mib"] == 140
    mismatched = sample(110, 110 * MIB) | {"phases": {("forward", 1): 1}}
    assert extrapolate(plan, [sample(100, 100 * MIB), mismatched, sample(130, 130 * MIB)]) is None


def test_tracker_windows_hold_the_peak_between_marks():
    meter = TrackerMeter()
    with meter:
        meter.reset_peak()
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del b
        meter.mark("one")
        c = torch.empty(MIB // 2, dtype=torch.uint8)
        meter.mark("two")
    assert [label for label, _ in meter.windows] == ["one", "two"]
    assert meter.windows[0][1] == 3 * MIB and meter.windows[1][1] == 1.5 * MIB
    assert meter.peak_bytes == 3 * MIB
    del a, c


def test_a_stack_the_library_will_not_build_runs_every_layer(tmp_path, monkeypatch):
    import probe_kit.dry_run as dry

    def refuse(config, types):
        raise ValueError("layer_types does not match")

    monkeypatch.setattr(dry, "with_layers", refuse)
    cfg = ProbeConfig(model=deeper(tmp_path, "tiny-llama", 8), random_weights=True, seq_len=128, response_len=32,
                      rank=8, fixes=[])
    got = dry_run(cfg)
    assert got["depth"]["method"] == "every layer" and "ValueError" in got["depth"]["why"]
    assert got["peak_mib"] == dry_run(cfg, full_depth=True)["peak_mib"]

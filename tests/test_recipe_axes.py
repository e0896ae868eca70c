"""The recipe axes people set (micro-batch, gradient checkpointing, the optimizer's step) through the
probe kit's one recipe: the dry run under fake tensors against the real step on CPU tensors, both
measured by the tracker meter, for tiny configs of three families."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from ledger.vocab.adapter import trainable_shapes  # noqa: E402
from ledger.vocab.model_configs import load_arch  # noqa: E402
from ledger.vocab.optimizers import state_bytes  # noqa: E402
from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig, RecipeError  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
CASES = list(itertools.product(FAMILIES, (1, 2, 4), (True, False), (None, "adamw_torch", "adamw_8bit")))


def recipe(model: str, batch: int = 1, checkpointing: bool = True, optimizer=None, rank: int = 8, **kw) -> ProbeConfig:
    return ProbeConfig(model=model, rank=rank, quant="bf16", seq_len=384, response_len=16, fixes=[], random_weights=True,
                       batch_size=batch, gradient_checkpointing=checkpointing, optimizer=optimizer, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model,batch,checkpointing,optimizer", CASES)
def test_the_dry_run_is_the_real_step_within_one_percent(model, batch, checkpointing, optimizer):
    cfg = recipe(model, batch, checkpointing, optimizer)
    real, _ = run_probe(cfg, device="cpu")
    fake = dry_run(cfg)
    assert real.outcome.status == "ok" and fake["oom"] is None
    assert fake["peak_mib"] == pytest.approx(real.outcome.peak_allocated_mib, rel=0.01)
    assert real.batch_size == batch and real.optimizer == optimizer
    assert real.gradient_checkpointing is (None if checkpointing else False)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_each_axis_moves_the_peak_the_way_physics_says():
    base = run_probe(recipe("tiny-llama"), device="cpu")[0].outcome
    four = run_probe(recipe("tiny-llama", batch=4), device="cpu")[0].outcome
    off = run_probe(recipe("tiny-llama", checkpointing=False), device="cpu")[0].outcome
    adam = run_probe(recipe("tiny-llama", optimizer="adamw_torch"), device="cpu")[0].outcome
    # Activations grow with the batch (nearly 4x the step's share); the weights do not.
    assert four.pre_step_mib == base.pre_step_mib
    grown = (four.peak_allocated_mib - four.pre_step_mib) / (base.peak_allocated_mib - base.pre_step_mib)
    assert 3.0 < grown <= 4.05
    assert off.peak_allocated_mib > base.peak_allocated_mib  # every activation kept for backward
    # The optimizer's state is there before the measured step: what ledger.vocab.optimizers says it keeps.
    state = state_bytes("adamw_torch", trainable_shapes(load_arch("tiny-llama"), 8)).device_mib
    assert adam.pre_step_mib - base.pre_step_mib == pytest.approx(state, abs=0.1)


def test_ids_of_the_recipes_every_earlier_probe_ran_are_unchanged():
    """An axis at the value every earlier probe had is not in the key, so --resume and ids hold."""
    cfg = recipe("tiny-llama")
    assert {"batch_size", "gradient_checkpointing", "optimizer"}.isdisjoint(cfg.key())
    assert "batch_size" in recipe("tiny-llama", batch=2).key()
    assert "4 x" not in cfg.label() and "batch 4 x" in recipe("tiny-llama", batch=4).label()
    with pytest.raises(RecipeError, match="--optim must be one of"):
        recipe("tiny-llama", optimizer="adam_typo")
    with pytest.raises(RecipeError, match="--batch-size must be > 0"):
        recipe("tiny-llama", batch=0)


# -- one typed recipe, read the same way from a probe configuration and from the row it records ----


@pytest.mark.parametrize("cfg", [
    ProbeConfig(model="tiny-llama", rank=8),
    ProbeConfig(model="tiny-qwen2", rank=32, alpha=64, rslora=True, dropout=0.05, dora=True, quant="bf16",
                seq_len=512, response_len=100, fixes=["chunked_mlp"], batch_size=4, gradient_checkpointing=False,
                optimizer="paged_adamw_8bit", target_modules=["q_proj", "v_proj"]),
    ProbeConfig(model="tiny-llama", rank=16, fixes=[], target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                                       "down_proj"]),
])
def test_a_probe_config_and_its_row_name_the_same_recipe(cfg):
    from ledger.vocab.recipe import recipe_of

    row = recipe_of(cfg.measurement(id="x", kind="dry_run"))
    mine = cfg.recipe()
    assert mine == row
    # The fields that change no memory are named all the same, and equal on both sides.
    assert (mine.dropout_rate, mine.alpha, mine.rslora) == (row.dropout_rate, row.alpha, row.rslora)
    assert (row.batch, row.checkpointing, row.optimizer) == (cfg.batch_size, cfg.gradient_checkpointing,
                                                             cfg.optimizer)


def test_recipes_differing_only_where_memory_does_not_are_one_question():
    from dataclasses import replace

    from ledger.vocab.adapter import ALL_LINEAR
    from ledger.vocab.recipe import Recipe, targets_of_row

    base = Recipe("tiny-llama", rank=16, dropout=True, dropout_rate=0.05, alpha=16)
    same = replace(base, dropout_rate=0.1, alpha=32, rslora=True)
    assert same == base and hash(same) == hash(base)
    assert replace(base, dropout=False) != base and replace(base, batch=2) != base
    # Fused projections train the same weights as their parts; module paths read by their last part.
    assert targets_of_row(["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]) == ALL_LINEAR
    assert targets_of_row(["q_proj", "v_proj"]) == ("q_proj", "v_proj")
    assert targets_of_row(None) == ALL_LINEAR
    assert targets_of_row(["v_proj", "lm_head"]) == ("v_proj", "lm_head")


def test_a_recipes_own_replace_is_dataclasses_replace():
    from dataclasses import asdict, replace

    from ledger.vocab.recipe import Recipe

    base = Recipe("tiny-llama", rank=16, dropout=True, dropout_rate=0.05, alpha=16, seq_len=512)
    for changes in ({"rank": 64}, {"seq_len": 4096, "batch": 4}, {"dropout_rate": 0.1}, {"targets": ("q_proj",)},
                    {"model": None, "optimizer": "sgd", "checkpointing": False}):
        fast, slow = base.replace(**changes), replace(base, **changes)
        assert asdict(fast) == asdict(slow) and fast == slow and hash(fast) == hash(slow), changes
    assert asdict(base) == asdict(Recipe("tiny-llama", rank=16, dropout=True, dropout_rate=0.05, alpha=16,
                                         seq_len=512))  # the original is untouched
    with pytest.raises(TypeError, match="rnak"):
        base.replace(rnak=8)


def test_the_estimators_answer_the_one_recipe():
    import ledger.report.estimators as estimators
    from ledger.vocab.recipe import Recipe

    assert not hasattr(estimators, "Recipe") or estimators.Recipe is Recipe
    arch = load_arch("tiny-llama")
    one = estimators.UnslothStudio().estimate(arch, Recipe("tiny-llama", rank=8, seq_len=256, batch=1))
    four = estimators.UnslothStudio().estimate(arch, Recipe("tiny-llama", rank=8, seq_len=256, batch=4))
    assert four.breakdown["activations"] == pytest.approx(4 * one.breakdown["activations"])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model,optimizer", list(itertools.product(FAMILIES, ("adamw_torch", "adamw_8bit", "adafactor"))))
def test_a_training_run_is_the_one_step_probe_or_the_optimizer_step_plus_the_state(model, optimizer):
    """What the predictor assumes of a stock training run (``ledger.fit.response_span.steady_state_text``):
    the steady-state step (an optimizer step first, then forward, backward and a step) peaks at the
    higher of the one-step probe's peak and the optimizer step's floor (the weights and adapter
    before the step, its gradients, the step's temporaries: ``ledger.vocab.optimizers.transient_bytes``),
    plus the state ``ledger.vocab.optimizers`` computes, on the real step with CPU tensors, at a rank
    where the state is a large share of the peak."""
    from ledger.vocab.adapter import adapter_mib
    from ledger.vocab.optimizers import transient_bytes
    from ledger.fit.response_span import STEADY_STATE_ERR_PCT

    probe = run_probe(recipe(model, rank=64), device="cpu")[0].outcome
    one = probe.peak_allocated_mib
    steady = run_probe(recipe(model, optimizer=optimizer, rank=64), device="cpu")[0].outcome.peak_allocated_mib
    shapes = trainable_shapes(load_arch(model), 64)
    state = state_bytes(optimizer, shapes).device_mib
    floor = probe.pre_step_mib + adapter_mib(model, 64) + transient_bytes(optimizer, shapes) / 2**20
    assert state > (0.05 * one if optimizer == "adamw_torch" else 0)
    # The real step is recorded to 0.1 MiB: the tolerance is that or the figure's own, the larger.
    assert abs(steady - (max(one, floor) + state)) <= max(0.15, STEADY_STATE_ERR_PCT / 100 * steady)

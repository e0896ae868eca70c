"""A fused linear cross-entropy (``--fixes fused_linear_ce``): Liger Kernel's own Python, its Triton
kernels stood in off a GPU. The stand-in computes the loss and gradients transformers computes;
the dry run under fake tensors is the real CPU step within 1% for three families; the fix lowers
the peak where the logits set it; combinations that cannot run are refused in one line."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("liger_kernel")

from ledger.recipe import fixes_key, fixes_value, parse_fixes  # noqa: E402
from probe_kit import liger  # noqa: E402
from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig, RecipeError, load_config  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


def recipe(model: str, fixes: str = "fused_linear_ce", **kw) -> ProbeConfig:
    base = dict(model=model, rank=8, quant="bf16", seq_len=384, response_len=16, fixes=parse_fixes(fixes),
                random_weights=True, batch_size=2)
    return ProbeConfig(**{**base, **kw})


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_stand_in_kernel_computes_transformers_loss_and_gradients(softcap):
    """fp32 tiny Gemma 3 (a tied lm_head), the prompt masked as the probe masks it: Liger's forward
    with the stand-in kernels gives transformers' loss and the same gradients."""
    from transformers import AutoModelForCausalLM

    config = load_config("tiny-gemma3")
    config.final_logit_softcapping = softcap
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config).float().train()
    fused = copy.deepcopy(stock)
    liger.apply(fused)
    ids = torch.randint(0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :-24] = -100
    want = stock(input_ids=ids, labels=labels, use_cache=False).loss
    want.backward()
    with liger.kernels(torch.device("cpu")):
        got = fused(input_ids=ids, labels=labels, use_cache=False).loss
        got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for (name, a), (_, b) in zip(stock.named_parameters(), fused.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("quant", ["bf16", "4bit"])
def test_the_dry_run_is_the_real_step_within_one_percent(model, quant):
    cfg = recipe(model, quant=quant)
    real, _ = run_probe(cfg, device="cpu")
    fake = dry_run(cfg)
    assert real.outcome.status == "ok" and fake["oom"] is None
    assert fake["peak_mib"] == pytest.approx(real.outcome.peak_allocated_mib, rel=0.01)
    assert real.memory_fixes == ["fused_linear_ce"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_it_lowers_the_peak_where_the_logits_set_it():
    """Tiny Gemma 3 (4,096-token vocabulary, hidden size 64): stock, the step's peak is the logits
    and their fp32 loss; fused, it is a chunk of them."""
    stock = dry_run(recipe("tiny-gemma3", fixes="none"))["peak_mib"]
    fused = dry_run(recipe("tiny-gemma3"))["peak_mib"]
    assert fused < 0.5 * stock


def test_what_cannot_run_together_is_refused_in_one_line():
    for text in ("fused_linear_ce,logits_to_keep", "fused_linear_ce,bf16_lm_head"):
        with pytest.raises(ValueError, match="fused_linear_ce cannot be combined with"):
            parse_fixes(text)
        with pytest.raises(RecipeError, match="fused_linear_ce cannot be combined with"):
            ProbeConfig(model="tiny-llama", rank=8, fixes=text.split(","))
    # The program's preset, 'all', does not include the fused loss.
    assert parse_fixes("all") == ["chunked_mlp", "save_on_cpu", "bf16_lm_head", "logits_to_keep"]
    assert fixes_key(fixes_value(parse_fixes("chunked_mlp,save_on_cpu,fused_linear_ce"))) == \
        "chunked_mlp,save_on_cpu,fused_linear_ce"


def test_without_liger_the_probe_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_liger(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise ImportError("No module named 'liger_kernel'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    with pytest.raises(RecipeError, match=r"pip install 'vram-ledger\[liger\]'"):
        run_probe(recipe("tiny-llama", seq_len=32), device="cpu")

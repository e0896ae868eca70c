"""The memory settings users set that come from other libraries: Liger Kernel's fused linear
cross-entropy (``--fixes fused_linear_ce``) and TRL's activation offloading (``--fixes
activation_offloading``), each the library's own Python with only what needs a GPU stood in off one.
The stood-in kernel computes transformers' loss and gradients; TRL's context is TRL's, with TRL's
settings; the dry run under fake tensors is the real CPU step within 1% for three families; each
fix moves the peak the way its physics says; what cannot run together is refused in one line."""

from __future__ import annotations

import builtins
import copy
import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("liger_kernel")
pytest.importorskip("trl")

from ledger.vocab.recipe import fixes_key, fixes_value, parse_fixes  # noqa: E402
from probe_kit import liger, trl_offload  # noqa: E402
from probe_kit.dry_run import dry_run  # noqa: E402
from probe_kit.meters import TrackerMeter  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig, RecipeError, load_config  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
FUSED, OFFLOAD = "fused_linear_ce", "activation_offloading"
#: (fixes, quant, checkpointing, micro-batch): Liger in bf16 and 4-bit; TRL with checkpointing and
#: without (what it moves differs), at micro-batch 1 and 2.
CASES = [(FUSED, q, True, 2) for q in ("bf16", "4bit")] + \
        [(OFFLOAD, "bf16", c, b) for c, b in itertools.product((True, False), (1, 2))]


def recipe(model: str, fixes: str, **kw) -> ProbeConfig:
    base = dict(model=model, rank=8, quant="bf16", seq_len=384, response_len=16, fixes=parse_fixes(fixes),
                random_weights=True, batch_size=2)
    return ProbeConfig(**{**base, **kw})


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("fixes,quant,checkpointing,batch", CASES)
def test_the_dry_run_is_the_real_step_within_one_percent(model, fixes, quant, checkpointing, batch):
    cfg = recipe(model, fixes, quant=quant, gradient_checkpointing=checkpointing, batch_size=batch)
    real, _ = run_probe(cfg, device="cpu")
    fake = dry_run(cfg)
    assert real.outcome.status == "ok" and fake["oom"] is None
    assert fake["peak_mib"] == pytest.approx(real.outcome.peak_allocated_mib, rel=0.01)
    assert real.memory_fixes == [fixes]


def test_what_cannot_run_together_is_refused_in_one_line():
    for text, why in (("fused_linear_ce,logits_to_keep", "fused_linear_ce cannot be combined with logits_to_keep"),
                      ("fused_linear_ce,bf16_lm_head", "fused_linear_ce cannot be combined with bf16_lm_head"),
                      ("activation_offloading,save_on_cpu", "activation_offloading cannot be combined with save_on_cpu")):
        with pytest.raises(ValueError, match=why):
            parse_fixes(text)
        with pytest.raises(RecipeError, match=why):
            ProbeConfig(model="tiny-llama", rank=8, fixes=text.split(","))
    # The program's preset, 'all', is the four it always was; the two go together and beside others.
    assert parse_fixes("all") == ["chunked_mlp", "save_on_cpu", "bf16_lm_head", "logits_to_keep"]
    assert parse_fixes("activation_offloading,fused_linear_ce") == [FUSED, OFFLOAD]
    assert fixes_key(fixes_value(parse_fixes("chunked_mlp,save_on_cpu,fused_linear_ce"))) == \
        "chunked_mlp,save_on_cpu,fused_linear_ce"


@pytest.mark.parametrize("fixes,module,extra", [(FUSED, "liger_kernel", "liger"), (OFFLOAD, "trl", "trl")])
def test_without_the_library_the_probe_says_what_to_install(monkeypatch, fixes, module, extra):
    real_import = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    with pytest.raises(RecipeError, match=rf"pip install 'vram-ledger\[{extra}\]'"):
        run_probe(recipe("tiny-llama", fixes, seq_len=32), device="cpu")


# -- Liger's fused linear cross-entropy ------------------------------------------------------------


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
def test_it_lowers_the_peak_where_the_logits_set_it():
    """Tiny Gemma 3 (4,096-token vocabulary, hidden size 64): stock, the step's peak is the logits
    and their fp32 loss; fused, it is a chunk of them."""
    stock = dry_run(recipe("tiny-gemma3", "none"))["peak_mib"]
    fused = dry_run(recipe("tiny-gemma3", "fused_linear_ce"))["peak_mib"]
    assert fused < 0.5 * stock


# -- TRL's activation offloading --------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_under_4bit_the_dry_run_is_the_step_with_its_4bit_stand_in(monkeypatch):
    """4-bit: the dry run's stand-in for bitsandbytes (its GPU storage and compute) on real CPU
    tensors gives the dry run's figure. (bitsandbytes' own CPU path recomputes a checkpointed
    layer with other temporaries, which offloading makes the peak: 19.4 against 19.1 MiB.)"""
    import probe_kit.recipe as recipe_module
    from probe_kit.dry_run import stand_in_4bit

    cfg = recipe("tiny-llama", OFFLOAD, quant="4bit")
    monkeypatch.setattr(recipe_module, "quantize_linear_layers",
                        lambda model, device, dq, std=0.02: stand_in_4bit(model, dq, device))
    real, _ = run_probe(cfg, device="cpu")
    assert dry_run(cfg)["peak_mib"] == pytest.approx(real.outcome.peak_allocated_mib, rel=0.01)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_it_moves_what_the_step_saves_to_host_ram():
    """Without checkpointing every activation is saved, and offloaded: the peak falls by half; with
    it (non-reentrant, as TRL sets it) the layers' inputs stay in their checkpoints and little moves."""
    off = dry_run(recipe("tiny-llama", OFFLOAD, gradient_checkpointing=False))["peak_mib"]
    stock_off = dry_run(recipe("tiny-llama", "none", gradient_checkpointing=False))["peak_mib"]
    assert off < 0.6 * stock_off
    on = dry_run(recipe("tiny-llama", OFFLOAD))["peak_mib"]
    stock_on = dry_run(recipe("tiny-llama", "none"))["peak_mib"]
    assert abs(on / stock_on - 1) < 0.1


def test_it_is_trls_own_context_with_trls_settings():
    from transformers import AutoModelForCausalLM
    from trl.models.activation_offloading import OffloadActivations

    model = AutoModelForCausalLM.from_config(load_config("tiny-llama"))
    ctx = trl_offload.offloader(model, torch.device("cpu"), TrackerMeter())
    assert isinstance(ctx.ctx, OffloadActivations)
    assert ctx.ctx.use_streams and ctx.ctx.min_tensor_size_bytes == 1024 and ctx.ctx.max_fwd_stash_size == 5
    assert not ctx.ctx.use_pin_memory  # no pinned memory without a GPU
    # Nothing it patched for the CPU outlives the construction or the step.
    assert torch.accelerator.current_accelerator() is None and torch.get_device_module("cpu") is torch.cpu


def test_host_copies_are_never_counted():
    meter = TrackerMeter()
    with meter:
        device = torch.ones(1024)
        with meter.host():
            host = torch.empty_like(device)
        host.copy_(device)  # an op returning the host copy later does not count it either
        assert meter.allocated_mib() * 2**20 == 4096
        assert meter.peak_allocated_mib() * 2**20 == 4096
        again = host.clone()  # brought back: a new device tensor
        assert meter.allocated_mib() * 2**20 == 8192
    del again


def test_a_freed_storages_dedup_key_is_never_given_again():
    """TRL names a saved tensor's storage by its address; a storage made after the first is freed
    can land on that address, and whether it does depends on the heap's history. The key the CPU
    step uses names each storage once: views of a live storage share it, a new storage at a reused
    address does not."""
    serials = trl_offload._StorageSerials(fallback=None)
    first = torch.ones(256)
    key = serials.key(first)
    assert serials.key(first[:128]) == key  # the same storage at the same offset: deduplicated
    assert serials.key(first[128:])[0] == key[0] and serials.key(first[128:]) != key
    address, storage_address = first.data_ptr(), first.untyped_storage()._cdata
    del first
    for _ in range(1000):  # until the allocator hands a freed address out again (at once, here)
        second = torch.ones(256)
        if second.data_ptr() == address or second.untyped_storage()._cdata == storage_address:
            break
        del second
    assert serials.key(second) != key and serials.serials == {id(second.untyped_storage()): key[0] + 1}

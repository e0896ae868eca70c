"""Full fine-tuning in the probe kit and the dry run (``--method full``): every weight trainable, no
adapter, in bf16 (optimizer state in the parameters' dtype) and in fp32 master weights under bf16
autocast, with the Trainer's optimizers, gradient checkpointing on and off. The dry run gives the
real CPU step's figures for three model families; tied embeddings are one parameter; the LoRA
flags and 4-bit weights are refused in one line; a row records ``finetune: full`` and the fits
leave LoRA's fits without it (full fine-tuning is answered from its own rows: test_full_ft_answers)."""

from __future__ import annotations

import json

import pytest
from conftest import assert_dry_run_is_the_real_cpu_step

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from probe_kit.dry_run import dry_run, main as dry_main  # noqa: E402
from probe_kit.probe_vram import main as probe_main  # noqa: E402
from probe_kit.recipe import ProbeConfig, RecipeError, load_config  # noqa: E402



def full(model: str, **recipe) -> ProbeConfig:
    return ProbeConfig(model=model, method="full", random_weights=True, seq_len=256, response_len=16,
                       **{"fixes": [], "quant": "bf16", **recipe})


CASES = [
    ("tiny-llama", dict(optimizer="adamw_torch")),
    ("tiny-llama", dict(quant="fp32", optimizer="adamw_torch")),
    ("tiny-qwen2", dict(optimizer="adamw_8bit")),
    ("tiny-qwen2", dict(quant="fp32", optimizer="adafactor", gradient_checkpointing=False)),
    ("tiny-gemma3", dict(optimizer="sgd")),
    ("tiny-gemma3", dict(quant="fp32", optimizer="paged_adamw_32bit")),
    ("tiny-gemma3", dict(gradient_checkpointing=False, batch_size=2)),
]


@pytest.mark.parametrize("model,recipe", CASES)
def test_the_dry_run_is_the_real_cpu_step(model, recipe):
    cfg = full(model, **recipe)
    assert_dry_run_is_the_real_cpu_step(cfg)


def _params(model: str) -> int:
    """The model's parameters, each tensor once (a tied lm_head is the embedding's)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(load_config(model))
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("quant,weight_bytes,state_bytes", [("bf16", 2, 4), ("fp32", 4, 8)])
def test_weights_and_adamw_state_in_the_parameters_dtype_tied_embeddings_once(quant, weight_bytes, state_bytes):
    """tiny-qwen2 ties its lm_head to the embedding: counted once. AdamW keeps two moments of
    each parameter in its dtype: bf16 weights 2 + 4 bytes a parameter, fp32 master weights 4 + 8
    (with their 4-byte gradients, the FT01 rule's 16 bytes a parameter at the step)."""
    n = _params("tiny-qwen2")
    d = dry_run(full("tiny-qwen2", quant=quant, optimizer="adamw_torch"))
    assert d["after_load_mib"] == pytest.approx(n * weight_bytes / 2**20, rel=0.01)
    assert d["pre_step_mib"] - d["after_load_mib"] == pytest.approx(n * state_bytes / 2**20, rel=0.01)
    assert d["peak_mib"] > n * (weight_bytes + state_bytes + weight_bytes) / 2**20  # + the gradients


@pytest.mark.parametrize("argv,message", [
    (["--quant", "4bit"], "--method full with --quant 4bit: 4-bit weights cannot be trained"),
    (["--rank", "8"], "--rank is a LoRA setting: --method full trains every weight, with no adapter"),
    (["--dropout", "0.1"], "--dropout is a LoRA setting"),
    (["--target-modules", "q_proj"], "--target-modules is a LoRA setting"),
    (["--find-ceiling", "rank", "--gpu", "RTX 4090"], "--find-ceiling rank: full fine-tuning has no rank"),
])
def test_what_full_fine_tuning_cannot_take_is_one_line(capsys, argv, message):
    assert dry_main(["--model", "tiny-llama", "--method", "full", "--seq-len", "128", "--response-len", "16",
                     *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_fp32_weights_and_a_missing_rank_are_refused_for_lora(capsys):
    with pytest.raises(RecipeError, match="fp32 master weights are a full fine-tuning precision"):
        ProbeConfig(model="tiny-llama", rank=8, quant="fp32")
    assert dry_main(["--model", "tiny-llama", "--seq-len", "128", "--response-len", "16"]) == 1
    assert "--rank is required for LoRA" in capsys.readouterr().err


def test_the_commands_print_a_full_fine_tuning_step(capsys, tmp_path):
    assert dry_main(["--model", "tiny-llama", "--method", "full", "--quant", "fp32", "--optim", "adamw_torch",
                     "--seq-len", "128", "--response-len", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["answer"]["verdict"] == "unknown" and "lora" not in doc["measurement"]  # no card: no verdict
    assert doc["answer"]["method"] == "dry run" and doc["answer"]["real_allocated"]["mib"] is not None
    assert json.loads(doc["measurement"]["config_text"])["method"] == "full"
    assert doc["measurement"]["id"].startswith("dry-tiny-llama-fp32-full-")
    assert probe_main(["--model", "tiny-llama", "--method", "full", "--random-weights", "--device", "cpu",
                       "--seq-len", "128", "--response-len", "16", "--json"]) == 0
    probe = json.loads(capsys.readouterr().out)
    assert probe["outcome"]["status"] == "ok" and "-bf16-full-" in probe["id"]
    # Recorded: finetune full, no LoRA settings; a valid ledger row the fits leave out.
    from ledger.answer.predictor import Predictor
    from ledger.fit.peaks import modelled
    from ledger.storage import store

    ledger = tmp_path / "l.json"
    assert probe_main(["--model", "tiny-llama", "--method", "full", "--random-weights", "--device", "cpu",
                       "--seq-len", "128", "--response-len", "16", "--ledger", str(ledger)]) == 0
    (row,) = store.load(ledger).measurements
    assert row.finetune == "full" and row.lora is None and row.quant == "bf16" and not modelled(row)
    assert dry_main(["--model", "tiny-llama", "--method", "full", "--seq-len", "128", "--response-len", "16",
                     "--ledger", str(ledger), "--append"]) == 0
    assert {m.finetune for m in store.load(ledger).measurements} == {"full"}
    assert Predictor(store.load(ledger), store.load(ledger).measurements).fit.dry == []


def test_a_full_fine_tuning_row_with_lora_settings_or_4bit_is_refused(tmp_path, capsys):
    from conftest import FROZEN
    from ledger import cli

    doc = json.loads(FROZEN.read_text())
    row = next(m for m in doc["measurements"] if m.get("lora"))
    doc["measurements"] = [{**m, **({"finetune": "full", "quant": "4bit"} if m is row else {})}
                           for m in doc["measurements"]]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert cli.main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "a full fine-tuning row (finetune: full) trains every weight: it has no LoRA settings" in err
    assert "a full fine-tuning row cannot have 4-bit weights" in err

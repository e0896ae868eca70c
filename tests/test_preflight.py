"""probe_kit.preflight: the run's own step on its worst batch before training (CPU, tiny models)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from probe_kit.meters import TrackerMeter  # noqa: E402
from probe_kit.preflight import Preflight, PreflightFailed, find_worst_batch, preflight, shrink  # noqa: E402
from probe_kit.preflight.data import read_examples  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LONGEST = 13  # the planted longest example's index
VOCAB = 256


def tiny_model(family: str = "llama", seed: int = 0, dropout: float = 0.1):
    torch.manual_seed(seed)
    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    cfg = kind(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                            target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"))


def examples(n: int = 24, longest: int = 120) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(8, 40, (n,), generator=g)]
    lengths[LONGEST] = longest
    lengths[5] = longest - 10  # the second longest
    return [{"input_ids": torch.randint(0, VOCAB, (k,), generator=g).tolist()} for k in lengths]


def collate(batch: list[dict]) -> dict:
    """Pad to the longest in the batch, as DataCollatorWithPadding does."""
    n = max(len(e["input_ids"]) for e in batch)
    ids = torch.zeros((len(batch), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(batch):
        ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Steps(TrainerCallback):
    def __init__(self):
        self.begun = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.begun += 1


def trainer_for(tmp_path: Path, model, *, batch: int = 4, accumulation: int = 2, steps: int = 3, optim="adamw_torch",
                device: str = "cpu"):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=steps, use_cpu=device == "cpu",
                             report_to=[],
                             save_strategy="no", logging_strategy="no", seed=3, gradient_checkpointing=True,
                             remove_unused_columns=False, optim=optim, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=examples(), data_collator=collate)


def trained(tmp_path: Path, device: str = "cpu", **preflight_options):
    """Train three steps (with preflight when options are given); the adapter and optimizer state after."""
    model = tiny_model()
    trainer = trainer_for(tmp_path, model, device=device)
    steps = Steps()
    trainer.add_callback(steps)
    if preflight_options:
        trainer.add_callback(Preflight(trainer, **preflight_options))
    trainer.train()
    weights = {k: v.detach().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}
    state = trainer.optimizer.state_dict()["state"]
    rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    return weights, state, steps.begun, rng, (trainer.callback_handler.callbacks[-1] if preflight_options else None)


def test_a_run_with_preflight_trains_bit_for_bit_like_one_without(tmp_path, capsys):
    """Dropout (the RNG), accumulation 2, AdamW's state, the scheduler: all as without preflight."""
    plain_w, plain_s, plain_steps, plain_rng, _ = trained(tmp_path / "a")
    pre_w, pre_s, pre_steps, pre_rng, _ = trained(tmp_path / "b", budget_mib=1000)
    assert "preflight: FITS" in capsys.readouterr().err
    assert plain_steps == pre_steps == 3  # on_step_begin: once per optimizer step
    assert plain_w.keys() == pre_w.keys() and all(torch.equal(plain_w[k], pre_w[k]) for k in plain_w)
    assert plain_s.keys() == pre_s.keys()
    for k in plain_s:
        for name, t in plain_s[k].items():
            assert torch.equal(t, pre_s[k][name]), (k, name)
    assert torch.equal(plain_rng, pre_rng)


def test_the_worst_batch_is_the_longest_examples_padded_as_the_collator_pads():
    rows = examples()
    worst = find_worst_batch(rows, collate, batch_size=1)
    assert worst.indices == [LONGEST] and worst.seq_len == 120 and worst.batch_size == 1
    four = find_worst_batch(rows, collate, batch_size=4)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))
    assert four.indices[:2] == [LONGEST, 5] and sorted(four.indices) == sorted(order[:4])
    assert tuple(four.inputs["input_ids"].shape) == (4, 120)  # all padded to the longest
    assert four.longer_than(60) == 2
    # A bounded scan says how much it saw, and misses what lies past it.
    part = find_worst_batch(rows, collate, batch_size=1, max_scan=10)
    assert part.scanned == 10 and part.total == len(rows) and part.seq_len < 120
    assert "the first 10 of 24 examples" in part.describe()
    cut = shrink(four.inputs, 2, 50)
    assert tuple(cut["input_ids"].shape) == (2, 50) and tuple(cut["labels"].shape) == (2, 50)


def test_the_preflight_peak_equals_a_separate_probe_of_the_same_batch(tmp_path):
    """The same step written out by hand (an optimizer step, then the measured micro-steps and a
    step) under its own tracker meter: the same peak, to the meter's 512-byte blocks."""
    model = tiny_model(dropout=0.0)
    trainer = trainer_for(tmp_path, model, batch=2, accumulation=1)
    result = preflight(trainer, budget_mib=1000, stream=sys.stderr)

    model = tiny_model(dropout=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, fused=False, foreach=True)
    batch = find_worst_batch(examples(), collate, 2).inputs
    model.activation_checkpointing_enable()  # what Trainer does for gradient_checkpointing=True
    model.train()

    def one_step():
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.zero_grad(set_to_none=True)

    meter = TrackerMeter()
    meter.register_module(model)
    meter.register(batch.values())
    with meter:
        one_step()
        one_step()
    assert result.step.peak_allocated_mib == pytest.approx(meter.peak_allocated_mib(), rel=0.005)
    assert result.verdict == "fits" and result.headroom_mib == pytest.approx(1000 - result.step.peak_allocated_mib, abs=0.05)


def test_a_budget_below_the_peak_stops_training_before_step_one_with_a_measured_recipe(tmp_path):
    """Simulated OOM (the tracker meter's budget): PreflightFailed before any step, naming the nearest
    recipe that fits (a smaller micro-batch with more accumulation), in seconds."""
    fits = preflight(trainer_for(tmp_path, tiny_model(), batch=4), budget_mib=1000, stream=sys.stderr)
    one = preflight(trainer_for(tmp_path, tiny_model(), batch=1), budget_mib=1000, stream=sys.stderr)
    budget = round((fits.step.peak_allocated_mib + one.step.peak_allocated_mib) / 2 * 1.1, 3)
    model = tiny_model()
    trainer = trainer_for(tmp_path, model, batch=4)
    steps = Steps()
    trainer.add_callback(steps)
    trainer.add_callback(Preflight(trainer, budget_mib=budget))
    t0 = time.perf_counter()
    with pytest.raises(PreflightFailed) as failed:
        trainer.train()
    assert time.perf_counter() - t0 < 10
    assert steps.begun == 0 and trainer.state.global_step == 0
    r = failed.value.result
    assert r.verdict == "won't fit"
    assert r.alternative is not None and r.alternative.step.peak_allocated_mib <= budget
    assert r.alternative.changes[0] in ("per_device_train_batch_size=2", "per_device_train_batch_size=1")
    assert "effective batch kept" in r.alternative.changes[1]
    text = str(failed.value)
    assert text.startswith("preflight: WON'T FIT") and "nearest recipe that fits" in text
    assert "stopped before step 1" in text


def test_nothing_fits_says_what_was_tried(tmp_path):
    trainer = trainer_for(tmp_path, tiny_model(), batch=2)
    result = preflight(trainer, budget_mib=0.01, stop=(), stream=sys.stderr)
    assert result.verdict == "won't fit" and result.alternative is None
    assert [a.changes[0] for a in result.tried][:1] == ["per_device_train_batch_size=1"]
    assert "no nearby recipe fits" in result.report()


def test_standalone_preflight_leaves_the_trainer_as_it_was(tmp_path):
    trainer = trainer_for(tmp_path, tiny_model(), accumulation=3)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    result = preflight(trainer, budget_mib=1000, stream=sys.stderr)
    assert result.verdict == "fits"
    assert trainer.optimizer is None  # train() makes its own, as without preflight
    assert all(torch.equal(v, dict(trainer.model.named_parameters())[k]) for k, v in before.items())
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_record_in_the_ledger_is_evidence_the_fits_leave_out(tmp_path):
    from ledger.storage import store
    from ledger.fit.ledger_fit import LedgerFit

    path = tmp_path / "runs.json"
    result = preflight(trainer_for(tmp_path, tiny_model()), budget_mib=1000, ledger=str(path), stream=sys.stderr)
    ledger = store.load(path)
    (m,) = ledger.measurements
    assert m.id == result.recorded and m.kind == "probe" and m.batch_size == 4
    assert m.optimizer == "adamw_torch" and m.gradient_checkpointing is True
    assert m.lora.rank == 8 and m.lora.dropout == 0.1 and sorted(m.lora.target_modules) == ["down_proj", "q_proj",
                                                                                              "v_proj"]
    assert m.outcome.peak_allocated_mib == round(result.step.peak_allocated_mib, 1) and m.seq_len == 120
    assert subprocess.run([sys.executable, "-m", "ledger.cli", "validate", str(path)],
                          capture_output=True).returncode == 0
    assert LedgerFit(ledger).ms == []  # a batch of 4 with its optimizer step is no batch-1 probe


def test_qwen_family_and_an_eight_bit_free_optimizer(tmp_path):
    model = tiny_model("qwen2")
    result = preflight(trainer_for(tmp_path, model, batch=2, optim="sgd"), budget_mib=1000, stream=sys.stderr)
    assert result.verdict == "fits" and "sgd" in result.recipe and "qwen2" in result.recipe


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} [EOS] {% endfor %}"
    fast.save_pretrained(folder)
    return fast


def _text_rows(n: int = 16, longest: int = 90) -> list[dict]:
    rows = [{"text": " ".join(f"w{(i * 7 + j) % 200}" for j in range(10 + i))} for i in range(n)]
    rows[3] = {"text": " ".join(f"w{j % 200}" for j in range(longest))}
    return rows


def test_sft_trainer(tmp_path, capsys):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tok = _tokenizer(tmp_path / "tok")
    model = tiny_model()
    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                           report_to=[], save_strategy="no", logging_strategy="no", max_length=64,
                           gradient_accumulation_steps=2, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(_text_rows()),
                             processing_class=tok)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    result = preflight(trainer, budget_mib=1000, stream=sys.stderr)
    assert result.verdict == "fits" and "2 × 64 tokens" in result.worst  # truncated to max_length, as SFT does
    assert all(torch.equal(v, dict(model.named_parameters())[k]) for k, v in before.items())
    trainer.add_callback(Preflight(trainer, budget_mib=1000))
    trainer.train()
    assert "preflight: FITS" in capsys.readouterr().err and trainer.state.global_step == 2


def test_the_command(tmp_path):
    _tokenizer(tmp_path / "tok")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _text_rows()) + "\n")
    cmd = [sys.executable, "-m", "probe_kit.preflight", "--model", "tiny-llama", "--random-weights", "--quant",
           "bf16", "--rank", "8", "--fixes", "none", "--data", str(data), "--tokenizer", str(tmp_path / "tok"),
           "--batch-size", "2", "--device", "cpu"]
    ok = subprocess.run(cmd + ["--budget-mib", "4000", "--json"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["verdict"] == "fits" and "2 × 90 tokens" in doc["worst"]
    low = subprocess.run(cmd + ["--budget-mib", "1"], capture_output=True, text=True, cwd=REPO)
    assert low.returncode == 3 and "WON'T FIT" in low.stdout
    bad = subprocess.run(cmd[:-4] + ["--data", str(tmp_path / "missing.jsonl")], capture_output=True, text=True,
                         cwd=REPO)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "no such file" in bad.stderr
    full = [c for c in cmd if c not in ("--rank", "8")]
    full[full.index("bf16")] = "fp32"
    done = subprocess.run(full + ["--method", "full", "--budget-mib", "4000", "--json"], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert "full fine-tuning" in doc["recipe"] and "fp32" in doc["recipe"] and doc["verdict"] == "fits"
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"text": "w1"}\n{"prompt": 1}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:2: a row needs a 'text' or 'messages' column"):
        read_examples(str(rows))


def test_on_the_cpu_a_card_is_judged_by_its_effective_limit_and_the_ledger_says_what_it_models(tmp_path):
    result = preflight(trainer_for(tmp_path, tiny_model(), batch=2), gpu="rtx-3070-ti", stop=(), stream=sys.stderr)
    assert result.available_source.startswith("rtx-3070-ti's effective limit")
    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.answer.predictor import Predictor

    bundled = store.load(DEFAULT_LEDGER)
    low, _, _ = Predictor(bundled, load_dry_runs()).card_limit("rtx-3070-ti", bundled.gpus["rtx-3070-ti"], "real")
    assert result.available_mib == low and result.headroom_mib == pytest.approx(low - result.step.peak_allocated_mib,
                                                                                abs=0.05)
    assert result.ledger_answer.startswith("unknown")  # the ledger has no row or dry run of this toy model
    with pytest.raises(Exception, match="unknown gpu 'RTX 9999'"):
        preflight(trainer_for(tmp_path, tiny_model()), gpu="RTX 9999", stream=sys.stderr)


def test_the_command_reads_messages_and_parquet_and_measures_checkpointing_off(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _tokenizer(tmp_path / "tok")
    rows = [{"messages": [{"role": "user", "content": " ".join(f"w{j}" for j in range(5 + i))},
                          {"role": "assistant", "content": "w1 w2"}]} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    base = [sys.executable, "-m", "probe_kit.preflight", "--model", "tiny-llama", "--random-weights", "--quant", "bf16",
            "--rank", "4", "--data", str(tmp_path / "chat.parquet"), "--tokenizer", str(tmp_path / "tok"),
            "--device", "cpu", "--budget-mib", "4000", "--json"]
    on = subprocess.run(base, capture_output=True, text=True, cwd=REPO)
    off = subprocess.run(base + ["--no-gradient-checkpointing"], capture_output=True, text=True, cwd=REPO)
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    on, off = json.loads(on.stdout), json.loads(off.stdout)
    assert "1 × 14 tokens" in on["worst"]  # 10 user words, [EOS], 2 assistant words, [EOS]
    assert "checkpointing on" in on["recipe"] and "checkpointing off" in off["recipe"]
    assert off["step"]["peak_allocated_mib"] > on["step"]["peak_allocated_mib"]
    refused = subprocess.run(base + ["--fixes", "all"], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "save_on_cpu" in refused.stderr


def test_gradient_accumulation_adds_at_most_the_adapters_gradients_to_the_peak(tmp_path):
    """The second micro-step runs while the first's gradients are held: the peak grows by at most
    the adapter's fp32 gradients (each in 512-byte blocks), and no further with more micro-steps."""
    peaks = {ga: preflight(trainer_for(tmp_path, tiny_model(dropout=0.0), batch=2, accumulation=ga), budget_mib=1000,
                           stream=sys.stderr).step.peak_allocated_mib for ga in (1, 2, 4)}
    grads = sum((p.numel() * 4 + 511) // 512 * 512 for p in tiny_model().parameters() if p.requires_grad) / 2**20
    assert 0 <= peaks[2] - peaks[1] <= grads and peaks[4] == peaks[2]


def test_when_nothing_nearby_fits_the_ledger_is_asked_for_a_smaller_rank(tmp_path):
    result = preflight(trainer_for(tmp_path, tiny_model(), batch=2), gpu="rtx-3070-ti", budget_mib=0.01, stop=(),
                       stream=sys.stderr)
    assert result.verdict == "won't fit" and result.alternative is None
    assert result.advice.startswith("or a smaller rank") and "vram ceiling" in result.advice
    assert "vram ceiling" in result.report()


def test_the_runs_memory_fixes_are_read_off_its_arguments():
    """TRL's activation_offloading and Liger's fused loss alone are recipes the ledger names; Liger's
    other kernels (on by default with use_liger_kernel) are not, so such a run is not recorded."""
    from types import SimpleNamespace

    from probe_kit.preflight.state import run_fixes

    pytest.importorskip("liger_kernel")
    base = tiny_model().get_base_model()
    only_fused = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
                  "fused_linear_cross_entropy": True}
    assert run_fixes(SimpleNamespace(), base) == []
    assert run_fixes(SimpleNamespace(activation_offloading=True), base) == ["activation_offloading"]
    assert run_fixes(SimpleNamespace(use_liger_kernel=True, liger_kernel_config=only_fused), base) == ["fused_linear_ce"]
    assert run_fixes(SimpleNamespace(use_liger_kernel=True, liger_kernel_config=only_fused, activation_offloading=True),
                     base) == ["fused_linear_ce", "activation_offloading"]
    assert run_fixes(SimpleNamespace(use_liger_kernel=True, liger_kernel_config=None), base) is None  # rope, norm, swiglu
    assert run_fixes(SimpleNamespace(use_liger_kernel=True, liger_kernel_config={**only_fused, "rms_norm": True}),
                     base) is None


def test_a_run_with_a_fix_is_recorded_under_it_and_one_without_a_name_is_not(tmp_path, monkeypatch):
    from ledger.storage import store
    from probe_kit.preflight import state

    path = tmp_path / "runs.json"
    monkeypatch.setattr(state, "run_fixes", lambda args, base: ["activation_offloading"])
    preflight(trainer_for(tmp_path, tiny_model()), budget_mib=1000, ledger=str(path), stream=sys.stderr)
    (m,) = store.load(path).measurements
    assert m.memory_fixes == ["activation_offloading"]
    monkeypatch.setattr(state, "run_fixes", lambda args, base: None)
    result = preflight(trainer_for(tmp_path, tiny_model()), budget_mib=1000, ledger=str(path), stream=sys.stderr)
    assert result.recorded is None and "no recipe the ledger names" in result.not_recorded
    assert len(store.load(path).measurements) == 1 and "not recorded:" in result.report()


def test_a_mixture_of_experts_with_adapted_experts_is_read_and_measured(tmp_path):
    """peft's target_parameters (a mixture of experts' fused expert weights) are part of the
    recipe preflight records: gate_up_proj as gate_proj and up_proj, down_proj as itself."""
    from transformers import Qwen3MoeConfig

    from probe_kit.preflight.state import read_recipe

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=VOCAB, max_position_embeddings=512)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(
        r=8, target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"], task_type="CAUSAL_LM"))
    trainer = trainer_for(tmp_path, model, batch=2)
    recipe = read_recipe(trainer, model)
    assert recipe.target_modules == ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    result = preflight(trainer, budget_mib=1000, stream=sys.stderr)
    assert result.verdict == "fits" and result.step.peak_allocated_mib > 0 and "r8" in result.recipe


def test_a_full_fine_tune_is_read_measured_recorded_and_answered_as_one(tmp_path):
    """No peft adapter and every weight trainable: preflight reads full fine-tuning in the weights'
    dtype, measures the run's own step, records ``finetune: full`` (a valid row, no LoRA), and
    asks the ledger about full fine-tuning (a toy model: no dry run of it, so unknown)."""
    from ledger.storage import store

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    path = tmp_path / "runs.json"
    result = preflight(trainer_for(tmp_path, model, batch=2), gpu="rtx-4090", ledger=str(path), stop=(),
                       stream=sys.stderr)
    assert "full fine-tuning (every weight trained)" in result.recipe and "bf16" in result.recipe
    assert "full fine-tuning" in result.ledger_answer and "LoRA" not in result.ledger_answer
    (m,) = store.load(path).measurements
    assert m.finetune == "full" and m.lora is None and m.quant == "bf16" and m.batch_size == 2
    n = sum(p.numel() for p in model.parameters())
    assert result.step.peak_allocated_mib > n * (2 + 2 + 4) / 2**20  # weights, gradients, AdamW's bf16 moments


def _two_ranks(tmp_path: Path, budget: float, extra: int) -> list[dict]:
    """tests/preflight_world_run.py on two CPU processes over gloo (DDP); each rank's result."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(port),
                           str(Path(__file__).with_name("preflight_world_run.py")), str(tmp_path), str(budget),
                           str(extra)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank-{k}.json").read_text()) for k in (0, 1)]


def test_on_two_ranks_the_run_is_judged_as_its_worst_rank_and_every_rank_stops_together(tmp_path):
    """A DDP run on two processes whose rank 0 has the longer worst batch: under a budget only rank 1
    would fit, both ranks say "won't fit", keep the same nearer recipe and stop before step 1
    (none trains while the other has stopped, none waits in a collective); with room, both train."""
    stopped = _two_ranks(tmp_path / "tight", 20, 1500)
    assert [r["trained"] for r in stopped] == [False, False]
    assert [r["verdict"] for r in stopped] == ["won't fit", "won't fit"]
    assert stopped[0]["rank_peaks"] == stopped[1]["rank_peaks"] and len(stopped[0]["rank_peaks"]) == 2
    low, high = sorted(stopped[0]["rank_peaks"])
    assert low < 20 < high and stopped[0]["peak"] == high
    assert stopped[0]["alternative"] == stopped[1]["alternative"] is not None
    assert {r["strategy"] for r in stopped} == {"ddp"} and {r["world_seen"] for r in stopped} == {2}
    roomy = _two_ranks(tmp_path / "roomy", 1000, 1500)
    assert [r["trained"] for r in roomy] == [True, True] and {r["verdict"] for r in roomy} == {"fits"}

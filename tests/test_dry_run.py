"""The dry run: fake tensors against real CPU runs, the 4-bit stand-in against bitsandbytes."""

from __future__ import annotations

import json

import pytest

import probe_kit.recipe as recipe
from conftest import DATA, SMALL
from ledger.storage import store
from probe_kit.dry_run import dry_run, main as dry_main, predict, stand_in_4bit, vision_mib
from probe_kit.probe_vram import run_probe
from probe_kit.recipe import ProbeConfig, parse_fixes

BASE = dict(model="tiny-llama", random_weights=True, seq_len=1024, response_len=237)


def real(cfg):
    m, _ = run_probe(cfg, device="cpu")
    return m.outcome


@pytest.mark.parametrize("quant", ["bf16", "4bit"])
def test_fake_and_real_cpu_runs_agree_within_one_percent(quant):
    cfg = ProbeConfig(**BASE, rank=16, quant=quant)
    r, d = real(cfg), dry_run(cfg)
    assert d["peak_mib"] == pytest.approx(r.peak_allocated_mib, rel=0.01)
    assert d["pre_step_mib"] == pytest.approx(r.pre_step_mib, rel=0.01, abs=0.1)


def test_stand_in_and_bitsandbytes_agree_on_activation_memory(monkeypatch):
    cfg = ProbeConfig(**BASE, rank=16, quant="4bit", dropout=0.1)
    bnb = real(cfg)
    monkeypatch.setattr(recipe, "quantize_linear_layers",
                        lambda model, device, dq, std=0.02: stand_in_4bit(model, dq, device))
    stand_in = real(cfg)  # real CPU tensors, the stand-in in place of bnb
    act_bnb = bnb.peak_allocated_mib - bnb.pre_step_mib
    act_si = stand_in.peak_allocated_mib - stand_in.pre_step_mib
    assert act_si == pytest.approx(act_bnb, rel=0.01)


def peak(**kw):
    return dry_run(ProbeConfig(**{**BASE, "rank": 16, **kw}))["peak_mib"]


def test_rank_dropout_and_dora_raise_the_prediction():
    base = peak()
    assert peak(rank=64) > base and peak(dropout=0.1) > base and peak(dora=True) > base


DEEP = str(DATA / "models" / "deep-llama.json")


def test_logits_to_keep_and_offload_lower_it():
    # logits_to_keep on a large-vocab model; offload on a deep one (per-layer activations dominate)
    big_vocab = dict(model="tiny-gemma3", seq_len=512, response_len=32)
    assert peak(**big_vocab) < peak(**big_vocab, fixes=parse_fixes("chunked_mlp,save_on_cpu,bf16_lm_head"))
    deep = dict(model=DEEP, seq_len=2048, response_len=64)
    assert peak(**deep) < peak(**deep, fixes=parse_fixes("chunked_mlp,bf16_lm_head,logits_to_keep"))


def test_same_config_twice_gives_the_same_bytes():
    a = dry_run(ProbeConfig(**BASE, rank=16))
    b = dry_run(ProbeConfig(**BASE, rank=16))
    for key in ("after_load_mib", "pre_step_mib", "peak_mib"):
        assert a[key] == b[key]


def test_vision_tower_is_modelled_for_multimodal_configs():
    assert 200 < vision_mib("gemma-3-4b-it", "4bit") < 240  # ~220 MiB: the program's after-load gap
    assert 780 < vision_mib("gemma-3-4b-it", "bf16") < 830
    assert vision_mib("tiny-llama", "4bit") == 0


def test_cli_appends_a_dry_run_kind(tmp_path, capsys):
    ledger = tmp_path / "l.json"
    ledger.write_bytes(SMALL.read_bytes())
    assert dry_main(["--model", "tiny-llama", "--rank", "8", "--seq-len", "256", "--response-len", "32",
                     "--ledger", str(ledger), "--gpu", "rx-7900-xtx", "--append", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    m = store.load(ledger).measurements[-1]
    assert m.kind == "dry_run" and m.id == doc["measurement"]["id"] and m.provenance.inferred
    assert m.gpu is None  # a dry run holds for every card; the card's terms are in the answer
    assert doc["breakdown"]["cublas_workspace_mib"] > 0
    a = doc["answer"]
    assert a["gpu"] == "rx-7900-xtx" and a["method"] == "dry run" and "remainder" in a["method_text"]
    assert a["reserved"]["mib"] > a["probe_allocated"]["mib"] > m.outcome.peak_allocated_mib


def test_find_ceiling_without_measurements(capsys):
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    outcome, _ = predict(ProbeConfig(**{**BASE, "rank": 64}))
    # Whatever rank 64 needs, calibrated as the command line calibrates it: the ceiling is 64.
    answer = Predictor(store.load(DEFAULT_LEDGER), load_dry_runs()).judge_dry(
        Recipe("tiny-llama", rank=64, seq_len=1024), outcome["peak_allocated_mib"])
    budget = answer.probe_allocated.high_mib
    assert dry_main(["--model", "tiny-llama", "--rank", "8", "--seq-len", "1024", "--response-len", "237",
                     "--fixes", "all", "--find-ceiling", "rank", "--budget-mib", str(budget + 0.01), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ceiling"] == 64 and doc["probes"] <= 14  # two bisections of 64 ranks: fits, then tight


def test_bad_input_is_one_line(capsys):
    assert dry_main(["--model", "nope.json", "--rank", "8"]) == 1
    assert capsys.readouterr().err.strip() == "dry_run: nope.json: no such config file"


@pytest.mark.parametrize("name,billions", [("gemma-3-4b-it", 3.88), ("gemma-3-1b-it", 1.0), ("gemma-3-12b-it", 11.77),
                                           ("llama-3.1-8b", 8.03), ("qwen2.5-7b", 7.62), ("mistral-7b", 7.25),
                                           ("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21), ("qwen2.5-0.5b", 0.49),
                                           ("qwen2.5-1.5b", 1.54), ("qwen2.5-3b", 3.09), ("qwen2.5-14b", 14.77),
                                           ("qwen3-4b", 4.02), ("qwen3-8b", 8.19), ("phi-3.5-mini", 3.82),
                                           # published: 70.6B, 32.8B, 72.7B, 14.8B, 32.8B, 27.4B (the text model
                                           # 27.0B, the vision tower the rest), 23.6B, 12.2B, 14.7B, 7.62B, 14.8B
                                           ("llama-3.3-70b", 70.55), ("qwen2.5-32b", 32.76), ("qwen2.5-72b", 72.71),
                                           ("qwen3-14b", 14.77), ("qwen3-32b", 32.76), ("gemma-3-27b-it", 27.01),
                                           ("mistral-small-24b", 23.57), ("mistral-nemo-12b", 12.25), ("phi-4", 14.66),
                                           ("deepseek-r1-distill-qwen-7b", 7.62),
                                           ("deepseek-r1-distill-qwen-14b", 14.77),
                                           # mixtures of experts, every expert counted: published 30.5B,
                                           # 21B (20.9B), 46.7B
                                           ("qwen3-30b-a3b", 30.53), ("gpt-oss-20b", 20.91),
                                           ("mixtral-8x7b", 46.70)])
def test_shipped_configs_have_the_published_sizes(name, billions):
    from ledger.vocab.model_configs import load_arch

    recipe.load_config(name)  # transformers accepts it
    assert load_arch(name).total_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_a_real_model_config_dry_runs_without_weights():
    d = dry_run(ProbeConfig(model="gemma-3-1b-it", random_weights=True, rank=16, seq_len=512, response_len=64))
    # 1B: 4-bit linears ~ 0.35 GiB + bf16 embedding 0.56 GiB after load; a step adds activations on top
    assert 800 < d["after_load_mib"] < 1100 and d["peak_mib"] > d["pre_step_mib"] > d["after_load_mib"]


def test_the_multimodal_class_is_chosen_from_the_config():
    from probe_kit.dry_run import loads_multimodal

    assert loads_multimodal("gemma-3-4b-it") and loads_multimodal("gemma-3-12b-it")
    assert not loads_multimodal("gemma-3-1b-it") and not loads_multimodal("tiny-llama")


def test_one_models_committed_grid_rows_are_rebuilt_on_the_cpu():
    """The fit table's rows of the smallest model, rebuilt here from the grid's points, are the
    committed ones (ledger/dry-runs.json): the table is reproducible from the repository. One
    point of each kind the grid has (quant x fixes x plain / dropout / DoRA: its shortest length),
    and the longest length of the first kind: the rest differ from these by length and rank alone."""
    from ledger.answer.fits import grid_points
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.vocab.model_configs import model_name
    from ledger.vocab.recipe import recipe_of
    from probe_kit.run_sweep import _config

    committed = {recipe_of(d): d for d in load_dry_runs() if model_name(d.model) == "qwen2.5-0.5b"
                 and d.outcome.status == "ok"}
    points = grid_points("qwen2.5-0.5b")
    assert len(committed) >= len(points)
    kinds: dict[tuple, list[int]] = {}
    for i, options in enumerate(points):
        kinds.setdefault(tuple(sorted((k, str(v)) for k, v in options.items()
                                      if k not in ("seq_len", "rank", "response_len"))), []).append(i)
    assert len(kinds) == 12  # 2 quants x 2 fixes x plain / dropout / DoRA
    first = next(iter(kinds.values()))
    chosen = sorted({min(at, key=lambda i: points[i]["seq_len"]) for at in kinds.values()}
                    | {max(first, key=lambda i: points[i]["seq_len"])})
    for i in chosen:
        options = points[i]
        cfg = _config({**options, "random_weights": True}, f"grid[{i}]")
        outcome, _ = predict(cfg)
        row = next(d for r, d in committed.items() if r == recipe_of(cfg.measurement(id="x", kind="dry_run")))
        assert outcome["peak_allocated_mib"] == pytest.approx(row.outcome.peak_allocated_mib, rel=0.001), options


def test_a_partial_fix_list_names_its_dry_run_and_label():
    """A comma list of fixes (what `vram estimate --fixes logits_to_keep` computes on demand) is
    spelled as its key in the dry run's id and in the progress label, not as a Python list."""
    from probe_kit.dry_run import dry_id

    cfg = ProbeConfig(model="tiny-llama", rank=8, seq_len=64, response_len=8, fixes=parse_fixes("logits_to_keep,save_on_cpu"))
    assert "-fixes-saveoncpu+logitstokeep-" in dry_id(cfg)
    assert cfg.label().endswith("64 tokens fixes save_on_cpu,logits_to_keep")
    assert "-fixes-none-" in dry_id(ProbeConfig(model="tiny-llama", rank=8, seq_len=64, response_len=8, fixes=[]))

"""Mixtures of experts, by the dry run: the real transformers classes (fused 3-D expert weights run
by grouped matmuls, a top-k router, the router's auxiliary loss when the config asks for it) under
fake tensors give the real CPU step's figures for tiny configs of three families, for LoRA on
attention only and on the experts (peft's ``target_parameters``), in 4-bit and bf16; the step's
memory does not depend on how the router spreads the tokens; the recipes peft cannot build are
refused in one line."""

from __future__ import annotations

import json

import pytest
from conftest import assert_dry_run_is_the_real_cpu_step

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from ledger.core.paths import MODEL_CONFIGS  # noqa: E402
from ledger.vocab.adapter import ALL_LINEAR  # noqa: E402
from probe_kit.dry_run import dry_run, main as dry_main  # noqa: E402
from probe_kit.probe_vram import run_probe  # noqa: E402
from probe_kit.recipe import ProbeConfig  # noqa: E402

ATTN = list(ALL_LINEAR[:4])


def config(model: str, **recipe) -> ProbeConfig:
    return ProbeConfig(model=model, random_weights=True, rank=8, seq_len=256, response_len=16,
                       **{"fixes": [], "target_modules": list(ALL_LINEAR), **recipe})


def with_aux_loss(tmp_path, name: str) -> str:
    """A shipped tiny config whose training adds the router's load-balancing loss."""
    data = json.loads((MODEL_CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    path = tmp_path / f"{name}-aux.json"
    path.write_text(json.dumps({**data, "output_router_logits": True, "router_aux_loss_coef": 0.01}), encoding="utf-8")
    return str(path)


CASES = [
    ("tiny-qwen3moe", dict(quant="4bit", optimizer="adamw_torch")),  # experts stay unquantised, cast to fp32
    ("tiny-qwen3moe", dict(quant="bf16", target_modules=ATTN)),
    ("tiny-mixtral", dict(quant="bf16", optimizer="adamw_torch")),
    ("tiny-mixtral", dict(quant="4bit", target_modules=ATTN, gradient_checkpointing=False)),
    ("tiny-gpt-oss", dict(quant="4bit", target_modules=ATTN, optimizer="adamw_torch")),
    ("tiny-gpt-oss", dict(quant="bf16", batch_size=2)),
    # the program's preset: the MoE block run in chunks of the sequence (gpt-oss's returns its router's scores too)
    ("tiny-gpt-oss", dict(quant="4bit", fixes=["chunked_mlp", "save_on_cpu", "bf16_lm_head", "logits_to_keep"],
                          mlp_chunk=64)),
    ("aux:tiny-qwen3moe", dict(quant="bf16")),
    ("aux:tiny-gpt-oss", dict(quant="4bit", target_modules=ATTN)),
]


@pytest.mark.parametrize("model,recipe", CASES)
def test_the_dry_run_is_the_real_cpu_step(tmp_path, model, recipe):
    if model.startswith("aux:"):
        model = with_aux_loss(tmp_path, model[4:])
    cfg = config(model, **recipe)
    assert_dry_run_is_the_real_cpu_step(cfg)


ROUTERS = {"tiny-qwen3moe": ("qwen3_moe", "Qwen3MoeTopKRouter"), "tiny-mixtral": ("mixtral", "MixtralTopKRouter"),
           "tiny-gpt-oss": ("gpt_oss", "GptOssTopKRouter")}


@pytest.mark.parametrize("model", sorted(ROUTERS))
def test_every_token_routed_to_the_same_experts_needs_what_the_dry_run_says(model, monkeypatch):
    """The uneven router's upper figure: every token sent to experts 0..k-1 (the scores still come
    from the router, so its gradients flow as in training). The experts' grouped matmuls take the
    routed pairs sorted by expert, so the step holds the same tensors as for any other routing."""
    import importlib

    module, name = ROUTERS[model]
    router = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    forward = router.forward
    seen: set[int] = set()

    def one_group(self, hidden_states):
        logits, scores, indices = forward(self, hidden_states)
        forced = torch.arange(indices.shape[-1], device=indices.device).expand_as(indices).contiguous()
        seen.update(forced.unique().tolist())
        return logits, scores, forced

    cfg = config(model, quant="bf16", optimizer="adamw_torch")
    spread = run_probe(cfg, device="cpu")[0].outcome
    dry = dry_run(cfg)["peak_mib"]
    monkeypatch.setattr(router, "forward", one_group)
    crowded = run_probe(cfg, device="cpu")[0].outcome
    top_k = json.loads((MODEL_CONFIGS / f"{model}.json").read_text(encoding="utf-8"))["num_experts_per_tok"]
    assert seen == set(range(top_k))  # the router really sent every token to the same experts
    assert crowded.peak_allocated_mib == pytest.approx(spread.peak_allocated_mib, abs=0.05)
    assert crowded.peak_allocated_mib == pytest.approx(dry, rel=0.01)


@pytest.mark.parametrize("argv,message", [
    (["--target-modules", "q_proj,gate_proj"], "--target-modules: this model's experts fuse gate_proj and up_proj "
                                               "into one weight (gate_up_proj): target both or neither"),
    (["--dropout", "0.1"], "LoRA on a mixture of experts' fused expert weights (peft's target_parameters) takes no "
                           "dropout"),
    (["--dora"], "takes no DoRA"),
])
def test_what_peft_cannot_build_is_one_line(capsys, argv, message):
    assert dry_main(["--model", "tiny-qwen3moe", "--rank", "8", "--seq-len", "128", "--response-len", "32", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err
    # attention only: dropout and DoRA are peft's usual modules
    if argv[0] != "--target-modules":
        assert dry_main(["--model", "tiny-qwen3moe", "--rank", "8", "--seq-len", "128", "--response-len", "32", "--target-modules",
                         "q_proj,k_proj,v_proj,o_proj", "--json", *argv]) == 0


def test_answering_commands_refuse_dropout_on_fused_experts_in_one_line(capsys):
    from ledger import cli

    assert cli.main(["estimate", "--model", "qwen3-30b-a3b", "--rank", "16", "--seq-len", "2048",
                     "--dropout", "0.1", "--budget-mib", "80000", "--no-compute"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("--dropout: LoRA on a mixture of experts' fused expert")
    # attention only: dropout is peft's usual; the answer needs dry runs of LoRA on attention
    assert cli.main(["estimate", "--model", "qwen3-30b-a3b", "--rank", "16", "--seq-len", "2048", "--dropout", "0.1",
                     "--target-modules", "attn", "--budget-mib", "80000", "--no-compute"]) == 1
    assert "dry runs not computed yet" in capsys.readouterr().err


def test_the_fit_table_of_a_mixture_of_experts_has_the_plain_adapter_only():
    from conftest import FROZEN
    from ledger.answer.fits import fit_table, grid_points
    from ledger.answer.predictor import Predictor
    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs

    assert not any(p.get("dropout") or p.get("dora") for p in grid_points("gpt-oss-20b"))
    assert any(p.get("dropout") for p in grid_points("qwen3-8b"))
    cells = fit_table(Predictor(store.load(FROZEN), load_dry_runs()), models=["gpt-oss-20b"], gpus=["h100-80gb"])
    assert {c.setting for c in cells} == {"plain"}
    bf16 = {c.seq_len: c for c in cells if c.quant == "bf16" and c.fixes == "none"}
    assert bf16[512].status == "ok" and bf16[512].fits_rank >= 8  # LoRA in bf16 fits an 80 GB card
    assert all(c.status == "none-fits" for c in cells if c.quant == "4bit" and c.fixes == "none")  # fp32 experts


def test_the_moe_board_scores_each_estimator_against_the_projects_dry_run():
    from conftest import FROZEN
    from ledger.answer.predictor import Predictor
    from ledger.report.dry_board import moe_board
    from ledger.report.estimators import MIB, UnslothStudio
    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.vocab.cards import resolve_card
    from ledger.vocab.model_configs import load_arch
    from ledger.vocab.recipe import Recipe

    p = Predictor(store.load(FROZEN), load_dry_runs())
    board = moe_board(p, estimators=[UnslothStudio()])
    assert board["recipes"] >= 30 and board["reference_card"] == "h100-80gb"
    (est,) = board["estimators"]
    assert est["n"] == board["recipes"] and set(est["slices"]["model"]) == {"qwen3-30b-a3b", "gpt-oss-20b",
                                                                         "mixtral-8x7b"}
    row = est["rows"][0]
    recipe = Recipe(model=row["model"], quant=row["quant"], rank=row["rank"], seq_len=row["seq_len"], fixes="none",
                    optimizer="adamw_torch")
    key, entry, _ = resolve_card(p.ledger, "h100-80gb")
    answer = p.predict(recipe, key, entry=entry, run="real")
    assert row["reference_mib"] == pytest.approx(answer.reserved.mib, abs=0.05)  # Unsloth predicts reserved
    assert row["estimate_mib"] == pytest.approx(UnslothStudio().estimate(load_arch(row["model"]), recipe).bytes / MIB,
                                                abs=0.05)
    assert row["error_pct"] == pytest.approx((row["estimate_mib"] - row["reference_mib"]) / row["reference_mib"] * 100,
                                             abs=0.01)


def test_a_step_past_what_any_device_holds_is_an_oom_with_its_figure(monkeypatch):
    """gpt-oss's eager attention at 131,072 tokens without checkpointing: the dry run's figure
    is past the ledger's 16 TiB bound, so the row records an OOM and the figure in words."""
    import probe_kit.dry_run as dry

    raw = {"after_load_mib": 39000.0, "pre_step_mib": 41000.0, "peak_mib": 2.0 ** 26, "vision_mib": 0.0, "oom": None,
           "seconds": 1.0, "rss_growth_mib": 0.0, "depth": {"method": "extrapolated"}}
    monkeypatch.setattr(dry, "dry_run", lambda *a, **k: dict(raw))
    cfg = config("tiny-gpt-oss", quant="bf16")
    outcome, _ = dry.predict(cfg)
    assert outcome["status"] == "oom" and outcome["peak_allocated_mib"] is None
    assert outcome["result_text"].startswith("the dry run's step needs 64.0 TiB allocated, past the 16 TiB")
    m = dry.measurement(cfg, outcome, {}, None, "dry-x")
    assert m.outcome.status == "oom" and m.outcome.pre_step_mib == 41000.0

"""Any model: a config path or folder, a Hub id in the local Hugging Face cache (no network), the
dry runs an answer lacks computed into the user's cache and reused while the config and the
libraries are the same; a mixture-of-experts config refused with its reason."""

from __future__ import annotations

import json
import shutil

from conftest import BUNDLED
from ledger import cli
from ledger.vocab.model_configs import CONFIG_DIR, config_path, load_arch, where_looked


def tiny_config(folder, name: str, **changes):
    """A user's config file: the shipped tiny Llama's, with ``changes``; (its path, the config)."""
    config = json.loads((CONFIG_DIR / "tiny-llama.json").read_text())
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**config, **changes}))
    return path, config


def hub_cache(root, model_id: str, config: dict, revision: str = "0123abcd") -> None:
    """A Hugging Face hub cache laid out as huggingface_hub lays it out."""
    repo = root / "hub" / ("models--" + model_id.replace("/", "--"))
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_a_hub_id_is_read_from_the_local_cache(tmp_path, monkeypatch):
    config = json.loads((CONFIG_DIR / "qwen2.5-7b.json").read_text())
    hub_cache(tmp_path, "Acme/Qwen-Like-7B", config)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    path = config_path("Acme/Qwen-Like-7B")
    assert path is not None and path.parent.name == "0123abcd"
    arch = load_arch("Acme/Qwen-Like-7B")
    assert arch.name == "qwen-like-7b" and arch.total_params == load_arch("qwen2.5-7b").total_params
    # HF_HUB_CACHE wins over HF_HOME, as huggingface_hub has it.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert config_path("Acme/Qwen-Like-7B") is None
    assert str(tmp_path / "elsewhere" / "models--Acme--Qwen-Like-7B") in where_looked("Acme/Qwen-Like-7B")


def test_a_model_it_cannot_find_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert cli.main(["estimate", "--probe", "--model", "Nobody/Nothing-1B", "--rank", "8", "--seq-len", "512"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "models--Nobody--Nothing-1B/snapshots" in err
    assert "huggingface-cli download Nobody/Nothing-1B config.json" in err


def test_a_config_folder_is_a_model(tmp_path):
    (tmp_path / "my-model").mkdir()
    shutil.copy(CONFIG_DIR / "tiny-llama.json", tmp_path / "my-model" / "config.json")
    assert load_arch(str(tmp_path / "my-model")).name == "my-model"


def test_a_mixture_of_experts_with_dense_layers_is_refused_with_its_reason(tmp_path, capsys):
    moe = tmp_path / "tiny-mixed.json"
    moe.write_text(json.dumps({**json.loads((CONFIG_DIR / "tiny-qwen3moe.json").read_text()), "mlp_only_layers": [0]}))
    assert cli.main(["ceiling", "--probe", "--ledger", str(BUNDLED), "--model", str(moe), "--seq-len", "512",
                     "--gpu", "RTX 4090"]) == 1
    err = capsys.readouterr().err
    assert "mixture-of-experts config the project does not model: its mlp_only_layers is [0]" in err
    assert len(err.strip().splitlines()) == 1


def test_a_length_past_the_grid_needs_dry_runs_and_no_compute_refuses(tmp_path, capsys):
    from ledger.storage import store

    argv = ["estimate", "--probe", "--ledger", str(BUNDLED), "--model", "llama-3.1-8b", "--rank", "16",
            "--seq-len", "28454", "--gpu", "RTX 4090", "--cache", str(tmp_path / "cache"), "--no-compute"]
    # The shipped grid reaches the model's context (131072 tokens): answered from its rows.
    assert cli.main(argv) == 0
    assert "vram-ledger: " in capsys.readouterr().out
    # Rows that stop at 16384 tokens: 28454 is past them.
    shipped = store.load(CONFIG_DIR.parent / "dry-runs.json")
    short = tmp_path / "short.json"
    store.save(shipped.model_copy(update={"measurements": [m for m in shipped.measurements if m.seq_len <= 16384]}),
               short)
    assert cli.main([*argv, "--dry-runs", str(short)]) == 1
    err = capsys.readouterr().err
    assert "needs 2 dry runs" in err and "without --no-compute" in err


def test_an_unlisted_model_is_answered_from_dry_runs_computed_once(tmp_path, capsys):
    mine, config = tiny_config(tmp_path, "my-tiny")
    cache = tmp_path / "cache"
    argv = ["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "256",
            "--gpu", "RTX 4060 Ti 16GB", "--cache", str(cache), "--json", "--probe"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "computing 2 dry runs of my-tiny at 256 tokens" in err and "about" in err
    first = json.loads(out)["answer"]
    assert first["method"] == "dry run" and first["verdict"] == "fits"
    rows = json.loads((cache / "dry-runs.json").read_text())["measurements"]
    assert len(rows) == 2 and all("/configs/" in r["model"] for r in rows)
    # The shipped rows are untouched.
    assert not any("my-tiny" in r["model"] for r in json.loads((CONFIG_DIR.parent / "dry-runs.json").read_text())
                   ["measurements"])
    # Asked again (another rank at the same length): nothing computed, the same rows answer.
    assert cli.main([*argv[:6], "32", *argv[7:]]) == 0
    out, err = capsys.readouterr()
    assert "computing" not in err and json.loads(out)["answer"]["method"] == "dry run"
    # The config edited: its old rows no longer describe it, so they are computed again.
    mine.write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "computing 2 dry runs" in err
    rows = json.loads((cache / "dry-runs.json").read_text())["measurements"]
    assert len({r["model"] for r in rows}) == 2 and len(rows) == 4
    assert json.loads(out)["answer"]["probe_allocated"]["mib"] > first["probe_allocated"]["mib"]


def test_the_shipped_mixtures_of_experts_are_answered_by_their_dry_runs(tmp_path, capsys):
    """Qwen3-30B-A3B in stock QLoRA: bitsandbytes quantises the attention's nn.Linear layers only,
    and peft's k-bit preparation casts the fused bf16 experts to fp32 — the dry run holds what
    that step holds, far past an 80 GB card; LoRA on attention in bf16 needs half of it."""
    from probe_kit import recipe

    recipe.load_config("qwen3-30b-a3b")  # transformers accepts it
    base = ["estimate", "--model", "qwen3-30b-a3b", "--rank", "16", "--seq-len", "1024", "--gpu", "H100 80GB",
            "--cache", str(tmp_path / "cache"), "--json"]
    assert cli.main([*base, "--quant", "4bit"]) == 0
    out, err = capsys.readouterr()
    assert "computing" not in err  # the shipped grid has its rows
    qlora = json.loads(out)["answer"]
    assert qlora["method"] == "dry run" and qlora["verdict"] == "won't fit"
    assert qlora["real_allocated"]["mib"] > 30.5e9 * 4 / 2**20  # every expert weight in fp32
    assert cli.main([*base, "--quant", "bf16", "--target-modules", "attn"]) == 0
    out, err = capsys.readouterr()
    assert "computing 2 dry runs of qwen3-30b-a3b at 1024 tokens" in err  # LoRA on attention: rows of its own
    bf16 = json.loads(out)["answer"]
    assert bf16["recipe"]["quant"] == "bf16"
    assert 30.5e9 * 2 / 2**20 < bf16["real_allocated"]["mib"] < qlora["real_allocated"]["mib"] / 1.8


def test_the_longest_sequence_at_a_rank_agrees_with_the_rank_ceiling_at_that_length(capsys):
    base = ["--ledger", str(BUNDLED), "--model", "qwen2.5-7b", "--gpu", "RTX 4090", "--json"]
    assert cli.main(["ceiling", "--probe", *base, "--rank", "16", "--no-compute"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["status"] == "ok" and c["fits_len"] and c["tight_len"] >= c["fits_len"] and not c["at_least"]
    assert c["lengths"][-1]["verdict"] == "won't fit"

    def verdict(seq: int) -> str:
        assert cli.main(["estimate", "--probe", *base, "--rank", "16", "--seq-len", str(seq), "--no-compute"]) == 0
        return json.loads(capsys.readouterr().out)["answer"]["verdict"]

    assert verdict(c["fits_len"]) == "fits"
    assert verdict(c["fits_len"] + c["step"]) != "fits"
    assert verdict(c["tight_len"] + c["step"]) == "won't fit"
    # The rank ceiling at the longest length that fits is rank 16 or more.
    assert cli.main(["ceiling", "--probe", *base, "--seq-len", str(c["fits_len"]), "--no-compute"]) == 0
    assert json.loads(capsys.readouterr().out)["fits_rank"] >= 16


def test_a_length_ceiling_computes_the_lengths_no_row_reaches(tmp_path, capsys):
    mine, _ = tiny_config(tmp_path, "short-tiny", max_position_embeddings=2048)
    argv = ["ceiling", "--probe", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "8", "--budget-mib", "200000",
            "--cache", str(tmp_path / "cache"), "--json"]
    assert cli.main([*argv, "--no-compute"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "unknown"
    assert not (tmp_path / "cache").exists()  # asking wrote nothing
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    c = json.loads(out)
    # Nothing fails under a huge budget: every ladder length up to the model's context is computed.
    assert [line.split(" at ")[1].split(" ")[0] for line in err.splitlines() if line.startswith("computing")] == \
        ["512", "1024", "2048"]
    assert c["fits_len"] == 2048 and c["at_least"] and c["unknown_from"] is None and "stops at 2048" in c["note"]


def test_fit_runs_an_unlisted_models_grid_once_and_takes_a_budget(tmp_path, capsys):
    mine, _ = tiny_config(tmp_path, "fit-tiny")
    argv = ["fit", "--ledger", str(BUNDLED), "--model", str(mine), "--budget-mib", "300", "--quant", "4bit",
            "--fixes", "none", "--cache", str(tmp_path / "cache"), "--json"]
    assert cli.main([*argv, "--no-compute"]) == 1
    assert "without --no-compute" in capsys.readouterr().err
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    # its context is 2048 tokens: rank 8 at 512 and 2048; rank 64, dropout and DoRA at both
    assert "computing 8 dry runs of fit-tiny's fit table" in err
    doc = json.loads(out)
    assert doc["gpu"] == "budget" and doc["limit_low_mib"] == 300 and "--budget-mib 300" in doc["limit_source"]
    assert all(c["method"] == "dry run" for c in doc["cells"]) and any(c["fits_rank"] for c in doc["cells"])
    assert cli.main(argv) == 0
    assert "computing" not in capsys.readouterr().err


def test_checkpointing_off_is_answered_by_its_own_dry_runs_never_by_rows_that_have_it_on(tmp_path, capsys):
    mine, _ = tiny_config(tmp_path, "ckpt-tiny")
    cache = tmp_path / "cache"
    base = ["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "256",
            "--gpu", "RTX 4060 Ti 16GB", "--cache", str(cache), "--real", "--json"]
    assert cli.main(base) == 0
    on = json.loads(capsys.readouterr().out)["answer"]
    assert cli.main([*base, "--no-gradient-checkpointing"]) == 0
    out, err = capsys.readouterr()
    assert "computing 2 dry runs" in err  # its own rows: the checkpointed ones do not answer it
    off = json.loads(out)["answer"]
    assert off["method"] == "dry run" and off["recipe"]["checkpointing"] is False
    assert off["real_allocated"]["mib"] > on["real_allocated"]["mib"]  # every layer's activations kept
    rows = json.loads((cache / "dry-runs.json").read_text())["measurements"]
    assert [r.get("gradient_checkpointing") is False for r in rows] == [False, False, True, True]
    # Asked again at another rank: the same rows answer, nothing computed.
    assert cli.main([*base[:6], "32", *base[7:], "--no-gradient-checkpointing", "--no-compute"]) == 0
    assert json.loads(capsys.readouterr().out)["answer"]["verdict"] != "unknown"


def test_a_measured_probe_never_answers_the_same_recipe_without_checkpointing():
    """The bundled ledger measured gemma-3-4b-it on the RTX 3070 Ti (checkpointing on): without
    checkpointing no measured row, real run or failure answers; only a dry run of it could."""
    from dataclasses import replace

    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import recipe_of

    ledger = store.load(BUNDLED)
    p = Predictor(ledger, load_dry_runs())
    probe = next(m for m in ledger.measurements if m.kind == "probe" and m.gpu == "rtx-3070-ti"
                 and m.outcome.status == "ok" and m.lora)
    recipe = recipe_of(probe)
    assert p.predict(recipe, probe.gpu).method == "measured probe"
    for run in ("probe", "real"):
        a = p.predict(replace(recipe, checkpointing=False), probe.gpu, run=run)
        assert a.verdict == "unknown" and a.evidence == [] and "checkpointing off" in a.method_text


def test_the_fixes_users_set_are_answered_by_dry_runs_of_their_own(tmp_path, capsys):
    """Liger's fused loss and TRL's offloading: `estimate` and `fit` compute the recipe's own dry
    runs (the stock rows never answer it), name it in the answer, and a fix that cannot run beside
    another is refused in one line."""
    import pytest

    pytest.importorskip("liger_kernel")
    pytest.importorskip("trl")
    mine, _ = tiny_config(tmp_path, "fix-tiny", vocab_size=8192)
    cache = tmp_path / "cache"
    base = ["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "1024",
            "--budget-mib", "400", "--cache", str(cache), "--json"]
    answers = {}
    for fixes in ("none", "fused_linear_ce", "activation_offloading"):
        assert cli.main([*base, "--fixes", fixes, "--no-gradient-checkpointing"]) == 0
        out, err = capsys.readouterr()
        assert "computing 2 dry runs" in err
        answers[fixes] = json.loads(out)["answer"]
        assert answers[fixes]["recipe"]["fixes"] == fixes and answers[fixes]["method"] == "dry run"
    stock = answers["none"]["real_allocated"]["mib"]
    assert answers["fused_linear_ce"]["real_allocated"]["mib"] < stock  # no logits of the whole sequence
    assert answers["activation_offloading"]["real_allocated"]["mib"] < stock  # activations in host RAM
    # The fit table of the fused loss: its own grid, every length computed at rank 8.
    argv = ["fit", "--ledger", str(BUNDLED), "--model", str(mine), "--budget-mib", "400", "--quant", "4bit",
            "--fixes", "fused_linear_ce", "--cache", str(cache), "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "dry runs of fix-tiny's fit table" in err
    doc = json.loads(out)
    assert {c["fixes"] for c in doc["cells"]} == {"fused_linear_ce"} and doc["optimizers"] == {"fused_linear_ce": "adamw_torch"}
    assert all(c["status"] != "unknown" for c in doc["cells"])
    assert cli.main([*argv[:-1], "--fixes", "fused_linear_ce,logits_to_keep"]) == 1
    assert "--fixes: fused_linear_ce cannot be combined with logits_to_keep" in capsys.readouterr().err
    # A micro-batch of 2 x 512 with the fused loss: as one sequence of 1,024 tokens (rows computed above).
    half = [*base[:8], "512", *base[9:]]
    assert cli.main([*half, "--fixes", "fused_linear_ce", "--no-gradient-checkpointing", "--batch-size", "2",
                     "--no-compute"]) == 0
    two = json.loads(capsys.readouterr().out)["answer"]
    assert two["verdict"] != "unknown" and "one sequence of 1024 tokens" in json.dumps(two)


def test_the_presets_micro_batch_is_answered_by_dry_runs_of_it(tmp_path, capsys):
    """A micro-batch with the program's preset is not one longer sequence: `estimate` computes dry
    runs of that micro-batch itself and `fit` the preset's grid at it; the micro-batch-1 rows never
    answer it."""
    mine, _ = tiny_config(tmp_path, "preset-tiny")
    cache = tmp_path / "cache"
    base = ["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "512",
            "--fixes", "all", "--budget-mib", "400", "--cache", str(cache), "--json"]
    assert cli.main([*base, "--batch-size", "2", "--no-compute"]) == 1
    assert "at micro-batch 2 x 512 tokens needs 2 dry runs not computed yet" in capsys.readouterr().err
    assert cli.main([*base, "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert "computing 2 dry runs of preset-tiny at micro-batch 2 x 512 tokens" in err
    two = json.loads(out)["answer"]
    assert two["verdict"] != "unknown" and "only dry runs of that micro-batch" in two["method_text"]
    rows = json.loads((cache / "dry-runs.json").read_text())["measurements"]
    assert {r.get("batch_size") for r in rows} == {2}
    assert cli.main(base) == 0  # micro-batch 1: its own rows, computed now
    assert "computing 2 dry runs of preset-tiny at 512 tokens" in capsys.readouterr().err
    assert cli.main([*base, "--no-gradient-checkpointing"]) == 0  # without checkpointing: its own rows too
    out, err = capsys.readouterr()
    assert "computing 2 dry runs of preset-tiny at 512 tokens" in err
    assert json.loads(out)["answer"]["verdict"] != "unknown"
    fit = ["fit", "--ledger", str(BUNDLED), "--model", str(mine), "--budget-mib", "400", "--quant", "4bit",
           "--fixes", "all", "--batch-size", "2", "--cache", str(cache), "--json", "--compute"]
    assert cli.main(fit) == 0  # --compute: the grid points of micro-batch 2 the two rows above leave
    out, err = capsys.readouterr()
    assert "dry runs of preset-tiny's fit table" in err
    assert all(c["status"] != "unknown" for c in json.loads(out)["cells"])


def test_without_the_probe_libraries_an_unlisted_model_names_the_extra_and_keeps_nothing(tmp_path, monkeypatch,
                                                                                          capsys):
    """The README's base install has no torch: the dry runs an answer needs are refused in one
    line naming the extra, never run to a crash, and nothing is cached."""
    import importlib.util

    mine, _ = tiny_config(tmp_path, "base-tiny")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "transformers", "peft") else found(name, *a))
    cache = tmp_path / "cache"
    assert cli.main(["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "256",
                     "--gpu", "rtx-4090", "--cache", str(cache)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[probe]'" in err and "torch, transformers, peft" in err
    assert not (cache / "dry-runs.json").exists()


def test_a_crashed_dry_run_is_never_kept_in_the_cache(tmp_path):
    """A crashed row would stop --resume from running its point again: the compute path removes
    the cache's crashed rows and says why they crashed."""
    from ledger.cli.compute import _drop_crashed
    from ledger.core.models import Measurement

    cache = tmp_path / "dry-runs.json"
    rows = json.loads((CONFIG_DIR.parent / "dry-runs.json").read_text())["measurements"][:2]
    crashed = {**rows[1], "id": rows[1]["id"] + "-crashed",
               "outcome": {"status": "crashed", "result_text": "the dry run failed: ImportError: no transformers"}}
    doc = {"schema_version": json.loads(BUNDLED.read_text())["schema_version"], "measurements": [rows[0], crashed]}
    Measurement.model_validate(crashed)
    cache.write_text(json.dumps(doc))
    assert _drop_crashed(cache) == [f"{crashed['id']}: the dry run failed: ImportError: no transformers"]
    left = json.loads(cache.read_text())["measurements"]
    assert [m["id"] for m in left] == [rows[0]["id"]]
    assert _drop_crashed(cache) == []


def test_fit_after_an_estimate_computes_the_grid_it_lacks_and_counts_the_optimizer(tmp_path, capsys):
    """An estimate's two dry runs at one length are not the fit table's grid: fit computes the rest
    (not "unknown" in most cells), and a user config's optimizer state is counted (the AdamW table
    lower than SGD's somewhere)."""
    mine, _ = tiny_config(tmp_path, "after-tiny")
    cache = str(tmp_path / "cache")
    assert cli.main(["estimate", "--ledger", str(BUNDLED), "--model", str(mine), "--rank", "16", "--seq-len", "512",
                     "--budget-mib", "300", "--cache", cache]) == 0
    capsys.readouterr()
    base = ["fit", "--ledger", str(BUNDLED), "--model", str(mine), "--budget-mib", "300", "--quant", "4bit",
            "--fixes", "none", "--cache", cache, "--json"]
    assert cli.main(base) == 0
    out, err = capsys.readouterr()
    assert "computing" in err
    adamw = json.loads(out)["cells"]
    assert all(c["status"] != "unknown" for c in adamw)
    assert cli.main([*base, "--optim", "sgd"]) == 0
    sgd = json.loads(capsys.readouterr().out)["cells"]
    assert any((a["tight_rank"] or 0) < (s["tight_rank"] or 0) for a, s in zip(adamw, sgd))

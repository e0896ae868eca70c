"""VRAM estimators: hand-computed cases from their write-ups, and the scoreboard."""

from __future__ import annotations

import json

import pytest

from conftest import FROZEN as BUNDLED
from ledger import cli
from ledger.storage import store
from ledger.report.estimators import FT01, GB, Canifinetune, UnslothStudio
from ledger.vocab.recipe import Recipe
from ledger.vocab.model_configs import Arch, load_arch
from ledger.report.scoreboard import scoreboard
from ledger.core.models import SCHEMA_VERSION, Ledger, Measurement, Outcome

# A small llama-shaped model whose arithmetic fits in a comment.
TOY = Arch(name="toy", hidden=1024, layers=2, heads=8, kv_heads=2, head_dim=128, intermediate=4096, vocab=32000,
           tied=False, family="llama")


def test_unsloth_studio_by_hand():
    # H=1024, L=2, V=32000, M=4096, r=8, S=512, B=1, K = (1024/8)*2 = 256.
    # QKVO = (1024+256+256+1024)*1024 = 2,621,440; MLP = 1024*4096*3 = 12,582,912
    # Quantizable = (2,621,440 + 12,582,912) * 2 = 30,408,704
    # Non-quantizable = 2*1024*2 + 32000*1024*2 (untied) = 65,540,096
    # weights (4-bit, double quant) = 30,408,704*2/3.6 + 65,540,096*2 = 16,893,724.4 + 131,080,192 = 147,973,916.4
    # LoRA params per layer: q 8*(1024+1024) + k,v 2*8*(1024+256) + o 8*2048 + gate,up 2*8*(1024+4096)
    #   + down 8*(4096+1024) = 16384 + 20480 + 16384 + 81920 + 40960 = 176,128; x2 layers = 352,256
    # LoRA bytes = 704,512; optimizer (adamw_8bit, 4 B) = 1,409,024
    # activations = (512*(1024+256+256) + 512*2 + 512*(4096+4096)) * 2 * 1.25 = 12,454,400
    # gradients = max(704,512, min(0.15*weights = 22,196,087.5, max(12,454,400, 1,409,024))) = 12,454,400
    # total = 147,973,916.4 + 704,512 + 1,409,024 + 12,454,400 + 12,454,400 + 1.4e9 = 1,574,996,252.4
    e = UnslothStudio().estimate(TOY, Recipe(model=None, quant="4bit", rank=8, seq_len=512))
    assert e.bytes == pytest.approx(1_574_996_252.4, rel=1e-9)
    assert e.predicts == "reserved"


# The toy as a mixture of experts: 4 experts of 1024 features a layer, 2 per token.
TOY_MOE = Arch(name="toy-moe", hidden=1024, layers=2, heads=8, kv_heads=2, head_dim=128, intermediate=1024,
               vocab=32000, tied=False, family="llama", experts=4, top_k=2)


def test_unsloth_studio_mixture_of_experts_by_hand():
    # Its write-up: MLP = H*M*3*E + E*H; the LoRA table's MLP modules x E. H=1024, M=1024, E=4, K=256.
    # QKVO = 2,621,440; MLP = 1024*1024*3*4 + 4*1024 = 12,587,008; quantizable = 15,208,448*2 = 30,416,896
    # weights (4-bit) = 30,416,896*2/3.6 + 131,080,192 = 16,898,275.6 + 131,080,192 = 147,978,467.6
    # LoRA per layer: attention 16384 + 20480 + 16384 = 53,248; MLP (gate,up 2*8*2048 + down 8*2048)*4
    #   = (32768 + 16384)*4 = 196,608; total 249,856 x 2 layers = 499,712
    # LoRA bytes = 999,424; optimizer (adamw_8bit, 4 B) = 1,998,848
    # activations = (512*1536 + 512*2 + 512*2048) * 2 * 1.25 = 4,590,080
    # gradients = max(999,424, min(0.15*weights = 22,196,770.1, max(4,590,080, 1,998,848))) = 4,590,080
    # total = 147,978,467.6 + 999,424 + 1,998,848 + 4,590,080 + 4,590,080 + 1.4e9 = 1,560,156,899.6
    e = UnslothStudio().estimate(TOY_MOE, Recipe(model=None, quant="4bit", rank=8, seq_len=512))
    assert e.bytes == pytest.approx(1_560_156_899.6, rel=1e-9)
    # every expert counted: 4 x the MLP weights and a router of E x H in the parameter count
    assert TOY_MOE.total_params == TOY.total_params - 2 * 3 * 1024 * 4096 + 2 * (3 * 1024 * 1024 * 4 + 4 * 1024)
    assert TOY_MOE.active_params == TOY_MOE.total_params - 2 * 3 * 1024 * 1024 * 2


@pytest.mark.skipif(not Canifinetune.available(), reason="canifinetune is not installed")
def test_canifinetune_is_told_the_experts():
    # Its write-up: expert adapters x num_local_experts; activations x num_experts_per_tok.
    dense = Canifinetune().estimate(TOY_MOE.__class__(**{**TOY_MOE.__dict__, "experts": 0, "top_k": 0}),
                                    Recipe(model=None, quant="bf16", rank=8, seq_len=512), gpu_total_mib=24 * 1024)
    moe = Canifinetune().estimate(TOY_MOE, Recipe(model=None, quant="bf16", rank=8, seq_len=512),
                                  gpu_total_mib=24 * 1024)
    assert moe.breakdown["activations"] > dense.breakdown["activations"]
    assert moe.breakdown["optimizer"] > dense.breakdown["optimizer"]


def test_ft01_by_hand():
    # params: linear per layer = q 1024*(8*128) + k,v 2*1024*(2*128) + o 1024*1024 + mlp 3*1024*4096
    #   = 1,048,576 + 524,288 + 1,048,576 + 12,582,912 = 15,204,352; x2 layers = 30,408,704
    # embeddings (untied) = 2*32000*1024 = 65,536,000; norms = (4*1024 + 2*128)*2 + 1024 = 9,728
    # total = 95,954,432; 4-bit weights = 47,977,216 B; range +6 GB .. +10 GB (decimal GB), midpoint +8 GB
    e = FT01().estimate(TOY, Recipe(model=None, quant="4bit", rank=8, seq_len=512))
    assert TOY.total_params == 95_954_432
    assert (e.low_bytes, e.high_bytes) == (47_977_216 + 6 * GB, 47_977_216 + 10 * GB)
    assert e.bytes == 47_977_216 + 8 * GB
    bf16 = FT01().estimate(TOY, Recipe(model=None, quant="bf16", rank=8, seq_len=512))
    assert (bf16.low_bytes, bf16.high_bytes) == (2 * 95_954_432 * 2, 3 * 95_954_432 * 2)


@pytest.mark.skipif(not Canifinetune.available(), reason="canifinetune is not installed")
def test_canifinetune_logits_chain_by_hand():
    # Its write-up: logits = s * b * vocab * (2 + 12) bytes; for the toy at s=512: 512*32000*14 = 229,376,000 B.
    e = Canifinetune().estimate(TOY, Recipe(model=None, quant="4bit", rank=8, seq_len=512), gpu_total_mib=24 * 1024)
    assert e.breakdown["logits"] == pytest.approx(229_376_000, rel=1e-3)
    # Its 8% CUDA overhead of the card: 0.08 * 24 GiB.
    assert e.breakdown["cuda_overhead"] == pytest.approx(0.08 * 24 * 2**30, rel=1e-3)
    assert e.predicts == "reserved"


def test_shipped_config_is_read():
    a = load_arch("unsloth/gemma-3-4b-it")
    assert (a.hidden, a.layers, a.vocab, a.tied) == (2560, 34, 262208, True)
    assert a.total_params == pytest.approx(3.88e9, rel=0.01)


@pytest.fixture(scope="module")
def board():
    return scoreboard(store.load(BUNDLED))


def test_scoreboard_counts_match_the_ledger(board):
    lg = store.load(BUNDLED)
    addressable = [m for m in lg.measurements if m.kind in ("probe", "real") and m.lora and m.quant in ("4bit", "bf16")
                   and (m.seq_len or (m.dataset and m.dataset.longest_example_tokens))
                   and m.outcome.status in ("ok", "oom", "spilled") and m.model]
    assert board["addressable"] == len(addressable) == 44
    ok = [m for m in addressable if m.outcome.status == "ok"]
    by = {e["name"]: e for e in board["estimators"]}
    for name in ("unsloth-studio", "ft01") + (("canifinetune",) if Canifinetune.available() else ()):
        assert by[name]["n"] == len(ok)
        assert sum(by[name]["confusion"].values()) == len(addressable)
        assert sum(v["n"] for v in by[name]["slices"]["kind"].values()) == len(ok)
    assert 0 < by["vram-ledger"]["n"] <= len(ok)


def test_vram_ledger_beats_the_formulas_here(board):
    by = {e["name"]: e["median_abs_err_pct"] for e in board["estimators"]}
    assert by["vram-ledger"] < by["unsloth-studio"] < by["ft01"]


def test_no_addressable_rows_gives_an_empty_scoreboard():
    lg = Ledger(schema_version=SCHEMA_VERSION, measurements=[Measurement(id="a", kind="load", outcome=Outcome())])
    b = scoreboard(lg)
    assert b["addressable"] == 0
    assert all(e["n"] == 0 and e["median_abs_err_pct"] is None for e in b["estimators"])


def test_estimate_cli(capsys):
    assert cli.main(["estimate", "--probe", "--model", "unsloth/gemma-3-4b-it", "--rank", "16", "--seq-len", "7177",
                     "--gpu", "RX 7900 XTX", "--ledger", str(BUNDLED), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [e["estimator"] for e in doc["estimates"]]
    assert names == ["canifinetune", "unsloth-studio", "ft01"]
    assert doc["nearest_measurement"]["id"] == "rx-7900-xtx-4bit-fixes-all-r16-seq7177"
    assert cli.main(["estimate", "--probe", "--model", "nope", "--rank", "16", "--seq-len", "7177"]) == 1
    assert "--model: no config for nope: looked in" in capsys.readouterr().err


def test_dry_run_rows_join_the_scoreboard():
    from ledger.core.models import Lora, Provenance

    lg = store.load(BUNDLED)
    probe = next(m for m in lg.measurements if m.id == "rx-7900-xtx-4bit-fixes-all-r16-seq7177")
    lg.measurements.append(Measurement(
        id="dry-r16", kind="dry_run", model="gemma-3-4b-it", quant="4bit", lora=Lora(rank=16, dropout=0.0),
        seq_len=7177, response_len=237, memory_fixes="all", outcome=Outcome(status="ok", peak_allocated_mib=5551.5),
        provenance=Provenance(inferred=True)))
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor

    dry_rows = [m for m in load_dry_runs() if m.seq_len != 7177 or m.lora.rank != 16 or m.memory_fixes != "all"
                or m.quant != "4bit" or m.lora.dora or m.lora.dropout]
    b = scoreboard(lg, dry_runs=dry_rows)
    dry = next(e for e in b["estimators"] if e["name"] == "dry-run")
    (row,) = [r for r in dry["rows"] if r["id"] == probe.id]
    # The ledger's own dry-run row, plus the card's remainder fitted without the probe scored.
    held_out = Predictor(lg, dry_rows, exclude=[probe.id])
    rem, _ = held_out.remainder(probe.gpu, "amd")
    assert row["estimate_mib"] == pytest.approx(5551.5 + rem, abs=0.1)
    assert abs(row["error_pct"]) < 3
    assert b["addressable"] == 44  # the dry run itself is not a measured row


def test_the_allocator_simulated_joins_the_scoreboard_on_rows_that_measured_reserved():
    import math

    from ledger.core.models import Lora, Provenance, SimulatedAllocator
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor

    lg = store.load(BUNDLED)
    probe = next(m for m in lg.measurements if m.id == "rx-7900-xtx-4bit-fixes-all-r16-seq7177")
    assert probe.outcome.peak_reserved_mib
    sim = SimulatedAllocator(peak_allocated_mib=5551.5, peak_reserved_mib=6580.0, oom_below_mib=6578.0)
    lg.measurements.append(Measurement(
        id="dry-r16", kind="dry_run", model="gemma-3-4b-it", quant="4bit", lora=Lora(rank=16, dropout=0.0),
        seq_len=7177, response_len=237, memory_fixes="all",
        outcome=Outcome(status="ok", peak_allocated_mib=5551.5, allocator=sim), provenance=Provenance(inferred=True)))
    dry_rows = [m for m in load_dry_runs() if m.seq_len != 7177 or m.lora.rank != 16 or m.memory_fixes != "all"
                or m.quant != "4bit" or m.lora.dora or m.lora.dropout]
    b = scoreboard(lg, dry_runs=dry_rows)
    est = next(e for e in b["estimators"] if e["name"] == "allocator-sim")
    assert est["predicts"] == "reserved"
    (row,) = [r for r in est["rows"] if r["id"] == probe.id]
    # The simulated reserved with the card's remainder, fitted without the probe, held in a
    # segment of its own (rounded up to 2 MiB), against the probe's measured peak reserved.
    rem, _ = Predictor(lg, dry_rows, exclude=[probe.id]).remainder(probe.gpu, "amd")
    assert rem > 10
    assert row["estimate_mib"] == pytest.approx(6580.0 + math.ceil(rem / 2) * 2, abs=0.1)  # (sim allocated = dry's)
    assert row["measured_quantity"] == "reserved" and row["measured_mib"] == probe.outcome.peak_reserved_mib
    # Only rows that measured a reserved figure are scored.
    ids = {r["id"] for r in est["rows"]}
    assert all(next(m for m in lg.measurements if m.id == i).outcome.peak_reserved_mib for i in ids)


def test_estimate_json_keys_name_the_unit_they_hold(capsys):
    assert cli.main(["estimate", "--probe", "--model", "gemma-3-4b-it", "--rank", "16", "--seq-len", "7177", "--ledger",
                     str(BUNDLED), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for e in doc["estimates"]:
        for key in e.get("breakdown_mib", {}):
            assert not key.endswith(("_gb", "_gib", "_bytes")), (e["estimator"], key)


def test_the_nearest_measured_row_is_on_the_requested_card(capsys):
    assert cli.main(["estimate", "--probe", "--model", "gemma-3-4b-it", "--rank", "96", "--seq-len", "7177", "--dropout", "0.1",
                     "--gpu", "rtx-3070-ti", "--ledger", str(BUNDLED), "--json"]) == 0
    near = json.loads(capsys.readouterr().out)["nearest_measurement"]
    assert near["gpu"] == "rtx-3070-ti"


def test_this_projects_verdict_never_says_fits_for_a_row_that_ran_out_of_memory():
    board = scoreboard(store.load(BUNDLED))
    own = next(e for e in board["estimators"] if e["name"] == "vram-ledger")
    c = own["confusion"]
    assert c["fits_but_oom"] == 0 and c["oom_and_oom"] > 0  # the costly cell is empty; OOMs are caught


def test_the_scoreboard_on_arrays_is_the_per_row_loops():
    """Above ``keep_rows`` rows an estimator that answers from the recipe alone is scored on arrays
    (each distinct question once): every figure (counts, medians overall and per slice, the
    confusion) is what the per-row loop gives with the rows kept, on the bundled ledger (every
    estimator, dry-run rows and ours among them), a synthetic and a cloned one, and a ledger with
    rows of unknown cards, zero and missing figures and OOMs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from synthetic import realistic_ledger, synthetic_ledger

    from ledger.report.estimators import ESTIMATORS

    def figures(board: dict) -> dict:
        return {**board, "estimators": [{k: v for k, v in e.items() if k not in ("rows", "rows_kept")}
                                        for e in board["estimators"]]}

    odd = synthetic_ledger(300, seed=4)
    rows = odd.measurements
    for i, m in enumerate(rows[:60]):
        if i % 3 == 0:
            rows[i] = m.model_copy(update={"gpu": None})
        elif i % 3 == 1:
            rows[i] = m.model_copy(update={"outcome": m.outcome.model_copy(update={"peak_allocated_mib": 0.0,
                                                                                    "peak_reserved_mib": None})})
        else:
            rows[i] = m.model_copy(update={"outcome": m.outcome.model_copy(update={"status": "oom"})})
    cases = [(store.load(BUNDLED), None), (synthetic_ledger(400, seed=1), ESTIMATORS),
             (realistic_ledger(500), ESTIMATORS), (odd, ESTIMATORS)]
    for ledger, estimators in cases:
        kept = scoreboard(ledger, estimators, keep_rows=10**6)
        arrays = scoreboard(ledger, estimators, keep_rows=0)
        assert all(e["rows_kept"] for e in kept["estimators"] if e["skipped"] is None)
        assert not any(e["rows"] for e in arrays["estimators"])
        assert figures(arrays) == figures(kept)
        assert sum(e["n"] for e in arrays["estimators"]) > 0


def test_an_answers_reserved_figure_is_its_dry_runs_simulated_allocator_where_the_row_has_one():
    from ledger.core.models import Lora, Provenance, SimulatedAllocator
    from ledger.fit.dry_calibration import simulated_reserved
    from ledger.storage.dry_runs import load_dry_runs
    from ledger.answer.predictor import Predictor
    from ledger.vocab.recipe import Recipe

    lg = store.load(BUNDLED)
    sim = SimulatedAllocator(peak_allocated_mib=5560.0, peak_reserved_mib=6600.0, oom_below_mib=6050.0)
    same = lambda m: (m.seq_len == 7177 and m.lora.rank == 16 and m.memory_fixes == "all" and m.quant == "4bit"  # noqa: E731
                      and not m.lora.dora and not m.lora.dropout and m.response_len == 237)
    dry_rows = [m for m in load_dry_runs() if not same(m)]
    dry_rows.append(Measurement(
        id="dry-r16", kind="dry_run", model="gemma-3-4b-it", quant="4bit", lora=Lora(rank=16, dropout=0.0),
        seq_len=7177, response_len=237, memory_fixes="all",
        outcome=Outcome(status="ok", peak_allocated_mib=5551.5, allocator=sim), provenance=Provenance(inferred=True)))
    p = Predictor(lg, dry_rows)
    recipe = Recipe(model="gemma-3-4b-it", quant="4bit", rank=16, seq_len=7177, response_len=237, fixes="all")
    a = p.predict(recipe, "rtx-3060-ti")
    iv = a.probe_allocated
    assert a.reserved.mib == round(simulated_reserved(sim, iv.mib), 1)
    assert a.reserved.high_mib == round(simulated_reserved(sim, iv.high_mib), 1)
    # A recipe whose row has no simulation: the card's reserved/allocated ratio, as before.
    assert p.table.simulated(recipe.replace(rank=40)) is None
    other = p.predict(recipe.replace(rank=40), "rtx-3060-ti")
    ratio = p.reserved_ratio("rtx-3060-ti")
    assert other.reserved.mib == pytest.approx(other.probe_allocated.mib * ratio[0], abs=0.2)

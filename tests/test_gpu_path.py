"""The GPU path, exercised on the CPU by simulating what a card returns: a card already in the
ledger, the exit code of a crash, raw allocation OOMs, spilling, the selected device, the doctor's
process matching, the callback under DDP and across devices, and building a 4-bit model without
holding it whole in host RAM."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import types

import pytest
import torch

from conftest import SMALL
from ledger.storage import store
from ledger.core.models import Gpu, Provenance
from probe_kit import doctor, probe_vram, recipe, run_sweep
from probe_kit.probe_vram import EXIT_CRASHED, EXIT_REFUSED, card_entry, run_probe, spill_status
from probe_kit.recipe import ProbeConfig, RecipeError

BASE = ["--model", "tiny-llama", "--random-weights", "--rank", "8", "--seq-len", "128", "--response-len", "16",
        "--device", "cpu"]


def fake_props(name="NVIDIA GeForce RTX 3070 Ti", total=8 * 2**30, bus=1):
    return types.SimpleNamespace(name=name, total_memory=total, pci_bus_id=bus, pci_domain_id=0, pci_device_id=0)


# 1. a card already in the ledger never blocks a measurement -------------------------------------


def test_a_probe_saves_when_its_card_is_already_in_the_ledger(tmp_path, monkeypatch):
    ledger = tmp_path / "l.json"
    ledger.write_bytes(SMALL.read_bytes())
    old_card = store.load(ledger).gpus["rtx-3070-ti"]
    real_run_probe = probe_vram.run_probe

    def on_a_card(cfg, **kw):  # what run_probe returns on a GPU: today's card entry, other content
        m, _ = real_run_probe(cfg, **{**kw, "device": "cpu"})
        m.gpu = "rtx-3070-ti"
        return m, card_entry(fake_props(), None, None, "2.13.0+cu130", "13.0")

    monkeypatch.setattr(probe_vram, "run_probe", on_a_card)
    assert probe_vram.main(BASE + ["--ledger", str(ledger), "--id", "p1"]) == 0
    after = store.load(ledger)
    assert after.gpus["rtx-3070-ti"] == old_card  # kept as it was
    assert after.measurements[-1].id == "p1" and after.measurements[-1].gpu == "rtx-3070-ti"
    # A new card is added with its entry.
    monkeypatch.setattr(probe_vram, "run_probe", lambda cfg, **kw: (
        real_run_probe(cfg, **{**kw, "device": "cpu"})[0].model_copy(update={"gpu": "rtx-4090", "id": "p2"}),
        card_entry(fake_props("NVIDIA GeForce RTX 4090", 24 * 2**30), None, None, "2.13.0", "13.0")))
    assert probe_vram.main(BASE + ["--ledger", str(ledger)]) == 0
    assert store.load(ledger).gpus["rtx-4090"].total_mib == 24576.0


# 2. exit codes: refused input is 1, a crash is 70; raw allocation OOMs are OOMs ------------------


def test_a_crash_is_exit_70_with_its_traceback_and_refused_input_is_1(monkeypatch, capsys):
    def device_side_assert(*a, **k):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(recipe, "step", device_side_assert)
    assert probe_vram.main(BASE) == EXIT_CRASHED == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "device-side assert" in err and "probe_vram: crashed" in err
    assert probe_vram.main(BASE[:3] + ["--rank", "0", "--device", "cpu"]) == EXIT_REFUSED == 1


@pytest.mark.parametrize("text", ["CUDA error: out of memory", "HIP error: out of memory",
                                  "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"])
def test_a_raw_allocation_failure_is_an_oom(monkeypatch, text):
    def raw_oom(*a, **k):
        raise RuntimeError(text)

    monkeypatch.setattr(recipe, "step", raw_oom)
    m, _ = run_probe(ProbeConfig(model="tiny-llama", random_weights=True, rank=8, seq_len=128, response_len=16))
    assert m.outcome.status == "oom" and m.outcome.oom.message.endswith(text.split("CUDA error: ")[-1].split(
        "HIP error: ")[-1]) and m.outcome.peak_allocated_mib is None


def _sweep(tmp_path, device="cpu"):
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(f"""
        [sweep]
        device = "{device}"
        timeout_s = 60
        [base]
        model = "tiny-llama"
        random_weights = true
        seq_len = 128
        response_len = 16
        [axes]
        rank = [8]
    """))
    return run_sweep.load_sweep(str(path))


@pytest.mark.parametrize("code,status", [(1, "error"), (70, "crashed"), (3, "crashed")])
def test_the_sweep_tells_refused_input_from_a_crash(tmp_path, code, status):
    sweep = _sweep(tmp_path)
    ledger = tmp_path / "l.json"
    child = [sys.executable, "-c", f"import sys; sys.stderr.write('RuntimeError: CUDA error: an illegal memory access "
                                   f"was encountered\\n'); sys.exit({code})"]
    result = run_sweep.run_point(sweep.points[0], sweep, str(ledger), command=lambda *a: child)
    assert result.status == status
    if status == "error":
        assert not ledger.exists()  # refused: nothing recorded, --resume runs it again
    else:
        (m,) = store.load(ledger).measurements
        assert m.outcome.status == "crashed" and "illegal memory access" in m.outcome.result_text


def test_a_crash_never_counts_as_does_not_fit():
    points = list(range(4))
    with pytest.raises(run_sweep.CeilingUnknown):
        run_sweep.find_ceiling(points, lambda p: run_sweep.fits("crashed", types.SimpleNamespace(id=f"p{p}")))
    assert run_sweep.fits("ok", None) and not run_sweep.fits("oom", None)


def test_a_crash_on_a_gpu_sweep_is_filed_under_the_cards_key(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path, device="cuda")
    ledger = tmp_path / "l.json"
    key, gpu = card_entry(fake_props("NVIDIA H200", 141 * 2**30), None, None, "2.13.0", "13.0")
    monkeypatch.setattr(run_sweep, "card_of", lambda sw: (key, gpu))
    child = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    assert run_sweep.run_point(sweep.points[0], sweep, str(ledger), command=lambda *a: child).status == "crashed"
    lg = store.load(ledger)
    assert lg.measurements[0].gpu == key and lg.gpus[key].name == "NVIDIA H200"
    assert lg.measurements[0].environment.device == "cuda"


def test_without_a_gpu_the_card_of_a_cuda_sweep_is_unknown_not_invented(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    run_sweep._CARDS.clear()
    assert run_sweep.card_of(_sweep(tmp_path, device="cuda")) is None


# 4. spilling starts past the memory free at the start ---------------------------------------------


def test_spilled_compares_with_free_memory_at_the_start():
    assert spill_status(7000.0, 7400.0) is None  # fits in what was free
    assert spill_status(7500.0, 7400.0) == "spilled"  # past what was free, under the card's total
    assert spill_status(7500.0, 7400.0, reserved_at_start_mib=200.0) is None
    assert spill_status(None, 7400.0) is None and spill_status(7500.0, None) is None


# 7. the selected device is made current -----------------------------------------------------------


def test_the_probed_device_is_made_current_before_anything_runs(monkeypatch):
    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: fake_props())
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (7 * 2**30, 8 * 2**30))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: None)

    def build(cfg, dev):
        calls.append(("build", str(dev)))
        raise RecipeError("stop here")

    monkeypatch.setattr(recipe, "build_model", build)
    with pytest.raises(RecipeError, match="stop here"):
        run_probe(ProbeConfig(model="tiny-llama", random_weights=True, rank=8, seq_len=128, response_len=16),
                  device="cuda:1")
    assert calls == [("set_device", "cuda:1"), ("build", "cuda:1")]


# 5. the doctor ------------------------------------------------------------------------------------


def _fake_tool(folder, name, script):
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_doctor_matches_processes_to_cards_by_bus_id(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "nvidia-smi", textwrap.dedent(f"""\
        case "$*" in
          *query-compute-apps*) printf '00000000:01:00.0, 4242, python, 550\\n00000000:02:00.0, 5151, other, 900\\n\
00000000:01:00.0, {os.getpid()}, me, 300\\n' ;;
          *query-gpu*) printf '00000000:01:00.0, 1200, 8192\\n00000000:02:00.0, 900, 24576\\n' ;;
        esac
        """))
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda i: fake_props(bus=1) if i == 0 else fake_props("NVIDIA GeForce RTX 4090", 24 * 2**30, 2))

    def no_context(*a, **k):
        raise AssertionError("the doctor must not create a CUDA context (mem_get_info)")

    monkeypatch.setattr(cuda, "mem_get_info", no_context)
    report = doctor.diagnose()
    g0, g1 = report["gpus"]
    assert g0["pci_bus_id"] == "00000000:01:00.0" and [p["pid"] for p in g0["other_processes"]] == [4242]
    assert [p["pid"] for p in g1["other_processes"]] == [5151]  # bus 0x02 is not bus 0x01
    assert g0["free_mib"] == 8192 - 1200
    held = [w for w in report["warnings"] if "held by other processes" in w]
    assert len(held) == 2 and "550 MiB" in held[0] and str(os.getpid()) not in held[0]


def test_doctor_reports_a_failing_vendor_tool_instead_of_reading_it(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate'; exit 9\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    warnings: list[str] = []
    assert doctor.nvidia_processes(warnings) == []
    assert warnings == ["nvidia-smi exited 9: NVIDIA-SMI has failed because it could not communicate"]


def test_rocm_driver_version_and_processes_from_rocm_smi_json(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "rocm-smi", textwrap.dedent("""\
        case "$*" in
          *showdriverversion*) echo '{"system": {"Driver version": "6.8.5"}}' ;;
          *showpids*) echo '{"system": {"PID7777": "python, 1, 4294967296, 0, unknown"}}' ;;
        esac
        """))
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert doctor.rocm_driver_version() == "6.8.5"
    assert doctor.rocm_processes() == [{"bus_id": None, "pid": 7777, "name": "python", "used_mib": 4096.0}]


def test_bus_ids_compare_across_tools():
    assert doctor.bus_id(fake_props(bus=0x41)) == "00000000:41:00.0"
    assert doctor.same_bus("00000000:41:00.0", "0000:41:00.0") and not doctor.same_bus("0000:41:00.0", "0000:01:00.0")
    assert doctor.bus_id(types.SimpleNamespace()) is None


# 6. the callback: main process only, every device that holds parameters ---------------------------


def test_the_callback_writes_only_from_the_main_process(tmp_path):
    import io

    from probe_kit.callback import VramLedgerCallback

    ledger = tmp_path / "l.json"
    ledger.write_bytes(SMALL.read_bytes())
    before = ledger.read_bytes()
    out = io.StringIO()
    cb = VramLedgerCallback(ledger=str(ledger), stream=out, gpu="rtx-3070-ti", rank=8)
    state = types.SimpleNamespace(is_world_process_zero=False, global_step=5)
    cb.on_train_begin(None, state, None, model=torch.nn.Linear(2, 2))
    cb.on_train_end(None, state, None)
    assert out.getvalue() == "" and ledger.read_bytes() == before


def test_the_callback_reports_each_device_that_holds_parameters(monkeypatch):
    from probe_kit.callback import VramLedgerCallback

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: fake_props())
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d: (1000 + 500 * d) * 2**20)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d: (1200 + 500 * d) * 2**20)
    cb = VramLedgerCallback()
    params = [types.SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1, 1)]
    cb.model = types.SimpleNamespace(parameters=lambda: iter(params))
    doc = cb._figures()
    assert doc["peak_allocated_mib"] == 1000.0 and doc["per_device_peak_mib"] == {"cuda:0": 1000.0, "cuda:1": 1500.0}


# 8 and 9. random-weight 4-bit models: built layer by layer; Params4bit knows its module ------------


def test_a_random_weight_4bit_model_is_never_whole_in_bf16_in_memory(tmp_path):
    from probe_kit.meters import MIB, TrackerMeter

    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
    path = tmp_path / "medium-llama.json"
    path.write_text(json.dumps(config))
    linear_bf16_mib = 8 * (4 * 1024 * 1024 + 3 * 1024 * 4096) * 2 / MIB  # 256 MiB, what the old build held
    with TrackerMeter() as meter:
        model = recipe.build_model(ProbeConfig(model=str(path), random_weights=True, rank=8, seq_len=128,
                                               response_len=16), torch.device("cpu"))
    # The quantised model plus about one layer's bf16 weight and its quantisation temporaries.
    assert meter.allocated_mib() < 0.35 * linear_bf16_mib
    assert meter.peak_allocated_mib() < 0.5 * linear_bf16_mib, (meter.peak_allocated_mib(), meter.allocated_mib())
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.module is q and q.weight.quant_state is not None
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_tied_embeddings_stay_tied_after_a_meta_build():
    model = recipe.build_model(ProbeConfig(model="tiny-gemma3", random_weights=True, rank=8, seq_len=64,
                                           response_len=8), torch.device("cpu"))
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


# 3. the environment a probe records ----------------------------------------------------------------


def test_environment_fields_are_in_the_schema_and_round_trip():
    from ledger.core.models import Environment, Outcome

    env = Environment(device="cuda:0", meter="allocator", cublas_workspace_mib=8.1, cublaslt_workspace_mib=32.0,
                      sdpa_backends=["flash", "mem_efficient", "math"], alloc_conf="PYTORCH_CUDA_ALLOC_CONF=x")
    assert Environment.model_validate_json(env.model_dump_json(), strict=True) == env
    out = Outcome(status="ok", peak_allocated_mib=1.0, free_at_start_mib=7400.0, outside_allocator_mib=420.0)
    assert Outcome.model_validate_json(out.model_dump_json(), strict=True) == out
    assert probe_vram.alloc_conf() == (f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}"
                                       if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else probe_vram.alloc_conf())


def test_card_entry_from_device_properties():
    key, gpu = card_entry(fake_props("AMD Radeon RX 7900 XTX", 24 * 2**30), None, "6.4", "2.13.0+rocm6.4")
    assert key == "amd-radeon-rx-7900-xtx" or key.endswith("7900-xtx")
    assert gpu.vendor == "amd" and gpu.total_mib == 24576.0 and gpu.usable_gib_torch == 24.0
    assert "HIP 6.4" in gpu.stack and isinstance(gpu.provenance, Provenance) and isinstance(gpu, Gpu)
    assert json.loads(gpu.model_dump_json())["name"] == "AMD Radeon RX 7900 XTX"

"""probe_kit.allocator: the CUDA caching allocator's model, rule by rule as the source states them,
and a dry run's recorded trace replayed through it (the replay's allocated bytes are the tracker's,
to the byte)."""

from __future__ import annotations

import pytest

from probe_kit.allocator import (
    EMPTY_CACHE,
    RESET_PEAK,
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    MIB,
    AllocConf,
    AllocConfError,
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    oom_capacity,
    replay,
    round_size,
)


def test_rounding_and_segment_sizes():
    d = AllocConf()
    assert round_size(1, d) == 512 and round_size(513, d) == 1024 and round_size(4096, d) == 4096
    four = AllocConf(roundup_power2_divisions=4)
    # 1,200,000 lies between 2^20 and 2^21: divisions of 262,144 bytes
    assert round_size(1_200_000, four) == 1_310_720 and round_size(2**20, four) == 2**20
    assert round_size(1000, four) == 1024  # at most 512 x 4: plain 512-byte rounding
    assert allocation_size(MIB) == K_SMALL_BUFFER and allocation_size(MIB + 1) == K_LARGE_BUFFER
    assert allocation_size(10 * MIB) == 10 * MIB and allocation_size(11 * MIB + 1) == 12 * MIB


def test_small_requests_share_a_2_mib_segment_and_large_ones_split_a_20_mib_one():
    a = CachingAllocator()
    x, y = a.malloc(1000), a.malloc(300_000)
    assert a.reserved == K_SMALL_BUFFER and a.allocated == 1024 + 300_032 and x.segment is y.segment
    z = a.malloc(3 * MIB)
    assert a.reserved == K_SMALL_BUFFER + K_LARGE_BUFFER
    w = a.malloc(5 * MIB)  # the 17 MiB left of the 20 MiB segment, best fit
    assert a.reserved == K_SMALL_BUFFER + K_LARGE_BUFFER and w.segment is z.segment
    big = a.malloc(50 * MIB + 7)  # its own segment, rounded up to 2 MiB
    assert big.segment.size == 52 * MIB and big.size == 50 * MIB + 512  # more than 1 MiB left: split
    assert a.reserved == K_SMALL_BUFFER + K_LARGE_BUFFER + 52 * MIB


def test_a_large_block_is_not_split_when_at_most_1_mib_would_remain_and_frees_merge():
    a = CachingAllocator()
    b = a.malloc(12 * MIB)  # a 12 MiB segment
    a.free(b)
    c = a.malloc(11 * MIB + 512)  # 0.5 MiB would remain: handed the whole block
    assert c.size == 12 * MIB and a.allocated == 12 * MIB
    a.free(c)
    d, e = a.malloc(4 * MIB), a.malloc(4 * MIB)  # two 4 MiB blocks from one 12 MiB segment
    assert d.segment is e.segment and a.reserved == 12 * MIB
    a.free(d)
    a.free(e)  # merged back into one free 12 MiB block
    assert a.pools[False].keys == [(12 * MIB, d.addr)]


def test_max_split_size_keeps_oversize_blocks_whole_and_the_oom_path_releases_cached_blocks():
    conf = AllocConf(max_split_size=40 * MIB)
    a = CachingAllocator(conf, capacity=100 * MIB)
    big = a.malloc(60 * MIB)
    a.free(big)
    small = a.malloc(8 * MIB)  # an oversize cached block is not handed to a smaller request
    assert small.segment is not big.segment and a.reserved == 80 * MIB
    again = a.malloc(50 * MIB)  # a larger request takes it only within 20 MiB of its size
    assert again.segment is big.segment
    a.free(again)
    # 90 MiB cannot be reserved beside 80: the cached oversize block is released and it fits
    huge = a.malloc(70 * MIB)
    assert huge.size == 70 * MIB and a.reserved == 90 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc(30 * MIB)


def test_the_default_oom_path_releases_every_unsplit_cached_segment_then_raises():
    a = CachingAllocator(capacity=64 * MIB)
    blocks = [a.malloc(10 * MIB) for _ in range(4)]
    for b in blocks:
        a.free(b)
    assert a.reserved == 40 * MIB
    c = a.malloc(60 * MIB)  # does not fit beside the cache: the cache goes, then it does
    assert a.reserved == 60 * MIB and c.size == 60 * MIB and a.stats.retries == 1
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MIB)


def test_expandable_segments_grow_one_segment_by_pages():
    a = CachingAllocator(AllocConf(expandable_segments=True))
    x = a.malloc(30 * MIB)
    assert a.reserved == 40 * MIB  # two 20 MiB pages
    y = a.malloc(5 * MIB)  # from the 10 MiB left at the end of the segment
    assert a.reserved == 40 * MIB and y.segment is x.segment
    a.free(x)
    z = a.malloc(12 * MIB)  # any remainder of 512 bytes splits with expandable segments
    assert z.size == 12 * MIB and z.segment is x.segment and a.reserved == 40 * MIB


def test_alloc_conf_is_read_as_pytorch_reads_it_and_refused_in_one_line():
    c = AllocConf.parse("expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:4")
    assert c.expandable_segments and c.max_split_size == 128 * MIB and c.roundup_power2_divisions == 4
    assert AllocConf.parse("") == AllocConf() and AllocConf.parse("backend:native") == AllocConf()
    for bad, words in (("max_split_size_mb:10", "minimum of 20"), ("roundup_power2_divisions:3", "power of two"),
                       ("expandable_segments:yes", "True or False"), ("colour:blue", "not a PYTORCH_CUDA_ALLOC_CONF"),
                       ("garbage_collection_threshold:1.5", r"not in \(0, 1\)"), ("max_split_size_mb", "key:value")):
        with pytest.raises(AllocConfError, match=words):
            AllocConf.parse(bad)


def test_the_oom_capacity_is_the_edge_where_a_replay_starts_to_fail():
    trace = [30 * MIB, 8 * MIB, -1, 50 * MIB, 3 * MIB, -2, -4, 40 * MIB]
    fails, free = oom_capacity(trace)
    assert free.oom is None and free.peak_allocated <= free.peak_reserved
    assert replay(trace, capacity=fails).oom is not None
    assert replay(trace, capacity=fails + 2 * MIB).oom is None
    assert free.peak_allocated <= fails + 2 * MIB <= free.peak_reserved + 2 * MIB


def test_a_dry_runs_trace_replays_to_the_trackers_bytes():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from probe_kit.dry_run import CUBLAS_HANDLES, allocation_trace
    from probe_kit.recipe import ProbeConfig

    cfg = ProbeConfig(model="tiny-llama", rank=8, quant="4bit", random_weights=True, seq_len=256, response_len=16,
                      fixes=[])
    trace, raw = allocation_trace(cfg, workspace_mib=8.0)
    sim = replay(trace)
    # Every storage the tracker counted, 512-byte rounded as both round: the same peak, plus the workspaces.
    assert sim.peak_allocated == pytest.approx(raw["peak_mib"] * MIB + CUBLAS_HANDLES * 8 * MIB, abs=1)
    assert sim.peak_reserved >= sim.peak_allocated and sim.oom is None
    assert trace.count(EMPTY_CACHE) == 1 and trace.count(RESET_PEAK) == 1  # peft's empty_cache, the probe's reset
    frees = [e for e in trace if RESET_PEAK < e < 0]
    assert len(set(frees)) == len(frees) and all(-e - 1 < sum(1 for x in trace if x >= 0) for e in frees)
    expandable = replay(trace, AllocConf(expandable_segments=True))
    assert expandable.peak_allocated == sim.peak_allocated


def test_empty_cache_and_a_peak_reset_in_a_trace():
    trace = [30 * MIB, 50 * MIB, -1, EMPTY_CACHE, RESET_PEAK, 4 * MIB]
    r = replay(trace)
    # 30 MiB freed and released by empty_cache; from the reset on: 50 MiB + a 20 MiB segment for 4 MiB
    assert r.peak_reserved == 70 * MIB and r.peak_allocated == 54 * MIB
    assert replay(trace[:3]).peak_reserved == 80 * MIB


def test_expandable_segments_replay_a_trace_that_grows_frees_and_grows_again():
    trace = [30 * MIB, 5 * MIB, 8192, -1, 12 * MIB, 50 * MIB, -2, 8192, -5, 70 * MIB, -3, 600_000, -4]
    a = replay(trace, AllocConf(expandable_segments=True))
    b = replay(trace)
    assert a.oom is None and b.oom is None and a.peak_allocated == b.peak_allocated
    assert a.peak_reserved % (2 * MIB) == 0 and a.peak_reserved >= a.peak_allocated


def test_estimate_simulates_the_allocator_with_the_cards_remainder_and_leans_safe(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from ledger import cli

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    base = ["estimate", "--model", "tiny-llama", "--rank", "8", "--seq-len", "256", "--json"]
    assert cli.main(base + ["--gpu", "rtx-3060-ti", "--alloc-conf", "expandable_segments:True"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sim, answer = doc["allocator"], doc["answer"]
    assert [run["conf"] for run in sim["runs"]] == ["", "expandable_segments:True"]
    # The card's remainder is held through the step: the simulation's peak allocated is the
    # answer's figure (dry run + remainder), and reserved at least that.
    assert sim["held_mib"] > 100 and "rtx-3060-ti" in sim["held_source"]
    figure = answer["real_allocated"]["mib"]
    for run in sim["runs"]:
        assert run["peak_allocated_mib"] == pytest.approx(figure, abs=1.0)
        assert run["peak_reserved_mib"] >= run["peak_allocated_mib"] and run["oom_below_mib"] < run["peak_reserved_mib"]
    assert sim["verdict"] == sim["verdict_leaning_safe"] == answer["verdict"] == "fits"
    low, high = sim["free_for_pytorch_mib"]
    assert low < high and "CUDA context" in sim["free_source"]
    # A card that leaves PyTorch about the step's OOM point: the simulation says so, and the
    # answer leans on the worse verdict.
    for total, expected in ((1200, "tight"), (900, "won't fit")):
        assert cli.main(base + ["--gpu-mib", str(total), "--simulate-allocator"]) == 0
        sim = json.loads(capsys.readouterr().out)["allocator"]
        assert sim["verdict"] == expected and len(sim["runs"]) == 1
        assert sim["verdict_leaning_safe"] in (expected, "won't fit")
    # Against a --budget-mib of allocated memory the answer is the budget's: no simulated verdict.
    assert cli.main(base + ["--gpu", "rtx-3060-ti", "--budget-mib", "100", "--simulate-allocator"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["allocator"]["verdict"] is None and doc["allocator"]["verdict_leaning_safe"] == doc["answer"]["verdict"]


@pytest.mark.parametrize("extra,message", [
    (["--gpu", "mac-16gb"], "--simulate-allocator: mac-16gb is a Mac: the simulation is of CUDA's"),
    (["--gpu", "rtx-4090", "--gpus", "2", "--strategy", "ddp"],
     "--simulate-allocator: the allocator's simulation is one GPU's (without --gpus)"),
])
def test_estimate_refuses_a_simulation_it_cannot_make_in_one_line(capsys, extra, message):
    from ledger import cli

    base = ["estimate", "--model", "qwen2.5-0.5b", "--rank", "8", "--seq-len", "512", "--no-compute",
            "--simulate-allocator"]
    assert cli.main(base + extra) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_estimate_refuses_an_alloc_conf_pytorch_would_refuse(capsys):
    from ledger import cli

    base = ["estimate", "--model", "qwen2.5-0.5b", "--rank", "8", "--seq-len", "512", "--no-compute"]
    assert cli.main(base + ["--alloc-conf", "max_split_size_mb:2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "--alloc-conf: max_split_size_mb: 2 is below the allocator's minimum of 20"


def test_memory_held_through_the_step_and_loaded_first_keep_every_free_pointing_at_its_allocation():
    from probe_kit.allocator import with_first, with_held

    trace = [30 * MIB, 5 * MIB, -1, RESET_PEAK, 4 * MIB, -2, -3]
    held = with_held(trace, 8 * MIB)
    assert held == [30 * MIB, 5 * MIB, -1, 8 * MIB, RESET_PEAK, 4 * MIB, -2, -4]
    base, more = replay(trace), replay(held)
    assert more.peak_allocated == base.peak_allocated + 8 * MIB
    assert with_held([1 * MIB, -1], 2 * MIB) == [1 * MIB, -1, 2 * MIB]  # no reset: held from the end
    first = with_first(trace, 3 * MIB)
    assert first == [3 * MIB, 30 * MIB, 5 * MIB, -2, RESET_PEAK, 4 * MIB, -3, -4]
    assert replay(first).peak_allocated == base.peak_allocated + 3 * MIB
    assert with_held(trace, 0) == with_first(trace, 0) == trace


@pytest.mark.parametrize("held_mib", [37.3, 250.0, 1024.0])
def test_a_remainder_held_through_the_step_adds_its_own_segment_to_the_simulated_reserved(held_mib):
    # ledger.fit.dry_calibration.simulated_reserved, which the scoreboard's allocator-sim row reads
    # off a dry-run row's simulation with nothing held, against the replay with the block held.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ledger.core.models import SimulatedAllocator
    from ledger.fit.dry_calibration import simulated_reserved
    from probe_kit.allocator import with_held
    from probe_kit.dry_run import allocation_trace
    from probe_kit.recipe import ProbeConfig

    cfg = ProbeConfig(model="tiny-qwen2", rank=8, quant="4bit", random_weights=True, seq_len=512, response_len=16,
                      fixes=[])
    trace, _ = allocation_trace(cfg)
    free = replay(trace)
    sim = SimulatedAllocator(peak_allocated_mib=free.peak_allocated / MIB, peak_reserved_mib=free.peak_reserved / MIB,
                             oom_below_mib=0.0)
    held = replay(with_held(trace, int(held_mib * MIB)))
    assert abs(simulated_reserved(sim, sim.peak_allocated_mib + held_mib) - held.peak_reserved / MIB) <= 2.0


def test_ceiling_checks_the_rank_that_fits_with_the_simulated_allocator(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from ledger import cli

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    assert cli.main(["ceiling", "--model", "tiny-llama", "--seq-len", "256", "--gpu-mib", "1400", "--max-rank", "64",
                     "--simulate-allocator", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sim = doc["allocator"]
    assert doc["fits_rank"] == 64 and sim["fits_rank"] == 64
    (one,) = sim["checked"]
    assert one["rank"] == 64 and one["verdict"] == "fits" and one["runs"][0]["oom_below_mib"] < one["free_for_pytorch_mib"][0]


@pytest.mark.parametrize("extra", [["--rank", "16"], ["--seq-len", "256", "--budget-mib", "9000"],
                                   ["--seq-len", "256", "--gpus", "2", "--strategy", "ddp"]])
def test_ceiling_refuses_a_simulation_it_cannot_check_in_one_line(capsys, extra):
    from ledger import cli

    assert cli.main(["ceiling", "--model", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--no-compute", "--simulate-allocator",
                     *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("--simulate-allocator: the simulation checks a rank ceiling on one card") and "\n" not in err


def test_an_answer_near_the_limit_names_the_allocators_simulation(capsys, tmp_path, monkeypatch):
    # The limit allows for the card's reserved/allocated; a fits or tight whose top times the
    # largest ratio the ledger's probes measured would pass it says so, and names the flag.
    import json

    from ledger import cli
    from ledger.answer.predictor import Predictor
    from ledger.storage import store
    from ledger.storage.dry_runs import load_dry_runs

    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path))
    predictor = Predictor(store.load("ledger/vram.json"), load_dry_runs())
    top, rid = predictor.limits.largest_ratio()
    assert 1.2 < top < 1.5 and rid
    base = ["estimate", "--model", "tiny-llama", "--rank", "8", "--seq-len", "256", "--json"]
    seen = {}
    for total in (1400, 1330, 9000):
        assert cli.main(base + ["--gpu-mib", str(total)]) == 0
        doc = json.loads(capsys.readouterr().out)
        a = doc["answer"]
        ratio = predictor.reserved_ratio(doc["gpu"])[0]
        near = a["verdict"] in ("fits", "tight") and a["real_allocated"]["high_mib"] * top > a["limit_low_mib"] * ratio
        seen[total] = (a["verdict"], doc["near_limit"])
        assert bool(doc["near_limit"]) == near, seen
        if near:
            assert "--simulate-allocator" in doc["near_limit"] and f"{top:.3f}" in doc["near_limit"]
    assert seen[9000][1] is None and any(v[1] for v in seen.values()), seen


SNAPSHOT_EVENTS = [
    {"action": "segment_alloc", "addr": 0x1000, "size": 30 * MIB},
    {"action": "alloc", "addr": 0x1000, "size": 30 * MIB},
    {"action": "segment_alloc", "addr": 0x9000000, "size": 20 * MIB},
    {"action": "alloc", "addr": 0x9000000, "size": 5 * MIB},
    {"action": "free_requested", "addr": 0x1000, "size": 30 * MIB},
    {"action": "free_completed", "addr": 0x1000, "size": 30 * MIB},
    {"action": "segment_free", "addr": 0x1000, "size": 30 * MIB},  # empty_cache: nothing retried after it
    {"action": "alloc", "addr": 0x9000000 + 5 * MIB, "size": 4 * MIB},
    {"action": "free_completed", "addr": 0x77, "size": 512},  # a block made before the history began
    {"action": "snapshot", "addr": 0, "size": 0},
]


def test_a_real_runs_history_becomes_a_trace_with_its_own_peak_reserved():
    from probe_kit.allocator import trace_of_snapshot

    trace, real = trace_of_snapshot(SNAPSHOT_EVENTS)
    assert trace == [30 * MIB, 5 * MIB, -1, EMPTY_CACHE, 4 * MIB]
    assert real["peak_reserved"] == 50 * MIB and real["allocations"] == 3 and real["unmatched_frees"] == 1
    assert replay(trace).peak_reserved == real["peak_reserved"]
    # The allocator's own OOM path (its cache released, the segment tried again) is not an
    # empty_cache: a replay at the card's capacity makes it itself.
    retry = SNAPSHOT_EVENTS[:6] + [{"action": "segment_free", "addr": 0x1000, "size": 30 * MIB},
                                   {"action": "segment_alloc", "addr": 0x1000, "size": 40 * MIB},
                                   {"action": "alloc", "addr": 0x1000, "size": 40 * MIB}]
    trace, real = trace_of_snapshot(retry)
    assert EMPTY_CACHE not in trace and trace[-1] == 40 * MIB and real["peak_reserved"] == 60 * MIB


def test_replay_compares_a_snapshot_with_the_model_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    import pickle

    from probe_kit.replay import main

    snap = tmp_path / "run.pickle"
    snap.write_bytes(pickle.dumps({"device_traces": [SNAPSHOT_EVENTS], "segments": []}))
    assert main([str(snap)]) == 0
    out = capsys.readouterr().out
    assert "real peak reserved 50.0 MiB (its segment events); replayed 50.0 MiB (+0.00%)" in out
    assert "1 frees of blocks made before the history began" in out
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    for argv, message in (([str(bad)], f"{bad}: not a memory snapshot with device 0's history"),
                          ([str(snap), "--device", "3"], f"{snap}: not a memory snapshot with device 3's history"),
                          ([str(tmp_path / "none.pickle")], f"{tmp_path / 'none.pickle'}: no such file"),
                          ([str(snap), "--alloc-conf", "max_split_size_mb:2"], "--alloc-conf: max_split_size_mb")):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and "\n" not in err


def test_a_ceilings_simulation_says_whether_it_agrees_lowers_or_cannot_confirm():
    from ledger.cli.ceiling import _simulated_lines

    def one(rank, verdict, oom):
        return {"rank": rank, "verdict": verdict, "free_for_pytorch_mib": [3815.3, 4236.0],
                "runs": [{"peak_reserved_mib": oom + 2, "oom_below_mib": oom}]}
    lowered = _simulated_lines({"fits_rank": 48, "checked": [one(96, "tight", 3922.0), one(48, "fits", 3218.0)]})
    assert "simulated at r96: peak reserved 3,924.0 MiB, an OOM with 3,922.0 MiB or less free" in lowered[0]
    assert lowered[-1] == "  leaning safe, the simulated allocator lowers the ceiling to rank 48"
    none = _simulated_lines({"fits_rank": None, "checked": [one(96, "tight", 3922.0), one(64, "tight", 3794.0)]})
    assert "does not confirm rank 96 (nor r64)" in none[-1]
    assert _simulated_lines(None) == ["  the allocator's simulation: no rank fits, nothing to check"]

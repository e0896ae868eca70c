"""Shared fixtures: paths to checked-in data and the bundled ledger."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# One compute thread in each of the suite's workers (pytest-xdist runs one a core) and in the
# processes their tests start: torch's default of one thread a core, in every worker at once,
# oversubscribes the cores and OpenMP's idle threads spin (tests/test_recipe_axes.py on 2 cores:
# 80 s of wall with the default, 43 s with one thread).
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(1)

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"
REPO = TESTS.parent
BUNDLED = REPO / "ledger" / "vram.json"
#: A frozen copy of the bundled ledger as of the tests that pin exact figures on it: adding a
#: measurement to the bundled ledger must not break them.
FROZEN = DATA / "program-ledger.json"
LEGACY = DATA / "legacy" / "program-vram.json"
SMALL = DATA / "small-ledger.json"


@pytest.fixture(autouse=True, scope="session")
def _own_dry_run_cache(tmp_path_factory):
    """The user's cache of computed dry runs is never read or written by the tests: every command
    that computes or reads cached dry runs gets a folder of the session's own (``--cache`` still
    names another)."""

    folder = tmp_path_factory.mktemp("vram-ledger-cache")
    before = os.environ.get("VRAM_LEDGER_CACHE")
    os.environ["VRAM_LEDGER_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("VRAM_LEDGER_CACHE", None)
    else:
        os.environ["VRAM_LEDGER_CACHE"] = before


@pytest.fixture
def small_ledger(tmp_path: Path) -> Path:
    """A writable copy of the small fixture ledger."""
    dst = tmp_path / "ledger.json"
    shutil.copy(SMALL, dst)
    return dst

BENCHMARKS = REPO / "benchmarks"
GOLDEN = DATA / "golden-site"
#: The dry-run rows the golden site's fit table is built from: a frozen copy of the shipped rows of
#: three models (one the ledger measured, one with a 32k context, one with 128k), so the golden
#: tree does not change each time the shipped grid grows.
GOLDEN_DRY = DATA / "golden-dry-runs.json"
#: ``vram build``'s arguments for the golden site.
GOLDEN_BUILD = ["--ledger", str(SMALL), "--dry-runs", str(GOLDEN_DRY)]


def _golden_versions() -> str:
    """The library versions the golden dry-run rows were computed with, as VRAM_LEDGER_LIBRARY_VERSIONS
    gives them: the golden site is built against its own rows' versions, whatever is installed."""
    import json

    rows = json.loads(GOLDEN_DRY.read_text(encoding="utf-8"))["measurements"]
    found = {(name, (r.get("environment") or {}).get(name)) for r in rows for name in ("torch", "transformers", "peft")}
    assert len(found) == 3 and all(v for _, v in found), found
    return ",".join(f"{name}={version}" for name, version in sorted(found))


#: ``VRAM_LEDGER_LIBRARY_VERSIONS`` for every build of the golden site.
GOLDEN_VERSIONS = _golden_versions()
#: The one command that regenerates the golden site (run from the repository root).
REGEN_GOLDEN = (f"rm -rf tests/data/golden-site && VRAM_LEDGER_LIBRARY_VERSIONS={GOLDEN_VERSIONS} vram build "
                "--ledger tests/data/small-ledger.json --dry-runs tests/data/golden-dry-runs.json "
                "--out tests/data/golden-site -q")


def assert_dry_run_is_the_real_cpu_step(cfg, rel: float = 0.01) -> None:
    """The dry run of a probe configuration against the real step on the CPU (tracker meter): after
    load, pre-step and peak allocated each within ``rel`` (0.05 MiB at the least)."""
    from probe_kit.dry_run import dry_run
    from probe_kit.probe_vram import run_probe

    real = run_probe(cfg, device="cpu")[0].outcome
    fake = dry_run(cfg)
    assert real.status == "ok"
    for key, got in (("after_load_mib", fake["after_load_mib"]), ("pre_step_mib", fake["pre_step_mib"]),
                     ("peak_allocated_mib", fake["peak_mib"])):
        assert got == pytest.approx(getattr(real, key), rel=rel, abs=0.05), key

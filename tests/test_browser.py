"""A real browser: headless Chromium loads index.html from file://, runs its script, and the
DOM has the tables and anchors; a screenshot is saved under test-artifacts/."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import html5lib
import pytest

from conftest import BUNDLED, REPO
from ledger import cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)"),
]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=3000"]


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("browser-site")
    assert cli.main(["build", "--ledger", str(BUNDLED), "--out", str(out), "-q"]) == 0
    return out


def test_dom_after_load_has_tables_anchors_and_ran_the_script(site, tmp_path):
    url = (site / "index.html").as_uri()
    run = chromium(tmp_path, "--dump-dom", url)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = html5lib.parse(run.stdout, namespaceHTMLElements=False)
    ids = {el.get("id") for el in dom.iter() if el.get("id")}
    for anchor in ("gpu", "measurements", "cross-gpu", "gpu-rx-7900-xtx", "gpu-rtx-3060-ti", "calibration",
                   "calibration-anchor", "calibration-prediction", "rank-cost", "dropout-memory", "host-ram"):
        assert anchor in ids
    tables = {t.get("id"): t for t in dom.iter("table")}
    assert {"measurements-table", "gpu-rx-7900-xtx-table",
            "predictions-table"} <= set(tables)
    rows = tables["measurements-table"].find("tbody").findall("tr")
    assert len(rows) == 46
    # The sort script ran in the browser: it marks every header of a sortable table.
    heads = tables["measurements-table"].find("thead").find("tr").findall("th")
    assert all("sortable" in (th.get("class") or "") for th in heads)
    imgs = [img for img in dom.iter("img")]
    assert imgs and all(img.get("alt") for img in imgs)


def test_screenshot_is_saved_as_an_artifact(site, tmp_path):
    artifacts = REPO / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    shot = artifacts / "site-index.png"
    if shot.exists():
        shot.unlink()
    run = chromium(tmp_path, "--window-size=1600,3000", f"--screenshot={shot}", (site / "index.html").as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.is_file() and shot.stat().st_size > 50_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

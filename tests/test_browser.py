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


# -- the page at phone and desktop widths, and the checkers people use ------------------------

#: Headless Chromium lays a page out no narrower than 500 CSS px (a 390 px window gets 500): the
#: narrowest width it allows stands in for a phone.
NARROW, WIDE = 500, 1400
PROBE = ("<script>(function(){var d=document.documentElement, f=document.getElementById('picker');"
         "document.body.setAttribute('data-scroll-width', d.scrollWidth);"
         "document.body.setAttribute('data-client-width', d.clientWidth);"
         "document.body.setAttribute('data-picker-top', f ? Math.round(f.getBoundingClientRect().top) : -1);})();"
         "</script></body>")


def measure(site: Path, page: str, width: int, tmp_path: Path) -> dict:
    """Layout figures of a page as Chromium lays it out at ``width``: from a copy with a probe."""
    probe = (site / page).parent / f"probe-{width}-{Path(page).name}"
    probe.write_text((site / page).read_text(encoding="utf-8").replace("</body>", PROBE), encoding="utf-8")
    try:
        run = chromium(tmp_path, f"--window-size={width},1800", "--dump-dom", probe.as_uri())
    finally:
        probe.unlink()
    assert run.returncode == 0, run.stderr[-2000:]
    body = html5lib.parse(run.stdout, namespaceHTMLElements=False).find("body")
    return {k: int(body.get(f"data-{k}")) for k in ("scroll-width", "client-width", "picker-top")}


@pytest.mark.parametrize("page", ["index.html", "fits.html", "fits/qwen2.5-7b.html", "estimators.html"])
@pytest.mark.parametrize("width", [NARROW, WIDE])
def test_no_page_scrolls_sideways(site, tmp_path, page, width):
    m = measure(site, page, width, tmp_path)
    assert m["scroll-width"] <= m["client-width"], m  # wide tables scroll inside their own box


def test_the_picker_is_the_first_thing_on_the_page(site, tmp_path):
    m = measure(site, "index.html", WIDE, tmp_path)
    assert 0 < m["picker-top"] <= 400, m


@pytest.mark.parametrize("width", [NARROW, WIDE])
def test_screenshots_at_phone_and_desktop_widths(site, tmp_path, width):
    artifacts = REPO / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    for page in ("index", "fits"):
        shot = artifacts / f"site-{page}-{width}.png"
        shot.unlink(missing_ok=True)
        run = chromium(tmp_path, f"--window-size={width},2400", f"--screenshot={shot}", (site / f"{page}.html").as_uri())
        assert run.returncode == 0, run.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_every_plotted_point_has_a_title(site):
    import json
    import re

    doc = json.loads((site / "vram.json").read_text(encoding="utf-8"))
    plots = doc["derived"]["plots"]
    assert plots
    for plot in plots:
        svg = (site / plot["file"]).read_text(encoding="utf-8")
        n = sum(len(s["points"]) for s in plot["series"])
        titles = re.findall(rf'<g id="{re.escape(plot["id"])}-pt\d+">\s*<title>([^<]+)</title>', svg)
        assert len(titles) == n, plot["id"]
        ids = {p["id"] for s in plot["series"] for p in s["points"]}
        assert {t.split(":")[0] for t in titles} == ids


def _tool(env: str, *candidates: Path) -> Path:
    import os

    for path in [Path(os.environ[env])] if os.environ.get(env) else list(candidates):
        if path.is_file():
            return path
    pytest.skip(f"{env} not set and no copy found (.ci/run installs it with npm)")


@pytest.mark.parametrize("page, query", [("index.html", ""), ("index.html", "?model=qwen2.5-7b&gpu=rtx-4090"),
                                         ("fits.html", ""), ("fits/qwen2.5-7b.html", "?gpu=rtx-4090&batch=4"),
                                         ("estimators.html", "")])
def test_axe_core_finds_no_violation(site, tmp_path, page, query):
    """Every page, and the picker with an answer shown: no violation of any impact."""
    import json

    axe = _tool("VRAM_AXE_JS", REPO / "node_modules" / "axe-core" / "axe.min.js")
    probe = (site / page).parent / f"axe-{Path(page).name}"
    # axe runs after the page's own scripts (the picker draws its answer on load from the query).
    script = (f'<script src="{axe.as_uri()}"></script><script>setTimeout(function(){{axe.run(document).then('
              "function(r){var p=document.createElement('pre');p.id='axe-result';p.textContent=JSON.stringify("
              "r.violations.map(function(v){return {id:v.id,impact:v.impact,nodes:v.nodes.length};}));"
              "document.body.appendChild(p);});}, 500);</script></body>")
    probe.write_text((site / page).read_text(encoding="utf-8").replace("</body>", script), encoding="utf-8")
    try:
        run = chromium(tmp_path, "--allow-file-access-from-files", "--virtual-time-budget=60000",
                       "--window-size=1400,1800", "--dump-dom", probe.as_uri() + query)
    finally:
        probe.unlink()
    dom = html5lib.parse(run.stdout, namespaceHTMLElements=False)
    result = next((el for el in dom.iter("pre") if el.get("id") == "axe-result"), None)
    assert result is not None, f"axe did not run on {page}"
    assert json.loads(result.text) == [], page + query
    if query:
        assert "fit-answer-table" in run.stdout  # the answer was drawn before axe looked


def test_the_nu_validator_has_nothing_to_say(site):
    import json

    jar = _tool("VRAM_VNU_JAR", REPO / "node_modules" / "vnu-jar" / "build" / "dist" / "vnu.jar")
    java = shutil.which("java")
    if java is None:
        pytest.skip("no java")
    pages = [site / p for p in ("index.html", "fits.html", "estimators.html")] + sorted((site / "fits").glob("*.html")) \
        + sorted((site / "plots").glob("*.svg"))
    run = subprocess.run([java, "-jar", str(jar), "--format", "json", "--also-check-svg", *map(str, pages)],
                         capture_output=True, text=True, timeout=600)
    messages = json.loads(run.stderr or run.stdout)["messages"]
    assert [m for m in messages if m["type"] == "error" or m.get("subType") == "warning"] == []


# -- the picker: your model and your card in two choices --------------------------------------


def _fit_label(model: str, gpu: str, seq: int, batch: int, capsys, optim: str = "", *more: str) -> str:
    import json

    assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", model, "--gpu", gpu, "--quant", "4bit", "--fixes",
                     "none", "--batch-size", str(batch), "--no-compute", "--json", *more]
                    + (["--optim", optim] if optim else [])) == 0
    doc = json.loads(capsys.readouterr().out)
    return next(c["label"] for c in doc["cells"] if c["seq_len"] == seq and c["setting"] == "plain")


CELL = "(() => {{ const c = document.querySelector('#fit-answer-table tr[data-len=\"{seq}\"] td'); " \
       "return c && c.textContent; }})()"


@pytest.mark.parametrize("width", [NARROW, WIDE])
def test_the_picker_answers_what_vram_fit_prints_in_two_choices(site, tmp_path, width, capsys):
    """Two choices (model, card) answer the stock default (AdamW, batch 1); the micro-batch, the
    optimizer and checkpointing each change the answer as ``vram fit --batch-size 4``, ``--optim
    adamw_8bit`` and ``--no-gradient-checkpointing`` do."""
    from cdp import Browser

    expected = _fit_label("qwen2.5-7b", "RTX 4090", 4096, 1, capsys)
    expected_4 = _fit_label("qwen2.5-7b", "RTX 4090", 4096, 4, capsys)
    expected_8bit = _fit_label("qwen2.5-7b", "RTX 4090", 4096, 1, capsys, optim="adamw_8bit")
    expected_off = _fit_label("qwen2.5-7b", "RTX 4090", 2048, 1, capsys, "adamw_8bit", "--no-gradient-checkpointing")
    assert expected_8bit != expected  # 8-bit AdamW keeps about a quarter of the state: a larger rank fits
    artifacts = REPO / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    browser = Browser(CHROMIUM, tmp_path / "cdp-profile")
    try:
        browser.open((site / "index.html").as_uri(), width)
        browser.choose("model", "qwen2.5-7b")  # one
        browser.choose("gpu", "rtx-4090")  # two
        assert browser.wait_for(CELL.format(seq=4096)) == expected
        assert browser.eval("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        browser.screenshot(artifacts / f"picker-{width}.png")
        browser.choose("batch", "4")
        assert browser.wait_for(f"document.getElementById('fit-answer-title').textContent.endsWith('batch 4') && "
                                f"{CELL.format(seq=4096)}") == expected_4
        assert browser.eval("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        browser.choose("batch", "1")
        browser.choose("optim", "adamw_8bit")
        assert browser.wait_for(f"document.getElementById('fit-answer-title').textContent.includes('adamw_8bit') && "
                                f"{CELL.format(seq=4096)}") == expected_8bit
        browser.choose("ckpt", "off")
        assert browser.wait_for(f"document.getElementById('fit-answer-title').textContent.includes('no gradient') && "
                                f"{CELL.format(seq=2048)}") == expected_off
        browser.choose("batch", "4")  # not in the tables: the command that answers it
        assert "--batch-size 4 --optim adamw_8bit --no-gradient-checkpointing" in browser.wait_for(
            "document.getElementById('fit-answer-title').textContent.endsWith('batch 4, no gradient checkpointing') && "
            "document.querySelector('#fit-answer pre code') && "
            "document.querySelector('#fit-answer pre code').textContent")
        browser.choose("ckpt", "")
        browser.choose("fixes", "all")  # the preset's batch: its own dry runs, from the command line
        assert "--fixes all --batch-size 4" in browser.wait_for(
            "document.getElementById('fit-answer-title').textContent.includes('memory fixes') && "
            "document.querySelector('#fit-answer pre code') && "
            "document.querySelector('#fit-answer pre code').textContent")
        browser.choose("batch", "1")
        browser.choose("ckpt", "off")  # the preset without checkpointing: also its own dry runs
        assert browser.wait_for(
            "document.getElementById('fit-answer-title').textContent.includes('no gradient') && "
            "document.querySelector('#fit-answer pre code') && "
            "document.querySelector('#fit-answer pre code').textContent").endswith(
            "--fixes all --no-gradient-checkpointing")
    finally:
        browser.close()
    assert (artifacts / f"picker-{width}.png").stat().st_size > 20_000


def test_without_javascript_the_default_recipe_is_a_plain_table(site, capsys):
    expected = _fit_label("qwen2.5-7b", "RTX 4090", 4096, 1, capsys)
    dom = html5lib.parse((site / "fits" / "qwen2.5-7b.html").read_text(encoding="utf-8"), namespaceHTMLElements=False)
    table = next(el for el in dom.iter("h3") if el.get("id") == "fit-qwen2-5-7b-4bit-none-plain")
    rows = [r for r in dom.iter("tr") if r.find("th") is not None and r.find("th").text == "rtx-4090"]
    assert table is not None and rows
    # The first rtx-4090 row is the stock 4-bit plain table's; its 4096-token cell is the third.
    cells = rows[0].findall("td")
    assert "".join(cells[2].itertext()).startswith(expected)


def _fit_cell(model: str, card_args: list, seq: int, capsys) -> dict:
    import json

    assert cli.main(["fit", "--ledger", str(BUNDLED), "--model", model, *card_args, "--quant", "4bit", "--fixes",
                     "none", "--no-compute", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return next(c for c in doc["cells"] if c["seq_len"] == seq and c["setting"] == "plain")


@pytest.mark.parametrize("width", [NARROW, WIDE])
def test_a_card_typed_by_its_memory_is_answered_as_vram_fit_gpu_mib_or_safely_below(site, tmp_path, width, capsys):
    """A total equal to a listed card's (16,384 MiB, the RTX 4060 Ti 16GB's) derives the same
    limit, so the same ranks as `vram fit --gpu-mib 16384`; another total (20,000 MiB) is answered
    as at least the listed card just below it, never above what `vram fit --gpu-mib 20000` says."""
    from cdp import Browser

    same = _fit_cell("qwen2.5-7b", ["--gpu-mib", "16384"], 512, capsys)
    exact = _fit_cell("qwen2.5-7b", ["--gpu-mib", "20000"], 512, capsys)
    typed = ("(() => {{ const f = document.querySelector('input[name=gpu_mib]'); f.value = '{total}'; "
             "f.dispatchEvent(new Event('input', {{bubbles: true}})); return true; }})()")
    browser = Browser(CHROMIUM, tmp_path / "cdp-profile")
    try:
        browser.open((site / "index.html").as_uri(), width)
        browser.choose("model", "qwen2.5-7b")
        assert browser.eval(typed.format(total=16384))  # two interactions: the model and the memory
        assert browser.wait_for(f"document.getElementById('fit-answer-title')?.textContent.includes('16384 MiB') && "
                                f"{CELL.format(seq=512)}") == same["label"]
        assert browser.eval(typed.format(total=20000))
        got = browser.wait_for(f"document.getElementById('fit-answer-title')?.textContent.includes('20000 MiB') && "
                               f"{CELL.format(seq=512)}")
        assert got.startswith("≥ ") and int(got[2:]) <= exact["fits_rank"]
        assert "gpu-mib 20000" in browser.eval("document.getElementById('fit-answer').textContent")
        assert browser.eval("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    finally:
        browser.close()


def test_the_picker_gives_fsdp_with_cpu_offload_as_the_command_that_answers_it(site, tmp_path):
    """Several GPUs: FSDP full shard is the shipped table; with CPU offload, the command of that
    world with --cpu-offload (its dry run is the user's to run)."""
    from cdp import Browser

    browser = Browser(CHROMIUM, tmp_path / "cdp-profile")
    title = "(document.getElementById('fit-answer-title') || {textContent: ''}).textContent"
    try:
        browser.open((site / "index.html").as_uri(), WIDE)
        browser.choose("model", "llama-3.3-70b")
        browser.choose("gpu", "rtx-4090")
        browser.choose("gpus", "2")
        assert browser.wait_for(f"{title}.endsWith('each of 2 GPUs (fsdp), per GPU') && "
                                "document.querySelector('#fit-answer-table td') !== null")
        browser.choose("strategy", "fsdp-offload")
        command = browser.wait_for(f"{title}.endsWith('each of 2 GPUs (fsdp, CPU offload), per GPU') && "
                                   "document.querySelector('#fit-answer pre code') && "
                                   "document.querySelector('#fit-answer pre code').textContent")
        assert command.endswith("--gpus 2 --strategy fsdp --cpu-offload"), command
        assert "host RAM" in browser.eval("document.getElementById('fit-answer').textContent")
    finally:
        browser.close()

"""Nothing lost, nothing unsafe: hostile and careless inputs get one located line and exit 1,
no write damages a ledger, and every output is safe for its reader."""

from __future__ import annotations

import csv
import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from conftest import REPO, SMALL
from ledger import cli
from ledger.storage import atomic
from ledger.storage import store
from ledger.core.models import Measurement, Outcome, Provenance

HOSTILE = [
    "[click](javascript:alert(1))",
    "[x][1]\n\n[1]: javascript:alert(2)",
    "![img](data:text/html;base64,PHNjcmlwdD4=)",
    "<a href=\"vbscript:msgbox(3)\">a</a> <script>alert(4)</script>",
    "[e](&#106;avascript:alert(5)) and <javascript:alert(6)>",
    "=HYPERLINK(\"http://evil\",\"x\")",
]


def run(*argv: str) -> int:
    return cli.main([str(a) for a in argv])


def one_line_error(capsys, startswith: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(startswith), err
    return err


@pytest.fixture
def hostile_ledger(tmp_path) -> Path:
    lg = store.load(SMALL)
    m = lg.measurements[0]
    m.provenance.notes = list(HOSTILE)
    m.provenance.source = HOSTILE[0]
    m.config_text = "-2+3 | " + HOSTILE[3]
    lg.findings[0].claim = "\n\n".join(HOSTILE)
    path = tmp_path / "hostile.json"
    store.save(lg, path)
    return path


# -- unsafe output ---------------------------------------------------------------------------


def test_markdown_pages_have_no_live_unsafe_link_and_no_entities(hostile_ledger, tmp_path):
    site = tmp_path / "site"
    assert run("build", "--ledger", hostile_ledger, "--out", site, "-q") == 0
    for page in ("vram.md", "estimators.md"):
        text = (site / page).read_text(encoding="utf-8")
        # Rendered the way permissive renderers do: raw HTML on, any link scheme allowed.
        md = MarkdownIt("commonmark", {"html": True, "linkify": False}).enable("table")
        md.validateLink = lambda url: True
        html = md.render(text)
        from bs4 import BeautifulSoup

        soup = BeautifulSoup(html, "html.parser")
        for tag, attr in (("a", "href"), ("img", "src")):
            for el in soup.find_all(tag):
                url = el.get(attr, "").strip().lower()
                assert url.startswith(("http://", "https://", "#")) or ":" not in url.split("/")[0], (page, url)
        assert not soup.find_all(["script", "iframe"]) and "vbscript:" not in str(soup.find_all("a"))
        for entity in ("&lt;", "&gt;", "&#39;", "&quot;", "&amp;#106;"):
            assert entity not in text, (page, entity)
    assert "alert(1)" in (site / "vram.md").read_text()  # the text is shown, not dropped


def test_csv_cells_cannot_start_a_formula(hostile_ledger, tmp_path):
    site = tmp_path / "site"
    assert run("build", "--ledger", hostile_ledger, "--out", site, "-q") == 0
    rows = list(csv.reader(io.StringIO((site / "vram.csv").read_text(encoding="utf-8"))))
    header = rows[0]
    for row in rows[1:]:
        for name, cell in zip(header, row):
            if cell and cell[0] in "=+-@\t\r":
                float(cell)  # only a number may start with a sign
    source = header.index("source")
    assert any(r[source] == "'" + HOSTILE[0] for r in rows[1:]) is False  # starts with '[': untouched
    assert any(r[source] == HOSTILE[0] for r in rows[1:])


def test_csv_neutralises_each_formula_start():
    from ledger.site.downloads import _v

    for start in ("=", "+", "-", "@", "\t", "\r"):
        assert _v(start + "1+1") == "'" + start + "1+1"
    assert _v(-3.5) == -3.5 and _v("plain") == "plain"


def test_csv_numbers_go_to_the_writer_as_they_are():
    """vram.csv's numbers and empty cells, passed to the writer without ``_v``, are written as ``_v``
    would have them: every value of every row through ``_v`` gives the same text (bundled, the
    hostile ledger and a synthetic one with OOMs, datasets and LoRA settings of every kind)."""
    import sys

    from conftest import REPO
    from ledger.core.paths import DEFAULT_LEDGER
    from ledger.site.downloads import COLUMNS, _v, csv_row, measurements_csv

    sys.path.insert(0, str(REPO / "benchmarks"))
    from synthetic import realistic_ledger, synthetic_ledger

    for led in (store.load(DEFAULT_LEDGER), store.load(SMALL), synthetic_ledger(1500), realistic_ledger(300)):
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows([_v(x) for x in csv_row(m)] for m in led.measurements)
        assert measurements_csv(led) == buf.getvalue()


# -- writes that must not damage a ledger ----------------------------------------------------


def test_build_refuses_to_overwrite_its_own_ledger(tmp_path, capsys):
    folder = tmp_path / "D"
    folder.mkdir()
    ledger = folder / "vram.json"
    shutil.copy(SMALL, ledger)
    before = ledger.read_bytes()
    assert run("build", "--ledger", ledger, "--out", folder, "-q") == 1
    one_line_error(capsys, f"{ledger}: the build would overwrite this ledger with its output vram.json")
    assert ledger.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["vram.json"]


def test_build_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "site"
    out.write_text("x")
    assert run("build", "--ledger", SMALL, "--out", out, "-q") == 1
    one_line_error(capsys, f"{out}: is a file, not a folder")


def test_a_symlinked_ledger_stays_a_link_and_its_target_is_updated(tmp_path):
    target = tmp_path / "real" / "ledger.json"
    target.parent.mkdir()
    shutil.copy(SMALL, target)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    store.append(link, [Measurement(id="via-link", kind="probe", outcome=Outcome(status="ok",
                                                                                 peak_allocated_mib=1.0))])
    assert link.is_symlink() and any(m.id == "via-link" for m in store.load(target).measurements)
    # Writers through the link and the target take one lock (beside the target).
    assert (target.parent / "ledger.json.lock").exists() and not (tmp_path / "link.json.lock").exists()


def test_output_that_is_a_directory_is_one_line(tmp_path, capsys):
    folder = tmp_path / "dir"
    folder.mkdir()
    assert run("merge", SMALL, "-o", folder) == 1
    one_line_error(capsys, f"{folder}:")
    assert run("import-legacy", REPO / "tests" / "data" / "legacy" / "program-vram.json", "-o", folder,
               "--force") == 1
    one_line_error(capsys, f"{folder}: is a directory")


@pytest.mark.parametrize("failing", ["lock", "temp", "fsync"])
def test_read_only_folder_and_full_disk_are_one_line_and_keep_the_old_file(small_ledger, monkeypatch, capsys,
                                                                          failing):
    import filelock

    shard = small_ledger.parent / "shard.json"
    lg = store.empty_ledger()
    lg.measurements.append(Measurement(id="new-one", kind="probe", outcome=Outcome(status="ok",
                                                                                  peak_allocated_mib=1.0)))
    store.save(lg, shard)
    before = small_ledger.read_bytes()
    code, text = (errno.ENOSPC, "No space left on device") if failing == "fsync" else (errno.EROFS,
                                                                                       "Read-only file system")

    def fail(*a, **k):
        raise OSError(code, text)

    if failing == "lock":
        monkeypatch.setattr(filelock.FileLock, "acquire", fail)
    elif failing == "temp":
        monkeypatch.setattr(atomic.tempfile, "mkstemp", fail)
    else:
        monkeypatch.setattr(atomic.os, "fsync", fail)
    assert run("merge", shard, "-o", small_ledger) == 1
    err = one_line_error(capsys, f"{small_ledger}: cannot ")
    assert text in err
    assert small_ledger.read_bytes() == before
    assert [p for p in small_ledger.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_nested_json_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 10000 + "]" * 10000)
    assert run("validate", path) == 1
    one_line_error(capsys, f"{path}: invalid JSON: nested too deeply")


def test_temp_files_of_dead_writers_are_removed(small_ledger):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    stale = small_ledger.parent / f".{small_ledger.name}.{dead}.abc123.tmp"
    live = small_ledger.parent / f".{small_ledger.name}.{os.getppid()}.def456.tmp"
    stale.write_text("half")
    live.write_text("in progress")
    store.append(small_ledger, [Measurement(id="x1", kind="probe", outcome=Outcome(status="ok",
                                                                                   peak_allocated_mib=1.0))])
    assert not stale.exists() and live.exists()


def test_documented_many_boxes_flow_keeps_every_entry(tmp_path):
    """README: shards from `run_sweep --shard K/N`, then `vram merge shards/*.json -o LEDGER`."""
    from probe_kit import run_sweep

    sweep = tmp_path / "s.toml"
    sweep.write_text('[sweep]\nname = "t"\ndevice = "cpu"\ntimeout_s = 300\n[base]\nmodel = "tiny-llama"\n'
                     'random_weights = true\nseq_len = 128\nresponse_len = 16\n[axes]\nrank = [4, 8]\n')
    shards = tmp_path / "shards"
    for k in (1, 2):
        assert run_sweep.main([str(sweep), "--shard", f"{k}/2", "--ledger", str(shards / f"s-{k}-of-2.json"),
                               "--no-progress"]) == 0
    ledger = tmp_path / "vram.json"
    shutil.copy(SMALL, ledger)
    old_ids = [m.id for m in store.load(ledger).measurements]
    new_ids = sorted(m.id for p in shards.glob("*.json") for m in store.load(p).measurements)
    assert len(new_ids) == 2
    assert run("merge", *sorted(shards.glob("*.json")), "-o", ledger) == 0
    ids = [m.id for m in store.load(ledger).measurements]
    assert ids[:len(old_ids)] == old_ids and sorted(ids[len(old_ids):]) == new_ids
    assert run("merge", *sorted(shards.glob("*.json")), "-o", ledger) == 0  # again: nothing changes
    assert [m.id for m in store.load(ledger).measurements] == ids


def test_a_cpu_sweep_without_a_ledger_is_refused(tmp_path, capsys):
    from probe_kit import run_sweep

    bundled = REPO / "ledger" / "vram.json"
    before = bundled.read_bytes()
    assert run_sweep.main([str(REPO / "examples" / "sweeps" / "cpu-smoke.toml"), "--find-ceiling", "rank"]) == 1
    one_line_error(capsys, f"{REPO / 'examples' / 'sweeps' / 'cpu-smoke.toml'}:sweep.device: a CPU sweep needs "
                           "--ledger")
    assert bundled.read_bytes() == before


def test_probes_with_a_simulated_oom_never_enter_the_bundled_ledger(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "vram.json"
    shutil.copy(SMALL, copy)
    monkeypatch.setattr(store, "DEFAULT_LEDGER", copy)
    before = copy.read_bytes()
    sim = Measurement(id="sim", kind="probe", outcome=Outcome(status="oom"), provenance=Provenance(simulated=True))
    with pytest.raises(store.LedgerError, match="measured on the CPU or simulated"):
        store.append(copy, [sim])
    assert copy.read_bytes() == before


# -- fuzz: mutated ledgers -------------------------------------------------------------------

TOKENS = ["Infinity", "NaN", "1e309", "-1", "0", "1.12e2", "null", "true", '"x"', '"\\ud800"', "{}", "[]",
          '"measurements": [], ', '"id": "dup", ', '"rank": 100000000000000000000', "[[[[[[", "}", "]", ",", ":"]
SMALL_TEXT = SMALL.read_text(encoding="utf-8")
SHARD = store.dumps(store.merge([("s", store.empty_ledger())]).model_copy(update={"measurements": [
    Measurement(id="fuzz-new", kind="probe", outcome=Outcome(status="ok", peak_allocated_mib=5.0))]}))


@st.composite
def mutated(draw) -> str:
    text = SMALL_TEXT
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(text)))
        how = draw(st.sampled_from(["insert", "replace-number", "delete"]))
        if how == "insert":
            text = text[:pos] + draw(st.sampled_from(TOKENS)) + text[pos:]
        elif how == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 40)):]
        else:
            import re

            numbers = list(re.finditer(r"-?\d+(?:\.\d+)?", text))
            if numbers:
                m = numbers[draw(st.integers(0, len(numbers) - 1))]
                text = text[:m.start()] + draw(st.sampled_from(TOKENS[:8])) + text[m.end():]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated())
def test_fuzz_exit_is_0_or_1_and_the_file_is_old_or_new_valid(tmp_path_factory, text):
    folder = tmp_path_factory.mktemp("fuzz")
    ledger, shard = folder / "l.json", folder / "shard.json"
    ledger.write_text(text, encoding="utf-8")
    shard.write_text(SHARD, encoding="utf-8")
    err = io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout

    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        valid = run("validate", ledger)
        merged = run("merge", shard, "-o", ledger)
    assert valid in (0, 1) and merged in (0, 1)
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
    after = ledger.read_text(encoding="utf-8")
    if merged == 1:
        assert after == text
    else:
        assert valid == 0 and store.validate_file(ledger) == []
        assert any(m.id == "fuzz-new" for m in store.load(ledger).measurements)


def test_every_valid_ledger_builds_rows_without_a_gpu_included(tmp_path):
    """Ledgers the README's own commands make (a CPU sweep, merged shards) have rows with no gpu."""
    lg = store.load(SMALL)
    lg.measurements.append(Measurement(id="cpu-row", kind="probe", model="tiny-llama", quant="4bit",
                                       lora={"rank": 8}, seq_len=128, response_len=16, memory_fixes="all",
                                       outcome=Outcome(status="ok", peak_allocated_mib=5.0)))
    path = tmp_path / "cpu.json"
    store.save(lg, path)
    assert run("build", "--ledger", path, "--out", tmp_path / "site", "-q") == 0
    only = store.empty_ledger()
    only.measurements.append(lg.measurements[-1])
    store.save(only, tmp_path / "only.json")
    assert run("build", "--ledger", tmp_path / "only.json", "--out", tmp_path / "site2", "-q") == 0

"""Publishing: base URLs, downloads with hashes, changes.json and the Atom feed, public validation."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from conftest import GOLDEN_DRY, GOLDEN_VERSIONS, REPO, SMALL
from ledger import cli
from ledger.storage import store
from ledger.site.index_page import ledger_hash
from ledger.site.render import render_site as render_shipped

ATOM = "{http://www.w3.org/2005/Atom}"


def render_site(*args, **kwargs):
    """These tests are about links, downloads, changes, the feed and validation, not the fit table:
    their builds read the golden site's dry-run rows (three models) rather than every shipped
    model's, which the site tests and the build benchmark build."""
    return render_shipped(*args, dry_runs=GOLDEN_DRY, **kwargs)


@pytest.fixture(autouse=True)
def golden_rows_versions(monkeypatch):
    """The library versions the golden dry-run rows were computed with (so none reads as stale)."""
    monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", GOLDEN_VERSIONS)


def test_absolute_links_only_with_a_base_url(tmp_path):
    plain, based = tmp_path / "plain", tmp_path / "based"
    ledger = store.load(SMALL)
    render_site(ledger, plain)
    render_site(ledger, based, base_url="https://example.org/vram/")
    for name in ("index.html", "vram.md", "vram.json", "vram.schema.json", "feed.xml"):
        assert "https://example.org" not in (plain / name).read_text(encoding="utf-8")
    html = (based / "index.html").read_text(encoding="utf-8")
    assert '<link rel="canonical" href="https://example.org/vram/">' in html
    assert 'href="https://example.org/vram/vram.json"' in html
    assert json.loads((based / "vram.schema.json").read_text())["$id"] == "https://example.org/vram/vram.schema.json"
    doc = json.loads((based / "vram.json").read_text())
    assert doc["url"] == "https://example.org/vram/vram.json"
    assert doc["schema_url"] == "https://example.org/vram/vram.schema.json"


def test_bad_base_url_is_refused(tmp_path, capsys):
    assert cli.main(["build", "--ledger", str(SMALL), "--out", str(tmp_path / "s"), "--base-url", "example.org"]) == 1
    assert "--base-url: must be an http(s) URL" in capsys.readouterr().err


def test_downloads_are_listed_with_size_and_hash(tmp_path):
    import hashlib

    render_site(store.load(SMALL), tmp_path)
    html = (tmp_path / "index.html").read_text(encoding="utf-8")
    for name in ("vram.json", "vram.csv", "vram.schema.json", "changes.json", "feed.xml", "vram.md"):
        data = (tmp_path / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() in html, name
        assert f"{len(data):,} bytes" in html, name


def _edited(tmp_path):
    d = json.loads(SMALL.read_text())
    d["measurements"][1]["outcome"]["peak_allocated_mib"] = 1234.5  # changed
    removed = d["measurements"].pop(2)["id"]
    d["measurements"].append({"id": "new-probe", "kind": "probe", "outcome": {"status": "ok"}})
    d["findings"].append({"id": "new-finding", "title": "New"})
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    return path, d["measurements"][1]["id"], removed


def test_feed_lists_exactly_the_rows_that_changed(tmp_path):
    out = tmp_path / "site"
    render_site(store.load(SMALL), out)
    edited, changed_id, removed_id = _edited(tmp_path)
    render_site(store.load(edited), out, build_date="2026-11-30")
    feed = ET.parse(out / "feed.xml").getroot()
    assert feed.tag == f"{ATOM}feed"
    for tag in ("title", "id", "updated"):
        assert feed.find(f"{ATOM}{tag}").text
    entries = feed.findall(f"{ATOM}entry")
    summaries = sorted(" ".join(e.find(f"{ATOM}summary").text.split()[:3]).rstrip(".:") for e in entries)
    assert summaries == sorted(["Measurement new-probe added", f"Measurement {removed_id} removed",
                                f"Measurement {changed_id} changed", "Finding new-finding added"])
    titles = {e.find(f"{ATOM}id").text.rsplit(":", 1)[1]: e.find(f"{ATOM}title").text for e in entries}
    # In words and figures: what the row was, not only its id.
    assert titles["new-probe"] == "probe: ok (added)" and titles["new-finding"] == "New (added)"
    assert titles[removed_id].endswith("(removed)") and ":" in titles[removed_id]
    for e in entries:
        assert e.find(f"{ATOM}id").text and re.match(r"\d{4}-\d{2}-\d{2}T", e.find(f"{ATOM}updated").text)
        assert e.find(f"{ATOM}content").text  # RFC 4287 4.1.2: content (or an alternate link)
    changed = next(e for e in entries if "changed" in e.find(f"{ATOM}title").text)
    assert "outcome.peak_allocated_mib" in changed.find(f"{ATOM}summary").text
    doc = json.loads((out / "changes.json").read_text())
    (cs,) = doc["history"]
    assert cs["measurements"]["changed"][0]["fields"]["outcome.peak_allocated_mib"][1] == 1234.5
    # The page shows the latest changes; rebuilding the same ledger adds nothing.
    assert "1 measurements added, 1 changed, 1 removed" in (out / "index.html").read_text(encoding="utf-8")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    render_site(store.load(edited), out, build_date="2026-11-30")
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_a_sweep_of_thousands_of_rows_makes_a_feed_of_at_most_feed_entries():
    from ledger.site.changes import FEED_ENTRIES, atom_feed

    def change_set(sha, added, findings=()):
        empty = {"added": [], "removed": [], "changed": [], "described": {}}
        return {"to_sha256": sha, "date": "2026-11-30",
                "measurements": {**empty, "added": added, "described": {i: f"probe {i}: ok" for i in added}},
                "findings": {**empty, "added": list(findings)}}

    def entries(history):
        feed = ET.fromstring(atom_feed({"history": history}, title="t", base_url="https://example.org/",
                                       updated="2026-11-30T00:00:00Z"))
        return feed.findall(f"{ATOM}entry")

    sweep = [f"m{i}" for i in range(FEED_ENTRIES + 10)]
    got = entries([change_set("new", sweep, ["f1"]), change_set("old", ["older"])])
    assert len(got) == FEED_ENTRIES  # the newest rows, one place kept for the count; the older set left out
    assert [e.find(f"{ATOM}title").text for e in got[:2]] == ["probe m0: ok (added)", "probe m1: ok (added)"]
    more = got[-1]
    assert more.find(f"{ATOM}title").text == "12 more rows changed (see changes.json)"  # 11 rows and the finding
    assert more.find(f"{ATOM}id").text == "urn:vram-ledger:new:more"
    assert more.find(f"{ATOM}content").text and more.find(f"{ATOM}link").get("href") == "https://example.org/changes.json"
    # Sets that fit are listed whole, newest first, with nothing counted.
    small = entries([change_set("b", ["x", "y"]), change_set("a", ["z"], ["f"])])
    assert [e.find(f"{ATOM}id").text.rsplit(":", 1)[1] for e in small] == ["x", "y", "z", "f"]
    # A set that exactly fills what is left is listed whole; the next one starts no count.
    full = entries([change_set("c", sweep[:FEED_ENTRIES]), change_set("d", ["w"])])
    assert len(full) == FEED_ENTRIES and not full[-1].find(f"{ATOM}id").text.endswith(":more")


def test_previous_from_a_path(tmp_path):
    first = tmp_path / "first"
    render_site(store.load(SMALL), first)
    edited, _, _ = _edited(tmp_path)
    assert cli.main(["build", "--ledger", str(edited), "--out", str(tmp_path / "second"), "--previous",
                     str(first / "vram.json"), "-q"]) == 0
    assert len(json.loads((tmp_path / "second" / "changes.json").read_text())["history"]) == 1
    assert cli.main(["build", "--ledger", str(edited), "--out", str(tmp_path / "third"), "--previous",
                     str(tmp_path / "nope.json"), "-q"]) == 1


def test_content_hash_changes_when_and_only_when_content_does(tmp_path):
    ledger = store.load(SMALL)
    h = ledger_hash(ledger)
    # The same content, written differently (other key order, no indentation): the same hash.
    data = json.loads(SMALL.read_text())
    shuffled = json.dumps({k: data[k] for k in reversed(list(data))}, separators=(",", ":"))
    assert ledger_hash(store.parse_ledger(shuffled, "x")) == h
    changed = ledger.model_copy(deep=True)
    changed.measurements[0].provenance.notes.append("a new note")
    assert ledger_hash(changed) != h


def test_validate_public(tmp_path, capsys):
    render_site(store.load(SMALL), tmp_path)
    assert cli.main(["validate", "--public", str(tmp_path / "vram.json")]) == 0
    doc = json.loads((tmp_path / "vram.json").read_text())
    doc["ledger"]["measurements"][0]["outcome"]["peak_allocated_mib"] = 1.0
    (tmp_path / "altered.json").write_text(json.dumps(doc))
    assert cli.main(["validate", "--public", str(tmp_path / "altered.json")]) == 1
    assert "ledger_sha256: does not match" in capsys.readouterr().err
    doc["schema_version"] = 99
    (tmp_path / "newer.json").write_text(json.dumps(doc))
    assert cli.main(["validate", "--public", str(tmp_path / "newer.json")]) == 1
    assert "version 99 is newer than this vram-ledger reads (1): upgrade vram-ledger" in capsys.readouterr().err


def _workflow_steps() -> list[str]:
    """The build job's shell steps of the example deploy workflow, as written."""
    import yaml

    doc = yaml.safe_load((REPO / "examples" / "deploy" / "publish-site.yml").read_text())
    return [step["run"] for step in doc["jobs"]["build"]["steps"] if "run" in step]


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("git") is None, reason="needs curl and git")
def test_the_deploy_workflow_replayed_keeps_the_history(tmp_path):
    """Three deploys of the example workflow, each in a fresh checkout, each publishing to a live
    site served on the loopback interface that the next deploy fetches from: the third
    publication's changes.json holds both change sets (the first deploy has none)."""
    import functools
    import http.server
    import threading

    live = tmp_path / "live"
    live.mkdir()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(live))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    steps = [s for s in _workflow_steps() if not s.startswith("pip install")]  # installed already
    ledger = json.loads(SMALL.read_text())
    rows = ledger["measurements"]
    try:
        for deploy in range(3):
            checkout = tmp_path / f"checkout{deploy}"
            shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(".git", "site", "tests", "test-artifacts",
                                                                          "__pycache__", "*.egg-info"))
            doc = {**ledger, "measurements": rows[: len(rows) - 2 + deploy]}  # one row more each deploy
            (checkout / "ledger" / "vram.json").write_text(json.dumps(doc, indent=1))
            env = {**os.environ, "BASE_URL": base, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                   "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                   "GIT_AUTHOR_DATE": f"2026-11-0{deploy + 1}T00:00:00Z",
                   "GIT_COMMITTER_DATE": f"2026-11-0{deploy + 1}T00:00:00Z"}
            for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", f"deploy {deploy}"]):
                subprocess.run(cmd, cwd=checkout, env=env, check=True)
            for step in steps:
                # GitHub Actions runs a step as `bash --noprofile --norc -eo pipefail {0}`.
                done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step], cwd=checkout, env=env,
                                      capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"{step}\n{done.stderr}"
            shutil.rmtree(live)
            shutil.copytree(checkout / "site", live)  # what actions/deploy-pages publishes
    finally:
        server.shutdown()
    history = json.loads((live / "changes.json").read_text())["history"]
    assert len(history) == 2
    assert [len(cs["measurements"]["added"]) for cs in history] == [1, 1]


def test_the_public_schema_describes_the_derived_figures(tmp_path, capsys):
    from ledger import cli
    from ledger.core.results import Calibration
    from ledger.site.public import public_schema

    defs = public_schema()["$defs"]
    for name in ("Calibration", "Costs", "CardLimit", "LeaveOneOut", "Scoreboard", "EstimatorScore", "Confusion"):
        assert name in defs and defs[name].get("additionalProperties") is False, name
    assert cli.main(["calibrate", "--ledger", str(REPO / "tests" / "data" / "small-ledger.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert Calibration.model_validate(doc).document() == doc  # --json prints the typed result


def test_history_accumulates_across_builds_in_fresh_folders(tmp_path):
    """The documented deploy builds in a fresh checkout with --previous pointing at the live
    vram.json: the live changes.json beside it is carried forward, not reset."""
    edited, _, _ = _edited(tmp_path)
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    render_site(store.load(SMALL), first)
    render_site(store.load(edited), second, previous=str(first / "vram.json"), build_date="2026-11-30")
    lg = store.load(edited)
    lg.measurements.append(lg.measurements[1].model_copy(update={"id": "third-row"}))
    render_site(lg, third, previous=str(second / "vram.json"), build_date="2026-12-01")
    history = json.loads((third / "changes.json").read_text())["history"]
    assert len(history) == 2 and history[0]["measurements"]["added"] == ["third-row"]
    assert history[1]["measurements"]["added"] == ["new-probe"]
    assert "third-row" in history[0]["measurements"]["described"]

"""The README and the docs (``docs/*.md``), as written: every Python snippet compiles, the download
snippet runs against a site built from the bundled ledger and served on 127.0.0.1, every command
shown with its output prints that output, the README stays a front door (at most 200 lines), and
the docs build as a MkDocs site without warnings."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import re
import threading

import pytest

from conftest import BUNDLED, REPO
from ledger import cli

README = (REPO / "README.md").read_text(encoding="utf-8")
#: The README and every page of the docs, by their path.
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text(encoding="utf-8")
                                 for p in sorted((REPO / "docs").glob("*.md"))}}
BLOCKS = [b for text in PAGES.values() for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_python_snippet_compiles(index):
    compile(BLOCKS[index], f"README.md python block {index}", "exec")


@contextlib.contextmanager
def serve(folder):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_download_snippet_prints_the_real_run_it_names(tmp_path):
    (snippet,) = [b for b in BLOCKS if "urlopen" in b]
    site = tmp_path / "site"
    assert cli.main(["build", "--ledger", str(BUNDLED), "--out", str(site), "-q"]) == 0
    with serve(site) as base:
        code = snippet.replace("https://example.org/vram", base)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README download snippet", "exec"), {})
    # The real r96 run with dropout on the RTX 3070 Ti (real-v15), not the r96 dropout probe (7127.6).
    from ledger.storage import store

    want = [m.outcome.peak_allocated_mib for m in store.load(BUNDLED).measurements
            if m.kind == "real" and m.gpu == "rtx-3070-ti" and m.lora and m.lora.rank == 96
            and (m.lora.dropout or 0) > 0 and m.outcome.status == "ok" and m.outcome.peak_allocated_mib]
    assert want and out.getvalue().strip() == f"{max(want)} MiB peak allocated"


#: Every command the README shows with its output: ``$ COMMAND`` lines in console blocks, each
#: followed by the output it prints (``...``: the rest is left out).
CONSOLE = [b for text in PAGES.values() for b in re.findall(r"^```console\n(.*?)^```", text, re.S | re.M)]


def _examples() -> list[tuple[str, list[str]]]:
    out = []
    for block in CONSOLE:
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *expected = chunk.rstrip("\n").split("\n")
            out.append((command, expected))
    return out


EXAMPLES = _examples()


def test_the_readme_shows_commands_with_their_output():
    assert len(EXAMPLES) >= 4
    readme = re.findall(r"^```console\n(.*?)^```", README, re.S | re.M)
    assert sum(block.count("\n$ ") + block.startswith("$ ") for block in readme) >= 3  # the three questions


def test_the_readme_is_a_front_door():
    """At most 200 lines: what it is, install, the three questions with their output, the site, the
    probe kit and preflight, links; the rest is in docs/."""
    assert README.count("\n") <= 200
    for page in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (REPO / page).is_file(), page


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    import yaml

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav):
        for item in nav:
            for value in item.values():
                yield from entries(value) if isinstance(value, list) else [value]
    listed = sorted(entries(config["nav"]))
    assert listed == sorted(p.name for p in (REPO / "docs").glob("*.md"))


def test_the_docs_build_without_warnings(tmp_path, monkeypatch):
    """``mkdocs build`` in strict mode (a warning fails it: a broken link, a page left out of the
    nav, a snippet that is not there), into a temporary folder; no warning logged at all."""
    import logging

    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(REPO)
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    handler = Catch()
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        config = load_config(str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "docs"), strict=True)
        build(config)
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    assert warnings == []
    index = (tmp_path / "docs" / "index.html").read_text(encoding="utf-8")
    assert "Will it fit?" in index
    # ARCHITECTURE.md is the architecture page, included whole (not copied into docs/)
    assert "The layers" in (tmp_path / "docs" / "architecture" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("command,expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_every_command_shown_prints_what_the_readme_says(command, expected, monkeypatch, tmp_path, capsys):
    import shlex

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path / "cache"))
    argv = shlex.split(command)
    assert argv[0] == "vram", "a README example runs the vram command"
    cli.main(argv[1:])
    out = capsys.readouterr()
    got = (out.out + out.err).rstrip("\n").split("\n")
    if expected and expected[-1] == "...":
        expected = expected[:-1]
        got = got[:len(expected)]
    assert got == expected

"""Every Python snippet in the README, as written: each compiles, and the download snippet runs
against a site built from the bundled ledger and served on 127.0.0.1."""

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
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


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
CONSOLE = re.findall(r"^```console\n(.*?)^```", README, re.S | re.M)


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

"""The package as users get it: the site builds from an installed wheel (templates and model
configs travel with it), and a publisher's --templates folder overrides the shipped templates."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from conftest import GOLDEN, GOLDEN_BUILD, GOLDEN_VERSIONS, REPO, SMALL
from ledger import cli


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    base = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)]
    # The environment's own setuptools first (no download); an isolated build if it is too old.
    proc = subprocess.run(base + ["--no-build-isolation"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        proc = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("vram_ledger-*.whl")
    return path


def test_the_wheel_carries_templates_static_files_and_model_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("vram_ledger_templates/index.html.j2", "vram_ledger_templates/vram.md.j2",
                 "vram_ledger_templates/static/style.css", "vram_ledger_templates/static/sort.js",
                 "ledger/model_configs/gemma-3-4b-it.json", "ledger/cli/__init__.py", "ledger/dry-runs.json",
                 "ledger/cards.json"):
        assert name in names, name


def test_the_site_builds_from_an_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    out = tmp_path / "site"
    # Run away from the clone, with only the installed copy of vram-ledger importable before the
    # environment's own packages (its dependencies).
    env = {**os.environ, "PYTHONPATH": str(target), "VRAM_LEDGER_LIBRARY_VERSIONS": GOLDEN_VERSIONS}
    code = ("import sys, ledger; assert 'site-packages' in ledger.__file__, ledger.__file__; "
            "from ledger.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "build", *GOLDEN_BUILD, "--out", str(out), "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (out / "index.html").read_bytes() == (GOLDEN / "index.html").read_bytes()


def test_a_templates_folder_overrides_only_what_it_has(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", GOLDEN_VERSIONS)
    mine = tmp_path / "theme"
    (mine / "static").mkdir(parents=True)
    (mine / "static" / "style.css").write_text("body { color: rebeccapurple; }\n")
    out = tmp_path / "site"
    assert cli.main(["build", *GOLDEN_BUILD, "--out", str(out), "-q", "--templates", str(mine)]) == 0
    html = (out / "index.html").read_text(encoding="utf-8")
    assert "rebeccapurple" in html and "Click a header to sort" in html  # shipped template and script kept
    assert (out / "vram.md").read_bytes() == (GOLDEN / "vram.md").read_bytes()


def test_a_missing_templates_folder_is_one_line(tmp_path, capsys):
    assert cli.main(["build", "--ledger", str(SMALL), "--out", str(tmp_path / "s"), "--templates",
                     str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip() == f"{tmp_path / 'nope'}: --templates needs a folder of templates"

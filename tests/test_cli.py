"""CLI: help for every command, documented in the README, exit codes, no torch in the core."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from ledger import cli

COMMANDS = sorted(c.name for c in cli.COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_and_is_documented(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert len(out) > 100
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"vram {name}" in readme, f"README.md does not document `vram {name}`"


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["validate", "--no-such-flag"])
    assert exc.value.code == 2


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "ledger.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "validate" in out.stdout


def test_core_never_imports_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ledger, ledger.cli, ledger.store, ledger.legacy, ledger.models\n"
        "cli = ledger.cli.build_parser()\n"
        "import importlib, pkgutil\n"
        "for m in pkgutil.walk_packages(ledger.__path__, 'ledger.'):\n"
        "    importlib.import_module(m.name)\n"
        "import runpy; runpy.run_path('build.py', run_name='not_main')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

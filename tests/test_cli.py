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
    commands = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    assert f"`vram {name}" in commands, f"docs/commands.md does not document `vram {name}`"


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
        "import ledger, ledger.cli, ledger.storage.store, ledger.intake.legacy, ledger.core.models\n"
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


@pytest.mark.parametrize("argv,flag,says", [
    (["--seq-len", "0"], "--seq-len", "must be > 0, got 0"),
    (["--seq-len", "512", "--batch-size", "0"], "--batch-size", "must be > 0, got 0"),
    (["--seq-len", "999999"], "--seq-len", "past qwen2.5-7b's context (max_position_embeddings 32768)"),
])
def test_an_answer_refuses_a_recipe_the_model_cannot_run_on_one_located_line(argv, flag, says, capsys):
    for command in (["estimate", "--rank", "16"], ["ceiling", "--gpu", "rtx-4090"]):
        assert cli.main([*command, "--model", "qwen2.5-7b", *argv, "--no-compute"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"{flag}: ") and says in err and err.count("\n") == 1


def test_predict_names_a_missing_ledger_and_says_when_it_starts_one(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert cli.main(["predict", "--ledger", str(missing), "--gpu", "rtx-4090", "--rank", "16", "--seq-len", "1024"]) == 1
    assert f"{missing}: no such ledger" in capsys.readouterr().err and not missing.exists()
    assert cli.main(["predict", "--ledger", str(missing), "--model", "qwen2.5-7b", "--gpu", "rtx-4090", "--rank", "16",
                     "--seq-len", "1024"]) == 0
    assert "this prediction starts a new one" in capsys.readouterr().err and missing.exists()


def test_a_ledger_made_read_only_is_never_replaced(tmp_path, capsys):
    from conftest import BUNDLED

    path = tmp_path / "ro.json"
    path.write_bytes(BUNDLED.read_bytes())
    path.chmod(0o444)
    assert cli.main(["predict", "--ledger", str(path), "--model", "qwen2.5-7b", "--gpu", "rtx-4090", "--rank", "16",
                     "--seq-len", "1024"]) == 1
    assert "is read-only (mode 0444): not replaced" in capsys.readouterr().err
    assert path.read_bytes() == BUNDLED.read_bytes()

"""The import rules of ARCHITECTURE.md, read off the source (every import, at any depth)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at the top level?) for every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if node.module is None or node.level else [base]
            out += [(n, id(node) in top) for n in names]
    return out


def files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


LIBRARY = [p for p in files("ledger") if "cli" not in p.relative_to(REPO / "ledger").parts]


def _is(module: str, *names: str) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(REPO)))
def test_the_library_imports_no_probe_kit_cli_torch_or_argparse(path):
    bad = [m for m, _ in imports(path) if _is(m, "probe_kit", "ledger.cli", "torch", "argparse")]
    assert bad == []


def test_the_cli_imports_the_probe_kit_only_inside_functions():
    bad = [(p.name, m) for p in files("ledger/cli") for m, top in imports(p) if _is(m, "probe_kit", "torch") and top]
    assert bad == []


def test_the_probe_kit_never_imports_the_cli_and_parses_arguments_only_in_its_tools():
    tools = {"probe_vram.py", "run_sweep.py", "dry_run.py"}
    for p in files("probe_kit"):
        mods = [m for m, _ in imports(p)]
        assert not any(_is(m, "ledger.cli") for m in mods), p
        if p.name not in tools:
            assert not any(_is(m, "argparse") for m in mods), p


def test_build_py_is_a_thin_entry_point():
    mods = [m for m, _ in imports(REPO / "build.py")]
    assert [m for m in mods if m != "sys"] == ["ledger.cli"]


def test_the_rules_are_the_documented_ones():
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for rule in ("never imports `probe_kit`, `ledger.cli`, `torch` or\n  `argparse`", "imports only `ledger.cli`"):
        assert rule in text

"""The import rules of ARCHITECTURE.md, read off the source (every import, at any depth)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO


def imports(path: Path, root: Path = REPO) -> list[tuple[str, bool]]:
    """(module imported, at the top level?) for every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
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


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth of the file (inside functions too);
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    mods: dict[str, Path] = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    return {n: {r for m, _ in imports(p, root) if (r := resolve(m)) not in (None, n)} for n, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other round a loop (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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
    tools = {"probe_vram.py", "run_sweep.py", "dry_run.py", "gloo_run.py", "replay.py", "__main__.py"}
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


GRAPH = import_graph(REPO, ("ledger", "probe_kit"))


def test_no_module_imports_itself_round_a_loop():
    assert cycles(GRAPH) == []


def test_a_loop_through_an_import_inside_a_function_is_caught(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def late():\n    from .c import x\n    return x\n")
    (pkg / "c.py").write_text("def x():\n    from pkg.a import b\n    return b\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("def x():\n    return 1\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == []


def layers() -> list[list[str]]:
    """The library's layers, bottom first, as ARCHITECTURE.md lists them (its ``layers`` block): one
    line a package, ``name: its modules``; a package's ``__init__`` belongs to its own layer, and the
    line ``ledger: ledger`` is the top package's ``__init__``."""
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        if ":" not in line:
            continue
        package, names = (x.strip() for x in line.split(":", 1))
        if package == "ledger":
            out.append(["ledger"])
        else:
            out.append([f"ledger.{package}"] + [f"ledger.{package}.{m}" for m in names.split()])
    return out


def test_each_layer_is_a_package_of_its_own():
    """The layout shows the layers: every library module lies in the folder of its layer's package,
    and no two layers share a package."""
    for layer in layers()[1:] if layers()[0] == ["ledger"] else layers():
        package = layer[0]
        assert all(m.startswith(package + ".") for m in layer[1:]), layer
        assert (REPO / package.replace(".", "/") / "__init__.py").is_file(), package
    assert len({layer[0] for layer in layers()}) == len(layers())


def test_each_package_says_what_it_owns_and_may_import():
    for layer in layers():
        if layer[0] in ("ledger", "ledger.site"):
            continue
        doc = ast.get_docstring(ast.parse((REPO / layer[0].replace(".", "/") / "__init__.py").read_text()))
        assert doc and "May import" in doc, layer[0]


def test_the_flat_import_paths_of_earlier_releases_still_work():
    import importlib

    import ledger

    for old, new in ledger.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from ledger import store  # the form scripts used

    assert store.__name__ == "ledger.storage.store" and ledger.LAYERS
    listed = {m for layer in layers() for m in layer}
    assert set(ledger.MOVED.values()) <= listed


def test_every_library_module_has_a_documented_layer():
    listed = [m for layer in layers() for m in layer]
    library = {m for m in GRAPH if m.startswith("ledger") and not m.startswith("ledger.cli")}
    assert sorted(library - set(listed)) == [] and sorted(set(listed) - library) == []
    assert len(listed) == len(set(listed))


def test_imports_run_down_the_layers_only():
    """A library module imports its own layer or those below it, never one above (function-level
    imports included): data flows one way."""
    level = {m: i for i, layer in enumerate(layers()) for m in layer}
    against = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m in level
                     for d in deps if d in level and level[d] > level[m])
    assert against == []


def test_data_coming_in_never_reaches_up_and_nothing_above_reads_it():
    """The modules that bring data in (ingest, logs, legacy) import nothing that answers, and no
    answering or publishing module imports them: only the command line and the probe kit do."""
    data_in = {"ledger.intake.ingest", "ledger.intake.logs", "ledger.intake.legacy"}
    level = {m: i for i, layer in enumerate(layers()) for m in layer}
    top_of_data_in = max(level[m] for m in data_in)
    for m in data_in:
        assert all(level.get(d, 0) <= top_of_data_in for d in GRAPH[m]), m
    readers = sorted(m for m, deps in GRAPH.items() if deps & data_in and m not in data_in
                     and not m.startswith(("ledger.cli", "probe_kit")))
    assert readers == []


def _sizes() -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every library module over 450 lines and every class over 200."""
    out = []
    for p in files("ledger"):
        text = p.read_text(encoding="utf-8")
        rel = str(p.relative_to(REPO))
        if text.count("\n") > 450:
            out.append(("module", rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                out.append(("class", node.name, node.end_lineno - node.lineno + 1))
    return out


def test_a_module_or_class_past_the_guideline_is_named_in_architecture_md_with_why():
    """No module over ~450 lines and no class over ~200 without a line in ARCHITECTURE.md's section
    on larger parts saying why."""
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("### Where a part is larger than the rest, and why", 1)[1].split("\n## ", 1)[0]
    missing = [f"{kind} {name} ({n} lines)" for kind, name, n in _sizes() if f"`{name}`" not in section]
    assert missing == []

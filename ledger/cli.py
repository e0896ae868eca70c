"""The ``vram`` command: a thin layer over the library.

Each command parses its options and calls one library function. A UserError is
printed as one located line per problem on stderr, exit 1; usage errors exit 2
(argparse); nothing is written when anything is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from . import store
from .errors import Issue, UserError
from .paths import DEFAULT_LEDGER, SCHEMA_FILE, shown

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {}


def command(name: str, help: str):
    """Register ``fn(args) -> int`` as a subcommand; its docstring is the long help."""

    def wrap(fn):
        COMMANDS[name] = (help, fn)
        return fn

    return wrap


# -- commands ------------------------------------------------------------------


def _add_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", nargs="?", default=shown(DEFAULT_LEDGER), help="ledger file (default: %(default)s)")
    p.add_argument("--public", action="store_true",
                   help="the file is a downloaded vram.json: check it against its schema and its content hash")


@command("validate", "check a ledger file against the schema and its cross-references")
def cmd_validate(args: argparse.Namespace) -> int:
    """Validate with both the JSON Schema (jsonschema) and the pydantic models, then the
    cross-references (known gpus, known evidence ids, unique ids). Exit 0 when valid. With
    --public: a published vram.json, checked against the public schema, the ledger inside it,
    and its ledger_sha256; a newer schema_version than this version reads is refused."""
    if args.public:
        from .site.public import validate_public

        issues = validate_public(args.ledger)
        if issues:
            raise UserError(issues)
        print(f"{args.ledger}: valid")
        return 0
    issues = store.validate_file(args.ledger)
    if issues:
        raise UserError(issues)
    print(f"{args.ledger}: valid")
    return 0


def _add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", help="the program's older vram.json")
    p.add_argument("-o", "--output", required=True, help="new ledger file to write")
    p.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")


@command("import-legacy", "convert the program's older vram.json into a ledger (nothing lost)")
def cmd_import_legacy(args: argparse.Namespace) -> int:
    """Every number and text of the old file lands in the new ledger; figures held in free
    text become structured fields and the text is kept too."""
    from .legacy import import_legacy

    out = Path(args.output)
    if out.exists() and not args.force:
        raise UserError(Issue(str(out), "", "exists already (use --force to overwrite)"))
    data = store.parse_json(store.read_text(args.old), args.old)
    ledger = import_legacy(data, args.old)
    store.save(ledger, out)
    print(
        f"{out}: {len(ledger.measurements)} measurements, {len(ledger.gpus)} gpus, "
        f"{len(ledger.findings)} findings, {len(ledger.predictions)} predictions"
    )
    return 0


def _add_merge(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="shard ledgers to merge")
    p.add_argument("-o", "--output", required=True,
                   help="ledger to write; when it exists, its own entries are kept and the inputs merged into it")


@command("merge", "merge shard ledgers into one (into OUTPUT's entries when it exists)")
def cmd_merge(args: argparse.Namespace) -> int:
    """Entries are unioned by id. The same id with the same content is kept once; with different
    content it is an error naming both files, and nothing is written. A new OUTPUT is sorted by
    id; an existing OUTPUT keeps its entries in their order and gets the new ones after them
    (locked, atomic), so `vram merge shards/*.json -o ledger/vram.json` adds the shards to the
    ledger and loses nothing."""
    ledgers = [(name, store.load(name)) for name in args.inputs]
    merged = store.merge(ledgers)
    out = Path(args.output)
    if out.exists():
        before = len(store.load(out).measurements)
        added = store.append(out, merged.measurements, findings=merged.findings, predictions=merged.predictions,
                             gpus=merged.gpus)
        total = len(store.load(out).measurements)
        print(f"{args.output}: {total} measurements ({total - before} new; {added} entries added in all) "
              f"after merging {len(ledgers)} files into its {before}")
        return 0
    store.save(merged, out)
    print(f"{args.output}: {len(merged.measurements)} measurements from {len(ledgers)} files")
    return 0


def _add_migrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", help="ledger file written by an older vram-ledger")
    p.add_argument("-o", "--output", help="write here instead of in place")


@command("migrate", "update a ledger written by an older version to the current schema")
def cmd_migrate(args: argparse.Namespace) -> int:
    """Applies the chained update_to_N migrations and writes the file atomically."""
    ledger = store.load(args.ledger, allow_older=True)
    out = args.output or args.ledger
    store.save(ledger, out)
    print(f"{out}: schema_version {ledger.schema_version}")
    return 0


def _add_schema(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help=f"write the schema here (e.g. {SCHEMA_FILE.name}); default: stdout")


@command("schema", "print or write the ledger's JSON Schema (generated from the models)")
def cmd_schema(args: argparse.Namespace) -> int:
    """The schema is generated from ledger/models.py; the committed copy is
    schema/ledger.schema.json and a test keeps them equal."""
    text = store.schema_text()
    if args.output:
        store.atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


ADDERS = {
    "validate": _add_validate,
    "import-legacy": _add_import,
    "merge": _add_merge,
    "migrate": _add_migrate,
    "schema": _add_schema,
}


def register(name: str, help: str, adder: Callable[[argparse.ArgumentParser], None]):
    """Register a subcommand defined in another module (its options via ``adder``)."""

    def wrap(fn):
        COMMANDS[name] = (help, fn)
        ADDERS[name] = adder
        return fn

    return wrap


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    parser = argparse.ArgumentParser(
        prog="vram",
        description="Measure, predict and publish GPU memory for LLM (Q)LoRA fine-tuning.",
        epilog="Exit codes: 0 ok, 1 bad data (one located line per problem), 2 bad usage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=(fn.__doc__ or help_text).strip())
        ADDERS[name](p)
        p.set_defaults(func=fn)
    return parser


def _load_plugins() -> None:
    # Commands defined beside their library code register themselves on import.
    for module in PLUGINS:
        importlib.import_module(module)


#: Modules that add commands with ``register``.
PLUGINS: list[str] = ["ledger.site_cli", "ledger.probe_cli", "ledger.ingest", "ledger.calibrate_cli", "ledger.estimate_cli"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        for issue in exc.issues:
            print(str(issue), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file the library did not expect to fail (the library names its own)
        where = exc.filename if exc.filename is not None else "vram"
        print(f"{where}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def dump_json(doc: object) -> None:
    """Print one JSON document on stdout (for --json)."""
    json.dump(doc, sys.stdout, indent=2, ensure_ascii=False, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: plugins register themselves on
    # ledger.cli.
    from ledger.cli import main as _main

    sys.exit(_main())

"""Commands on ledger files: validate, import-legacy, merge, migrate, schema."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ledger.storage import store
from ledger.core.errors import Issue, UserError
from ledger.core.paths import DEFAULT_LEDGER, SCHEMA_FILE, shown
from .options import Command


def _add_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", nargs="?", default=shown(DEFAULT_LEDGER), help="ledger file (default: %(default)s)")
    p.add_argument("--public", action="store_true",
                   help="the file is a downloaded vram.json: check it against its schema and its content hash")


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate with both the JSON Schema (jsonschema) and the pydantic models, then the
    cross-references (known gpus, known evidence ids, unique ids). Exit 0 when valid. With
    --public: a published vram.json, checked against the public schema, the ledger inside it,
    and its ledger_sha256; a newer schema_version than this version reads is refused."""
    if args.public:
        from ..site.public import validate_public

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


def _add_init(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", help="the new ledger file")
    p.add_argument("--about", help="what the ledger holds, in Markdown (shown on its site)")


def cmd_init(args: argparse.Namespace) -> int:
    """Start a ledger: a valid, empty ledger file (schema_version, no rows) for probes, logs,
    the TrainerCallback and predictions to append to. An existing file is never overwritten. (The
    callback, `vram ingest-log` and `vram predict` also create a missing ledger on their first
    write.)"""
    out = Path(args.ledger)
    if os.path.lexists(out):
        raise UserError(Issue(str(out), "", "exists already: a ledger is never overwritten (give a new path)"))
    with store.locked(out):
        if os.path.lexists(out):
            raise UserError(Issue(str(out), "", "exists already: a ledger is never overwritten (give a new path)"))
        store.save_unlocked(store.empty_ledger(args.about), out)
    print(f"{out}: a new, empty ledger")
    return 0


def _add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", help="the program's older vram.json")
    p.add_argument("-o", "--output", required=True, help="new ledger file to write")
    p.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")


def cmd_import_legacy(args: argparse.Namespace) -> int:
    """Every number and text of the old file lands in the new ledger; figures held in free
    text become structured fields and the text is kept too."""
    from ledger.intake.legacy import import_legacy

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
              f"after merging {_files(len(ledgers))} into its {before}")
        return 0
    store.save(merged, out)
    print(f"{args.output}: {len(merged.measurements)} measurements from {_files(len(ledgers))}")
    return 0


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _add_migrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", help="ledger file written by an older vram-ledger")
    p.add_argument("-o", "--output", help="write here instead of in place")


def cmd_migrate(args: argparse.Namespace) -> int:
    """Applies the chained update_to_N migrations and writes the file atomically."""
    ledger = store.load(args.ledger, allow_older=True)
    out = args.output or args.ledger
    store.save(ledger, out)
    print(f"{out}: schema_version {ledger.schema_version}")
    return 0


def _add_schema(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help=f"write the schema here (e.g. {SCHEMA_FILE.name}); default: stdout")


def cmd_schema(args: argparse.Namespace) -> int:
    """The schema is generated from ledger/models.py; the committed copy is
    schema/ledger.schema.json and a test keeps them equal."""
    text = store.schema_text()
    if args.output:
        store.atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


COMMANDS = [
    Command("validate", "check a ledger file against the schema and its cross-references", _add_validate,
            cmd_validate),
    Command("init", "start a new, empty ledger file", _add_init, cmd_init),
    Command("import-legacy", "convert the program's older vram.json into a ledger (nothing lost)", _add_import,
            cmd_import_legacy),
    Command("merge", "merge shard ledgers into one (into OUTPUT's entries when it exists)", _add_merge, cmd_merge),
    Command("migrate", "update a ledger written by an older version to the current schema", _add_migrate,
            cmd_migrate),
    Command("schema", "print or write the ledger's JSON Schema (generated from the models)", _add_schema,
            cmd_schema),
]

"""The ``vram`` command: a thin layer over the library.

Each command module under ``ledger/cli/`` lists its commands in ``COMMANDS``: a name, one line of
help, a function that adds its options (from the shared groups in ``options``) and a function
that parses nothing more, calls one library function and prints. This module imports them
explicitly and builds one parser. A UserError is printed as one located line per problem on
stderr, exit 1; usage errors exit 2 (argparse); nothing is written when anything is wrong.
The CLI is the only code that parses arguments; the library never sees an argparse Namespace.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ledger.storage import store
from ledger.core.errors import UserError
from . import build, calibrate, ceiling, doctor, estimate, files, fit, ingest_log
from .options import Command, dump_json

__all__ = ["COMMANDS", "build_parser", "dump_json", "main"]

#: Every command, in the order `vram --help` lists them.
COMMANDS: list[Command] = [*files.COMMANDS, *build.COMMANDS, *ingest_log.COMMANDS, *calibrate.COMMANDS, *ceiling.COMMANDS,
                           *estimate.COMMANDS, *fit.COMMANDS, *doctor.COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vram",
        description="Measure, predict and publish GPU memory for LLM (Q)LoRA fine-tuning.",
        epilog="Exit codes: 0 ok, 1 bad data (one located line per problem), 2 bad usage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=(cmd.run.__doc__ or cmd.help).strip())
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # A command is a whole process: what it loads (a ledger of 100k rows) lives until it ends,
        # so the collector may freeze it rather than walk it again on every collection.
        store.FREEZE_SURVIVORS = True
        return int(args.run(args) or 0)
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

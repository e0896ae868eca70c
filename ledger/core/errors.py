"""The one error type users see: a list of located problems, printed one per line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Issue:
    """One problem at one place: ``file:location: message``."""

    file: str
    location: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.location}" if self.location else self.file
        return f"{where}: {self.message}"


class UserError(Exception):
    """Bad input or bad usage that the user can fix. Printed as one line each, exit 1."""

    def __init__(self, issues: Iterable[Issue] | Issue | str):
        if isinstance(issues, (Issue, str)):
            issues = [issues]
        self.issues: list[Issue | str] = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


class LedgerError(UserError):
    """A ledger file that cannot be read, validated or written."""


def format_loc(loc: Iterable[object]) -> str:
    """Turn a pydantic / jsonschema path into ``measurements[12].lora.rank``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out

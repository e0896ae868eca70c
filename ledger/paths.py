"""Where the bundled files live. The project is used from a clone, installed editable."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
#: The bundled ledger: the program's measurements, migrated.
DEFAULT_LEDGER = PACKAGE_DIR / "vram.json"
#: The committed JSON Schema, generated from ledger/models.py.
SCHEMA_FILE = REPO_ROOT / "schema" / "ledger.schema.json"


def shown(path: str | os.PathLike) -> str:
    """A path as users should see it in messages: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)

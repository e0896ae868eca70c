"""Where the bundled files live. The project is used from a clone, installed editable."""

from __future__ import annotations

import os
from pathlib import Path

#: The ``ledger`` package's folder: its data files (the bundled ledger, the card table, the shipped
#: dry runs and model configs) live beside its layers' packages.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent
#: The bundled ledger: the program's measurements, migrated.
DEFAULT_LEDGER = PACKAGE_DIR / "vram.json"
#: Dry-run rows (kind dry_run, no card): predictions under fake tensors, computed on a CPU by the
#: dry-run sweeps in sweeps/ and committed as data, so a build needs no torch.
DRY_RUNS = PACKAGE_DIR / "dry-runs.json"
#: The committed JSON Schema, generated from ledger/models.py.
SCHEMA_FILE = REPO_ROOT / "schema" / "ledger.schema.json"
#: Public configs of the models the ledger describes (data the ledger owns; the probe kit and the
#: estimators read them): '<name>.json', e.g. gemma-3-4b-it.json.
MODEL_CONFIGS = PACKAGE_DIR / "model_configs"


def shipped_templates() -> Path:
    """The site's jinja2 templates and static files: ``templates/`` at the top of a clone (an
    editable install), else the copy a wheel installs as the package ``vram_ledger_templates``."""
    local = REPO_ROOT / "templates"
    if (local / "index.html.j2").is_file():
        return local
    from importlib.resources import files

    return Path(str(files("vram_ledger_templates")))


def shown(path: str | os.PathLike) -> str:
    """A path as users should see it in messages: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)

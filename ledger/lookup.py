"""Finding things in a ledger by the names people use."""

from __future__ import annotations

from typing import Optional

from .errors import Issue, UserError
from .legacy import slug
from .models import Ledger


def resolve_gpu(ledger: Ledger, name: str) -> Optional[str]:
    """The key of the card called ``name``: its key, an alias, its name, or a slug of either."""
    want = slug(name)
    for key, gpu in ledger.gpus.items():
        names = {key, gpu.name, *gpu.aliases}
        if name in names or want in {slug(n) for n in names}:
            return key
    return None


def require_gpu(ledger: Ledger, name: str, where: str = "--gpu") -> str:
    key = resolve_gpu(ledger, name)
    if key is None:
        known = ", ".join(sorted(ledger.gpus)) or "none"
        raise UserError(Issue(where, "", f"unknown gpu {name!r} (known: {known})"))
    return key

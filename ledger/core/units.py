"""Sizes as people and tools print them, turned into MiB; one place for unit rules."""

from __future__ import annotations

import re

#: MiB per unit. "MB"/"GB" are read as MiB/GiB: torch, the program's notes and
#: Unsloth all divide by powers of 1024 and print the decimal-looking names.
_MIB_PER_UNIT = {
    "b": 1 / 2**20,
    "byte": 1 / 2**20,
    "bytes": 1 / 2**20,
    "kib": 1 / 1024,
    "kb": 1 / 1024,
    "mib": 1.0,
    "mb": 1.0,
    "gib": 1024.0,
    "gb": 1024.0,
    "tib": 1024.0**2,
    "tb": 1024.0**2,
}

#: A number followed by a size unit, e.g. "7.39 GB", "248 MB", "20.00 MiB", "512 bytes".
SIZE = r"(?P<num>\d+(?:[.,]\d+)*)\s*(?P<unit>[KMGT]i?B|bytes?|B)\b"
SIZE_RE = re.compile(SIZE)


def to_mib(number: str | float, unit: str) -> float:
    """Convert ``number unit`` to MiB. Raises ValueError for an unknown unit."""
    try:
        factor = _MIB_PER_UNIT[unit.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown size unit {unit!r}") from None
    value = float(str(number).replace(",", "")) if isinstance(number, str) else float(number)
    return value * factor


def round_mib(value: float) -> float:
    """Round a MiB figure to 0.1 MiB, the resolution the ledger keeps."""
    return round(value, 1)

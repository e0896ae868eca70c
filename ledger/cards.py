"""The card vocabulary every command shares: the ledger's own cards first, then the common cards
of the card table (``ledger/cards.json``: total MiB, what PyTorch reports as usable, and the
public source of each figure). No torch, no fits: names in, entries out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .errors import Issue, UserError
from .models import Gpu, Ledger, Provenance
from .paths import PACKAGE_DIR
from .recipe import resolve_gpu

CARDS_FILE = PACKAGE_DIR / "cards.json"


@dataclass(frozen=True)
class Card:
    key: str
    gpu: Gpu
    source: str


@lru_cache(maxsize=1)
def _card_table() -> tuple[tuple[str, Card], ...]:
    doc = json.loads(CARDS_FILE.read_text(encoding="utf-8"))
    return tuple((c["key"], Card(c["key"], Gpu(name=c["name"], vendor=c["vendor"], total_mib=c["total_mib"],
                                                usable_gib_torch=c.get("usable_gib_torch"),
                                                aliases=c.get("aliases", []), provenance=Provenance(source=c["source"])),
                                  c["source"])) for c in doc["cards"])


def card_table() -> dict[str, Card]:
    """The common cards (``ledger/cards.json``) by key (read once; a fresh dict each call)."""
    return dict(_card_table())


def resolve_card(ledger: Ledger, name: str) -> Optional[tuple[str, Gpu, str]]:
    """(key, entry, 'ledger' | 'card table') for a card name, key or alias; the ledger first."""
    key = resolve_gpu(ledger.gpus, name)
    if key is not None:
        return key, ledger.gpus[key], "ledger"
    table = card_table()
    key = resolve_gpu({k: c.gpu for k, c in table.items()}, name)
    if key is not None:
        return key, table[key].gpu, "card table"
    return None


def known_card_names(ledger: Ledger) -> list[str]:
    return sorted(set(ledger.gpus) | set(card_table()))


def require_card(ledger: Ledger, name: str, where: str = "--gpu") -> tuple[str, Gpu, str]:
    """``resolve_card``, or a one-line error listing every card a command accepts."""
    found = resolve_card(ledger, name)
    if found is None:
        raise UserError(Issue(where, "", f"unknown gpu {name!r} (known: {', '.join(known_card_names(ledger))}; for "
                              "another card give --budget-mib with any of them)"))
    return found

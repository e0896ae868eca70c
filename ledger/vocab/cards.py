"""The card vocabulary every command shares: the ledger's own cards first, then the common cards
of the card table (``ledger/cards.json``: total MiB, what PyTorch reports as usable, and the
public source of each figure). No torch, no fits: names in, entries out."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ledger.core.errors import Issue, UserError
from ledger.core.models import Gpu, Ledger, Provenance
from ledger.core.paths import PACKAGE_DIR
from .recipe import resolve_gpu

CARDS_FILE = PACKAGE_DIR / "cards.json"


@dataclass(frozen=True)
class Card:
    key: str
    gpu: Gpu
    source: str
    #: The total nvidia-smi shows (MiB), where a public source gives it.
    smi_total_mib: Optional[float] = None
    #: Shown on the site's fit page (the common cards; the commands answer every card).
    fit_page: bool = False


@lru_cache(maxsize=1)
def _card_table() -> tuple[tuple[str, Card], ...]:
    doc = json.loads(CARDS_FILE.read_text(encoding="utf-8"))
    return tuple((c["key"], Card(c["key"], Gpu(name=c["name"], vendor=c["vendor"], total_mib=c["total_mib"],
                                                usable_gib_torch=c.get("usable_gib_torch"),
                                                aliases=c.get("aliases", []), provenance=Provenance(source=c["source"])),
                                  c["source"], c.get("smi_total_mib"), c.get("fit_page", False))) for c in doc["cards"])


@dataclass(frozen=True)
class UsableRatio:
    """What PyTorch reports as a card's total over what nvidia-smi shows, on the cards of the card
    table that have a public source for both: the rule that turns a total into usable memory."""

    low: float
    high: float
    cards: tuple[str, ...]

    def usable_mib(self, total_mib: float) -> tuple[float, float]:
        return round(total_mib * self.low, 1), round(total_mib * self.high, 1)

    def describe(self) -> str:
        return (f"PyTorch reports {self.low:.4f}–{self.high:.4f} of nvidia-smi's total on "
                f"{', '.join(self.cards)} (the card table's sources)")


@lru_cache(maxsize=1)
def usable_ratio() -> UsableRatio:
    pairs = [(k, c.gpu.usable_gib_torch * 1024 / c.smi_total_mib) for k, c in _card_table()
             if c.smi_total_mib and c.gpu.usable_gib_torch]
    ratios = [r for _, r in pairs]
    return UsableRatio(min(ratios), max(ratios), tuple(k for k, _ in pairs))


#: Metal's ``recommendedMaxWorkingSetSize`` over a Mac's unified memory: what the GPU may hold
#: before macOS pages the rest out. Metal device logs print it (a 16 GB Mac: 11,453 MB, 0.70; 32 and
#: 36 GB Macs: 0.82) and PyTorch's MPSAllocator.h calls it "typically 75% of total system memory".
#: The MPS allocator itself raises an out-of-memory error only at ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``
#: (default 1.7) times it, past the physical memory: on a Mac the working set is the limit, and
#: the OS and every other app share the same memory.
MPS_WORKING_SET = (0.70, 0.82)
#: Said with every answer for a Mac.
UNIFIED_NOTE = "unified memory: the OS and other apps share it"


def mps_working_set_mib(entry: Gpu) -> tuple[float, float]:
    """(low, high) of a Mac's recommended working set, MiB, from its unified memory."""
    return round(entry.total_mib * MPS_WORKING_SET[0], 1), round(entry.total_mib * MPS_WORKING_SET[1], 1)


def is_mac(entry: Optional[Gpu]) -> bool:
    return entry is not None and entry.vendor == "apple"


def derives_usable(entry: Optional[Gpu]) -> bool:
    """A CUDA card whose usable memory no PyTorch report gives: derived from its total by the rule
    (ROCm reports a card's whole memory, so an AMD card's total is what PyTorch sees)."""
    return entry is not None and not entry.usable_gib_torch and entry.vendor == "nvidia" and bool(entry.total_mib)


def card_of_total(total_mib: float) -> tuple[str, Gpu]:
    """A card the table does not list, by the total nvidia-smi shows for it (``--gpu-mib``)."""
    total = float(total_mib)
    key = f"gpu-{total:g}-mib"
    return key, Gpu(name=f"a card of {total:g} MiB (--gpu-mib)", vendor="nvidia", total_mib=total,
                    provenance=Provenance(source=f"--gpu-mib {total:g}: the total nvidia-smi shows"))


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


#: Words a card's name may carry or lack without naming another card.
_VENDOR_WORDS = ("nvidia", "geforce", "amd", "radeon")


def compact(name: str) -> str:
    """A card's name as people type it, compared: lower case, vendor words and everything but
    letters and digits dropped ('NVIDIA GeForce RTX 4090', 'RTX4090' and 'rtx-4090' are one)."""
    low = name.lower()
    for word in _VENDOR_WORDS:
        low = re.sub(rf"\b{word}\b", " ", low)
    return re.sub(r"[^a-z0-9]+", "", low)


def _spellings(ledger: Ledger) -> dict[str, tuple[str, set[str]]]:
    """Every card a command accepts: key -> (its name, the compact forms of its key, name and aliases)."""
    out = {k: (c.gpu.name, {compact(n) for n in (k, c.gpu.name, *c.gpu.aliases)}) for k, c in card_table().items()}
    for k, g in ledger.gpus.items():
        out[k] = (g.name, {compact(n) for n in (k, g.name, *g.aliases)})
    return out


def require_card(ledger: Ledger, name: str, where: str = "--gpu") -> tuple[str, Gpu, str]:
    """``resolve_card`` (a key, name or alias, spaced and prefixed as people type it: ``compact``),
    or a one-line error: a name that could be several cards lists them (an ``A100`` is 40 or 80 GB),
    else the nearest names."""
    found = resolve_card(ledger, name)
    if found is not None:
        return found
    want = compact(name)
    cards = _spellings(ledger)
    exact = sorted(k for k, (_, forms) in cards.items() if want in forms)
    if len(exact) == 1:
        return resolve_card(ledger, exact[0])
    other = "for another card give --gpu-mib with the total nvidia-smi shows for it; `vram cards` lists them"
    if len(exact) > 1 or not want:
        candidates = exact
    else:
        candidates = sorted(k for k, (_, forms) in cards.items() if any(f.startswith(want) for f in forms))
    if len(candidates) > 1 and len(exact) != 1:
        listed = ", ".join(f"{k} ({cards[k][0]})" for k in candidates[:8])
        raise UserError(Issue(where, "", f"ambiguous gpu {name!r}: it could be {listed}; name one ({other})"))
    if not candidates:
        forms = {f: k for k, (_, fs) in cards.items() for f in fs}
        candidates = sorted({forms[f] for f in difflib.get_close_matches(want, list(forms), n=3, cutoff=0.75)})
    hint = f"; did you mean {' or '.join(f'{k} ({cards[k][0]})' for k in candidates)}?" if candidates else ""
    raise UserError(Issue(where, "", f"unknown gpu {name!r}{hint} ({other})"))

"""Unit filters and safe Markdown for the templates, in one place (unit-tested).

Every figure is shown with its unit: MiB with one decimal, GiB with two, percent with one.
Note text is Markdown rendered by markdown-it-py with raw HTML disabled and only
http(s), relative and in-page links allowed.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

from markdown_it import MarkdownIt
from markupsafe import Markup, escape

_SCHEME = re.compile(r"^\s*([a-z][a-z0-9+.-]*):", re.I)


def _validate_link(url: str) -> bool:
    # Only http(s), in-page and relative links: no javascript:, data:, vbscript:, file: ...
    scheme = _SCHEME.match(url)
    return scheme is None or scheme.group(1).lower() in ("http", "https")


_MD = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
_MD.validateLink = _validate_link


#: Unicode's explicit bidirectional controls (embeddings, overrides, isolates): kept in a page they
#: can make a row read as another (a peak shown backwards, an id that reads as a different one).
BIDI_CONTROLS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_BIDI_TABLE = {ord(c): f"[U+{ord(c):04X}]" for c in BIDI_CONTROLS}


def neutral(text: str) -> str:
    """Text with every bidirectional control written out as ``[U+202E]``: shown, never obeyed.
    Applied to every page, Markdown file, CSV, feed and image the build writes (vram.json keeps
    the text as it is: it is the data). A text without any (nearly all: the site is some 50 MB)
    is only searched, not copied."""
    return text.translate(_BIDI_TABLE) if any(c in text for c in BIDI_CONTROLS) else text


#: Characters of one ledger text a page shows; the whole text is in vram.json.
PAGE_TEXT_CHARS = 2000


def clip(text: str, limit: int = PAGE_TEXT_CHARS) -> str:
    """A ledger text shortened for a page: cut at a space near ``limit``, with the length it had."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", limit - 200, limit)
    return f"{text[:cut if cut > 0 else limit].rstrip()} … (shortened: {len(text):,} characters in all; the whole " \
           "text is in vram.json)"


def markdown(text: Optional[str]) -> Markup:
    """Markdown to HTML with raw HTML escaped and unsafe links dropped (long texts clipped)."""
    if not text:
        return Markup("")
    return Markup(_MD.render(clip(text)))


def markdown_inline(text: Optional[str]) -> Markup:
    """Like ``markdown`` but without the surrounding paragraph (for table cells)."""
    if not text:
        return Markup("")
    return Markup(_MD.renderInline(clip(text)))


def num(value: Optional[float], digits: int = 1) -> str:
    """A number with fixed decimals; '' for unknown."""
    if value is None:
        return ""
    return f"{value:,.{digits}f}"


def mib(value: Optional[float]) -> str:
    """'6,653.0 MiB', or '' when unknown."""
    return "" if value is None else f"{num(value)} MiB"


def gib(value_mib: Optional[float]) -> str:
    """A MiB figure shown in GiB: '6.50 GiB'."""
    return "" if value_mib is None else f"{value_mib / 1024:,.2f} GiB"


def pct(value: Optional[float], digits: int = 1) -> str:
    """'4.7%' or '+2.5%' (signed when negative values are possible, use ``signed_pct``)."""
    return "" if value is None else f"{value:.{digits}f}%"


def signed_pct(value: Optional[float], digits: int = 1) -> str:
    """'+2.5%' / '-1.1%'; a value that rounds to zero is '0.0%' (never '-0.0%')."""
    if value is None:
        return ""
    if round(value, digits) == 0:
        return f"{0:.{digits}f}%"
    return f"{value:+.{digits}f}%"


def yesno(value: Optional[bool]) -> str:
    return "" if value is None else ("yes" if value else "no")


# Markdown output (vram.md, estimators.md) is read by many renderers, some of which allow any link
# scheme and raw HTML. Ledger text goes in with every character that could open a link, an
# image, a reference definition, an autolink, raw HTML or an entity backslash-escaped (CommonMark
# shows the character itself), so no renderer can make a live javascript:, vbscript: or data:
# link of it; inline http(s) links and code spans are kept as they are. No HTML entities.
_MD_SAFE_LINK = re.compile(r"\[([^\[\]\n]*)\]\((https?://[^\s()<>\\]+)\)")
_MD_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_MD_SPECIAL = re.compile(r"([\\\[\]<>&])")


def _md_escape(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", text)


def _md_plain(text: str) -> str:
    """Escape text outside code spans (a code span shows its content literally: nothing in it is live)."""
    out, pos = [], 0
    for m in _MD_CODE.finditer(text):
        out.append(_md_escape(text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_md_escape(text[pos:]))
    return "".join(out)


def md_text(value: object) -> str:
    """Ledger text for the Markdown twin: lines kept; emphasis, code spans and http(s) links work;
    nothing else can become a link, an image or HTML."""
    if value is None:
        return ""
    return _md_text(str(value))


@lru_cache(maxsize=16384)
def _md_text(value: str) -> str:
    # Remembered: the fit table's Markdown repeats a few hundred labels some 70,000 times.
    text, out, pos = clip(value), [], 0
    for m in _MD_SAFE_LINK.finditer(text):
        out.append(_md_plain(text[pos:m.start()]))
        out.append(f"[{_md_plain(m.group(1))}]({m.group(2)})")
        pos = m.end()
    out.append(_md_plain(text[pos:]))
    return "".join(out)


def md_cell(value: object) -> str:
    """Ledger text for a Markdown table cell: as ``md_text``, on one line, pipes escaped."""
    return "" if value is None else _md_cell(str(value))


@lru_cache(maxsize=16384)
def _md_cell(value: str) -> str:
    return _md_text(value.replace("\r", " ").replace("\n", " ")).replace("|", "\\|")


def md_fit_cells(cells) -> str:
    """A fit-table row's cells for fits.md: each cell's label and its measured rows, as
    `` label (ledger: ids) |`` (the table's 70,000 cells joined here, not one by one in the template)."""
    return "".join(f" {_md_cell(c.label)}{_md_cell(' (ledger: ' + ', '.join(c.measured) + ')') if c.measured else ''} |"
                   for c in cells)


def full_words(c) -> str:
    """A full fine-tuning cell in words: its verdict and predicted peak allocated (the interval's top)."""
    if c.mib is None:
        return c.verdict + (" (past any device)" if c.verdict == "won't fit" else "")
    return f"{c.verdict} {c.mib:,.0f} MiB" + (f" (≤ {c.high_mib:,.0f})" if c.high_mib is not None else "")


def md_full_cells(cells) -> str:
    """A full fine-tuning row's cells for fits.md."""
    return "".join(f" {_md_cell(full_words(c))} |" for c in cells)


def html_fit_cells(cells, model: str, quant: str, fixes: str, setting: str, card: str, root: str) -> Markup:
    """A fit-table row's cells for a model's page, each ``<td>`` with its class, its title (the
    recipe, the method, the measured rows nearby), its label and method and links to those rows:
    what the template wrote cell by cell, escaped as its autoescape escapes (the pages' some
    20,000 cells joined here)."""
    where = f"{escape(model)} {escape(quant)} fixes {escape(fixes)} {escape(setting)} "
    on = f" tokens on {escape(card)}: "
    root = escape(root)
    out = []
    for c in cells:
        kind = escape("tight" if c.fits_rank is None and c.tight_rank else c.status)
        method = escape(c.method)
        measured = c.measured
        nearby = f"; measured nearby: {', '.join(map(escape, measured))}" if measured else ""
        links = ("<br><span class=\"meta\">" + "".join(f'<a href="{root}index.html#m-{escape(i)}">{escape(i)}</a> '
                                                     for i in measured) + "</span>") if measured else ""
        out.append(f'<td class="num fit-{kind}" title="{where}{escape(c.seq_len)}{on}{method}{nearby}">'
                   f'{escape(c.label)}<span class="meta"> {method}</span>{links}</td>')
    return Markup("".join(out))


#: A full fine-tuning verdict's colour: the fit table's classes.
FULL_CLASS = {"fits": "ok", "tight": "tight", "won't fit": "none-fits", "unknown": "unknown"}


def html_full_cells(cells, model: str, quant: str, card: str) -> Markup:
    """A full fine-tuning row's cells for a model's page: each verdict and its predicted peak (MiB),
    the interval's top and the method in its title (kept short: a page holds some 200 of them)."""
    out = []
    for c in cells:
        fig = f"{c.mib:,.0f}" if c.mib is not None else ""
        title = full_words(c) + f" by {c.method or 'nothing (no dry run)'}"
        out.append(f'<td class="num fit-{escape(FULL_CLASS.get(c.verdict, "unknown"))}" title="{escape(title)}">'
                   f'{escape(c.verdict)}' + (f'<span class="meta"> {fig}</span>' if fig else '') + '</td>')
    return Markup("".join(out))


def world_words(c) -> str:
    """A several-GPU cell in words: LoRA's rank ceiling per GPU; full fine-tuning's verdict and figure."""
    return full_words(c) if c.method == "full" else c.label


def world_class(c) -> str:
    """A several-GPU cell's colour: the fit table's classes."""
    if c.method == "full" or c.verdict == "unknown" and c.fits_rank is None:
        return FULL_CLASS.get(c.verdict, "unknown")
    return "ok" if c.fits_rank is not None else "tight" if c.tight_rank else "none-fits"


def md_world_cells(cells) -> str:
    """A several-GPU row's cells for fits.md."""
    return "".join(f" {_md_cell(world_words(c))} |" for c in cells)


def html_world_cells(cells) -> Markup:
    """A several-GPU row's cells for a model's page: the words, and in the title the per-GPU figure
    (LoRA: at rank 16) and the rank's dry runs."""
    out = []
    for c in cells:
        at = "" if c.mib is None else (f"; {c.mib:,.0f} MiB per GPU" + (" at rank 16" if c.method == "lora" else "")
                                       + (f" (≤ {c.high_mib:,.0f})" if c.high_mib is not None else ""))
        title = f"{c.gpus} × {c.gpu} ({c.strategy}), {c.seq_len} tokens: {world_words(c)}{at}; dry runs of one rank: " \
                + ", ".join(c.dry_runs)
        out.append(f'<td class="num fit-{escape(world_class(c))}" title="{escape(title)}">{escape(world_words(c))}</td>')
    return Markup("".join(out))


def full_row(card: str, rows: dict, quant: str) -> list:
    """A card's full fine-tuning cells in one precision (``Fits.full_rows``), or none."""
    return rows.get((quant, card), [])


def anchor(text: object) -> str:
    """An HTML id fragment from any text: lower case, a-z0-9 and '-'."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "section"


FILTERS = {
    "anchor": anchor,
    "markdown": markdown,
    "markdown_inline": markdown_inline,
    "num": num,
    "mib": mib,
    "gib": gib,
    "pct": pct,
    "signed_pct": signed_pct,
    "yesno": yesno,
    "md_cell": md_cell,
    "md_fit_cells": md_fit_cells,
    "html_fit_cells": html_fit_cells,
    "html_full_cells": html_full_cells,
    "full_row": full_row,
    "md_full_cells": md_full_cells,
    "md_world_cells": md_world_cells,
    "html_world_cells": html_world_cells,
    "md_text": md_text,
}

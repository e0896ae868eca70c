"""What changed since the previous published vram.json: changes.json and an Atom feed.

A change set lists measurements added, removed and changed (with each changed figure's old and
new value), and findings added, removed and changed. Each build that finds the ledger's content
hash different from the previous publication's prepends one change set to the history kept in
changes.json (the last ``HISTORY`` sets); a build of unchanged content adds nothing, so building
twice gives the same files.
"""

from __future__ import annotations

import json
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

from pydantic_core import from_json

from ledger.core.errors import Issue, UserError

HISTORY = 50
#: The feed's entries at most, newest change set first (changes.json keeps every row of the last
#: HISTORY sets): a sweep of thousands of rows would otherwise make a feed no reader loads.
FEED_ENTRIES = 500
ATOM = "http://www.w3.org/2005/Atom"


def parse_document(text: str) -> Any:
    """A published JSON document as ``json.loads`` reads it, through pydantic's Rust parser (a
    100k-row vram.json in under half the time); a text that parser refuses is left to
    ``json.loads``, whose result or message stands."""
    try:
        return from_json(text)
    except ValueError:
        return json.loads(text)


def load_previous(source: Optional[str], out: Path) -> tuple[Optional[dict], Optional[dict]]:
    """(previous vram.json, previous changes.json) from --previous (a path or an http(s) URL) or,
    failing that, from the output folder. An explicit --previous that cannot be read is an error."""
    def read(src: str) -> Any:
        if src.startswith(("http://", "https://")):
            with urllib.request.urlopen(src, timeout=30) as resp:  # noqa: S310 (explicit user URL)
                return parse_document(resp.read().decode("utf-8"))
        path = Path(src)
        if path.exists() and not path.is_file():  # a FIFO or a device would block the build
            raise ValueError("not a regular file")
        return parse_document(path.read_text(encoding="utf-8"))

    previous = None
    if source:
        try:
            previous = read(source)
        except (OSError, ValueError) as exc:
            raise UserError(Issue(source, "", f"cannot read the previous vram.json: {exc}")) from None
    elif (out / "vram.json").is_file():
        try:
            previous = read(str(out / "vram.json"))
        except (OSError, ValueError):
            previous = None  # a damaged earlier build: start afresh
    if previous is not None and not (isinstance(previous, dict) and isinstance(previous.get("ledger"), dict)):
        if source:
            raise UserError(Issue(source, "", "not a vram.json (no ledger in it)"))
        previous = None
    history = None
    if source:
        # The previous publication's history, beside its vram.json: a build in a fresh checkout
        # (the documented deploy) keeps every earlier change set.
        sibling = (source.rsplit("/", 1)[0] + "/changes.json" if source.startswith(("http://", "https://"))
                   else str(Path(source).with_name("changes.json")))
        try:
            history = read(sibling)
        except (OSError, ValueError):
            history = None
    if history is None and (out / "changes.json").is_file():
        try:
            history = parse_document((out / "changes.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            history = None
    if not isinstance(history, dict):
        history = None
    return previous, history


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: node}


def _by_id(items: list) -> dict[str, dict]:
    return {x["id"]: x for x in items if isinstance(x, dict) and "id" in x}


def _diff_items(a: dict[str, dict], b: dict[str, dict]) -> tuple[list[str], list[str], list[dict]]:
    """(added, removed, changed) between two sections' items by id."""
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    changed = []
    for key in sorted(set(a) & set(b)):
        if a[key] == b[key]:  # most rows are as they were: one comparison in C, nothing flattened
            continue
        fa, fb = _flatten(a[key]), _flatten(b[key])
        fields = {f: [fa.get(f), fb.get(f)] for f in sorted(set(fa) | set(fb)) if fa.get(f) != fb.get(f)}
        if fields:
            changed.append({"id": key, "fields": fields})
    return added, removed, changed


def describe(item: dict) -> str:
    """A measurement or finding in words and figures: 'rtx-3070-ti gemma-3-4b-it r112 dropout
    7177 tokens: oom (needed at least 7147.5 MiB)'."""
    if "kind" not in item:  # a finding
        return str(item.get("title") or item.get("id"))
    lora = item.get("lora") or {}
    o = item.get("outcome") or {}
    bits = [item.get("gpu"), (item.get("model") or "").split("/")[-1] or None, item.get("kind"),
            f"r{lora['rank']}" if lora.get("rank") else None, "dropout" if lora.get("dropout") else None,
            "DoRA" if lora.get("dora") else None,
            f"{item['seq_len']} tokens" if item.get("seq_len") else None]
    head = " ".join(str(b) for b in bits if b)
    status = o.get("status") or "no outcome"
    if o.get("peak_allocated_mib") is not None:
        figure = f"{status}, peak allocated {o['peak_allocated_mib']} MiB"
    elif (o.get("oom") or {}).get("allocated_mib") is not None:
        figure = f"{status}, {o['oom']['allocated_mib']} MiB allocated when it failed"
    else:
        figure = status
    return f"{head}: {figure}"


def change_set(previous: dict, ledger_doc: dict, sha: str, date: Optional[str]) -> dict:
    """The differences between the previous publication's ledger and this one, each added or
    removed row also described in words and figures."""
    prev = previous["ledger"]
    old_m, new_m = _by_id(prev.get("measurements", [])), _by_id(ledger_doc.get("measurements", []))
    old_f, new_f = _by_id(prev.get("findings", [])), _by_id(ledger_doc.get("findings", []))
    m_add, m_rem, m_chg = _diff_items(old_m, new_m)
    f_add, f_rem, f_chg = _diff_items(old_f, new_f)
    return {
        "from_sha256": previous.get("ledger_sha256"),
        "to_sha256": sha,
        "date": date,
        "measurements": {"added": m_add, "removed": m_rem, "changed": m_chg,
                         "described": {i: describe(new_m[i]) for i in m_add} | {i: describe(old_m[i]) for i in m_rem}},
        "findings": {"added": f_add, "removed": f_rem, "changed": f_chg,
                     "described": {i: describe(new_f[i]) for i in f_add} | {i: describe(old_f[i]) for i in f_rem}},
    }


def history_for(previous: Optional[dict], old_history: Optional[dict], ledger_doc: dict, sha: str,
                date: Optional[str]) -> dict:
    """changes.json: the change sets, newest first."""
    sets = list((old_history or {}).get("history", [])) if isinstance(old_history, dict) else []
    if previous is not None and previous.get("ledger_sha256") != sha:
        if not sets or sets[0].get("to_sha256") != sha:
            sets.insert(0, change_set(previous, ledger_doc, sha, date))
    return {"schema_version": 1, "ledger_sha256": sha, "history": sets[:HISTORY]}


def atom_feed(history: dict, *, title: str, base_url: Optional[str], updated: str) -> str:
    """An Atom feed with one entry per changed row (newest change set first), at most
    ``FEED_ENTRIES``: a change set cut short ends with one entry that counts the rows left out
    and points to changes.json, which lists them all."""
    ET.register_namespace("", ATOM)
    feed = ET.Element(f"{{{ATOM}}}feed")
    ET.SubElement(feed, f"{{{ATOM}}}title").text = f"{title}: changes"
    ET.SubElement(feed, f"{{{ATOM}}}id").text = (f"{base_url.rstrip('/')}/feed.xml" if base_url
                                                  else "urn:vram-ledger:feed")
    ET.SubElement(feed, f"{{{ATOM}}}updated").text = updated
    author = ET.SubElement(feed, f"{{{ATOM}}}author")
    ET.SubElement(author, f"{{{ATOM}}}name").text = "vram ledger"
    if base_url:
        ET.SubElement(feed, f"{{{ATOM}}}link", rel="alternate", href=base_url.rstrip("/") + "/")
        ET.SubElement(feed, f"{{{ATOM}}}link", rel="self", href=base_url.rstrip("/") + "/feed.xml")
    room = FEED_ENTRIES
    for cs in history.get("history", []):
        if room <= 0:
            break
        when = f"{cs['date']}T00:00:00Z" if cs.get("date") else updated
        rows = [(section, what, rid, fields) for section in ("measurements", "findings") for what, rid, fields in (
            [("added", i, None) for i in cs[section]["added"]] + [("removed", i, None) for i in cs[section]["removed"]]
            + [("changed", c["id"], c["fields"]) for c in cs[section]["changed"]])]
        # A change set cut short keeps one place for the entry that counts what is left out.
        shown = len(rows) if len(rows) <= room else room - 1
        left_out, room = len(rows) - shown, room - shown
        for section, what, rid, fields in rows[:shown]:
            part = cs[section]
            entry = ET.SubElement(feed, f"{{{ATOM}}}entry")
            noun = "measurement" if section == "measurements" else "finding"
            text = (part.get("described") or {}).get(rid)
            ET.SubElement(entry, f"{{{ATOM}}}title").text = (f"{text} ({what})" if text
                                                             else f"{noun} {rid} {what}")
            ET.SubElement(entry, f"{{{ATOM}}}id").text = f"urn:vram-ledger:{cs['to_sha256']}:{section}:{what}:{rid}"
            ET.SubElement(entry, f"{{{ATOM}}}updated").text = when
            summary = f"{noun.capitalize()} {rid} {what}" + (f": {text}." if text else ".")
            if fields:
                summary += " " + "; ".join(f"{k}: {json.dumps(v[0])} → {json.dumps(v[1])}" for k, v in fields.items())
            ET.SubElement(entry, f"{{{ATOM}}}summary").text = summary
            # RFC 4287 4.1.2: an entry has content or an alternate link; every entry has content.
            ET.SubElement(entry, f"{{{ATOM}}}content", type="text").text = summary
            if base_url:
                anchor = (f"#m-{rid}" if section == "measurements" and what != "removed" else
                          f"#{rid}" if section == "findings" and what != "removed" else "#changes")
                ET.SubElement(entry, f"{{{ATOM}}}link", rel="alternate", href=f"{base_url.rstrip('/')}/{anchor}")
        if left_out:
            entry = ET.SubElement(feed, f"{{{ATOM}}}entry")
            ET.SubElement(entry, f"{{{ATOM}}}title").text = f"{left_out:,} more rows changed (see changes.json)"
            ET.SubElement(entry, f"{{{ATOM}}}id").text = f"urn:vram-ledger:{cs['to_sha256']}:more"
            ET.SubElement(entry, f"{{{ATOM}}}updated").text = when
            summary = (f"This change set changed {left_out:,} more measurements and findings than the feed lists; "
                       "changes.json lists every one.")
            ET.SubElement(entry, f"{{{ATOM}}}summary").text = summary
            ET.SubElement(entry, f"{{{ATOM}}}content", type="text").text = summary
            if base_url:
                ET.SubElement(entry, f"{{{ATOM}}}link", rel="alternate", href=f"{base_url.rstrip('/')}/changes.json")
            room = 0
    ET.indent(feed)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(feed, encoding="unicode") + "\n"

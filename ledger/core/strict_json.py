"""JSON text read the way a ledger must be: stricter than JSON itself, with located errors.

``json.loads`` (and pydantic's parser) accept what a ledger cannot keep: ``NaN`` and
``Infinity`` (and numbers too large for a float, which become infinity), duplicate keys in an
object (the last one silently wins), lone UTF-16 surrogates (they cannot be written back as
UTF-8) and nesting deep enough to exhaust the stack. ``parse_json`` refuses each with its line and
column: the parser flags the problem, a small scanner over the text finds where it is.
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional

from .errors import Issue, LedgerError

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_MESSAGE = "a lone UTF-16 surrogate (\\ud800-\\udfff) cannot be stored as UTF-8"


class _StrictJsonError(ValueError):
    """A JSON text that json.loads would accept but that cannot be a ledger (kept or written)."""


def _no_constant(token: str) -> float:
    raise _StrictJsonError(f"{token} is not a number in JSON")


def _finite_float(token: str) -> float:
    value = float(token)
    if math.isinf(value):
        raise _StrictJsonError(f"{token} is too large for a number")
    return value


#: Digits an integer may have: no ledger field holds more (the largest bound is 16 TiB in MiB), and
#: Python refuses to convert more than 4300 with a bare ValueError.
MAX_INT_DIGITS = 30


def _bounded_int(token: str) -> int:
    if len(token.lstrip("-")) > MAX_INT_DIGITS:
        raise _StrictJsonError(f"an integer of {len(token.lstrip('-'))} digits")
    return int(token)


def _no_duplicate_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _StrictJsonError(f"duplicate key {key!r} in one object")
    return out


# A JSON token: a string (group 1), a bare word (group 2: true/false/null/NaN/Infinity), a number
# (group 3), or one structural character (group 4).
_TOKEN = re.compile(r'("(?:[^"\\]|\\.)*")|(-?[A-Za-z]+)|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|([{}\[\]:,])')
_LONE_SURROGATE = re.compile(
    r"(?<!\\)\\u(d[89ab][0-9a-f]{2})(?!\\ud[c-f][0-9a-f]{2})"  # a high surrogate with no low one after it
    r"|(?<!\\ud[89ab][0-9a-f]{2})(?<!\\)\\u(d[c-f][0-9a-f]{2})",  # a low one with no high one before it
    re.I,
)


def _line_col(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"{line}:{pos - text.rfind(chr(10), 0, pos)}"


def _locate_strict_error(text: str, default: str = "not valid for a ledger") -> tuple[int, str]:
    """Where a text that parsed as JSON breaks the ledger's stricter rules, and why."""
    stack: list[Optional[set]] = []
    pending_key: Optional[str] = None
    key_at = 0
    for m in _TOKEN.finditer(text):
        string, word, number, char = m.groups()
        if string is not None:
            if _LONE_SURROGATE.search(string):
                return m.start(), _SURROGATE_MESSAGE
            pending_key = string if stack and stack[-1] is not None else None
            key_at = m.start()
        elif word is not None and word.lstrip("-") in ("NaN", "Infinity"):
            return m.start(), f"{word} is not a number in JSON"
        elif number is not None and len(number.lstrip("-")) > MAX_INT_DIGITS and number.lstrip("-").isdigit():
            return m.start(), f"an integer of {len(number.lstrip('-'))} digits is too large for a number"
        elif number is not None and math.isinf(float(number)):
            return m.start(), f"{number[:40]}{'...' if len(number) > 40 else ''} is too large for a number"
        elif char == ":" and pending_key is not None:
            key = json.loads(pending_key)
            if key in stack[-1]:  # type: ignore[operator]
                return key_at, f"duplicate key {key!r} in one object"
            stack[-1].add(key)  # type: ignore[union-attr]
        elif char is None:
            pass
        elif char in "{[":
            stack.append(set() if char == "{" else None)
        elif char in "}]" and stack:
            stack.pop()
        if char != ":" and string is None:
            pending_key = None
    return 0, default


def parse_json(text: str, name: str) -> object:
    """``json.loads`` with located errors (``file:line:col: invalid JSON: ...``), stricter than
    JSON itself where a ledger must be: no NaN or Infinity (nor numbers too large for a float),
    no duplicate keys in an object (one would silently win), no lone UTF-16 surrogates (they
    cannot be written back as UTF-8), and a bounded nesting depth."""
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int,
                          object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise LedgerError(Issue(name, f"{exc.lineno}:{exc.colno}", f"invalid JSON: {exc.msg}")) from None
    except RecursionError:
        raise LedgerError(Issue(name, "", "invalid JSON: nested too deeply")) from None
    except _StrictJsonError:
        pos, why = _locate_strict_error(text)
        raise LedgerError(Issue(name, _line_col(text, pos), f"invalid JSON: {why}")) from None
    if _SURROGATE_ESCAPE.search(text) and not _encodable(data):
        pos, why = _locate_strict_error(text, _SURROGATE_MESSAGE)
        raise LedgerError(Issue(name, _line_col(text, pos), f"invalid JSON: {why}"))
    return data


def _encodable(node: object) -> bool:
    """True when every string in parsed JSON can be written as UTF-8 (no lone surrogates)."""
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(node, dict):
        return all(_encodable(k) and _encodable(v) for k, v in node.items())
    if isinstance(node, list):
        return all(map(_encodable, node))
    return True

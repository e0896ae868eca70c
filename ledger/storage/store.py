"""Reading and writing ledger files: the only code that touches them.

- ``load`` validates (pydantic models + cross-references) and checks the
  version: a newer ``schema_version`` is refused, an older one is told to run
  ``vram migrate``; ``migrate`` applies the chained ``update_to_N`` functions.
- ``save`` writes atomically (temp file + fsync + os.replace) under a file lock,
  with deterministic formatting: model field order, two-space indent, UTF-8,
  defaults left out, a trailing newline.
- ``append`` / ``update`` are locked read-modify-write cycles; ``merge`` combines
  shard ledgers (same id + same content is a no-op, different content an error).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from pydantic import ValidationError

from .atomic import atomic_write_text, locked, real_path
from ledger.core.checks import ledger_issues
from ledger.core.errors import Issue, LedgerError, format_loc
from ledger.core.strict_json import parse_json
from ledger.core.paths import DEFAULT_LEDGER
from ledger.core.models import SCHEMA_VERSION, Finding, Gpu, Ledger, Measurement, Prediction, json_schema

#: ``MIGRATIONS[n]`` turns a version n-1 ledger dict into version n. Version 1 is the first
#: format, so there are none yet; each one added must come with a frozen file of the older
#: version under tests/data/ and a test that migrates it.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {}

#: Freeze what a load built (gc.freeze): a process-wide choice, made by the command line only.
FREEZE_SURVIVORS = False


# -- reading -----------------------------------------------------------------


def read_text(path: str | os.PathLike) -> str:
    """Read a file as UTF-8, or raise a one-line LedgerError."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise LedgerError(Issue(str(path), "", "not a regular file"))
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LedgerError(Issue(str(path), "", "no such file")) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(Issue(str(path), "", f"cannot read: {exc}")) from None


def check_version(data: object, name: str, *, allow_older: bool = False) -> int:
    """Return the file's schema_version; refuse newer ones and (unless allowed) older ones."""
    if not isinstance(data, dict):
        raise LedgerError(Issue(name, "", "top level must be a JSON object"))
    version = data.get("schema_version")
    if type(version) is not int:
        raise LedgerError(Issue(name, "schema_version", "missing or not an integer"))
    if version > SCHEMA_VERSION:
        raise LedgerError(
            Issue(
                name,
                "schema_version",
                f"version {version} is newer than this vram-ledger reads ({SCHEMA_VERSION}): upgrade vram-ledger",
            )
        )
    if version < SCHEMA_VERSION:
        if not all(v in MIGRATIONS for v in range(version + 1, SCHEMA_VERSION + 1)):
            raise LedgerError(Issue(name, "schema_version", f"version {version} is not a ledger format this "
                                    f"vram-ledger reads or can migrate (it reads version {SCHEMA_VERSION})"))
        if not allow_older:
            raise LedgerError(Issue(name, "schema_version",
                                    f"version {version} is older than {SCHEMA_VERSION}: run `vram migrate {name}`"))
    return version


def migrate_data(data: dict, name: str) -> dict:
    """Apply the chained migrations from the file's version up to SCHEMA_VERSION."""
    version = check_version(data, name, allow_older=True)
    for target in range(version + 1, SCHEMA_VERSION + 1):
        step = MIGRATIONS.get(target)
        if step is None:
            raise LedgerError(Issue(name, "schema_version", f"no migration from version {target - 1} to {target}"))
        data = step(data)
        data["schema_version"] = target
    return data


def _pydantic_issues(exc: ValidationError, name: str) -> list[Issue]:
    issues: list[Issue] = []
    seen: set[str] = set()
    for err in exc.errors(include_url=False):
        # Union branches add tags like "literal['all','none']" to the path: drop them.
        loc = [p for p in err["loc"] if isinstance(p, int) or not any(c in str(p) for c in "[(")]
        where = format_loc(loc)
        if where in seen:
            continue
        seen.add(where)
        issues.append(Issue(name, where, err["msg"]))
    # A union reports one error per branch; keep the most specific (deepest) one.
    deeper = {i.location for i in issues}
    return [
        i for i in issues
        if not any(d != i.location and d.startswith(i.location) and d[len(i.location)] in ".[" for d in deeper)
    ]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many objects that form no cycles:
    validating 100k measurements takes a quarter of the time without its repeated passes. Models
    hold no cycles, so reference counting still frees them. With ``FREEZE_SURVIVORS`` (set by
    the ``vram`` command, whose process ends with the command) the survivors are also frozen, so
    later collections do not walk them again; a library call leaves the process's collector as
    it found it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if FREEZE_SURVIVORS:
            gc.freeze()
        elif gc.get_freeze_count() == 0:
            # Promote the survivors to the oldest generation without walking them: otherwise the
            # first young collection after this walks every object made here (0.6 s at 100k rows)
            # and the next ones walk them again. Freezing and unfreezing does exactly that, and
            # is done only when nothing else is frozen, so the collector is left as found.
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def parse_ledger(text: str, name: str, *, allow_older: bool = False) -> Ledger:
    """Parse and fully validate ledger text; raise LedgerError with every located issue."""
    with gc_paused():  # the models, the check's dump and the cross-references make no cycles
        return _parse_ledger(text, name, allow_older)


def _fast_parse(text: str) -> Ledger | None:
    """One pass through the Rust parser for a current, valid file (None otherwise). It lets
    through what strict JSON refuses (a key written twice, the last one winning): its result is
    trusted only once the text is proved to be its own echo (``_echo``)."""
    try:
        ledger = Ledger.model_validate_json(text, strict=True)
    except ValueError:  # ValidationError, or a recursion limit
        return None
    return ledger if ledger.schema_version == SCHEMA_VERSION else None


def _echo(ledger: Ledger) -> str:
    """A parsed ledger written back with exactly the keys its text gave (``exclude_unset``), in
    ``dumps``' form. A text that is its parse's echo holds nothing strict JSON refuses: no key
    twice (the echo writes each once), no NaN, Infinity or number too large for a float (the
    models refuse them, and the echo writes each number as itself), no lone surrogate (the fast
    parser refuses one). A file ``save`` wrote is its own echo (its keys are the values that are
    not defaults); the echo skips the comparison of every value with a new default that
    ``dumps`` makes (a third of that dump)."""
    return ledger.model_dump_json(indent=2, exclude_unset=True) + "\n"


def _parse_ledger(text: str, name: str, allow_older: bool) -> Ledger:
    ledger = _fast_parse(text)
    # The fast path is accepted only when the text is the parse's echo (one dump, _echo).
    if ledger is None or _echo(ledger) != text:
        # Slow path for exact messages: strict JSON, version, migrations, then the models.
        data = parse_json(text, name)
        version = check_version(data, name, allow_older=allow_older)
        if version < SCHEMA_VERSION:
            text = json.dumps(migrate_data(data, name))
        try:
            ledger = Ledger.model_validate_json(text, strict=True)
        except ValidationError as exc:
            raise LedgerError(_pydantic_issues(exc, name)) from None
    issues = ledger_issues(ledger, name)
    if issues:
        raise LedgerError(issues)
    return ledger


def load(path: str | os.PathLike, *, allow_older: bool = False) -> Ledger:
    """Load and validate a ledger file."""
    return parse_ledger(read_text(path), str(path), allow_older=allow_older)


def load_or_new(path: str | os.PathLike) -> Ledger:
    """Load a ledger, or an empty one when the file does not exist yet (the first write creates
    it): a new user's first run, log or prediction starts their ledger."""
    if not os.path.lexists(path):
        return empty_ledger()
    return load(path)


@lru_cache(maxsize=1)
def _compiled_schema():
    """The generated JSON Schema compiled by jsonschema-rs (formats checked, as FormatChecker does)."""
    import jsonschema_rs

    return jsonschema_rs.validator_for(json_schema(), validate_formats=True)


def schema_issues(data: object, name: str) -> list[Issue]:
    """Validate parsed JSON against the generated JSON Schema (draft 2020-12). A compiled validator
    (jsonschema-rs) decides; only a document it refuses is walked again by jsonschema, whose
    messages the issues quote (a test checks the two agree on every malformed ledger we keep)."""
    if _compiled_schema().is_valid(data):
        return []
    from jsonschema import Draft202012Validator, FormatChecker

    validator = Draft202012Validator(json_schema(), format_checker=FormatChecker())
    return [
        Issue(name, format_loc(err.absolute_path), err.message)
        for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    ]


def schema_text() -> str:
    """The generated JSON Schema as the committed file holds it."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def validate_file(path: str | os.PathLike) -> list[Issue]:
    """Every problem with a ledger file: JSON syntax, version, JSON Schema and pydantic (which
    must agree), then cross-references. An empty list means valid."""
    name = str(path)
    text = read_text(path)
    data = parse_json(text, name)
    check_version(data, name)
    by_schema = schema_issues(data, name)
    try:
        with gc_paused():
            ledger = Ledger.model_validate_json(text, strict=True)
        by_models: list[Issue] = []
    except ValidationError as exc:
        ledger, by_models = None, _pydantic_issues(exc, name)
    if by_schema and not by_models:
        # The models are the source of truth, and the schema is generated from them: a file only
        # the schema refuses means the two drifted apart.
        return by_schema + [Issue(name, "", "internal error: only the JSON Schema rejected this file; please report it")]
    if by_models:
        # The models can be stricter than JSON Schema can say (1.12e2 is an integer to JSON
        # Schema, not to the models): their messages stand.
        return by_models
    return ledger_issues(ledger, name)


# -- writing -----------------------------------------------------------------


def dumps(ledger: Ledger) -> str:
    """Deterministic text of a ledger: field order, indent 2, defaults omitted, trailing newline."""
    return ledger.model_dump_json(indent=2, exclude_defaults=True) + "\n"


def measured_on_cpu(m: Measurement) -> bool:
    """A probe or real run measured on the CPU (tracker meter) or with a simulated outcome: test
    data, never a GPU figure."""
    env = m.environment
    return m.kind in ("probe", "real") and (
        m.provenance.simulated
        or (env is not None and ((env.device or "").startswith("cpu") or env.meter == "tracker"))
    )


def published_ledger_issues(ledger: Ledger, path: str | os.PathLike, old_ids: set[str] = frozenset()) -> list[Issue]:
    """The bundled ledger (the one the site publishes) takes no CPU or simulated measurements:
    a CPU sweep, a test run of the callback or a simulated OOM must go to a ledger of its own."""
    if real_path(path) != real_path(DEFAULT_LEDGER):
        return []
    return [
        Issue(str(path), f"measurements[{i}]", f"{m.id} was measured on the CPU or simulated: the published ledger "
              "takes GPU measurements only; write it to a ledger file of its own")
        for i, m in enumerate(ledger.measurements) if m.id not in old_ids and measured_on_cpu(m)
    ]


def save(ledger: Ledger, path: str | os.PathLike) -> None:
    """Validate cross-references, then write atomically under the lock."""
    with locked(path):
        save_unlocked(ledger, path)


def save_unlocked(ledger: Ledger, path: str | os.PathLike) -> None:
    """``save`` for a caller that holds the lock already."""
    with gc_paused():
        issues = ledger_issues(ledger, str(path)) + published_ledger_issues(ledger, path)
        if issues:
            raise LedgerError(issues)
        text = dumps(ledger)
    atomic_write_text(path, text)


def empty_ledger(about: str | None = None) -> Ledger:
    """A new ledger with nothing in it."""
    return Ledger(schema_version=SCHEMA_VERSION, about=about)


def _revalidate(ledger: Ledger, loaded: set[int], name: str) -> None:
    """Validate what a change may have built without validation: every measurement that is not one
    of the objects loaded (``loaded``: their ids), and every other section; then the
    cross-references and physics of the whole. A refused entry is located in the whole document."""
    try:
        for m in ledger.measurements:
            if id(m) not in loaded:
                Measurement.model_validate_json(m.model_dump_json(exclude_defaults=True), strict=True)
        Ledger.model_validate_json(dumps(ledger.model_copy(update={"measurements": []})), strict=True)
    except ValueError:  # ValidationError, or a value that does not serialise
        try:
            Ledger.model_validate_json(dumps(ledger), strict=True)
        except ValidationError as exc:
            raise LedgerError(_pydantic_issues(exc, name)) from None
        raise
    issues = ledger_issues(ledger, name)
    if issues:
        raise LedgerError(issues)


#: What a ``change`` passed to ``update`` returns to write nothing (nothing new to record).
UNCHANGED = object()


def update(path: str | os.PathLike, change: Callable[[Ledger], Ledger | None], *, create: bool = False) -> Ledger:
    """Locked read-modify-write: load, apply ``change``, validate, write atomically. ``change``
    edits the ledger (replacing entries, never editing one in place), returns a new one, or
    returns ``UNCHANGED`` to write nothing.

    The file is parsed once and the result serialised once: what ``load`` proves with a dump of
    its own (that the file is its parse's echo, so the fast parser read what it says) is proved
    here from the new text when the change appended entries (``_as_written``: the file is
    exactly what ``save`` writes, which is its own echo), and only otherwise by that dump."""
    path = Path(path)
    name = str(path)
    with locked(path):
        text = None  # the file as read, while it is not yet proved to be what save writes
        if path.exists():
            text = read_text(path)
            ledger = _parsed_unchecked(text, name)
            if ledger is None:
                ledger, text = parse_ledger(text, name), None
        elif create:
            ledger = empty_ledger()
        else:
            raise LedgerError(Issue(name, "", "no such file"))
        before = _entries(ledger)
        old_ids = {m.id for m in ledger.measurements}
        loaded = before["measurements"]  # validated as loaded; held, so their ids stay theirs
        try:
            result = change(ledger)
        except Exception:
            if text is not None:
                _check_as_read(text, name, before)  # a file that is not sound says so first
            raise
        if result is UNCHANGED:
            if text is not None:
                _check_as_read(text, name, before)
            return ledger
        ledger = result if result is not None else ledger
        with gc_paused():
            _revalidate(ledger, {id(m) for m in loaded}, name)
            new_text = dumps(ledger)
            if text is not None and not _as_written(text, new_text, before, ledger):
                _check_as_read(text, name, before)
        issues = published_ledger_issues(ledger, path, old_ids)
        if issues:
            raise LedgerError(issues)
        atomic_write_text(path, new_text)
    return ledger


def _parsed_unchecked(text: str, name: str) -> Ledger | None:
    """``load``'s fast path without its canonical check: the ledger the fast parser reads, with
    its cross-references and physics checked; None when it refuses the text, the version is not
    the current one or a cross-reference fails (``parse_ledger`` then says why, located)."""
    with gc_paused():
        ledger = _fast_parse(text)
        return None if ledger is None or ledger_issues(ledger, name) else ledger


#: A ledger's sections of entries as ``dumps`` writes them: the name, its brackets, and what
#: separates two entries (entries are objects at an indent of four: only their own closing brace
#: and the next one's opening start a line there).
_SECTIONS = (("gpus", "{", "}", '\n    },\n    "'), ("measurements", "[", "]", "\n    },\n    {"),
             ("findings", "[", "]", "\n    },\n    {"), ("predictions", "[", "]", "\n    },\n    {"))


#: The text that ends an entry of a section (its closing brace, at an indent of four).
_ENTRY_END = "\n    }"


def _entries(ledger: Ledger) -> dict:
    """The header (version, about) and each section's entries in order (the cards as (key,
    card)), copied, and the keys the file gave: what the file held."""
    return {"header": (ledger.schema_version, ledger.about), "gpus": list(ledger.gpus.items()), "measurements": list(ledger.measurements),
            "findings": list(ledger.findings), "predictions": list(ledger.predictions),
            "given": set(ledger.model_fields_set)}


def _as_written(old: str, new: str, before: dict, after: Ledger) -> bool:
    """Whether ``old`` (the file as read) is exactly what ``save`` writes, proved from ``new``
    (``dumps(after)``): every section of ``after`` holds the entries ``before`` had, the very
    objects in the same order, with others appended after them (what an append does), and
    ``new`` without the appended entries' text is ``old``. That text is then what ``dumps``
    writes for the ledger of the entries as read, so it has no duplicate key and the fast parser
    read what it says. False proves nothing either way (an entry replaced or removed, a section's
    first entry, the header changed, a file not written by ``save``): the caller checks by a dump."""
    now = _entries(after)
    if now["header"] != before["header"]:
        return False
    kept, at = [], 0
    for section, opening, closing, sep in _SECTIONS:
        was, items = before[section], now[section]
        if len(items) < len(was) or any(a[0] != b[0] or a[1] is not b[1] if section == "gpus" else a is not b
                                        for a, b in zip(was, items)):
            return False
        if len(items) == len(was):
            continue
        if not was:
            return False
        head = f'\n  "{section}": {opening}\n'
        start = new.find(head, at)
        if start < 0:
            return False
        start += len(head)
        end = cut = new.find(f"\n  {closing}", start)
        if end < 0:
            return False
        for _ in range(len(items) - len(was)):  # back over the appended entries
            cut = new.rfind(sep, start, cut)
            if cut < 0:
                return False
        kept.append((at, cut + len(_ENTRY_END)))  # up to the end of the last entry read
        at = end
    return "".join(new[a:b] for a, b in kept) + new[at:] == old


def _check_as_read(text: str, name: str, before: dict) -> None:
    """``load``'s check of the file as read: the ledger of the entries it held, with the keys it
    gave, echoed (``_echo``), is the text; otherwise the full parse with its exact messages
    (raises for a file that is not sound; a sound one the fast parser cannot prove passes)."""
    version, about = before["header"]
    as_read = Ledger.model_construct(_fields_set=set(before["given"]), schema_version=version, about=about,
                                     gpus=dict(before["gpus"]), measurements=before["measurements"],
                                     findings=before["findings"], predictions=before["predictions"])
    if _echo(as_read) != text:
        parse_ledger(text, name)


def _add(section: list, items: Iterable, name: str, what: str) -> int:
    by_id = {item.id: item for item in section}
    added = 0
    for item in items:
        old = by_id.get(item.id)
        if old is None:
            section.append(item)
            by_id[item.id] = item
            added += 1
        elif old != item:
            raise LedgerError(Issue(name, "", f"{what} id {item.id!r} is already in the ledger with other content"))
    return added


def append(
    path: str | os.PathLike,
    measurements: Iterable[Measurement] = (),
    *,
    findings: Iterable[Finding] = (),
    predictions: Iterable[Prediction] = (),
    gpus: dict[str, Gpu] | None = None,
    gpus_if_missing: dict[str, Gpu] | None = None,
    create: bool = False,
) -> int:
    """Append entries under the lock. An id already present with the same content is skipped
    (so re-appending is idempotent); with other content it is an error and nothing is written.
    ``gpus`` must match an entry already there; ``gpus_if_missing`` (a probe's description of its
    card, dated today) is added only where the key is missing and never blocks a measurement.
    Returns how many entries were added."""
    counter = {"n": 0}
    name = str(path)

    def change(ledger: Ledger) -> None:
        for key, gpu in (gpus or {}).items():
            if key in ledger.gpus and ledger.gpus[key] != gpu:
                raise LedgerError(Issue(name, f"gpus.{key}", "already in the ledger with other content"))
            ledger.gpus.setdefault(key, gpu)
        for key, gpu in (gpus_if_missing or {}).items():
            ledger.gpus.setdefault(key, gpu)
        counter["n"] += _add(ledger.measurements, measurements, name, "measurement")
        counter["n"] += _add(ledger.findings, findings, name, "finding")
        counter["n"] += _add(ledger.predictions, predictions, name, "prediction")

    update(path, change, create=create)
    return counter["n"]


# -- merging -----------------------------------------------------------------


def merge(ledgers: Sequence[tuple[str, Ledger]]) -> Ledger:
    """Merge shard ledgers. Entries are unioned by id and sorted by id, so the result does not
    depend on the order of the inputs; the same id with different content is an error naming
    both files."""
    if not ledgers:
        raise LedgerError("merge needs at least one ledger")
    about = next((lg.about for _, lg in ledgers if lg.about), None)
    gpus: dict[str, tuple[str, Gpu]] = {}
    sections: dict[str, dict[str, tuple[str, int, object]]] = {"measurements": {}, "findings": {}, "predictions": {}}
    issues: list[Issue] = []
    for name, ledger in ledgers:
        for key, gpu in ledger.gpus.items():
            if key in gpus and gpus[key][1] != gpu:
                issues.append(Issue(name, f"gpus.{key}", f"differs from {gpus[key][0]}: gpus.{key}"))
            gpus.setdefault(key, (name, gpu))
        for section, seen in sections.items():
            for i, item in enumerate(getattr(ledger, section)):
                if item.id in seen and seen[item.id][2] != item:
                    first, j, _ = seen[item.id]
                    issues.append(
                        Issue(name, f"{section}[{i}]", f"id {item.id!r} differs from {first}: {section}[{j}]")
                    )
                seen.setdefault(item.id, (name, i, item))
    if issues:
        raise LedgerError(issues)
    return Ledger(
        schema_version=SCHEMA_VERSION,
        about=about,
        gpus={k: gpus[k][1] for k in sorted(gpus)},
        **{s: [seen[k][2] for k in sorted(seen)] for s, seen in sections.items()},
    )

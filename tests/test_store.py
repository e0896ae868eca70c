"""Store: the invalid corpus, versions and migrations, append, merge, locking and crash safety."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BUNDLED, DATA, SMALL
from ledger import cli
from ledger.storage import store
from ledger.core.errors import LedgerError
from ledger.core.models import SCHEMA_VERSION, Ledger, Measurement, Outcome

INVALID = sorted((DATA / "invalid").glob("*.json"))


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_ledger_gives_its_message(path, capsys, monkeypatch):
    monkeypatch.chdir(path.parent)
    before = path.read_bytes()
    assert cli.main(["validate", path.name]) == 1
    err = capsys.readouterr().err
    assert err == path.with_suffix(".expected").read_text(encoding="utf-8")
    assert "Traceback" not in err
    assert path.read_bytes() == before


def test_invalid_corpus_is_large_enough():
    assert len(INVALID) >= 15


def _structural(path: Path) -> bool:
    """Cases that reach schema validation (strictly parseable, a current-version object)."""
    try:
        data = store.parse_json(path.read_text(), path.name)
    except LedgerError:
        return False
    return isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION


#: JSON Schema calls 1.12e2 an integer; the models (the source of truth) do not.
STRICTER_THAN_JSON_SCHEMA = {"integer-as-float"}
STRUCTURAL = [p for p in INVALID if _structural(p) and p.stem not in STRICTER_THAN_JSON_SCHEMA]


@pytest.mark.parametrize("path", STRUCTURAL, ids=[p.stem for p in STRUCTURAL])
def test_jsonschema_and_models_agree_on_the_corpus(path):
    data = json.loads(path.read_text())
    by_schema = store.schema_issues(data, "x")
    try:
        Ledger.model_validate_json(path.read_text(), strict=True)
        by_models = False
    except Exception:
        by_models = True
    assert bool(by_schema) == by_models


def test_bundled_ledger_is_valid():
    assert store.validate_file(BUNDLED) == []
    assert cli.main(["validate", str(BUNDLED)]) == 0


def test_save_is_deterministic(tmp_path):
    ledger = store.load(SMALL)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    store.save(ledger, a)
    store.save(store.load(a), b)
    assert a.read_bytes() == b.read_bytes() == SMALL.read_bytes()
    assert a.read_text().endswith("}\n")


def test_older_version_migrates_through_the_chain(tmp_path, monkeypatch):
    # A frozen version-0 file: the same content with 'peak_mib' instead of 'peak_allocated_mib'.
    data = json.loads(SMALL.read_text())
    for m in data["measurements"]:
        if "peak_allocated_mib" in m.get("outcome", {}):
            m["outcome"]["peak_mib"] = m["outcome"].pop("peak_allocated_mib")
    data["schema_version"] = SCHEMA_VERSION - 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))

    with pytest.raises(LedgerError, match="not a ledger format this vram-ledger reads or can migrate"):
        store.load(old)

    def update_to_current(d):
        for m in d["measurements"]:
            if "peak_mib" in m.get("outcome", {}):
                m["outcome"]["peak_allocated_mib"] = m["outcome"].pop("peak_mib")
        return d

    monkeypatch.setitem(store.MIGRATIONS, SCHEMA_VERSION, update_to_current)
    with pytest.raises(LedgerError, match="run `vram migrate"):
        store.load(old)
    assert cli.main(["migrate", str(old)]) == 0
    assert store.load(old) == store.load(SMALL)


def test_missing_migration_is_a_clear_error(tmp_path):
    data = json.loads(SMALL.read_text())
    data["schema_version"] = SCHEMA_VERSION - 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="not a ledger format this vram-ledger reads or can migrate"):
        store.load(old, allow_older=True)
    with pytest.raises(LedgerError, match="not a ledger format"):
        store.load(old)  # and `vram migrate` is not advised when it could not help


def _m(i: int, peak: float = 100.0) -> Measurement:
    return Measurement(id=f"m{i}", kind="probe", outcome=Outcome(status="ok", peak_allocated_mib=peak))


def test_append_enforces_unique_ids_and_is_idempotent(small_ledger):
    n0 = len(store.load(small_ledger).measurements)
    assert store.append(small_ledger, [_m(1)]) == 1
    assert store.append(small_ledger, [_m(1)]) == 0  # same content: nothing added
    before = small_ledger.read_bytes()
    with pytest.raises(LedgerError, match="already in the ledger with other content"):
        store.append(small_ledger, [_m(2), _m(1, peak=999.0)])
    assert small_ledger.read_bytes() == before  # nothing written on error
    assert len(store.load(small_ledger).measurements) == n0 + 1


def test_append_refuses_an_unknown_gpu_and_writes_nothing(small_ledger):
    before = small_ledger.read_bytes()
    bad = Measurement(id="x1", kind="probe", gpu="no-such-card")
    with pytest.raises(LedgerError, match="unknown gpu"):
        store.append(small_ledger, [bad])
    assert small_ledger.read_bytes() == before


def _ledger_of(items):
    return Ledger(schema_version=SCHEMA_VERSION, measurements=list(items))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=12), st.lists(st.integers(0, 30), max_size=12))
def test_merge_twice_is_merge_once_and_order_does_not_matter(xs, ys):
    a = _ledger_of(_m(i) for i in sorted(set(xs)))
    b = _ledger_of(_m(i) for i in sorted(set(ys)))
    ab = store.merge([("a", a), ("b", b)])
    assert store.merge([("ab", ab), ("b", b)]) == ab
    assert store.merge([("ab", ab), ("ab2", ab)]) == ab
    assert store.merge([("b", b), ("a", a)]) == ab
    assert {m.id for m in ab.measurements} == {f"m{i}" for i in set(xs) | set(ys)}


def test_merge_conflict_names_both_files(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    store.save(_ledger_of([_m(1, 100.0)]), a)
    store.save(_ledger_of([_m(1, 200.0)]), b)
    assert cli.main(["merge", str(a), str(b), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert str(a) in err and str(b) in err and "'m1'" in err
    assert not out.exists()


def test_merge_cli_writes_the_union(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    store.save(_ledger_of([_m(1), _m(2)]), a)
    store.save(_ledger_of([_m(2), _m(3)]), b)
    assert cli.main(["merge", str(a), str(b), "-o", str(out)]) == 0
    assert [m.id for m in store.load(out).measurements] == ["m1", "m2", "m3"]


# -- concurrency and crash safety ---------------------------------------------------


def _appender(path: str, worker: int, count: int) -> None:
    for i in range(count):
        store.append(path, [Measurement(id=f"w{worker}-{i}", kind="probe")])


def test_four_processes_append_fifty_each(tmp_path):
    path = tmp_path / "ledger.json"
    store.save(_ledger_of([]), path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_appender, args=(str(path), w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ledger = store.load(path)
    assert len(ledger.measurements) == 200
    assert len({m.id for m in ledger.measurements}) == 200


WRITER = r"""
import sys
from ledger import store
from ledger.core.models import Ledger, Measurement, Outcome
path, n = sys.argv[1], int(sys.argv[2])
big = Ledger(schema_version=1, measurements=[
    Measurement(id=f"new-{i}", kind="probe", outcome=Outcome(status="ok", peak_allocated_mib=float(i)))
    for i in range(n)])
print("ready", flush=True)
while True:
    store.save(big, path)
"""


def test_kill_minus_nine_mid_save_never_corrupts(tmp_path):
    path = tmp_path / "ledger.json"
    old = _ledger_of([_m(0)])
    store.save(old, path)
    old_text = path.read_text()
    new_text = None
    for trial in range(50):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "3000"], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.005 + (trial % 10) * 0.007)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        text = path.read_text()
        ledger = store.parse_ledger(text, str(path))  # always valid
        if text != old_text:
            new_text = new_text or text
            assert text == new_text and len(ledger.measurements) == 3000
    # A killed writer may leave its temp file (never the ledger half-written); the next locked
    # write removes the temp files of writers that are gone.
    store.append(path, [_m(99999)])
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_compiled_schema_check_agrees_with_jsonschema(tmp_path):
    """``vram validate`` lets jsonschema-rs decide and asks jsonschema only for the messages of a
    refused document: on every malformed and valid ledger we keep (and the migrated older
    files), the two accept and refuse exactly the same documents."""
    from jsonschema import Draft202012Validator, FormatChecker

    from ledger.core.errors import LedgerError
    from ledger.core.models import json_schema
    from ledger.storage.store import _compiled_schema
    from ledger.core.strict_json import parse_json
    from malformed import VALID, cases

    slow = Draft202012Validator(json_schema(), format_checker=FormatChecker())
    def parsed(path: Path):
        """The document as ``validate_file`` hands it to the schema check (None: refused before it)."""
        if not path.is_file():
            return None  # a FIFO, a folder: refused as not a regular file, never read
        try:
            return parse_json(path.read_text(encoding="utf-8"), path.name)
        except (LedgerError, UnicodeDecodeError, ValueError, RecursionError):
            return None

    docs = []
    for name, write in [*cases(), *VALID]:
        path = tmp_path / f"{name}.json"
        write(path)
        docs.append((name, parsed(path)))
    data = Path(__file__).parent / "data"
    for path in [*sorted((data / "invalid").glob("*.json")), data / "small-ledger.json", data / "program-ledger.json"]:
        docs.append((path.name, parsed(path)))
    docs = [(name, doc) for name, doc in docs if doc is not None]
    refused = 0
    for name, doc in docs:
        fast = _compiled_schema().is_valid(doc)
        assert fast == (not list(slow.iter_errors(doc))), name
        refused += not fast
    assert len(docs) >= 70 and refused >= 10  # the corpus has both kinds


@pytest.mark.parametrize("where", ["measurement", "finding", "gpu"])
def test_an_append_revalidates_what_the_change_built_without_validation(tmp_path, where):
    """``update`` validates the entries a change made (they may bypass validation) and the small
    sections, not every loaded row again: a bad one is still one located line and nothing is written."""
    path = tmp_path / "l.json"
    path.write_bytes(SMALL.read_bytes())
    before = path.read_bytes()
    ledger = store.load(path)

    def change(lg: Ledger) -> None:
        if where == "measurement":
            row = next(m for m in lg.measurements if m.lora is not None)
            bad = Measurement.model_construct(**{**dict(row), "id": "built-raw",
                                                 "lora": row.lora.model_construct(**{**dict(row.lora), "rank": -4})})
            lg.measurements.append(bad)
        elif where == "finding":
            f = lg.findings[0]
            lg.findings.append(f.model_construct(**{**dict(f), "id": "x" * 5000}))
        else:
            g = next(iter(lg.gpus.values()))
            lg.gpus["new-card"] = g.model_construct(**{**dict(g), "total_mib": -1})

    assert ledger.findings or where != "finding"
    with pytest.raises(LedgerError) as err:
        store.update(path, change)
    lines = [str(i) for i in err.value.issues]
    assert lines and all(line.startswith(str(path)) for line in lines), lines
    assert any(k in " ".join(lines) for k in ("measurements[", "findings[", "gpus")), lines
    assert path.read_bytes() == before


def test_objects_made_while_collection_is_paused_are_not_walked_again(monkeypatch):
    """A load's models go straight to the collector's oldest generation (no young collection walks
    a 100k-row ledger again), and the collector is left as found: enabled, nothing frozen."""
    import gc

    monkeypatch.setattr(store, "FREEZE_SURVIVORS", False)  # a library call, not the vram command
    gc.unfreeze()  # what a vram command run in this process froze goes to the oldest generation
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with store.gc_paused():
        made = [[i] for i in range(50_000)]
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(made) in oldest and id(made[-1]) in oldest  # no young collection walks them
    theirs = [[]]
    gc.freeze()  # another caller's frozen objects stay frozen, and nothing of ours joins them
    try:
        # The freeze count alone cannot say this: a frozen object that dies meanwhile leaves it.
        with store.gc_paused():
            ours = [[i] for i in range(1000)]
        tracked = {id(o) for o in gc.get_objects()}  # every generation but the frozen one
        assert id(theirs) not in tracked and id(theirs[0]) not in tracked
        assert id(ours) in tracked and id(ours[-1]) in tracked
    finally:
        gc.unfreeze()


# -- an append parses the file once and serialises the ledger once ----------------------------


def _picked(data, seq: list) -> list:
    """Some of ``seq``'s entries, in their order."""
    return [seq[i] for i in sorted(data.draw(st.sets(st.integers(0, max(len(seq) - 1, 0)), max_size=len(seq))))
            if seq]


def _as_ledger(header: tuple, sections: dict) -> Ledger:
    return Ledger.model_construct(schema_version=header[0], about=header[1], gpus=dict(sections["gpus"]),
                                  measurements=list(sections["measurements"]), findings=list(sections["findings"]),
                                  predictions=list(sections["predictions"]))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_new_text_proves_the_old_one_only_for_appended_entries(data):
    """``update``'s proof that the file read is what ``save`` writes (``_as_written``) holds
    exactly when every section kept its entries read, the same objects in order, and appended
    others to a section that had some, the header unchanged; and then only for that very text: the
    file with a key written twice, a space more or an entry less is refused (the full check
    decides). Entries of every section of the small ledger, cards included."""
    src = store.load(SMALL)
    pool = {"gpus": list(src.gpus.items()), "measurements": src.measurements, "findings": src.findings,
            "predictions": src.predictions}
    was = {k: _picked(data, v) for k, v in pool.items()}
    header = (SCHEMA_VERSION, data.draw(st.sampled_from([None, src.about, "about *this* ledger"])))
    old = store.dumps(_as_ledger(header, was))
    before = store._entries(_as_ledger(header, was))
    now, provable = {}, True
    for section, items in was.items():
        op = data.draw(st.sampled_from(["keep", "append", "replace", "drop"] if items else ["keep", "append"]))
        new = list(items)
        if op == "append":
            more = data.draw(st.integers(1, 3))
            for j in range(more):
                if section == "gpus":
                    key, card = pool["gpus"][j % len(pool["gpus"])]
                    new.append((f"added-{j}-{key}", card.model_copy()))
                else:
                    new.append(pool[section][j % len(pool[section])].model_copy(update={"id": f"added-{j}"}))
            provable &= bool(items)
        elif op == "replace":
            i = data.draw(st.integers(0, len(items) - 1))
            new[i] = (items[i][0], items[i][1].model_copy()) if section == "gpus" else items[i].model_copy()
            provable = False
        elif op == "drop":
            del new[data.draw(st.integers(0, len(items) - 1))]
            provable = False
        now[section] = new
    about = data.draw(st.sampled_from([header[1], header[1], "another about"]))
    provable &= about == header[1]
    after = _as_ledger((SCHEMA_VERSION, about), now)
    new_text = store.dumps(after)
    assert store._as_written(old, new_text, before, after) == provable
    if provable:
        line = data.draw(st.integers(1, old.count("\n") - 1))
        lines = old.split("\n")
        twice = "\n".join([*lines[:line], lines[line], *lines[line:]])  # a line (a key) written twice
        for bad in (twice, old.replace(": ", ":  ", 1), old.replace("\n", "\n ", 1)):
            assert not store._as_written(bad, new_text, before, after)


def _corpus():
    from malformed import VALID, cases

    return [*cases(), *VALID]


@pytest.mark.parametrize("name,write", _corpus(), ids=[name for name, _ in _corpus()])
def test_an_append_to_every_corpus_file_says_what_a_load_says(tmp_path, name, write):
    """An append proves the file sound without load's own dump: on every malformed ledger of the
    corpus (none of them as ``save`` writes it, one with a key written twice) it refuses with the
    very issues ``load`` gives and leaves the file as it was; on the valid ones it writes what
    load, append and save write."""
    path = tmp_path / "l.json"
    write(path)
    as_read = path.read_bytes() if path.is_file() else None
    try:
        expected = store.dumps(store.load(path).model_copy(update={"measurements": [
            *store.load(path).measurements, _m(424242)]}))
        refused = None
    except LedgerError as exc:
        refused = [str(i) for i in exc.issues]
    if refused is None:
        assert store.append(path, [_m(424242)]) == 1
        assert path.read_text(encoding="utf-8") == expected
        return
    with pytest.raises(LedgerError) as err:
        store.append(path, [_m(424242)])
    assert [str(i) for i in err.value.issues] == refused
    assert (path.read_bytes() if path.is_file() else None) == as_read


@pytest.mark.parametrize("how", ["save's text", "a key twice", "indent 1", "a row replaced", "a default written"])
def test_an_append_parses_once_and_serialises_once(tmp_path, monkeypatch, how):
    """On a file ``save`` wrote, an append parses it once and serialises the whole ledger once
    (the one text it writes); a file with a key written twice in save's layout is refused as
    ``load`` refuses it; a change that replaces a row, or a file that writes a default out, pays
    ``load``'s own check (one dump more), one in another layout its slow path too; each writes
    the same."""
    path = tmp_path / "l.json"
    ledger = store.load(SMALL)
    text = store.dumps(ledger)
    if how == "a key twice":
        text = text.replace('\n      "kind": "probe",', '\n      "kind": "probe",\n      "kind": "real",', 1)
    elif how == "indent 1":
        text = json.dumps(json.loads(text), indent=1, ensure_ascii=False)
    elif how == "a default written":
        data = json.loads(text)
        first = {**data["measurements"][0], "dataset": None}
        data["measurements"][0] = {k: first[k] for k in Measurement.model_fields if k in first}  # the models' order
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
    parses, dumps_of_all = [], []
    real_parse, real_dumps, real_echo = Ledger.model_validate_json, store.dumps, store._echo

    def counted_parse(given, *args, **kwargs):
        if given == text:
            parses.append(1)
        return real_parse(given, *args, **kwargs)

    def counted_dumps(lg):
        if len(lg.measurements) >= len(ledger.measurements):
            dumps_of_all.append(1)
        return real_dumps(lg)

    def counted_echo(lg):  # load's proof: a dump of the whole ledger too
        dumps_of_all.append(1)
        return real_echo(lg)

    monkeypatch.setattr(Ledger, "model_validate_json", counted_parse)
    monkeypatch.setattr(store, "dumps", counted_dumps)
    monkeypatch.setattr(store, "_echo", counted_echo)

    def change(lg: Ledger) -> None:
        if how == "a row replaced":
            lg.measurements[0] = lg.measurements[0].model_copy()
        lg.measurements.append(_m(7))

    if how == "a key twice":
        with pytest.raises(LedgerError, match="duplicate"):
            store.update(path, change)
        assert path.read_text(encoding="utf-8") == text
        return
    store.update(path, change)
    # The file's text parsed, the whole ledger dumped: once; load's check adds a dump, and a file
    # not in save's layout goes on to load's own slow path (a dump and a strict parse more).
    assert (len(parses), len(dumps_of_all)) == {"save's text": (1, 1), "a row replaced": (1, 2),
                                                "indent 1": (3, 3), "a default written": (1, 2)}[how]
    assert path.read_text(encoding="utf-8") == real_dumps(ledger.model_copy(update={
        "measurements": [*ledger.measurements, _m(7)]}))


@pytest.mark.parametrize("how", ["save's text", "a default written", "keys reordered", "indent 1", "é escaped",
                                 "a key twice"])
def test_a_load_takes_the_fast_path_only_for_its_own_echo(tmp_path, monkeypatch, how):
    """``load`` reads a file once with the fast parser and keeps that when the text is the
    parse's echo (the keys it gave, in the models' order and save's layout): save's text, and one
    that writes a default value out. Any other text is parsed again strictly, and read the same;
    a key written twice is refused as the strict parser refuses it."""
    path = tmp_path / "l.json"
    text = store.dumps(store.load(SMALL))
    data = json.loads(text)
    first = data["measurements"][0]
    if how == "a default written":
        assert "dataset" not in first and Measurement.model_fields["dataset"].default is None
        first["dataset"] = None
        data["measurements"][0] = {k: first[k] for k in Measurement.model_fields if k in first}  # the models' order
    elif how == "keys reordered":
        data["measurements"][0] = dict(reversed(list(first.items())))
    elif how == "é escaped":
        data["about"] = (data.get("about") or "") + " café"
    if how == "indent 1":
        text = json.dumps(data, indent=1, ensure_ascii=False)
    elif how == "a key twice":
        text = text.replace('\n      "kind": "probe",', '\n      "kind": "probe",\n      "kind": "real",', 1)
    elif how != "save's text":
        text = json.dumps(data, indent=2, ensure_ascii=how == "é escaped") + "\n"
    path.write_text(text, encoding="utf-8")
    parses = []
    real_parse = Ledger.model_validate_json

    def counted(given, *args, **kwargs):
        parses.append(1)
        return real_parse(given, *args, **kwargs)

    monkeypatch.setattr(Ledger, "model_validate_json", counted)
    if how == "a key twice":
        with pytest.raises(LedgerError, match="duplicate key 'kind'"):
            store.load(path)
        return
    loaded = store.load(path)
    assert len(parses) == (1 if how in ("save's text", "a default written") else 2)
    assert loaded == real_parse(json.dumps(data), strict=True)
    if how != "é escaped":
        assert store.dumps(loaded) == store.dumps(store.load(SMALL))

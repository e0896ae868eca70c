"""Models: JSON round trips (hypothesis), the committed schema stays generated."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from ledger.storage import store
from ledger.core.models import (
    SCHEMA_VERSION,
    Ledger,
    Lora,
    Measurement,
    Outcome,
    Provenance,
    _default_outcome,
    _default_provenance,
    json_schema,
)

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
mib = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
text = st.none() | st.text(max_size=40)

@st.composite
def outcomes(draw):
    """Physically possible outcomes (ledger.core.checks): reserved >= allocated, no peak after an OOM."""
    status = draw(st.none() | st.sampled_from(["ok", "oom", "spilled", "crashed", "host_oom"]))
    allocated = None if status == "oom" else draw(mib)
    extra = draw(mib)
    reserved = None if status == "oom" or extra is None else (allocated or 0.0) + extra
    return Outcome(status=status, pre_step_mib=draw(mib), peak_allocated_mib=allocated, peak_reserved_mib=reserved,
                   step_s=draw(mib), result_text=draw(text))


loras = st.none() | st.builds(
    Lora,
    rank=st.integers(1, 4096),
    alpha=st.none() | st.floats(min_value=0.5, max_value=512),
    rslora=st.none() | st.booleans(),
    dropout=st.none() | st.floats(min_value=0, max_value=0.99),
    dora=st.none() | st.booleans(),
)
provs = st.builds(
    Provenance,
    source=text,
    measured_on=st.none() | st.dates(max_value=dt.date.today()),
    inferred=st.booleans(),
    notes=st.lists(st.text(max_size=30), max_size=2),
)
measurements = st.builds(
    Measurement,
    id=ids,
    kind=st.sampled_from(["probe", "real", "load", "computed", "dry_run"]),
    model=text,
    quant=st.none() | st.sampled_from(["4bit", "bf16"]),
    lora=loras,
    seq_len=st.none() | st.integers(1, 200_000),
    memory_fixes=st.none() | st.sampled_from(["all", "none"]) | st.lists(st.sampled_from(["chunked_mlp", "save_on_cpu"]), unique=True),
    outcome=outcomes(),
    provenance=provs,
)


@st.composite
def ledgers(draw):
    ms = draw(st.lists(measurements, max_size=8, unique_by=lambda m: m.id))
    return Ledger(schema_version=SCHEMA_VERSION, about=draw(text), measurements=ms)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(ledgers())
def test_model_json_model_round_trip(ledger):
    text = store.dumps(ledger)
    again = store.parse_ledger(text, "x.json")
    assert again == ledger
    assert store.dumps(again) == text


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(measurements, measurements)
def test_model_equality_is_basemodels(a, b):
    """The models' equality (its common case first, for dumps without defaults) answers what
    BaseModel's does: for equal and unequal rows and their parts, a copy, a default, another
    class, a non-model, and an instance holding a key that is not a field."""
    from pydantic import BaseModel

    copy = a.model_copy(deep=True)
    extra = a.model_copy(deep=True)
    object.__setattr__(extra, "__dict__", {**extra.__dict__, "_remembered": object()})
    pairs = [(a, b), (a, copy), (a, extra), (extra, a), (a.outcome, b.outcome), (a.outcome, Outcome()),
             (a.provenance, Provenance()), (copy.provenance, a.provenance), (a.outcome, a.provenance),
             (a.lora, b.lora), (a, None), (a, "a"), (Outcome(), Outcome()), (a.outcome, _default_outcome()),
             (_default_outcome(), Outcome()), (Provenance(), _default_provenance()), (a.lora, None)]
    for x, y in pairs:
        if isinstance(x, BaseModel):
            assert x.__eq__(y) == BaseModel.__eq__(x, y), (x, y)  # NotImplemented for a non-model
            assert (x == y) is (BaseModel.__eq__(x, y) is True), (x, y)


def test_the_fast_defaults_are_what_the_models_make():
    """The default outcome and provenance a row gets (and a dump without defaults compares with)
    are made without validation: each is what ``Outcome()`` / ``Provenance()`` makes (fields,
    fields set, private and extra attributes, dump, equality both ways), its lists new for each;
    a model whose defaults hold anything but immutable values and empty lists is refused."""
    from pydantic import Field

    from ledger.core.models import _default_of, _Model

    for cls, fast in ((Outcome, _default_outcome), (Provenance, _default_provenance)):
        made, slow = fast(), cls()
        assert type(made) is cls and made == slow and slow == made and made.__dict__ == slow.__dict__
        assert list(made.__dict__) == list(slow.__dict__)
        assert (made.model_fields_set, made.__pydantic_private__, made.__pydantic_extra__) == (
            slow.model_fields_set, slow.__pydantic_private__, slow.__pydantic_extra__)
        assert made.model_dump_json() == slow.model_dump_json() and made.model_copy() == slow
        other = fast()
        for k, v in made.__dict__.items():
            if isinstance(v, list):
                v.append("x")
                assert other.__dict__[k] == [] and fast().__dict__[k] == []
    row = Measurement(id="m", kind="probe")
    assert row.outcome == Outcome() and row.provenance == Provenance() and row.provenance.notes is not (
        Measurement(id="n", kind="probe").provenance.notes)
    assert Measurement.model_validate_json('{"id": "m", "kind": "probe"}') == row

    class Held(_Model):
        values: dict[str, int] = Field(default_factory=lambda: {"a": 1})

    with pytest.raises(TypeError):
        _default_of(Held)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(ledgers())
def test_every_generated_ledger_passes_the_json_schema(ledger):
    data = json.loads(store.dumps(ledger))
    assert store.schema_issues(data, "x.json") == []


def test_committed_schema_is_generated_from_the_models():
    committed = (REPO / "schema" / "ledger.schema.json").read_text(encoding="utf-8")
    assert committed == store.schema_text(), (
        "schema/ledger.schema.json is stale; regenerate it with: vram schema -o schema/ledger.schema.json"
    )


def test_schema_is_draft_2020_12_with_id_and_title():
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] and schema["title"] == "vram ledger"


def test_every_field_has_a_description():
    missing = []

    def walk(defs):
        for name, d in defs.items():
            for field, spec in d.get("properties", {}).items():
                if "description" not in spec:
                    missing.append(f"{name}.{field}")

    schema = json_schema()
    walk(schema["$defs"])
    walk({"Ledger": schema})
    assert missing == []


def _loosen(node):
    """What another pydantic version may emit: object schemas left open, keys in another order."""
    if isinstance(node, list):
        return [_loosen(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in reversed(list(node.items())):
        if key == "additionalProperties" and value is False:
            continue
        # Field order comes from the models, not the generator: keep it.
        out[key] = {n: _loosen(s) for n, s in value.items()} if key == "properties" else _loosen(value)
    return out


def test_schema_canonical_form_does_not_depend_on_the_generator():
    from ledger.core.models import canonical_schema
    from ledger.site.public import public_schema

    for schema in (json_schema(), public_schema()):
        assert canonical_schema(schema) == schema
        loosened = _loosen(schema)
        assert loosened != schema and json.dumps(canonical_schema(loosened)) == json.dumps(schema)


def test_every_object_schema_is_closed():
    from ledger.site.public import public_schema

    open_nodes = []

    def walk(node, where):
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_nodes.append(where)
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(json_schema(), "ledger")
    walk(public_schema(), "public")
    assert open_nodes == []

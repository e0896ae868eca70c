"""The public download ``vram.json``: the ledger plus the derived figures the page shows.

Its JSON Schema (``vram.schema.json``, published beside it) is generated from these models.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from ledger.core.models import Ledger, canonical_schema
from ledger.core.results import Calibration, Fits, Scoreboard
from .views import Plot

#: Version of the public document's format (not of the ledger inside it).
PUBLIC_SCHEMA_VERSION = 1
PUBLIC_SCHEMA_ID = "urn:vram-ledger:schema:public"

class Derived(BaseModel):
    """Figures computed from the ledger at build time."""

    model_config = ConfigDict(extra="forbid")

    counts: dict[str, int] = Field(description="Row counts: measurements, gpus, findings, predictions, ok, oom.")
    training_gpu: Optional[str] = Field(None, description="Key of the card the real runs ran on.")
    plots: list[Plot] = Field(default_factory=list, description="Every plot on the page with the points it draws.")
    estimators: Optional[Scoreboard] = Field(
        None, description="How every VRAM estimator fares against the ledger's measured peaks (the scoreboard).")
    calibration: Optional[Calibration] = Field(
        None, description="`vram calibrate --json` of the ledger at build time, plus the ceiling table.")
    fits: Optional[Fits] = Field(
        None, description="The fit table (fits.html): rank ceilings per model, card, quant, fixes, setting and length.")

class PublicDocument(BaseModel):
    """vram.json as published."""

    model_config = ConfigDict(
        extra="forbid",
        title="vram ledger public download",
        json_schema_extra={"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": PUBLIC_SCHEMA_ID},
    )

    schema_version: int = Field(description="Version of this document's format.")
    url: Optional[str] = Field(None, description="Public address of this file (when built with --base-url).")
    schema_url: str = Field(description="Address of the JSON Schema this file validates against.")
    ledger_sha256: str = Field(description="sha256 of the ledger's canonical text: changes when its content does.")
    build_date: Optional[str] = Field(None, description="Build date when one was given (--build-date, SOURCE_DATE_EPOCH).")
    ledger: Ledger = Field(description="The ledger, as stored.")
    derived: Derived = Field(description="Figures derived from the ledger at build time.")

def public_schema(base_url: Optional[str] = None) -> dict:
    """The JSON Schema of vram.json (draft 2020-12), generated from the models in its canonical
    form; its ``$id`` is its public address when the site has one."""
    schema = PublicDocument.model_json_schema()
    if base_url:
        schema["$id"] = f"{base_url.rstrip('/')}/vram.schema.json"
    ledger_def = schema["$defs"]["Ledger"]
    for key in ("$id", "$schema"):  # an embedded $id would rebase the ledger's $refs
        ledger_def.pop(key, None)
    return canonical_schema(schema)  # type: ignore[return-value]

def validate_public(path) -> list:
    """Every problem with a downloaded vram.json: JSON, version, schema, the ledger, its hash."""

    from jsonschema import Draft202012Validator

    from ledger.core.errors import Issue, format_loc
    from ledger.core.checks import ledger_issues
    from ledger.storage.store import parse_json, read_text

    name = str(path)
    data = parse_json(read_text(path), name)
    if not isinstance(data, dict):
        return [Issue(name, "", "top level must be a JSON object")]
    version = data.get("schema_version")
    if type(version) is not int:
        return [Issue(name, "schema_version", "missing or not an integer")]
    if version > PUBLIC_SCHEMA_VERSION:
        return [Issue(name, "schema_version", f"version {version} is newer than this vram-ledger reads "
                      f"({PUBLIC_SCHEMA_VERSION}): upgrade vram-ledger")]
    validator = Draft202012Validator(public_schema())
    issues = [Issue(name, format_loc(e.absolute_path), e.message)
              for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))]
    if issues:
        return issues
    doc = PublicDocument.model_validate(data)
    issues = [Issue(name, f"ledger.{i.location}", i.message) for i in ledger_issues(doc.ledger, name)]
    from .index_page import ledger_hash

    sha = ledger_hash(doc.ledger)
    if sha != doc.ledger_sha256:
        issues.append(Issue(name, "ledger_sha256", "does not match the ledger in the file: altered or damaged"))
    return issues

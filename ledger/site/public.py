"""The public download ``vram.json``: the ledger plus the derived figures the page shows.

Its JSON Schema (``vram.schema.json``, published beside it) is generated from these models.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..models import Ledger, _close_pattern_properties
from .context import Plot

#: Version of the public document's format (not of the ledger inside it).
PUBLIC_SCHEMA_VERSION = 1
PUBLIC_SCHEMA_ID = "urn:vram-ledger:schema:public"


class Derived(BaseModel):
    """Figures computed from the ledger at build time."""

    model_config = ConfigDict(extra="forbid")

    counts: dict[str, int] = Field(description="Row counts: measurements, gpus, findings, predictions, ok, oom.")
    training_gpu: Optional[str] = Field(None, description="Key of the card the real runs ran on.")
    plots: list[Plot] = Field(default_factory=list, description="Every plot on the page with the points it draws.")
    calibration: Optional[dict[str, Any]] = Field(
        None, description="`vram calibrate --json` of the ledger at build time, plus the ceiling table.")


class PublicDocument(BaseModel):
    """vram.json as published."""

    model_config = ConfigDict(
        extra="forbid",
        title="vram ledger public download",
        json_schema_extra={"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": PUBLIC_SCHEMA_ID},
    )

    schema_version: int = Field(description="Version of this document's format.")
    ledger_sha256: str = Field(description="sha256 of the ledger's canonical text: changes when its content does.")
    build_date: Optional[str] = Field(None, description="Build date when one was given (--build-date, SOURCE_DATE_EPOCH).")
    ledger: Ledger = Field(description="The ledger, as stored.")
    derived: Derived = Field(description="Figures derived from the ledger at build time.")


def public_schema() -> dict:
    """The JSON Schema of vram.json (draft 2020-12), generated from the models."""
    schema = PublicDocument.model_json_schema()
    ledger_def = schema["$defs"]["Ledger"]
    for key in ("$id", "$schema"):  # an embedded $id would rebase the ledger's $refs
        ledger_def.pop(key, None)
    _close_pattern_properties(schema)
    ordered = {"$schema": schema.pop("$schema"), "$id": schema.pop("$id"), "title": schema.pop("title")}
    ordered.update(schema)
    return ordered

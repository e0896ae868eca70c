"""Import of the program's older vram.json format into the ledger. Nothing is lost.

The older format has: ``about``; ``gpu`` (the training card); ``measurements``
(free-form records with ``mode``, ``peak_mb`` / ``peak_gb`` / ``peak`` text,
``result`` text, ...); ``cross_gpu`` (``gpus`` and structured ``probes``); and
named sections (``rank_cost``, ``calibration``, ...) of prose and figures.

Rules, applied to any file of that format:

- every known field goes to its structured place; free text that holds figures
  ("OOM: 7.39 GB used, 256 MB free, tried to allocate 248 MB") is parsed into
  structured fields *and* kept verbatim (``result_text``, ``config_text``,
  ``peak_as_reported``); an unknown field is kept as a note ``key: value``;
- the program's "MB" are MiB and its "GB" GiB (DESIGN.md, Units);
- defaults the ``about`` text states ("4-bit nf4 QLoRA on org/model ... unless
  noted", the training card) fill missing fields, named in
  ``provenance.inferred_fields``;
- every other top-level section becomes a finding: strings become details,
  numbers, ranges and flags become figures (unit from the key's suffix), nested
  ``source`` / ``measured_on`` become the figure's provenance; the measurements a
  finding cites (by id, or by a peak figure it quotes) become its evidence;
- ``predicted_mb`` on a real run becomes the ledger's first prediction, scored
  against that run.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from ledger.core.errors import Issue, LedgerError
from ledger.core.models import (
    SCHEMA_VERSION,
    Dataset,
    Detail,
    Figure,
    Finding,
    Gpu,
    Ledger,
    Lora,
    Measurement,
    Oom,
    Outcome,
    Prediction,
    PredictionScore,
    Provenance,
)
from ledger.vocab.recipe import resolve_gpu, short_name, slug, vendor_of
from ledger.core.units import SIZE, SIZE_RE, round_mib, to_mib

_KINDS = {"probe", "real", "load", "computed", "dry_run"}
_STATUSES = {"ok", "oom", "spilled", "crashed", "host_oom"}
_PROV_KEYS = {"source", "measured_on", "inferred"}
_FILE_EXT = re.compile(r"\.(py|json|log|sh|md|txt|toml|yaml|yml)$")
_MODEL_ID = re.compile(r"(?<![\w./-])([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*[A-Za-z0-9])")


_ACRONYMS = {"gpu": "GPU", "ram": "RAM", "vram": "VRAM", "lora": "LoRA", "dora": "DoRA", "vs": "versus"}


def _title(key: str, capital: bool = True) -> str:
    text = " ".join(_ACRONYMS.get(w, w) for w in key.split("_") if w)
    return text[:1].upper() + text[1:] if capital else text


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- free-text parsing ---------------------------------------------------------------

_OOM_FIGURES = [
    # (field, pattern) - each pattern has one SIZE group
    ("tried_mib", re.compile(r"tried(?: to allocate)?\s+" + SIZE, re.I)),
    ("free_mib", re.compile(SIZE + r"\s+free", re.I)),
    ("allocated_mib", re.compile(SIZE + r"\s+(?:already\s+)?allocated", re.I)),
    ("in_use_mib", re.compile(SIZE + r"\s+(?:used|in use)", re.I)),
]
_RESERVED_UNALLOC = re.compile(SIZE + r"\s+reserved[- ](?:but[- ])?unallocated", re.I)
_STEP = re.compile(r"\bat step\s+(\d+)", re.I)
_XID = re.compile(r"\bXid\s+(\d+)", re.I)
_RANK_IN_TEXT = re.compile(r"(?<![\w.])r(\d{1,4})\b")
_TOKENS_IN_TEXT = re.compile(r"(?<![~\d.])(\d{3,6})[- ]tokens?\b", re.I)
_PER_DEVICE = re.compile(SIZE + r"\s+on\s+(?P<dev>[A-Za-z]+\s?\d+)", re.I)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_oom_summary(text: str) -> Oom:
    """Structured figures from a summarised OOM note ('OOM at step 236: 6.98 GiB allocated,
    394 MiB reserved-unallocated, 58 MiB free'). The text is kept as ``message``."""
    fields: dict[str, float] = {}
    m = _RESERVED_UNALLOC.search(text)
    if m:
        fields["reserved_unallocated_mib"] = round_mib(to_mib(m["num"], m["unit"]))
    for name, pattern in _OOM_FIGURES:
        m = pattern.search(text)
        if m and m["num"]:
            fields[name] = round_mib(to_mib(m["num"], m["unit"]))
    return Oom(message=text, **fields)


def status_from_text(text: str) -> str | None:
    low = text.lower()
    if re.search(r"\boom\b|out of memory", low):
        return "oom"
    if any(w in low for w in ("crash", "died", "illegal memory access", "segfault", "xid")):
        return "crashed"
    if re.search(r"\bfits\b|\bfit\b|\bok\b", low):
        return "ok"
    return None


# -- the importer --------------------------------------------------------------------


class _Importer:
    def __init__(self, data: dict, name: str):
        self.data = data
        self.name = name
        self.issues: list[Issue] = []
        about = data.get("about") or ""
        self.default_model = self._model_in(about)
        self.default_quant = "4bit" if re.search(r"4-?bit|nf4|qlora", about, re.I) else None
        self.gpus: dict[str, Gpu] = {}
        self.training_gpu: str | None = None
        self.measurements: list[Measurement] = []
        self.predictions: list[Prediction] = []

    @staticmethod
    def _model_in(text: str) -> str | None:
        for m in _MODEL_ID.finditer(text):
            if not _FILE_EXT.search(m[1]):
                return m[1]
        return None

    def fail(self, loc: str, msg: str) -> None:
        self.issues.append(Issue(self.name, loc, msg))

    # gpus -------------------------------------------------------------------------
    def gpu(self, rec: dict, loc: str, legacy_key: str | None = None) -> str | None:
        if not isinstance(rec, dict) or not isinstance(rec.get("model"), str):
            self.fail(loc, "a gpu needs a 'model' name")
            return None
        name = rec["model"]
        prov = Provenance(
            source=rec.get("source"),
            measured_on=rec.get("measured_on"),
            inferred=bool(rec.get("inferred", False)),
        )
        fields: dict[str, Any] = {}
        mapping = {"arch": "arch", "os": "os", "driver": "driver", "stack": "stack", "libraries": "libraries",
                   "python": "python", "usable_gib_torch": "usable_gib_torch"}
        for key, value in rec.items():
            if key in ("model",) or key in _PROV_KEYS:
                continue
            if key in mapping:
                fields[mapping[key]] = value
            elif key in ("total_mib", "total_mb"):
                fields["total_mib"] = float(value)
            elif key == "note":
                prov.notes.append(value)
            else:
                prov.notes.append(f"{key.replace('_', ' ').capitalize()}: {_fmt(value)}")
        key = slug(name)
        aliases = sorted({a for a in (legacy_key, short_name(name)) if a and a != key})
        try:
            gpu = Gpu(name=name, vendor=vendor_of(name), aliases=aliases, provenance=prov, **fields)
        except Exception as exc:  # pydantic ValidationError: report, keep going
            self.fail(loc, f"cannot import gpu: {str(exc).splitlines()[-1].strip()}")
            return None
        self.gpus[key] = gpu
        return key

    def resolve_gpu(self, name: str) -> str | None:
        return resolve_gpu(self.gpus, name)

    # measurements -----------------------------------------------------------------
    def measurement(self, rec: dict, loc: str, *, cross: bool, default_model: str | None) -> None:
        if not isinstance(rec, dict):
            self.fail(loc, "a measurement must be an object")
            return
        prov = Provenance(source=rec.get("source"), measured_on=rec.get("measured_on"),
                          inferred=bool(rec.get("inferred", False)))
        out: dict[str, Any] = {}
        lora: dict[str, Any] = {}
        ds: dict[str, Any] = {}
        m: dict[str, Any] = {}
        inferred: list[str] = []
        predicted = None

        kind = rec.get("mode", "probe" if cross else None)
        if kind not in _KINDS:
            self.fail(f"{loc}.mode", f"unknown mode {kind!r} (known: {', '.join(sorted(_KINDS))})")
            return
        for key, value in rec.items():
            if key in _PROV_KEYS or key in ("id", "mode"):
                continue
            if key in ("rank", "alpha", "rslora", "dropout", "dora", "target_modules"):
                lora[key] = value
            elif key == "dataset":
                ds["name"] = value
            elif key == "dataset_examples":
                ds["examples"] = value
            elif key == "longest_example_tokens":
                ds["longest_example_tokens"] = value
            elif key == "epochs":
                ds["epochs"] = float(value)
            elif key in ("model", "quant", "seq_len", "response_len", "logits_to_keep", "memory_fixes", "batch_size"):
                m[key] = value
            elif key == "gpu":
                gpu = self.resolve_gpu(value)
                if gpu is None:
                    self.fail(f"{loc}.gpu", f"unknown gpu {value!r}")
                    return
                m["gpu"] = gpu
            elif key == "config":
                m["config_text"] = value
            elif key == "status":
                if value not in _STATUSES:
                    self.fail(f"{loc}.status", f"unknown status {value!r}")
                    return
                out["status"] = value
            elif key in ("after_load_mb", "pre_step_mb", "peak_allocated_mb", "peak_reserved_mb"):
                out[key[:-3] + "_mib"] = float(value)
            elif key == "peak_mb":
                out["peak_allocated_mib"] = float(value)
            elif key == "peak_gb":
                out["peak_allocated_mib"] = round_mib(to_mib(value, "GiB"))
                out["peak_as_reported"] = f"{_fmt(value)} GB"
                inferred.append("outcome.peak_allocated_mib")
            elif key == "peak":
                out["peak_as_reported"] = value
                devices = {d["dev"].replace(" ", ""): round_mib(to_mib(d["num"], d["unit"]))
                           for d in _PER_DEVICE.finditer(value)}
                if devices:
                    out["per_device_peak_mib"] = devices
                else:
                    size = SIZE_RE.search(value)
                    if size:
                        out["peak_allocated_mib"] = round_mib(to_mib(size["num"], size["unit"]))
                        inferred.append("outcome.peak_allocated_mib")
            elif key == "step_s":
                out["step_s"] = float(value)
            elif key == "result":
                out["result_text"] = value
            elif key == "note":
                prov.notes.append(value)
            elif key == "predicted_mb":
                predicted = float(value)
            else:
                prov.notes.append(f"{key}: {_fmt(value)}")

        # Figures held in free text.
        result = out.get("result_text", "")
        text_status = status_from_text(result) if result else None
        if "status" not in out:
            if text_status:
                out["status"] = text_status
            elif "peak_allocated_mib" in out or "per_device_peak_mib" in out:
                out["status"] = "ok"
        if out.get("status") == "oom":
            oom = parse_oom_summary(result) if result else Oom()
            if "peak_allocated_mib" in out:  # an OOM has no peak: what was read is a lower bound
                oom.max_allocated_mib = out.pop("peak_allocated_mib")
            out["oom"] = oom
        if result:
            step = _STEP.search(result)
            if step:
                out["failed_at_step"] = int(step[1])
            xid = _XID.search(result)
            if xid:
                out["xid"] = int(xid[1])
        config = m.get("config_text", "")
        if "rank" not in lora and config:
            r = _RANK_IN_TEXT.search(config)
            if r:
                lora["rank"] = int(r[1])
                inferred.append("lora.rank")
        if "seq_len" not in m and kind == "probe":
            if "longest_example_tokens" in ds:
                m["seq_len"] = ds["longest_example_tokens"]
                inferred.append("seq_len")
            elif config and _TOKENS_IN_TEXT.search(config):
                m["seq_len"] = int(_TOKENS_IN_TEXT.search(config)[1])
                inferred.append("seq_len")
        # Defaults the about text states.
        if "model" not in m and default_model:
            m["model"] = default_model
            inferred.append("model")
        if "quant" not in m and self.default_quant:
            m["quant"] = self.default_quant
            inferred.append("quant")
        if "gpu" not in m and self.training_gpu:
            m["gpu"] = self.training_gpu
            inferred.append("gpu")
        if "memory_fixes" not in m and "rank" in rec and not cross:
            before = re.search(r"(before|without) the memory fixes", config, re.I)
            m["memory_fixes"] = "none" if before else "all"
            inferred.append("memory_fixes")
        elif "memory_fixes" not in m and re.search(r"(before|without) the memory fixes", config, re.I):
            m["memory_fixes"] = "none"
            inferred.append("memory_fixes")
        prov.inferred_fields = inferred

        mid = rec.get("id") or self.cross_id(m, lora)
        try:
            meas = Measurement(
                id=mid,
                kind=kind,
                lora=Lora(**lora) if "rank" in lora else None,
                dataset=Dataset(**ds) if ds else None,
                outcome=Outcome(**out),
                provenance=prov,
                **m,
            )
            if lora and "rank" not in lora:
                meas.provenance.notes.extend(f"{k}: {_fmt(v)}" for k, v in lora.items())
        except Exception as exc:
            self.fail(loc, f"cannot import: {str(exc).splitlines()[-1].strip()}")
            return
        self.measurements.append(meas)
        if predicted is not None:
            self.pending_predictions.append((meas, predicted))

    def shared_example_keep(self) -> None:
        """A probe that does not record its logits_to_keep ran the same longest example as a probe
        that does when both name the same dataset, or ran on the same day from a shared log: it
        kept the same response positions. Marked inferred, with the row it was read from."""
        def files(m: Measurement) -> set[str]:
            return {f.strip() for f in (m.provenance.source or "").split(";") if f.strip()}

        for m in self.measurements:
            ds = m.dataset
            if m.kind != "probe" or m.logits_to_keep or m.response_len or not ds or not ds.longest_example_tokens:
                continue
            same = [x for x in self.measurements if x is not m and x.logits_to_keep and x.dataset
                    and x.dataset.longest_example_tokens == ds.longest_example_tokens
                    and ((ds.name and x.dataset.name == ds.name)
                         or (x.provenance.measured_on == m.provenance.measured_on and files(x) & files(m)))]
            keeps = {x.logits_to_keep for x in same}
            if len(keeps) == 1:
                m.logits_to_keep = keeps.pop()
                m.provenance.inferred_fields.append("logits_to_keep")
                m.provenance.notes.append(f"logits_to_keep {m.logits_to_keep}: read from {same[0].id}, which ran the "
                                          f"same longest example ({ds.longest_example_tokens} tokens)")

    def cross_id(self, m: dict, lora: dict) -> str:
        parts = [m.get("gpu") or "gpu", m.get("quant") or "q", f"fixes-{m.get('memory_fixes', 'na')}",
                 f"r{lora.get('rank', 'na')}"]
        if lora.get("dropout"):
            parts.append(f"drop{lora['dropout']:g}")
        if lora.get("dora"):
            parts.append("dora")
        parts.append(f"seq{m.get('seq_len', 'na')}")
        base = "-".join(str(p) for p in parts)
        taken = {x.id for x in self.measurements}
        mid, n = base, 2
        while mid in taken:
            mid, n = f"{base}-{n}", n + 1
        return mid

    # findings ---------------------------------------------------------------------
    def finding(self, key: str, value: Any, extra_evidence: Iterable[str] = ()) -> Finding:
        title = _title(key)
        prov = Provenance()
        details: list[Detail] = []
        figures: list[Figure] = []
        claim = None
        if isinstance(value, dict):
            prov = Provenance(source=value.get("source"), measured_on=value.get("measured_on"),
                              inferred=bool(value.get("inferred", False)))
            for ckey in ("claim", "observed", "incident", "method", "about"):
                if isinstance(value.get(ckey), str):
                    claim = value[ckey]
                    break
            body = {k: v for k, v in value.items() if k not in _PROV_KEYS and not (claim is not None and v is claim)}
            self._walk(body, [], None, None, details, figures)
        else:
            self._walk({"": value} if not isinstance(value, list) else {key: value}, [], None, None, details, figures)
        texts = [claim or ""] + [d.text for d in details] + [f.text or "" for f in figures]
        numbers = [f.value for f in figures if isinstance(f.value, float)]
        evidence = self._evidence(" ".join(texts), numbers, extra_evidence)
        if evidence:
            prov.inferred_fields.append("evidence")
        return Finding(
            id=key.replace("_", "-"),
            title=title,
            claim=claim,
            details=details,
            figures=figures,
            evidence=evidence,
            status="inferred" if prov.inferred else "measured",
            provenance=prov,
        )

    def _walk(self, node: dict, path: list[str], unit: str | None, prov: Provenance | None,
              details: list[Detail], figures: list[Figure]) -> None:
        local_prov = prov
        if any(k in node for k in _PROV_KEYS) and path:
            local_prov = Provenance(source=node.get("source"), measured_on=node.get("measured_on"),
                                    inferred=bool(node.get("inferred", False)))
        for key, value in node.items():
            if path and key in _PROV_KEYS:
                continue
            k_unit, base = unit, key
            for suffix, u in (("_mb", "MiB"), ("_mib", "MiB"), ("_gb", "GB (as reported)"), ("_pct", "%"),
                              ("_s", "s")):
                if key.endswith(suffix):
                    k_unit, base = u, key[: -len(suffix)]
                    break
                if f"{suffix}_" in key:  # e.g. resident_gb_estimate
                    k_unit, base = u, key.replace(f"{suffix}_", "_")
                    break
            name = _title(base, capital=not path)
            label = ": ".join(p for p in [*path, name] if p) or "Value"
            if isinstance(value, dict):
                self._walk(value, [*path, name], k_unit, local_prov, details, figures)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        head = next((v for v in item.values() if isinstance(v, str)), None)
                        sub = {k: v for k, v in item.items() if v is not head} if head and "note" not in item else item
                        item_name = head if head and "note" not in item else f"{name} {i + 1}"
                        self._walk(sub, [*path, item_name], k_unit, local_prov, details, figures)
                    else:
                        self._leaf(f"{label} {i + 1}", item, k_unit, local_prov, details, figures)
            else:
                self._leaf(label, value, k_unit, local_prov, details, figures)

    @staticmethod
    def _leaf(label: str, value: Any, unit: str | None, prov: Provenance | None,
              details: list[Detail], figures: list[Figure]) -> None:
        if isinstance(value, bool):
            figures.append(Figure(label=label, value=value, provenance=prov))
        elif isinstance(value, (int, float)):
            figures.append(Figure(label=label, value=float(value), unit=unit, provenance=prov))
        elif isinstance(value, str):
            nums = [float(x) for x in _NUMBER.findall(value.replace(",", ""))]
            rangey = re.fullmatch(r"\s*(about\s+)?\d+(\.\d+)?\s*[-\u2013]\s*\d+(\.\d+)?\s*", value)
            if unit and rangey and len(nums) == 2:
                lo, hi = sorted(abs(n) for n in nums)
                figures.append(Figure(label=label, low=lo, high=hi, unit=unit, text=value, provenance=prov))
            elif unit and len(nums) == 1 and re.fullmatch(r"[\s\d.,~about]*", value):
                figures.append(Figure(label=label, value=nums[0], unit=unit, text=value, provenance=prov))
            else:
                details.append(Detail(label=label, text=value))
        elif value is None:
            details.append(Detail(label=label, text="(none)"))

    def _evidence(self, text: str, numbers: list[float], extra: Iterable[str]) -> list[str]:
        found: list[str] = list(extra)
        tokens = {float(t) for t in _NUMBER.findall(text.replace(",", "")) if len(t.replace(".", "")) >= 4}
        tokens.update(n for n in numbers if n >= 1000)
        for meas in self.measurements:
            peaks = {meas.outcome.peak_allocated_mib}
            if meas.outcome.oom:
                peaks.add(meas.outcome.oom.max_allocated_mib)
            cited = re.search(rf"(?<![\w-]){re.escape(meas.id)}(?![\w-])", text) or (peaks - {None}) & tokens
            if cited and meas.id not in found:
                found.append(meas.id)
        return found

    # top level --------------------------------------------------------------------
    def run(self) -> Ledger:
        data = self.data
        self.pending_predictions: list[tuple[Measurement, float]] = []
        if not isinstance(data.get("measurements"), list):
            raise LedgerError(Issue(self.name, "measurements", "not the older vram.json format: no measurements list"))
        if isinstance(data.get("gpu"), dict):
            self.training_gpu = self.gpu(data["gpu"], "gpu")
        cross = data.get("cross_gpu") if isinstance(data.get("cross_gpu"), dict) else {}
        for key, rec in (cross.get("gpus") or {}).items():
            self.gpu(rec, f"cross_gpu.gpus.{key}", legacy_key=key)
        for i, rec in enumerate(data["measurements"]):
            self.measurement(rec, f"measurements[{i}]", cross=False, default_model=self.default_model)
        n_main = len(self.measurements)
        self.shared_example_keep()
        cross_model = self._model_in(cross.get("about") or "") or self.default_model
        for i, rec in enumerate(cross.get("probes") or []):
            if isinstance(rec, dict) and "source" not in rec and isinstance(cross.get("source"), str):
                rec = {**rec, "source": cross["source"]}  # the section's source is each probe's
            self.measurement(rec, f"cross_gpu.probes[{i}]", cross=True, default_model=cross_model)
        cross_ids = [m.id for m in self.measurements[n_main:]]

        findings: list[Finding] = []
        for key, value in data.items():
            if key in ("about", "gpu", "measurements", "cross_gpu", "schema_version"):
                continue
            findings.append(self.finding(key, value))
        if cross:
            rest = {k: v for k, v in cross.items() if k not in ("gpus", "probes")}
            if rest:
                findings.append(self.finding("cross_gpu", rest, extra_evidence=cross_ids))
        for meas, predicted in self.pending_predictions:
            self.predictions.append(self.prediction(meas, predicted, findings))
        if self.issues:
            raise LedgerError(self.issues)
        return Ledger(
            schema_version=SCHEMA_VERSION,
            about=data.get("about"),
            gpus=self.gpus,
            measurements=self.measurements,
            findings=findings,
            predictions=self.predictions,
        )

    def prediction(self, meas: Measurement, predicted: float, findings: list[Finding]) -> Prediction:
        basis: list[str] = []
        method = None
        for f in findings:
            if any(fig.value == predicted for fig in f.figures):
                method = f.claim
                probe_peaks = {fig.value for fig in f.figures if "probe" in fig.label.lower()}
                basis = [m.id for m in self.measurements
                         if m.kind == "probe" and m.outcome.peak_allocated_mib in probe_peaks]
        score = None
        if meas.outcome.peak_allocated_mib:
            actual = meas.outcome.peak_allocated_mib
            score = PredictionScore(measurement=meas.id, actual_peak_mib=actual,
                                    error_pct=round((predicted - actual) / actual * 100, 2))
        return Prediction(
            id=f"pred-{meas.id}",
            gpu=meas.gpu, model=meas.model, quant=meas.quant, lora=meas.lora, seq_len=meas.seq_len,
            memory_fixes=meas.memory_fixes, dataset=meas.dataset,
            made_on=meas.provenance.measured_on,
            predicted_peak_mib=predicted,
            basis=basis,
            method=method,
            score=score,
            provenance=Provenance(
                source=meas.provenance.source,
                measured_on=meas.provenance.measured_on,
                inferred=True,
                inferred_fields=["made_on", "basis"],
                notes=[f"Imported from the predicted_mb of {meas.id}; made before that run, on or before its date."],
            ),
        )


def import_legacy(data: Any, name: str) -> Ledger:
    """Convert a parsed older-format vram.json into a Ledger. Raises LedgerError with located issues."""
    if not isinstance(data, dict):
        raise LedgerError(Issue(name, "", "not the older vram.json format: top level must be an object"))
    if "schema_version" in data:
        raise LedgerError(Issue(name, "schema_version", "this is already a ledger, not the older format"))
    return _Importer(data, name).run()

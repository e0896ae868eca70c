"""A transformers TrainerCallback that records a real run's peak memory.

In a training script:

    from probe_kit.callback import VramLedgerCallback
    vram = VramLedgerCallback(ledger="runs.json", gpu="rtx-3070-ti", rank=96, dropout=0.1)
    trainer = Trainer(..., callbacks=[vram])
    with vram.watch():
        trainer.train()

At train end (and on an OOM, which ``watch()`` catches, records and re-raises) it reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (never resetting them: peak stats are
process-global and the trainer or the user may rely on them), prints one ``vram-ledger: {...}``
line that ``vram ingest-log`` reads, and, given a ledger, appends the real measurement itself (a
missing ledger is created; a ledger that cannot be written is warned about, never raised into
training: the record then goes to ``LEDGER.unrecorded.log``).
Without a GPU (a CPU test run) it measures with the tracker meter between train begin and end, and
records the run with its device and meter and without a card: a CPU run is never filed as a run on
the card it was configured for (and the bundled ledger refuses CPU rows).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import sys
from typing import Iterator, Optional

import torch
from transformers import TrainerCallback

from ledger.intake.logs import CALLBACK_PREFIX

from .meters import MIB, TrackerMeter

log = logging.getLogger(__name__)


class VramLedgerCallback(TrainerCallback):
    """Records the run's peak memory at train end and on an OOM."""

    def __init__(self, ledger: Optional[str] = None, log_file: Optional[str] = None, stream=None, **config):
        self.ledger = ledger
        self.log_file = log_file
        self.stream = stream
        # The run's description for the ledger entry: the fields of ledger.intake.ingest.RunSpec (gpu, model,
        # quant, rank, alpha, rslora, dropout, dora, seq_len, fixes, dataset, examples, epochs).
        from ledger.intake.ingest import RunSpec

        unknown = sorted(set(config) - set(RunSpec.__dataclass_fields__))
        if unknown:
            raise TypeError(f"VramLedgerCallback: unknown option {unknown[0]!r} "
                            f"(known: {', '.join(RunSpec.__dataclass_fields__)})")
        self.config = config
        self.step = 0
        self.model: Optional[torch.nn.Module] = None
        self.is_main = True
        self.tracker: Optional[TrackerMeter] = None
        self.written: list[dict] = []
        #: Why a record could not be appended to the ledger (kept in LEDGER.unrecorded.log).
        self.failures: list[str] = []

    # -- meters -------------------------------------------------------------------------
    def _cuda(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _devices(self) -> list[int]:
        """The CUDA devices that hold the model's parameters (a model split across cards has
        several), else the current device."""
        found = sorted({p.device.index for p in (self.model.parameters() if self.model is not None else [])
                        if p.device.type == "cuda" and p.device.index is not None})
        return found or [torch.cuda.current_device()]

    def _figures(self) -> dict:
        if self._cuda():
            devices = self._devices()
            for d in devices:
                torch.cuda.synchronize(d)
            props = torch.cuda.get_device_properties(devices[0])
            doc = {"meter": "allocator", "device": props.name,
                   "total_mib": round(props.total_memory / MIB, 1),
                   "peak_allocated_mib": round(torch.cuda.max_memory_allocated(devices[0]) / MIB, 1),
                   "peak_reserved_mib": round(torch.cuda.max_memory_reserved(devices[0]) / MIB, 1)}
            if len(devices) > 1:
                doc["per_device_peak_mib"] = {f"cuda:{d}": round(torch.cuda.max_memory_allocated(d) / MIB, 1)
                                              for d in devices}
            return doc
        if self.tracker is not None:
            return {"meter": "tracker", "device": "cpu",
                    "peak_allocated_mib": round(self.tracker.peak_allocated_mib(), 1)}
        return {"meter": None, "device": "cpu"}

    def _main_process(self, state=None) -> bool:
        """Only the main process of a distributed run prints and appends (every rank would
        otherwise write its own copy)."""
        if state is not None and hasattr(state, "is_world_process_zero"):
            return bool(state.is_world_process_zero)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return int(os.environ.get("RANK", "0") or 0) == 0

    # -- TrainerCallback hooks ----------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.model = kwargs.get("model")
        self.is_main = self._main_process(state)
        if not torch.cuda.is_available() and self.tracker is None:
            self.tracker = TrackerMeter()
            model = kwargs.get("model")
            if model is not None:
                self.tracker.register_module(model)
            self.tracker.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        self._stop_tracker()
        self.record("train_end")

    def _stop_tracker(self) -> None:
        if self.tracker is not None and self.tracker in _active_modes():
            self.tracker.__exit__(None, None, None)

    # -- recording ----------------------------------------------------------------------
    def record(self, event: str, message: Optional[str] = None) -> dict:
        """Write the vram-ledger line (and the ledger entry, when a ledger was given); in a
        distributed run, only from the main process."""
        doc = {"event": event, "date": dt.date.today().isoformat(), "step": self.step, **self._figures()}
        if not self.is_main or not self._main_process():
            return doc
        if message is not None:
            doc["message"] = message
        line = f"{CALLBACK_PREFIX} {json.dumps(doc, sort_keys=True)}"
        print(line, file=self.stream or sys.stdout, flush=True)
        if self.log_file:
            try:
                with open(self.log_file, "a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
            except OSError as exc:  # never into training: the line is printed above
                log.warning("vram-ledger: could not write %s: %s", self.log_file, exc.strerror or exc)
        self.written.append(doc)
        if self.ledger:
            self._append(doc)
        return doc

    def _append(self, doc: dict) -> None:
        """Append the run to the ledger (created on the first write). Never raises into training:
        hours of a finished run must not end in a traceback because a ledger could not be
        written. On failure the record goes to ``LEDGER.unrecorded.log`` (one line that
        ``vram ingest-log`` reads) and a warning says how to add it."""
        from ledger.core.errors import UserError
        from ledger.intake.ingest import RunSpec, record_callback
        from ledger.answer.predictions import score_predictions

        spec = dict(self.config)
        if doc.get("meter") != "allocator" and spec.get("gpu"):
            # A run measured on the CPU is never filed as a run on the card it was configured for.
            log.warning("vram-ledger: measured on the CPU, so recorded without gpu=%r", spec["gpu"])
            spec["gpu"] = None
        try:
            record_callback(doc, self.ledger, RunSpec(**spec), then=score_predictions)
        except (UserError, OSError, ValueError) as exc:
            self.failures.append(str(exc))
            kept = self._keep(doc)
            log.warning("vram-ledger: could not record the run in %s: %s. The figures are kept%s; add them with "
                        "`vram ingest-log %s --ledger %s%s`", self.ledger, str(exc).replace("\n", "; "),
                        f" in {kept}" if kept else " in the vram-ledger line printed above",
                        kept or "TRAINING.log", self.ledger, f" --gpu {spec['gpu']}" if spec.get("gpu") else "")

    def _keep(self, doc: dict) -> Optional[str]:
        """Write the record where ``ingest-log`` can read it; the path, or None if that fails too."""
        path = f"{self.ledger}.unrecorded.log"
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"{CALLBACK_PREFIX} {json.dumps(doc, sort_keys=True)}\n")
        except OSError:
            return None
        return path

    @contextlib.contextmanager
    def watch(self) -> Iterator["VramLedgerCallback"]:
        """Wrap ``trainer.train()``: an OOM is recorded (with its message and step), then re-raised."""
        try:
            yield self
        except torch.OutOfMemoryError as exc:
            self._stop_tracker()
            self.record("oom", message=f"torch.OutOfMemoryError: {exc}")
            raise


def _active_modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())

"""vram ledger: a ledger of measured GPU memory for LLM (Q)LoRA fine-tuning.

``ledger`` is the only package that reads or writes ledger files; it never imports torch. Its
packages are its layers, bottom first (ARCHITECTURE.md; ``tests/test_architecture.py`` holds them):
``core`` (the format, errors, units, answers' types) → ``storage`` (ledger files) → ``vocab`` (recipes,
cards, model configs, adapters, optimizers) → ``intake`` (logs, OOM messages, the older format) →
``fit`` (the fitted ledger) → ``answer`` (the ladder, the predictor, ceilings, the fit table) →
``report`` (estimators, held-out answers, the scoreboard) → ``site`` → ``cli``.

The modules' earlier flat paths (``ledger.store``, ``ledger.predictor``, ...) still import: each is
the same module object as its new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: Each layer package and its modules; the flat path ``ledger.<module>`` is an alias of
#: ``ledger.<package>.<module>``.
LAYERS = {
    "core": ("errors", "paths", "units", "strict_json", "models", "results", "ends", "answers", "checks"),
    "storage": ("atomic", "store", "dry_runs"),
    "vocab": ("model_configs", "adapter", "optimizers", "recipe", "cards"),
    "intake": ("oom", "logs", "legacy", "ingest"),
    "fit": ("peak_rows", "held_out_views", "peaks", "calibration", "ledger_fit", "dry_table", "dry_calibration", "limits",
            "response_span", "dominance"),
    "answer": ("ceilings", "rungs", "verdicts", "predictor", "rank_judge", "fits", "predictions"),
    "report": ("held_out", "estimators", "scoreboard", "calibration_report"),
}
MOVED = {f"{__name__}.{m}": f"{__name__}.{p}.{m}" for p, ms in LAYERS.items() for m in ms}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a flat path as the module at its layer's path (one module object, two names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())  # before the path finder: ledger/model_configs/ is a data folder

from ledger.core.models import SCHEMA_VERSION, Ledger, Measurement  # noqa: E402

__all__ = ["SCHEMA_VERSION", "Ledger", "Measurement", "LAYERS"]

"""Write tests/data/golden-dry-runs.json: the shipped dry-run rows of the golden site's three models.

    python tests/data/make_golden_dry_runs.py   # then regenerate the golden site (tests/conftest.py: REGEN_GOLDEN)

A frozen copy: the golden site's fit table is built from it (``vram build --dry-runs``), so the
golden tree changes when the site's code does, not each time the shipped grid grows.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ledger.storage import store  # noqa: E402
from ledger.vocab.model_configs import model_name  # noqa: E402
from ledger.core.paths import DRY_RUNS  # noqa: E402

#: The ledger's own model (its cells take the whole evidence ladder), one with a 32k context and
#: one with 128k.
MODELS = ("gemma-3-4b-it", "qwen2.5-0.5b", "llama-3.1-8b")


def main() -> None:
    shipped = store.load(DRY_RUNS)
    kept = [m for m in shipped.measurements if model_name(m.model) in MODELS]
    store.save(shipped.model_copy(update={"measurements": kept}), Path(__file__).with_name("golden-dry-runs.json"))


if __name__ == "__main__":
    main()

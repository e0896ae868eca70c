"""The fit table's data (``fits.html``, ``fits.md``, ``fits.csv``) and the first section's grids
of the ledger's own cards, from the committed dry-run rows and the one predictor."""

from __future__ import annotations

from typing import Optional

from ..dry_runs import load_dry_runs
from ..fits import fits_document, ledger_grids
from ..models import Ledger
from ..held_out import shared_predictor
from ..results import Fits

#: Above this many rows the whole ladder per cell (and leave-one-out) is too slow for a build.
LOO_LIMIT = 1000


def fit_table_doc(ledger: Ledger) -> tuple[Optional[Fits], list]:
    """The fit table (site/fits.html) from the committed dry-run rows (None without any), and the
    first section's grids of the ledger's own cards (none above LOO_LIMIT rows)."""
    p = shared_predictor(ledger, load_dry_runs())
    small = len(ledger.measurements) <= LOO_LIMIT
    grids = ledger_grids(p) if small else []
    if not p.dry:
        return None, grids
    # Above LOO_LIMIT rows the whole ladder per cell is too slow for a build: the dry run answers.
    return Fits.model_validate(fits_document(p, ladder=small)), grids

"""Where dry-run rows come from: the shipped file and the user's cache.

``ledger/dry-runs.json`` is shipped data (the fit table's grid, computed by the sweeps in
``sweeps/``): the site is built from it alone (or from the file ``vram build --dry-runs`` names),
so the same ledger gives the same site on any install. Rows a user computes (``vram fit --model my.json --compute``) go to a cache of their own,
``dry-runs.json`` under the user's cache folder (``--cache DIR``; ``VRAM_LEDGER_CACHE``; else the
platform's, e.g. ``~/.cache/vram-ledger``), never into the shipped file; the commands that
answer (``estimate``, ``ceiling``, ``predict``, ``fit``, ``cards``, ``calibrate``) read both.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ledger.core.models import Measurement
from ledger.core.paths import DRY_RUNS

CACHE_FILE = "dry-runs.json"


def user_cache_dir() -> Path:
    """The folder computed dry-run rows go to: ``VRAM_LEDGER_CACHE``, else the platform's user
    cache folder for vram-ledger."""
    env = os.environ.get("VRAM_LEDGER_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir as platform_cache

    return Path(platform_cache("vram-ledger", appauthor=False))


def cache_file(cache: Optional[os.PathLike | str] = None) -> Path:
    """The cache's dry-run file (``dry-runs.json`` in ``cache``, default ``user_cache_dir()``)."""
    return Path(cache if cache is not None else user_cache_dir()) / CACHE_FILE


#: Rows already read, by file and the state it was read in (a build asks for them four times).
_READ: dict[tuple, list[Measurement]] = {}


def _rows_of(source: Path) -> list[Measurement]:
    from . import store

    st = source.stat()
    key = (str(source.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _READ:
        while len(_READ) >= 4:  # the shipped file and a cache or two; an edited file's old rows go
            del _READ[next(iter(_READ))]
        _READ[key] = store.load(source).measurements
    return list(_READ[key])


#: The file ``load_dry_runs`` reads when given none (``rows_from``): the shipped rows, unless a
#: build was told another file.
_SOURCE: Optional[Path] = None


@contextmanager
def rows_from(path: Optional[os.PathLike | str]) -> Iterator[None]:
    """Within the block, ``load_dry_runs()`` reads ``path`` instead of the shipped file (None: the
    shipped file). A build reads its dry runs in several places and worker processes (forked:
    they inherit this), all from the one file it was given (``vram build --dry-runs``)."""
    global _SOURCE
    before, _SOURCE = _SOURCE, (Path(path) if path is not None else None)
    try:
        yield
    finally:
        _SOURCE = before


def load_dry_runs(path=None, cache: Optional[os.PathLike | str] = None) -> list[Measurement]:
    """Dry-run rows: the shipped file's (or ``path``'s, or ``rows_from``'s), then, given ``cache``,
    the rows computed into that cache folder that the file lacks. A missing file holds no rows."""
    rows: list[Measurement] = []
    for source in [Path(path or _SOURCE or DRY_RUNS)] + ([cache_file(cache)] if cache is not None else []):
        if not source.exists():
            continue
        rows += _rows_of(source)  # a damaged file is a located error, never skipped
    seen: set[str] = set()
    return [m for m in rows if not (m.id in seen or seen.add(m.id))]  # type: ignore[func-returns-value]

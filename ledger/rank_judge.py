"""The fit table's fast path: ``Predictor.predict``'s verdict for a recipe on a card, as a function
of the rank, computed from the committed dry-run figures alone (the fit table asks it some hundred
thousand times; ``tests/test_predictor.py`` compares every cell with ``vram ceiling``'s scan,
which asks ``predict`` itself). ``p`` is a ``ledger.predictor.Predictor``."""

from __future__ import annotations

from typing import Callable, Optional

from .answers import Run, verdict_for
from .models import Gpu
from .recipe import Recipe
from .response_span import growth_mib, state_mib


def dry_judge(p, recipe: Recipe, gpu: str, entry: Optional[Gpu] = None,
              budget_mib: Optional[float] = None, widened: float = 0.0, run: Run = "probe",
              optimizer: Optional[str] = None) -> Callable[[int], str]:
    """``predict(...).verdict`` for the committed dry-run rows' figure of this recipe on a card
    the ledger did not measure it on, as a function of the rank ("unknown" where the dry-run
    table does not reach it), computed from the figures alone: the fit table asks it some
    hundred thousand times. ``budget_mib``: judged against it instead of the card's limit.
    ``widened``: each end of the interval then moved out by this fraction, as ``predict`` widens
    a derived answer (a micro-batch answered as one sequence). ``run="real"``: a training run's
    figure as ``predict`` makes it (the calibrated over-estimate where the probe/real pairs
    measured the recipe's fixes, else the steady state), plus ``optimizer``'s state."""
    profile, low, high = _profile(p, recipe, gpu, entry, budget_mib, widened, run, optimizer)
    bounds = profile.bounds

    def verdict(rank: int) -> str:
        found = bounds(rank)
        return "unknown" if found is None else verdict_for(found[0], found[1], low, high, 0.0)
    verdict.exact = profile.exact  # the ranks dry-run exactly (a narrower interval: the verdict can be stricter)
    return verdict


def dry_ceilings(p, recipe: Recipe, cards: list[tuple[str, Optional[Gpu]]], budget_mib: Optional[float],
                 widened: float, run: Run, optimizer: Optional[str], step: int, max_rank: int) -> list[tuple]:
    """(fits, tight, status, at least) on each of ``cards`` ((key, entry) pairs), in their order:
    what ``vram ceiling``'s scan from the smallest rank finds with ``dry_judge``'s verdicts (the
    largest rank with every rank up to it "fits"; the last before the first "won't fit"). The
    recipe's profile is made once per card remainder (the fit table asks every card of a recipe
    together)."""
    return [ceiling_of(*_profile(p, recipe, gpu, entry, budget_mib, widened, run, optimizer), step, max_rank)
            for gpu, entry in cards]


def ceiling_of(profile: "_Profile", low: Optional[float], high: Optional[float], step: int, max_rank: int
               ) -> tuple[Optional[int], Optional[int], str, bool]:
    """The scan's ceilings for one profile against one limit. A derived rank's verdict only
    worsens with the rank (bisection), while a rank dry-run exactly has a narrower interval than
    the derived ranks around it, so its verdict can be better or worse than theirs: each of those
    few is asked on its own. The verdict rule is ``answers.verdict_for``'s, inlined (the fit table
    asks this for every cell)."""
    bounds = profile.bounds
    if low is None or bounds(step) is None:
        return None, None, "unknown", False
    over = high if high is not None else low

    def not_fits(rank: int) -> bool:  # verdict != "fits"
        b = bounds(rank)
        return b is None or not b[1] <= low

    def stops(rank: int) -> bool:  # verdict "won't fit" or "unknown"
        b = bounds(rank)
        return b is None or (not b[1] <= low and b[0] > over)

    derived, exact = profile.ranks(step, max_rank)

    def first(bad) -> Optional[int]:
        lo, hi = -1, len(derived)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if bad(derived[mid]):
                hi = mid
            else:
                lo = mid
        found = derived[hi] if hi < len(derived) else None
        for r in exact:
            if (found is None or r < found) and bad(r):
                found = r
        return found

    def before(rank: Optional[int]) -> Optional[int]:
        return max_rank - max_rank % step if rank is None else (rank - step if rank > step else None)

    tight = before(first(stops))
    fits = before(first(not_fits))
    if fits is not None and tight is not None:
        fits = min(fits, tight)
    top = tight or fits
    # Past the last rank known to fit only unknowns (no slope to extrapolate with): "at least".
    at_least = top is not None and top + step <= max_rank and bounds(top + step) is None
    return fits, tight, "ok" if (fits or tight) else "none-fits", at_least


class _Profile:
    """One recipe's judged interval by rank, for every card with the same remainder."""

    __slots__ = ("bounds", "exact", "_ranks")

    def __init__(self, bounds, exact):
        self.bounds, self.exact, self._ranks = bounds, exact, {}

    def ranks(self, step: int, max_rank: int) -> tuple[list[int], list[int]]:
        """(the derived ranks, the exact ones) of the scan's grid, in order."""
        key = (step, max_rank)
        if key not in self._ranks:
            grid = range(step, max_rank + 1, step)
            self._ranks[key] = ([r for r in grid if r not in self.exact],
                                sorted(r for r in self.exact if r % step == 0 and step <= r <= max_rank))
        return self._ranks[key]


def _profile(p, recipe: Recipe, gpu: str, entry: Optional[Gpu], budget_mib: Optional[float], widened: float,
             run: Run, optimizer: Optional[str]) -> tuple[_Profile, Optional[float], Optional[float]]:
    """The recipe's profile on this card's remainder, and the card's limit (or the budget)."""
    entry = entry or p.ledger.gpus.get(gpu)
    rem = p.remainder(gpu or "", entry.vendor if entry else None)[0] or 0.0
    low, high, _ = p.card_limit(gpu, entry, run) if budget_mib is None else (budget_mib, budget_mib, "")
    # The interval at each rank depends on the card only through its remainder: made once per
    # recipe and remainder, and shared by every card (most cards share a vendor's remainder).
    return _profile_at(p, recipe, rem, widened, run, optimizer), low, high


def _profile_at(p, recipe: Recipe, rem: float, widened: float, run: Run, optimizer: Optional[str]) -> "_Profile":
    key = (recipe, rem, widened, run, optimizer)
    memo = p.rank_bounds
    found = memo.get(key)
    if found is None:
        found = memo[key] = _Profile(*_bounds(p, recipe, rem, widened, run, optimizer))
    return found


def _bounds(p, recipe: Recipe, rem: float, widened: float, run: Run, optimizer: Optional[str]):
    """(rank -> (bottom, top) of the judged interval, or None where the table does not reach; the
    ranks dry-run exactly), each rank's computed once."""
    figure = p.table.rank_figure(recipe)
    exact = p.table.exact_ranks(recipe)
    narrow, wide = p.dry_cal.width_fraction(False), p.dry_cal.width_fraction(True, recipe)
    over = off = None
    if run == "real" and p.calibrated_real(recipe):
        o = p.over
        off = o.logits_off_mib(recipe.model, p.span.figure_keep(recipe, []))
        over = (1 - o.high_pct / 100, 1 - o.low_pct / 100)
    state = optimizer if run == "real" and recipe.model else None
    measured_rank = p.over.max_rank
    cache: dict[int, Optional[tuple[float, float]]] = {}

    def bounds(rank: int) -> Optional[tuple[float, float]]:
        if rank in cache:
            return cache[rank]
        raw, _ = figure(rank)
        if raw is None:
            cache[rank] = None
            return None
        mib = raw + rem
        width = narrow if rank in exact else wide
        bottom, top = round(mib * (1 - width), 1), round(mib * (1 + width), 1)
        if over is not None:  # as ProbeToReal.probe_to_real: the core, then the over-estimate
            bottom, top = round(round(bottom - off, 1) * over[0], 1), round(round(top - off, 1) * over[1], 1)
        if state is not None:
            s = state_mib(recipe.model, rank, recipe.targets, recipe.dora, state)
            if s is not None:
                bottom, top = round(bottom + s, 1), round(top + s, 1)
        elif over is not None and measured_rank and rank > measured_rank:
            grown = growth_mib(recipe.model, rank, recipe.targets, recipe.dora, measured_rank)
            if grown:
                bottom, top = round(bottom + grown, 1), round(top + grown, 1)
        if widened:
            bottom, top = round(bottom * (1 - widened), 1), round(top * (1 + widened), 1)
        cache[rank] = (bottom, top)
        return cache[rank]
    return bounds, exact

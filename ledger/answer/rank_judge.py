"""The fit table's fast path: ``Predictor.predict``'s verdict for a recipe on a card, as a function
of the rank, computed from the committed dry-run figures alone (the fit table asks it some hundred
thousand times; ``tests/test_predictor.py`` compares every cell with ``vram ceiling``'s scan,
which asks ``predict`` itself). ``p`` is a ``ledger.answer.predictor.Predictor``."""

from __future__ import annotations

from bisect import bisect_right
from math import inf
from typing import Callable, NamedTuple, Optional

import numpy as np

from ledger.core.answers import Run
from ledger.core.ends import round1  # noqa: F401  (the fit table's and tests' name for it)

from .verdicts import judged_ends
from .verdicts import verdict as judged_verdict
from ledger.core.models import Gpu
from ledger.vocab.recipe import Recipe
from ledger.fit.response_span import growth_mib, state_mib, step_floor_mib


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
        return "unknown" if found is None else judged_verdict(found[0], found[1], low, high, 0.0)
    verdict.exact = profile.exact  # the ranks dry-run exactly (a narrower interval: the verdict can be stricter)
    return verdict


def card_limits(p, cards: list[tuple[str, Optional[Gpu]]], budget_mib: Optional[float], run: Run
                ) -> list[tuple[float, Optional[float], Optional[float]]]:
    """(remainder, low, high) of each of ``cards`` ((key, entry) pairs): the card's remainder and
    its limit (or the budget), what ``dry_ceilings`` judges each recipe against. Made once per
    card list (the fit table asks every recipe of a model against the same cards)."""
    out = []
    for gpu, entry in cards:
        entry = entry or p.ledger.gpus.get(gpu)
        rem = p.remainder(gpu or "", entry.vendor if entry else None)[0] or 0.0
        low, high, _ = p.card_limit(gpu, entry, run) if budget_mib is None else (budget_mib, budget_mib, "")
        out.append((rem, low, high))
    return out


def dry_ceilings(p, recipe: Recipe, limits: list[tuple[float, Optional[float], Optional[float]]], widened: float,
                 run: Run, optimizer: Optional[str], step: int, max_rank: int) -> list[tuple]:
    """(fits, tight, status, at least) on each card of ``limits`` (``card_limits``), in their order:
    what ``vram ceiling``'s scan from the smallest rank finds with ``dry_judge``'s verdicts (the
    largest rank with every rank up to it "fits"; the last before the first "won't fit"). The
    recipe's profile is made once per remainder (most cards share a vendor's)."""
    profiles: dict[float, _Profile] = {}
    out = []
    for rem, low, high in limits:
        profile = profiles.get(rem)
        if profile is None:
            profile = profiles[rem] = _profile_at(p, recipe, rem, widened, run, optimizer)
        out.append(ceiling_of(profile, low, high, step, max_rank))
    return out


def ceiling_of(profile: "_Profile", low: Optional[float], high: Optional[float], step: int, max_rank: int
               ) -> tuple[Optional[int], Optional[int], str, bool]:
    """The scan's ceilings for one profile against one limit. A derived rank's verdict only
    worsens with the rank, while a rank dry-run exactly has a narrower interval than the derived
    ranks around it, so its verdict can be better or worse than theirs: each of those few is asked
    on its own. The verdict rule is ``answers.verdict_for``'s, inlined (the fit table asks this
    for every cell). The derived ranks' interval ends, made once per profile, rise with the rank:
    the first derived rank that does not fit (its top above the limit's low end) and the first that
    stops the scan (besides, its bottom above the limit's top end) are found by bisecting them; a
    profile whose ends do not rise (a rank the table cannot reach between two it can) is bisected
    rank by rank as the scan would."""
    bounds = profile.bounds
    if low is None or bounds(step) is None:
        return None, None, "unknown", False
    over = high if high is not None else low
    derived, exact = profile.ranks(step, max_rank)
    columns = profile.columns(step, max_rank)
    if columns is not None:
        bottoms, tops = columns
        n = len(derived)
        at = bisect_right(tops, low)  # the first derived rank whose top is above the low end: not "fits"
        no_fit = derived[at] if at < n else None
        at = max(at, bisect_right(bottoms, over))  # ... and its bottom above the top end: the scan stops
        stop = derived[at] if at < n else None
    else:
        no_fit, stop = _bisected(bounds, derived, low, None), _bisected(bounds, derived, low, over)
    for r in exact:  # ascending: the first exact rank below the derived one that is bad is the first bad
        if no_fit is not None and r >= no_fit and stop is not None and r >= stop:
            break
        b = bounds(r)
        bad = b is None or not b[1] <= low
        if bad and (no_fit is None or r < no_fit):
            no_fit = r
        if (b is None or (bad and b[0] > over)) and (stop is None or r < stop):
            stop = r
    last = max_rank - max_rank % step
    tight = last if stop is None else (stop - step if stop > step else None)
    fits = last if no_fit is None else (no_fit - step if no_fit > step else None)
    if fits is not None and tight is not None:
        fits = min(fits, tight)
    top = tight or fits
    # Past the last rank known to fit only unknowns (no slope to extrapolate with): "at least".
    at_least = top is not None and top + step <= max_rank and bounds(top + step) is None
    return fits, tight, "ok" if (fits or tight) else "none-fits", at_least


def _bisected(bounds, derived: list[int], low: float, over: Optional[float]) -> Optional[int]:
    """The first derived rank that is not "fits" (``over`` None) or that stops the scan ("won't fit"
    or "unknown": also its bottom above ``over``), by the scan's own bisection, rank by rank."""
    lo, hi = -1, len(derived)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        b = bounds(derived[mid])
        if b is None or (not b[1] <= low and (over is None or b[0] > over)):
            hi = mid
        else:
            lo = mid
    return derived[hi] if hi < len(derived) else None


class _Profile:
    """One recipe's judged interval by rank, for every card with the same remainder."""

    __slots__ = ("bounds", "exact", "_column", "_ranks", "_columns")

    def __init__(self, bounds, exact, column):
        self.bounds, self.exact, self._column, self._ranks, self._columns = bounds, exact, column, {}, {}

    def ranks(self, step: int, max_rank: int) -> tuple[list[int], list[int]]:
        """(the derived ranks, the exact ones) of the scan's grid, in order."""
        key = (step, max_rank)
        if key not in self._ranks:
            grid = range(step, max_rank + 1, step)
            self._ranks[key] = ([r for r in grid if r not in self.exact],
                                sorted(r for r in self.exact if r % step == 0 and step <= r <= max_rank))
        return self._ranks[key]

    def columns(self, step: int, max_rank: int) -> Optional[tuple[list[float], list[float]]]:
        """(bottoms, tops) of the derived ranks' intervals (infinite where the table does not
        reach), or None where either does not rise with the rank."""
        key = (step, max_rank)
        if key not in self._columns:
            self._columns[key] = self._column(self.ranks(step, max_rank)[0])
        return self._columns[key]


def _profile(p, recipe: Recipe, gpu: str, entry: Optional[Gpu], budget_mib: Optional[float], widened: float,
             run: Run, optimizer: Optional[str]) -> tuple[_Profile, Optional[float], Optional[float]]:
    """The recipe's profile on this card's remainder, and the card's limit (or the budget)."""
    (rem, low, high), = card_limits(p, [(gpu, entry)], budget_mib, run)
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


class _Spec(NamedTuple):
    """What a recipe's judged interval at each rank is made of, besides the card's remainder:
    the dry-run figure and the optimizer's state by rank, the widths, the over-estimate of a
    calibrated real run and the widening of a derived answer."""

    exact: set
    narrow: float
    wide: float
    over: Optional[tuple[float, float]]
    off: Optional[float]
    widened: float
    raw_at: Callable
    added_at: Callable
    raw_column: Callable
    added_column: Callable
    floor_column: Callable  # ranks -> the optimizer step's floor (raw), nan where none


def _spec(p, recipe: Recipe, widened: float, run: Run, optimizer: Optional[str]) -> _Spec:
    exact = p.table.exact_ranks(recipe)
    narrow, wide = p.dry_cal.width_fraction(False), p.dry_cal.width_fraction(True, recipe)
    over = off = None
    # The pairs' over-estimate never takes a named optimizer's run below its probe (Predictor.predict).
    if run == "real" and p.calibrated_real(recipe) and not optimizer:
        o = p.over
        off = o.logits_off_mib(recipe.model, p.span.figure_keep(recipe, []))
        over = (1 - o.high_pct / 100, 1 - o.low_pct / 100)
    state = optimizer if run == "real" and recipe.model else None
    measured_rank = p.over.max_rank if over is not None and state is None else None
    return _Spec(exact, narrow, wide, over, off, widened, *_per_rank(p, recipe, state, measured_rank),
                 _floor_of(p, recipe, state)[1])


def _floor_of(p, recipe: Recipe, state: Optional[str]) -> tuple[Callable, Callable]:
    """(rank -> the optimizer step's floor or None, ranks -> the same as an array, nan for None):
    ``response_span.step_floor_mib`` rank by rank, what ``Predictor.predict`` floors a training run
    with; None everywhere without an optimizer."""
    # The floor reads neither the length, the micro-batch nor dropout: shared by every such recipe.
    key = ("floor", recipe.model, recipe.quant, recipe.fixes, recipe.dora, recipe.targets, state)
    found = p.rank_bounds.get(key)
    if found is None:
        seen: dict[int, Optional[float]] = {}
        columns: dict[tuple, np.ndarray] = {}

        def floor_at(rank: int) -> Optional[float]:
            if rank not in seen:
                seen[rank] = None if state is None else step_floor_mib(p.table, recipe.replace(rank=rank), state)
            return seen[rank]

        def floor_column(ranks) -> np.ndarray:
            at = tuple(ranks)
            if at not in columns:
                columns[at] = np.array([np.nan if (f := floor_at(int(r))) is None else f for r in ranks], dtype=float)
            return columns[at]
        found = p.rank_bounds[key] = floor_at, floor_column
    return found


def _bounds(p, recipe: Recipe, rem: float, widened: float, run: Run, optimizer: Optional[str]):
    """(rank -> (bottom, top) of the judged interval, or None where the table does not reach; the
    ranks dry-run exactly), each rank's computed once. The dry-run figure and the state added
    at a rank do not depend on the card: made once per recipe (``_per_rank``) for every remainder."""
    exact, narrow, wide, over, off, widened, raw_at, added_at, raw_column, added_column, floor_column = _spec(
        p, recipe, widened, run, optimizer)
    floor_at = _floor_of(p, recipe, optimizer if run == "real" and recipe.model else None)[0]
    cache: dict[int, Optional[tuple[float, float]]] = {}

    def bounds(rank: int) -> Optional[tuple[float, float]]:
        if rank in cache:
            return cache[rank]
        raw = raw_at(rank)
        if raw is None:
            cache[rank] = None
            return None
        floor = floor_at(rank)
        add = added_at(rank)
        if add != add:  # nan: the optimizer's state is not known
            cache[rank] = None
            return None
        bottom, top = judged_ends(raw + rem, narrow if rank in exact else wide, wide,
                                  None if floor is None else floor + rem, add, over, off, widened)
        cache[rank] = (bottom, top)
        return cache[rank]

    def column(ranks: list[int]) -> Optional[tuple[list[float], list[float]]]:
        """``bounds`` of these ranks (none exact) as (bottoms, tops), infinite where it is None, or
        None where either does not rise with the rank: the same arithmetic on one array of both
        ends, each rounding ``round``'s (``round1``)."""
        lows, highs = judged_ends(raw_column(ranks) + rem, wide, wide, floor_column(ranks) + rem,
                                  added_column(ranks), over, off or 0.0, widened)
        ends = np.stack((lows, highs))
        ends[np.isnan(ends)] = inf
        if not (ends[:, 1:] >= ends[:, :-1]).all():
            return None
        return ends[0].tolist(), ends[1].tolist()
    return bounds, exact, column


def dry_ceilings_many(p, asks: list[tuple[Recipe, float, Optional[str]]],
                      limits: list[tuple[float, Optional[float], Optional[float]]], run: Run, step: int,
                      max_rank: int) -> list[list[tuple]]:
    """``dry_ceilings`` of each of ``asks`` ((recipe, widened, optimizer)) on each card of
    ``limits``, every recipe of a fit-table row at once: the judged intervals of all of them at
    every rank of the scan's grid are one array per card remainder (the same arithmetic as
    ``bounds``, element by element), and each card's ceilings are the first grid ranks that are
    not "fits" and that stop the scan. A recipe whose derived ranks' ends do not rise with the
    rank is judged by ``dry_ceilings`` (rank by rank)."""
    grid = list(range(step, max_rank + 1, step))
    last = max_rank - max_rank % step
    specs = [_spec(p, recipe, widened, run, optimizer) for recipe, widened, optimizer in asks]
    n, k = len(specs), len(grid)
    out: list[list] = [[None] * len(limits) for _ in range(n)]
    if not n:
        return out
    raw = np.stack([s.raw_column(grid) for s in specs])
    added = np.stack([s.added_column(grid) for s in specs])
    floors = np.stack([s.floor_column(grid) for s in specs])
    exact = np.zeros((n, k), dtype=bool)
    for i, s in enumerate(specs):
        for r in s.exact:
            if r % step == 0 and step <= r <= max_rank:
                exact[i, r // step - 1] = True
    width = np.where(exact, np.array([[s.narrow] for s in specs]), np.array([[s.wide] for s in specs]))
    with_over = np.array([s.over is not None for s in specs])
    over_lo = np.array([[s.over[0] if s.over else 1.0] for s in specs])
    over_hi = np.array([[s.over[1] if s.over else 1.0] for s in specs])
    off = np.array([[s.off or 0.0] for s in specs])
    with_widened = np.array([bool(s.widened) for s in specs])
    widened = np.array([[s.widened] for s in specs])
    unreached = np.isnan(raw)
    at_least_from = np.isnan(np.concatenate((raw[:, 1:], np.zeros((n, 1))), axis=1))  # rank + step unreached
    by_rem: dict[float, list[int]] = {}
    for j, (rem, _, _) in enumerate(limits):
        by_rem.setdefault(rem, []).append(j)
    for rem, cards in by_rem.items():
        bottom, top = judged_ends(raw + rem, width, np.array([[s.wide] for s in specs]), floors + rem, added,
                                  (over_lo, over_hi) if with_over.any() else None, off,
                                  widened if with_widened.any() else 0.0)
        bottom[np.isnan(bottom)] = inf
        top[np.isnan(top)] = inf
        # The derived ranks' ends rise with the rank where each equals the running maximum of the
        # derived ends before it (the exact ranks left out of the maximum).
        rising = np.ones(n, dtype=bool)
        for ends in (bottom, top):
            derived = np.where(exact, -inf, ends)
            rising &= ((derived == np.maximum.accumulate(derived, axis=1)) | exact).all(axis=1)
        lows = np.array([limits[j][1] if limits[j][1] is not None else np.nan for j in cards])
        overs = np.array([(limits[j][2] if limits[j][2] is not None else limits[j][1])
                          if limits[j][1] is not None else np.nan for j in cards])
        # Not "fits": the top above the limit's low end; stops the scan: also the bottom above its top end.
        not_fits = top[:, None, :] > lows[None, :, None]
        stops = not_fits & (bottom[:, None, :] > overs[None, :, None])
        first_bad = np.where(not_fits.any(axis=2), not_fits.argmax(axis=2), -1).tolist()
        first_stop = np.where(stops.any(axis=2), stops.argmax(axis=2), -1).tolist()
        more = at_least_from.tolist()
        start_unreached = unreached[:, 0].tolist()
        rising_l = rising.tolist()
        for i in range(n):
            if start_unreached[i]:
                for j in cards:
                    out[i][j] = (None, None, "unknown", False)
                continue
            if not rising_l[i]:
                recipe, w, optimizer = asks[i]
                profile = _profile_at(p, recipe, rem, w, run, optimizer)
                for j in cards:
                    out[i][j] = ceiling_of(profile, limits[j][1], limits[j][2], step, max_rank)
                continue
            bad_i, stop_i, more_i = first_bad[i], first_stop[i], more[i]
            for c, j in enumerate(cards):
                if limits[j][1] is None:
                    out[i][j] = (None, None, "unknown", False)
                    continue
                b, s_ = bad_i[c], stop_i[c]
                tight = last if s_ < 0 else (grid[s_ - 1] if s_ > 0 else None)
                fits = last if b < 0 else (grid[b - 1] if b > 0 else None)
                if fits is not None and tight is not None:
                    fits = min(fits, tight)
                top_rank = tight or fits
                at_least = top_rank is not None and top_rank + step <= max_rank and more_i[top_rank // step - 1]
                out[i][j] = (fits, tight, "ok" if (fits or tight) else "none-fits", at_least)
    return out


def _per_rank(p, recipe: Recipe, state: Optional[str], measured_rank: Optional[int]):
    """(rank -> the dry-run figure or None, rank -> the MiB added for the optimizer's state or 0,
    and each of them for a list of ranks as an array, nan for None), remembered and shared by every
    profile of the recipe (every remainder, the widenings, the optimizers for the figure).
    ``state``: that optimizer's whole state is added (None where none is known); else
    ``measured_rank``: the stock optimizer's growth past it."""
    memo = p.rank_bounds
    figure_key = ("figure", recipe)
    raws = memo.get(figure_key)
    if raws is None:
        figure = p.table.rank_figure(recipe)
        seen: dict[int, Optional[float]] = {}
        raw_columns: dict[tuple, np.ndarray] = {}

        def raw_at(rank: int) -> Optional[float]:
            if rank not in seen:
                seen[rank] = figure(rank)[0]
            return seen[rank]

        def raw_column(ranks: list[int]) -> np.ndarray:
            key = tuple(ranks)
            if key not in raw_columns:
                column = getattr(figure, "column", None)  # the table's own arithmetic on an array of ranks
                raw_columns[key] = (column(np.array(ranks, dtype=float)) if column is not None
                                    else np.array([raw_at(r) for r in ranks], dtype=float))
            return raw_columns[key]
        raws = memo[figure_key] = raw_at, raw_column
    state_key = ("state", recipe.model, recipe.targets, recipe.dora, state, measured_rank)
    adds = memo.get(state_key)
    if adds is None:
        added: dict[int, float] = {}
        added_columns: dict[tuple, np.ndarray] = {}
        model, targets, dora = recipe.model, recipe.targets, recipe.dora

        def added_at(rank: int) -> float:
            if rank not in added:
                if state is not None:  # a state that cannot be counted leaves the figure unknown
                    s = state_mib(model, rank, targets, dora, state)
                    added[rank] = float("nan") if s is None else s
                elif measured_rank and rank > measured_rank:
                    added[rank] = growth_mib(model, rank, targets, dora, measured_rank)
                else:
                    added[rank] = 0.0
            return added[rank]

        def added_column(ranks: list[int]) -> np.ndarray:
            key = tuple(ranks)
            if key not in added_columns:
                added_columns[key] = np.array([added_at(r) for r in ranks], dtype=float)
            return added_columns[key]
        adds = memo[state_key] = added_at, added_column
    return raws[0], adds[0], raws[1], adds[1]

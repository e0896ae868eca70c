"""Plots as deterministic SVG (matplotlib's object API: no pyplot, so no global figure registry to
leak into or a backend to select): fixed hash salt, no date, text kept as text."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Iterator

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .views import Plot

_STYLE = {
    "svg.hashsalt": "vram-ledger",  # ids in the SVG come from this salt, not from random state
    "svg.fonttype": "none",  # text stays text: smaller files, selectable, no font-dependent paths
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
_MARKERS = "os^Dv<>phP*"
_LEGEND_MAX = 16
_OOM_COLOR = "#b00020"
_SPILL_COLOR = "#9a5b00"


def _point_title(pt) -> str:
    what = {"oom": "ran out of memory (drawn at the card's limit)", "spilled": "spilled past the card"}.get(pt.status)
    return f"{pt.id}: {pt.y:,.1f} MiB" + (f", {what}" if what else "")


def render_svg(plot: Plot) -> str:
    """One plot as SVG text. The same Plot always gives the same bytes. Every point is its own
    group carrying a <title> (its id and peak) that a browser shows on hover. A point that did not
    fit is never drawn like one that did: an OOM is a red × on the card line; a spilled run (it
    finished only by spilling past the card) is an orange ▲ clipped into a band just above the
    card line, its real value written beside it, so it neither reads as a fit nor squashes the
    other series."""
    titles: dict[str, str] = {}
    points: list = []  # every point's own artist (see _saved_once)
    with rc_context(_STYLE):
        fig = Figure(figsize=(7.5, 4.2))
        ax = fig.subplots()
        limit = plot.limit_mib
        fits_y = [p.y for s in plot.series for p in s.points if p.status not in ("oom", "spilled")]
        band = None
        if limit and any(p.status == "spilled" and p.y > limit for s in plot.series for p in s.points):
            band = max([limit, *fits_y]) * 1.06
        handles, labels = [], []
        n = 0
        for i, series in enumerate(plot.series):
            marker = _MARKERS[i % len(_MARKERS)]
            fit = [p for p in series.points if p.status not in ("oom", "spilled") and not p.exceeded]
            line = ax.plot([p.x for p in fit], [p.y for p in fit], marker="none",
                           linewidth=0 if plot.markers_only else 1.2)[0]
            color = line.get_color()
            for pt in series.points:
                gid = f"{plot.id}-pt{n}"
                n += 1
                titles[gid] = _point_title(pt)
                # Each point a Line2D added as it is (what ax.plot makes of one point with its colour
                # given, without parsing its arguments: a large ledger's plots have thousands).
                if pt.status == "oom" or pt.exceeded:
                    points.append(ax.add_line(Line2D([pt.x], [pt.y], marker="x", markersize=7, markeredgewidth=2,
                                                     color=_OOM_COLOR, linestyle="none", gid=gid, zorder=4)))
                elif pt.status == "spilled" and band is not None and pt.y > limit:
                    points.append(ax.add_line(Line2D([pt.x], [band], marker="^", markersize=7, color=_SPILL_COLOR,
                                                     linestyle="none", gid=gid, zorder=4)))
                    ax.annotate(f"spilled: {pt.y:,.0f} MiB", xy=(pt.x, band), xytext=(6, -3),
                                textcoords="offset points", fontsize=8, color=_SPILL_COLOR)
                else:
                    points.append(ax.add_line(Line2D([pt.x], [pt.y], marker=marker, markersize=5, color=color,
                                                     linestyle="none", gid=gid, zorder=3)))
            shown_marker = marker if fit else ("x" if any(p.status == "oom" for p in series.points) else "^")
            handles.append(Line2D([], [], marker=shown_marker, color=color if fit else (
                _OOM_COLOR if shown_marker == "x" else _SPILL_COLOR), linewidth=0 if plot.markers_only or not fit
                else 1.2))
            labels.append(series.label)
        if plot.log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        if plot.diagonal:
            values = [v for s in plot.series for pt in s.points for v in (pt.x, pt.y)]
            lo, hi = min(values) * 0.9, max(values) * 1.1
            handles.append(ax.plot([lo, hi], [lo, hi], linestyle="--", color="#555555", linewidth=1)[0])
            labels.append("estimate = measured")
        if limit:
            handles.append(ax.axhline(limit, color=_OOM_COLOR, linestyle="--", linewidth=1))
            labels.append(f"{plot.limit_label}: {limit:,.0f} MiB")
            if any(p.status == "oom" or p.exceeded for s in plot.series for p in s.points):
                handles.append(Line2D([], [], marker="x", color=_OOM_COLOR, linewidth=0, markeredgewidth=2))
                labels.append("× ran out of memory")
            if band is not None:
                handles.append(Line2D([], [], marker="^", color=_SPILL_COLOR, linewidth=0))
                labels.append("▲ spilled past the card (value written beside it)")
                bottom = ax.get_ylim()[0]
                ax.set_ylim(bottom, band * 1.04)
        ax.set_xlabel(plot.xlabel)
        ax.set_ylabel(plot.ylabel)
        ax.set_title(plot.title, fontsize=10, y=1.0 if _title_stays(ax) else None)  # None: matplotlib places it
        if handles:
            if len(handles) > _LEGEND_MAX:  # every series is still in vram.json
                extra = len(handles) - _LEGEND_MAX
                handles, labels = handles[:_LEGEND_MAX], labels[:_LEGEND_MAX] + [f"+ {extra} more (see vram.json)"]
                handles.append(Line2D([], [], linestyle="none"))
            ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        buf = io.StringIO()
        with _saved_once(fig, points):
            fig.savefig(buf, format="svg", bbox_inches="tight",
                        metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    return _add_titles(buf.getvalue(), titles)


def _title_stays(ax) -> bool:
    """Whether matplotlib will leave the title where it starts, at the top of the axes. Left to
    place it, it measures every tick label of the y axis again at each of the figure's two draws
    (a third of drawing a plot) to see whether the axis's offset text (``+5.01e3``, ``1e6``) is in
    the title's way, and raises the title above it when it is; its x ticks and label are at the
    bottom here, so nothing else can. The offset text is asked of the y axis's formatter on the
    ticks the draw will use (the limits are final: the caller has drawn every artist): without one the title
    stays, and is placed there at once, which draws the same bytes (a test compares)."""
    if ax.xaxis.get_ticks_position() != "bottom" or ax.xaxis.get_label_position() != "bottom":
        return False
    formatter = ax.yaxis.get_major_formatter()
    formatter.set_locs(ax.yaxis.get_majorticklocs())  # as the draw sets them again (format_ticks)
    return not formatter.get_offset()


@contextlib.contextmanager
def _saved_once(fig: Figure, points: list) -> Iterator[None]:
    """Draw the points once, not twice. A tight bounding box makes matplotlib lay the figure out
    first (every artist drawn with drawing switched off), measure it, then draw it: the points,
    each an artist of its own, cost that layout pass as much as the drawing (a large ledger's
    plots have thousands). They are hidden for the layout and shown once the box is measured.
    The box is the same: a point is clipped to the axes, whose box the figure's already holds,
    and the axes' limits come from the data added, not from what is shown."""
    for a in points:
        a.set_visible(False)
    measure = fig.get_tightbbox

    def measured(*args, **kwargs):
        box = measure(*args, **kwargs)
        for a in points:
            a.set_visible(True)
        return box

    fig.get_tightbbox = measured
    try:
        yield
    finally:
        del fig.get_tightbbox
        for a in points:
            a.set_visible(True)


def _add_titles(svg: str, titles: dict[str, str]) -> str:
    """Put each point's <title> first in its group (what a browser shows on hover)."""
    from xml.sax.saxutils import escape

    done: set[str] = set()

    def title(match: re.Match) -> str:
        gid = match.group(1)
        if gid not in titles or gid in done:  # the first group of each id gets it, as before
            return match.group(0)
        done.add(gid)
        return f'{match.group(0)}\n   <title>{escape(titles[gid])}</title>'

    return re.sub(r'<g id="([^"]*)">', title, svg)  # one pass: a point per group, not per point

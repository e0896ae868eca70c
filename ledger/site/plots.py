"""Plots as deterministic SVG (matplotlib, Agg): fixed hash salt, no date, text kept as text."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from .context import Plot  # noqa: E402

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


def render_svg(plot: Plot) -> str:
    """One plot as SVG text. The same Plot always gives the same bytes."""
    with plt.rc_context(_STYLE):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        try:
            for i, series in enumerate(plot.series):
                fits = [p for p in series.points if not p.exceeded]
                over = [p for p in series.points if p.exceeded]
                marker = _MARKERS[i % len(_MARKERS)]
                line = ax.plot([p.x for p in fits], [p.y for p in fits], marker=marker, markersize=4,
                               linewidth=0 if plot.markers_only else 1.2, label=series.label)[0]
                if over:
                    ax.scatter([p.x for p in over], [p.y for p in over], marker="x", s=40,
                               color=line.get_color(), zorder=3)
            if plot.log:
                ax.set_xscale("log")
                ax.set_yscale("log")
            if plot.diagonal:
                values = [v for s in plot.series for pt in s.points for v in (pt.x, pt.y)]
                lo, hi = min(values) * 0.9, max(values) * 1.1
                ax.plot([lo, hi], [lo, hi], linestyle="--", color="#555555", linewidth=1, label="estimate = measured")
            if plot.limit_mib:
                ax.axhline(plot.limit_mib, color="#b00020", linestyle="--", linewidth=1)
                ax.annotate(f"{plot.limit_label}: {plot.limit_mib:,.0f} MiB; × = OOM (exceeded)",
                            xy=(0.01, plot.limit_mib), xycoords=("axes fraction", "data"),
                            va="bottom", fontsize=8, color="#b00020")
            ax.set_xlabel(plot.xlabel)
            ax.set_ylabel(plot.ylabel)
            ax.set_title(plot.title, fontsize=10)
            if plot.series:
                handles, labels = ax.get_legend_handles_labels()
                if len(handles) > _LEGEND_MAX:  # every series is still in vram.json
                    extra = len(handles) - _LEGEND_MAX
                    handles, labels = handles[:_LEGEND_MAX], labels[:_LEGEND_MAX] + [f"+ {extra} more (see vram.json)"]
                    handles.append(plt.Line2D([], [], linestyle="none"))
                ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
            buf = io.StringIO()
            fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": "vram-ledger"})
        finally:
            plt.close(fig)
    return buf.getvalue()


"""Charts for the tools' HTML reports: matplotlib figures (Agg canvas), each saved as SVG into the
page, so a report is one self-contained file that fetches nothing. Used by the simulator's page
(simulator/report.py) and `radixserve bench --plot` (bench/plots.py).

Two chart kinds (lines from x = 0, grouped bars) and the series they draw: a distribution (cdf), a
rate over time from timed amounts (binned_rate) and a count of open intervals (in_flight). The
chart functions return the Figure, so a caller (or a test) can read its series before it is saved.
"""

from __future__ import annotations

import html
import io
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Types only: matplotlib is imported where a chart is drawn (_figure), since every radixserve
    # command builds the bench parser, which imports this module, and matplotlib takes ~0.4 s.
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# A line's legend name, its points and its colour.
Line = tuple[str, list[tuple[float, float]], str]
# A bar series' legend name, its value per category (None: no bar there) and its colour.
Bars = tuple[str, list[float | None], str]
COLOURS = ("#4f8cff", "#d9a441", "#3fbf7f", "#e5605c", "#9b6bd6", "#4fb6c4")
# A chart's size in inches: wide and low, one under another down the page.
WIDTH_IN, HEIGHT_IN = 8.0, 3.0
# Each line keeps at most this many points: an ITL distribution has one per token of the run, and
# the page would grow with it for no visible difference.
MAX_POINTS = 1000
# Category labels longer than this many characters stand upright, below the bars in a chart made
# taller by about their length (LABEL_CHAR_IN a character), so the bars keep their height.
UPRIGHT_LABEL_CHARS = 12
LABEL_CHAR_IN = 0.08


def _figure(height_in: float = HEIGHT_IN) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure with its own Agg canvas, never pyplot's: no global figure registry, no GUI backend.
    figure = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def thinned(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most about MAX_POINTS of the points, evenly spaced, always with the last one."""
    step = max(1, -(-len(points) // MAX_POINTS))
    kept = points[::step]
    if points and kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def line_chart(title: str, lines: list[Line], x_label: str, y_max: float) -> Figure:
    """The lines from x = 0 to the largest x, y from 0 to y_max."""
    figure, axes = _figure()
    for name, points, colour in lines:
        kept = thinned(points)
        axes.plot([x for x, _ in kept], [y for _, y in kept], color=colour, linewidth=1.5, label=name)
    x_max = max((x for _, points, _ in lines for x, _ in points), default=0.0)
    axes.set_xlim(0.0, x_max if x_max > 0 else 1.0)
    axes.set_ylim(0.0, y_max if y_max > 0 else 1.0)
    axes.set_title(title)
    axes.set_xlabel(x_label)
    if lines:
        axes.legend(loc="best", fontsize="small")
    return figure


def bar_chart(title: str, categories: list[str], series: list[Bars], y_label: str) -> Figure:
    """Grouped bars: per category a bar of each series that has a value there, each labelled with
    its value."""
    longest = max((len(c) for c in categories), default=0)
    upright = longest > UPRIGHT_LABEL_CHARS
    figure, axes = _figure(HEIGHT_IN + (longest * LABEL_CHAR_IN if upright else 0.0))
    width = 0.8 / max(1, len(series))
    for j, (name, values, colour) in enumerate(series):
        offset = -0.4 + width * (j + 0.5)
        placed = [(i + offset, v) for i, v in enumerate(values[: len(categories)]) if v is not None]
        xs, heights = [x for x, _ in placed], [v for _, v in placed]
        bars = axes.bar(xs, heights, width * 0.92, color=colour, label=name)
        axes.bar_label(bars, fmt="{:,.3g}", fontsize="x-small")
    axes.set_xticks(range(len(categories)), categories, rotation=90 if upright else 0, fontsize="small")
    # Room above the tallest bar for its value.
    y_max = max((v for _, values, _ in series for v in values if v is not None), default=0.0)
    axes.set_ylim(0.0, y_max * 1.15 if y_max > 0 else 1.0)
    axes.set_title(title)
    axes.set_ylabel(y_label)
    if series:
        axes.legend(loc="best", fontsize="small")
    return figure


def cdf(values: list[float]) -> list[tuple[float, float]]:
    """The empirical distribution: (value, share of values at or below it)."""
    ordered = sorted(values)
    return [(v, (i + 1) / len(ordered)) for i, v in enumerate(ordered)]


def binned_rate(events: list[tuple[float, float]], bins: int = 60) -> list[tuple[float, float]]:
    """(time, amount) events as a rate: the amount per unit of time in each of `bins` equal spans
    from 0 to the last event, as steps. Empty when the events take no time (all at 0)."""
    end = max((t for t, _ in events), default=0.0)
    if end <= 0:
        return []
    width = end / bins
    totals = [0.0] * bins
    for t, amount in events:
        totals[min(bins - 1, int(t / width))] += amount
    points: list[tuple[float, float]] = []
    for i, total in enumerate(totals):
        points += [(i * width, total / width), ((i + 1) * width, total / width)]
    return points


def in_flight(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """How many of the (start, end) intervals are open over time, as steps from 0."""
    # At equal times an end sorts before a start (-1 < 1): back-to-back intervals never count twice.
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    points, count = [(0.0, 0.0)], 0
    for t, change in edges:
        points.append((t, float(count)))
        count += change
        points.append((t, float(count)))
    return points


def svg(figure: Figure) -> str:
    """The figure as an <svg> element to inline in a page: text kept as text (smaller, searchable),
    no metadata block, ids the same from run to run."""
    from matplotlib import rc_context

    out = io.StringIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "radixserve"}):
        no_metadata = {"Creator": None, "Date": None, "Format": None, "Type": None}
        figure.savefig(out, format="svg", metadata=no_metadata)
    text = out.getvalue()
    return text[text.index("<svg") :]  # without the XML declaration and doctype


def html_page(title: str, charts: list[Figure], summary: dict[str, Any] | None = None) -> str:
    """A whole page: the charts, then the summary as JSON."""
    tail = "" if summary is None else f"<pre>{html.escape(json.dumps(summary, indent=2))}</pre>"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h2>{html.escape(title)}</h2>"
        + "<br>".join(svg(chart) for chart in charts)
        + f"{tail}</body></html>"
    )

"""Self-contained charts for HTML reports: inline SVG, no plotting library, nothing fetched. Used by
the simulator's page (simulator/report.py) and `radixserve bench --plot` (bench/plots.py).

Two chart kinds (lines from x = 0, grouped bars) and the series they draw: a distribution (cdf), a
rate over time from timed amounts (binned_rate) and a count of open intervals (in_flight)."""

from __future__ import annotations

import html
import json
from typing import Any

WIDTH, HEIGHT, PAD = 640, 200, 36
# A line's legend name, its points and its colour.
Line = tuple[str, list[tuple[float, float]], str]
# A bar series' legend name, its value per category (None: no bar there) and its colour.
Bars = tuple[str, list[float | None], str]
COLOURS = ("#4f8cff", "#d9a441", "#3fbf7f", "#e5605c", "#9b6bd6", "#4fb6c4")
# Category labels this many pixels wide per character; longer than their slot, they stand upright.
_CHAR_PX = 5.5


def _svg(title: str, names: list[tuple[str, str]], height: int, body: str) -> str:
    """The frame every chart shares: white box, title and legend (name, colour) on top."""
    legend = " ".join(f'<tspan fill="{c}">■ {html.escape(n)}</tspan>' for n, c in names)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img">'
        f'<rect width="{WIDTH}" height="{height}" fill="#fff" stroke="#ccc"/>'
        f'<text x="{PAD}" y="20" font-size="13">{html.escape(title)} {legend}</text>{body}</svg>'
    )


def _polyline(points: list[tuple[float, float]], x_max: float, y_max: float, colour: str) -> str:
    if not points or x_max <= 0 or y_max <= 0:
        return ""
    step = max(1, len(points) // 1000)  # at most ~1000 vertices per line
    coords = " ".join(
        f"{PAD + x / x_max * (WIDTH - 2 * PAD):.1f},{HEIGHT - PAD - y / y_max * (HEIGHT - 2 * PAD):.1f}"
        for x, y in points[::step]
    )
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'


def line_chart(title: str, lines: list[Line], x_label: str, y_max: float) -> str:
    """One SVG chart: the lines from x = 0 to the largest x, y from 0 to y_max."""
    x_max = max((max(x for x, _ in p) for _, p, _ in lines if p), default=0.0)
    body = (
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" font-size="11" text-anchor="end">'
        f"{html.escape(x_label)} (0 to {x_max:,.1f})</text>"
        f'<text x="4" y="{PAD}" font-size="11">{y_max:,.3g}</text>'
        + "".join(_polyline(p, x_max, y_max, c) for _, p, c in lines)
    )
    return _svg(title, [(n, c) for n, _, c in lines], HEIGHT, body)


def bar_chart(title: str, categories: list[str], series: list[Bars], y_label: str) -> str:
    """One SVG chart of grouped bars: per category a bar of each series, y from 0 to the largest
    value. Each bar's exact value is its tooltip, and its label where the bar is wide enough."""
    y_max = max((v for _, values, _ in series for v in values if v is not None), default=0.0)
    slot = (WIDTH - 2 * PAD) / max(1, len(categories))
    bar_w = slot * 0.8 / max(1, len(series))
    longest = max((len(c) for c in categories), default=0) * _CHAR_PX
    upright = longest > slot
    # Upright labels need the room their length takes below the bars (and never leave the chart's
    # sides, as slanted ones would).
    height = HEIGHT + (max(0, int(longest) + 12 - PAD) if upright else 0)
    base, top = HEIGHT - PAD, PAD + 8
    parts = [
        f'<text x="{WIDTH - PAD}" y="{PAD - 4}" font-size="11" text-anchor="end">'
        f"{html.escape(y_label)} (0 to {y_max:,.1f})</text>",
        f'<line x1="{PAD}" y1="{base}" x2="{WIDTH - PAD}" y2="{base}" stroke="#999"/>',
    ]
    for i, category in enumerate(categories):
        left = PAD + i * slot + slot * 0.1
        for j, (name, values, colour) in enumerate(series):
            value = values[i] if i < len(values) else None
            if value is None or y_max <= 0:
                continue
            h = max(0.0, value) / y_max * (base - top)
            x = left + j * bar_w
            tip = html.escape(f"{name}, {category}: {value:,.4g}")
            parts.append(
                f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w * 0.92:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{tip}</title></rect>'
            )
            if bar_w >= 28:
                parts.append(
                    f'<text x="{x + bar_w / 2:.1f}" y="{base - h - 3:.1f}" font-size="9" '
                    f'text-anchor="middle">{value:,.3g}</text>'
                )
        centre, label = left + slot * 0.4, html.escape(category)
        if upright:
            parts.append(
                f'<text x="{centre + 3:.1f}" y="{base + 6}" font-size="10" text-anchor="end" '
                f'transform="rotate(-90 {centre + 3:.1f} {base + 6})">{label}</text>'
            )
        else:
            parts.append(
                f'<text x="{centre:.1f}" y="{base + 14}" font-size="10" text-anchor="middle">{label}</text>'
            )
    return _svg(title, [(n, c) for n, _, c in series], height, "".join(parts))


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


def html_page(title: str, charts: list[str], summary: dict[str, Any] | None = None) -> str:
    """A whole page: the charts, then the summary as JSON."""
    tail = "" if summary is None else f"<pre>{html.escape(json.dumps(summary, indent=2))}</pre>"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h2>{html.escape(title)}</h2>"
        + "<br>".join(charts)
        + f"{tail}</body></html>"
    )

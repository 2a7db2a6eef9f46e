"""Self-contained charts for HTML reports: inline SVG, no plotting library, nothing fetched. Used by
the simulator's page (simulator/report.py) and `radixserve bench --plot` (bench/plots.py)."""

from __future__ import annotations

import html
import json
from typing import Any

WIDTH, HEIGHT, PAD = 640, 200, 36
# A line's points, and its legend name and colour.
Line = tuple[str, list[tuple[float, float]], str]
COLOURS = ("#4f8cff", "#d9a441", "#3fbf7f", "#e5605c", "#9b6bd6", "#4fb6c4")


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
    legend = " ".join(f'<tspan fill="{c}">■ {html.escape(n)}</tspan>' for n, _, c in lines)
    body = "".join(_polyline(p, x_max, y_max, c) for _, p, c in lines)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">'
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff" stroke="#ccc"/>'
        f'<text x="{PAD}" y="20" font-size="13">{html.escape(title)} {legend}</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" font-size="11" text-anchor="end">'
        f"{html.escape(x_label)} (0 to {x_max:,.1f})</text>"
        f'<text x="4" y="{PAD}" font-size="11">{y_max:,.3g}</text>{body}</svg>'
    )


def cdf(values: list[float]) -> list[tuple[float, float]]:
    """The empirical distribution: (value, share of values at or below it)."""
    ordered = sorted(values)
    return [(v, (i + 1) / len(ordered)) for i, v in enumerate(ordered)]


def html_page(title: str, charts: list[str], summary: dict[str, Any] | None = None) -> str:
    """A whole page: the charts, then the summary as JSON."""
    tail = "" if summary is None else f"<pre>{html.escape(json.dumps(summary, indent=2))}</pre>"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h2>{html.escape(title)}</h2>"
        + "<br>".join(charts)
        + f"{tail}</body></html>"
    )

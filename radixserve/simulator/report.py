"""The simulator's outputs: a Markdown table, JSON, and one self-contained HTML page with inline SVG
plots (KV usage and cache hit rate over time, the TTFT distribution)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from radixserve.simulator.simulate import SimResult

_W, _H, _PAD = 640, 200, 36


def table(result: SimResult, title: str) -> str:
    def ms(p: dict[str, Any], key: str) -> str:
        value = p[key]
        return "-" if value is None else f"{value:,.1f}"

    peak = max((u for _, u, _ in result.kv_timeline), default=0)
    rows = [
        ("requests", f"{result.requests:,}"),
        ("simulated time", f"{result.makespan_s:,.2f} s"),
        ("throughput", f"{result.requests_s:,.2f} req/s, {result.output_tok_s:,.0f} output tok/s"),
        ("TTFT p50 / p90 / p99", " / ".join(ms(result.ttft_ms, k) for k in ("p50", "p90", "p99")) + " ms"),
        ("ITL p50 / p90 / p99", " / ".join(ms(result.itl_ms, k) for k in ("p50", "p90", "p99")) + " ms"),
        ("E2E p50 / p90 / p99", " / ".join(ms(result.e2e_ms, k) for k in ("p50", "p90", "p99")) + " ms"),
        ("prompt tokens from cache", f"{result.cache_hit_rate:.1%}"),
        (
            "peak KV slots in use",
            f"{peak:,} of {result.max_total_tokens:,}",
        ),
        ("retractions", f"{result.retracted_reqs:,}"),
        ("forwards / wall time", f"{result.forwards:,} / {result.wall_s:,.1f} s"),
    ]
    lines = [f"| {title} | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines)


def _polyline(points: list[tuple[float, float]], x_max: float, y_max: float, colour: str) -> str:
    if not points or x_max <= 0 or y_max <= 0:
        return ""
    step = max(1, len(points) // 1000)  # at most ~1000 vertices per line
    coords = " ".join(
        f"{_PAD + x / x_max * (_W - 2 * _PAD):.1f},{_H - _PAD - y / y_max * (_H - 2 * _PAD):.1f}"
        for x, y in points[::step]
    )
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'


def _chart(
    title: str, lines: list[tuple[str, list[tuple[float, float]], str]], x_label: str, y_max: float
) -> str:
    x_max = max((p[-1][0] for _, p, _ in lines if p), default=0.0)
    legend = " ".join(f'<tspan fill="{c}">■ {html.escape(n)}</tspan>' for n, _, c in lines)
    body = "".join(_polyline(p, x_max, y_max, c) for _, p, c in lines)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">'
        f'<rect width="{_W}" height="{_H}" fill="#fff" stroke="#ccc"/>'
        f'<text x="{_PAD}" y="20" font-size="13">{html.escape(title)} {legend}</text>'
        f'<text x="{_W - _PAD}" y="{_H - 8}" font-size="11" text-anchor="end">{html.escape(x_label)} '
        f"(0 to {x_max:,.1f})</text>"
        f'<text x="4" y="{_PAD}" font-size="11">{y_max:,.3g}</text>{body}</svg>'
    )


def html_page(result: SimResult, title: str) -> str:
    kv_used = [(t, float(u)) for t, u, _ in result.kv_timeline]
    kv_cached = [(t, float(c)) for t, _, c in result.kv_timeline]
    ttfts = sorted(t for t in result.ttft_values_ms)
    cdf = [(v, (i + 1) / len(ttfts)) for i, v in enumerate(ttfts)]
    charts = [
        _chart(
            "KV slots",
            [("in use", kv_used, "#4f8cff"), ("evictable cache", kv_cached, "#d9a441")],
            "simulated s",
            float(result.max_total_tokens),
        ),
        _chart(
            "cache hit rate",
            [("prompt tokens from cache", result.hit_timeline, "#3fbf7f")],
            "simulated s",
            1.0,
        ),
        _chart("TTFT distribution", [("share of requests", cdf, "#e5605c")], "TTFT ms", 1.0),
    ]
    summary = html.escape(json.dumps(result.summary(), indent=2))
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h2>{html.escape(title)}</h2>"
        + "<br>".join(charts)
        + f"<pre>{summary}</pre></body></html>"
    )


def write_outputs(result: SimResult, title: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "simulation.json", out_dir / "simulation.md", out_dir / "simulation.html"]
    paths[0].write_text(json.dumps(result.summary(), indent=2) + "\n")
    paths[1].write_text(table(result, title) + "\n")
    paths[2].write_text(html_page(result, title))
    return paths

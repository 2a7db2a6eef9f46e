"""The simulator's outputs: a Markdown table, JSON, and one self-contained HTML page of charts
(KV usage and cache hit rate over time, the TTFT distribution; radixserve_tools/plots.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve_tools.plots import cdf, line_chart
from radixserve_tools.plots import html_page as page
from radixserve_tools.simulator.simulate import SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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


def charts(result: SimResult) -> list[Figure]:
    kv_used = [(t, float(u)) for t, u, _ in result.kv_timeline]
    kv_cached = [(t, float(c)) for t, _, c in result.kv_timeline]
    return [
        line_chart(
            "KV slots",
            [("in use", kv_used, "#4f8cff"), ("evictable cache", kv_cached, "#d9a441")],
            "simulated s",
            float(result.max_total_tokens),
        ),
        line_chart(
            "cache hit rate",
            [("prompt tokens from cache", result.hit_timeline, "#3fbf7f")],
            "simulated s",
            1.0,
        ),
        line_chart(
            "TTFT distribution",
            [("share of requests", cdf(result.ttft_values_ms), "#e5605c")],
            "TTFT ms",
            1.0,
        ),
    ]


def html_page(result: SimResult, title: str) -> str:
    return page(title, charts(result), result.summary())


def write_outputs(result: SimResult, title: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "simulation.json", out_dir / "simulation.md", out_dir / "simulation.html"]
    paths[0].write_text(json.dumps(result.summary(), indent=2) + "\n")
    paths[1].write_text(table(result, title) + "\n")
    paths[2].write_text(html_page(result, title))
    return paths

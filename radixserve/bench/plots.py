"""`radixserve bench ... --plot`: an HTML page of charts next to the bench's JSON (same name,
.html), drawn with radixserve/plots.py (inline SVG, nothing fetched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.plots import COLOURS, Line, cdf, html_page, line_chart


def serving_charts(results: list[Any]) -> list[str]:
    """`bench serving`: the distributions of TTFT, ITL and end-to-end latency over the requests that
    succeeded (RequestResult, bench/serving.py), and output tokens against each request's E2E."""
    ok = [r for r in results if r.success]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s * 1000 for r in ok]
    return [
        line_chart("TTFT distribution", [("share of requests", cdf(ttft), COLOURS[3])], "TTFT ms", 1.0),
        line_chart("ITL distribution", [("share of gaps", cdf(itl), COLOURS[0])], "ITL ms", 1.0),
        line_chart("E2E distribution", [("share of requests", cdf(e2e), COLOURS[2])], "E2E ms", 1.0),
    ]


def multiturn_charts(report: dict[str, Any]) -> list[str]:
    """`bench multiturn`: every setting's TTFT distribution on one chart (its table has the rest)."""
    lines: list[Line] = [
        (row["setting"], cdf(row["ttft_ms"]), COLOURS[i % len(COLOURS)])
        for i, row in enumerate(report["rows"])
    ]
    return [line_chart("TTFT distribution per setting", lines, "TTFT ms", 1.0)]


def write_plot(json_path: str, title: str, charts: list[str], summary: dict[str, Any] | None = None) -> Path:
    """Writes the page beside the JSON (its name with .html) and returns where."""
    path = Path(json_path).with_suffix(".html")
    path.write_text(html_page(title, charts, summary), encoding="utf-8")
    return path

"""`radixserve bench ... --plot`: an HTML page of charts next to the bench's JSON (same name,
.html), drawn with radixserve_tools/plots.py (matplotlib figures inlined as SVG, nothing fetched).

Each bench plots what its run measured:
- serving: per request timings, so the TTFT, ITL and E2E distributions and, over the run, the
  output token rate and the requests in flight;
- multiturn: each setting's TTFT distribution and output token rate;
- soak: the outcomes, per kind too, the completed requests' latency distribution and the server's
  RSS at the samples taken;
- offline and speculative: medians only, as bars (tok/s per workload, system or setting).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve_tools.plots import (
    COLOURS,
    Bars,
    Line,
    bar_chart,
    binned_rate,
    cdf,
    html_page,
    in_flight,
    line_chart,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    # Types only: bench/serving.py imports httpx and tqdm, which a page of charts needs neither of.
    from radixserve_tools.bench.serving import RequestResult
    from radixserve_tools.bench.soak_report import SoakReport


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


def _token_times(r: RequestResult) -> list[tuple[float, float]]:
    """When a request's output arrived: (seconds into the run, tokens). The chunks share its
    output tokens evenly, since a chunk may carry more than one token."""
    first = r.start_s + r.ttft_s
    times = [first]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    return [(t, r.output_tokens / len(times)) for t in times]


def serving_charts(results: list[RequestResult]) -> list[Figure]:
    """`bench serving`, over the requests that succeeded."""
    ok = [r for r in results if r.success]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s * 1000 for r in ok]
    rate = binned_rate([event for r in ok for event in _token_times(r)])
    running = in_flight([(r.start_s, r.start_s + r.e2e_s) for r in ok])
    return [
        line_chart("TTFT distribution", [("share of requests", cdf(ttft), COLOURS[3])], "TTFT ms", 1.0),
        line_chart("ITL distribution", [("share of gaps", cdf(itl), COLOURS[0])], "ITL ms", 1.0),
        line_chart("E2E distribution", [("share of requests", cdf(e2e), COLOURS[2])], "E2E ms", 1.0),
        line_chart(
            "output throughput",
            [("output tok/s", rate, COLOURS[1])],
            "seconds into the run",
            max((y for _, y in rate), default=0.0),
        ),
        line_chart(
            "requests in flight",
            [("requests", running, COLOURS[4])],
            "seconds into the run",
            max((y for _, y in running), default=0.0),
        ),
    ]


def multiturn_charts(report: dict[str, Any]) -> list[Figure]:
    """`bench multiturn`: every setting's TTFT distribution on one chart, and its output rate."""
    rows = report["rows"]
    lines: list[Line] = [(row["setting"], cdf(row["ttft_ms"]), _colour(i)) for i, row in enumerate(rows)]
    rate: Bars = ("output tok/s", [row["output_tok_s"] for row in rows], COLOURS[1])
    return [
        line_chart("TTFT distribution per setting", lines, "TTFT ms", 1.0),
        bar_chart("output throughput per setting", [row["setting"] for row in rows], [rate], "tok/s"),
    ]


def offline_charts(report: dict[str, Any]) -> list[Figure]:
    """`bench offline`: each workload's median throughput, radixserve beside transformers (no bar
    where the baseline did not run). Total tok/s is (input + output) / wall; output tok/s leaves
    out the prompts."""
    rows = report["comparisons"]
    names = [f"{row['workload']} {row['dtype']}" for row in rows]
    charts = []
    for key, title in (("total_tok_s", "total throughput"), ("out_tok_s", "output throughput")):
        series: list[Bars] = [
            ("radixserve", [row[f"radixserve_{key}"] for row in rows], COLOURS[0]),
            ("transformers", [row[f"transformers_{key}"] for row in rows], COLOURS[1]),
        ]
        charts.append(bar_chart(f"{title} (median)", names, series, "tok/s"))
    return charts


def speculative_charts(report: dict[str, Any]) -> list[Figure]:
    """`bench speculative`: each case's median decode tok/s, a bar per speculation setting."""
    rows = report["rows"]
    cases = list(dict.fromkeys(f"{row['workload']}, {row['mode']}" for row in rows))
    settings = list(dict.fromkeys(row["speculative"] for row in rows))
    value = {(f"{row['workload']}, {row['mode']}", row["speculative"]): row["decode_tok_s"] for row in rows}
    series: list[Bars] = [
        (setting, [value.get((case, setting)) for case in cases], _colour(i))
        for i, setting in enumerate(settings)
    ]
    return [bar_chart("decode throughput (median)", cases, series, "decode tok/s")]


def soak_charts(report: SoakReport) -> list[Figure]:
    """`bench soak`: how the requests ended, overall and per kind; the latency of those that
    completed; the server's RSS at each sample (with --server-pid)."""
    outcomes = [name for name, count in report.outcomes.items() if count]
    kinds = list(report.by_kind)
    per_kind: list[Bars] = [
        (name, [float(report.by_kind[kind].get(name, 0)) for kind in kinds], _colour(i))
        for i, name in enumerate(outcomes)
    ]
    counts: Bars = ("requests", [float(report.outcomes[name]) for name in outcomes], COLOURS[0])
    charts = [
        bar_chart("outcomes", outcomes, [counts], "requests"),
        bar_chart("outcomes per kind", kinds, per_kind, "requests"),
        line_chart(
            "latency distribution (completed)",
            [("share of requests", cdf(report.latencies_ms), COLOURS[3])],
            "ms",
            1.0,
        ),
    ]
    phases = [phase for phase, sample in report.rss_kb.items() if sample]
    if phases:
        rss: Bars = ("MiB", [report.rss_kb[p]["total"] / 1024 for p in phases], COLOURS[2])
        charts.append(bar_chart("server RSS (process tree)", phases, [rss], "MiB"))
    return charts


def plot_path(json_path: str) -> Path:
    """Where a bench's page goes: beside its JSON, the same name with .html (never the JSON's own
    path, should that end in .html)."""
    path = Path(json_path)
    return path.with_suffix(".plots.html" if path.suffix == ".html" else ".html")


def write_plot(
    json_path: str, title: str, charts: list[Figure], summary: dict[str, Any] | None = None
) -> Path:
    """Writes the page beside the JSON and returns where."""
    path = plot_path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_page(title, charts, summary), encoding="utf-8")
    return path


def add_plot_flag(parser: Any, out_flag: str) -> None:
    """A bench's --plot flag, on its parser or an argument group of it; out_flag names its JSON
    output."""
    parser.add_argument(
        "--plot",
        action="store_true",
        help=f"with {out_flag}: an HTML page of charts beside it (same name, .html)",
    )


def plot_without_out(args: argparse.Namespace, out: str | None, out_flag: str) -> bool:
    """--plot writes beside the JSON, so it needs one: said before the run, not after it."""
    if args.plot and not out:
        print(f"radixserve: error: --plot needs {out_flag} (the page goes beside the JSON)", file=sys.stderr)
        return True
    return False


def write_plot_if_asked(
    args: argparse.Namespace, out: str | None, title: str, charts: Callable[[], list[Figure]]
) -> None:
    """With --plot: the page beside the JSON at `out` (charts are drawn only then)."""
    if args.plot and out:
        print(f"wrote {write_plot(out, title, charts())}")

"""`radixserve bench --plot` (bench/plots.py over radixserve_tools/plots.py): matplotlib charts of
what each bench measured, read back from the figures (titles, series, values, axes), and the page
of them written beside the bench's JSON, self-contained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from radixserve.cli import main
from radixserve_tools.bench.plots import (
    multiturn_charts,
    offline_charts,
    plot_path,
    serving_charts,
    soak_charts,
    speculative_charts,
    write_plot,
)
from radixserve_tools.bench.serving import RequestResult
from radixserve_tools.bench.soak_report import Result, SoakConfig, build_report
from radixserve_tools.plots import MAX_POINTS, bar_chart, binned_rate, cdf, in_flight, line_chart, svg


def _axes(figure: Figure) -> Axes:
    (axes,) = figure.axes
    return axes


def _lines(figure: Figure) -> dict[str, list[tuple[float, float]]]:
    """Each line's legend name and its points (rounded: 3 * 0.05 * 1000 is not quite 150)."""
    lines = {}
    for line in _axes(figure).get_lines():
        xs, ys = line.get_xdata(), line.get_ydata()
        lines[str(line.get_label())] = [
            (round(float(x), 9), round(float(y), 9)) for x, y in zip(xs, ys, strict=True)
        ]
    return lines


def _bars(figure: Figure) -> dict[str, list[float]]:
    """Each bar series' legend name and its bars' heights, left to right."""
    return {
        str(bars.get_label()): [float(bar.get_height()) for bar in bars.patches]
        for bars in _axes(figure).containers
    }


def _categories(figure: Figure) -> list[str]:
    return [label.get_text() for label in _axes(figure).get_xticklabels()]


def test_cdf_is_the_share_at_or_below_each_value() -> None:
    assert cdf([3.0, 1.0, 2.0, 2.0]) == [(1.0, 0.25), (2.0, 0.5), (2.0, 0.75), (3.0, 1.0)]
    assert cdf([]) == []


def test_binned_rate_spreads_amounts_per_second_over_the_run() -> None:
    # 10 tokens in the first second, 30 in the second: steps at 10/s then 30/s.
    events = [(0.5, 10.0), (1.2, 15.0), (2.0, 15.0)]
    assert binned_rate(events, bins=2) == [(0.0, 10.0), (1.0, 10.0), (1.0, 30.0), (2.0, 30.0)]
    assert binned_rate([]) == [] and binned_rate([(0.0, 4.0)]) == []


def test_in_flight_counts_open_intervals_as_steps() -> None:
    points = in_flight([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)])
    assert max(y for _, y in points) == 2  # the third starts as the first ends: never 3
    assert points[-1] == (4.0, 0.0)
    assert [y for x, y in points if x == 1.5] == []  # vertices only where the count changes


def test_serving_charts_from_the_requests_that_succeeded() -> None:
    results = [
        RequestResult(True, 10, 4, ttft_s=0.05 * i, e2e_s=0.2 * i, itl_s=[0.01, 0.02, 0.03], start_s=0.1 * i)
        for i in range(1, 6)
    ]
    results.append(RequestResult(False, error="boom"))  # failures are left out of every chart
    charts = serving_charts(results)
    assert [_axes(c).get_title() for c in charts] == [
        "TTFT distribution",
        "ITL distribution",
        "E2E distribution",
        "output throughput",
        "requests in flight",
    ]
    ttft, itl, e2e, rate, running = (_lines(c) for c in charts)
    assert ttft == {"share of requests": [(50.0 * i, i / 5) for i in range(1, 6)]}
    assert [x for x, _ in itl["share of gaps"]] == pytest.approx([10.0] * 5 + [20.0] * 5 + [30.0] * 5)
    assert max(x for x, _ in e2e["share of requests"]) == pytest.approx(1000.0)
    # 5 requests of 4 tokens each, over the run.
    (points,) = rate.values()
    widths = {round(b - a, 9) for (a, _), (b, _) in zip(points[::2], points[1::2], strict=True)}
    assert sum(y for _, y in points[::2]) * widths.pop() == pytest.approx(20.0)
    # At most 4 in flight (the first ends at 0.3 s, as the fourth starts at 0.4 s), none at the end.
    assert max(y for _, y in running["requests"]) == 4 and running["requests"][-1] == (1.5, 0.0)
    # The axes run from 0 to the slowest TTFT (250 ms) and to the last request's end (1.5 s).
    assert _axes(charts[0]).get_xlim() == (0.0, 250.0) and _axes(charts[0]).get_xlabel() == "TTFT ms"
    assert _axes(charts[4]).get_xlim() == pytest.approx((0.0, 1.5))
    assert _axes(charts[4]).get_ylim() == (0.0, 4.0)


def test_serving_page_beside_the_json(tmp_path: Path) -> None:
    results = [RequestResult(True, 10, 4, ttft_s=0.05, e2e_s=0.2, itl_s=[0.01, 0.02, 0.03], start_s=0.1)]
    json_path = tmp_path / "serving.json"
    json_path.write_text("{}")
    page = write_plot(str(json_path), "bench serving <test>", serving_charts(results), {"completed": 1})
    assert page == tmp_path / "serving.html"
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.endswith("</html>")
    assert text.count("<svg") == 5 and "<?xml" not in text  # each figure inline, without its prolog
    assert "TTFT distribution" in text  # text stays text in the SVG
    assert "bench serving &lt;test&gt;" in text and "&quot;completed&quot;: 1" in text
    # Nothing to fetch: the only URLs are the SVG namespaces' names.
    assert set(re.findall(r"https?://[^\"' ]+", text)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }


def test_a_run_without_successes_still_draws_empty_charts() -> None:
    charts = serving_charts([RequestResult(False, error="refused")])
    assert len(charts) == 5
    # No points, but the in-flight count's start at 0.
    assert [list(_lines(c).values()) for c in charts] == [[[]], [[]], [[]], [[]], [[(0.0, 0.0)]]]
    assert all(svg(c).startswith("<svg") for c in charts)


def test_long_lines_are_thinned_but_keep_their_ends() -> None:
    points = [(float(i), float(i)) for i in range(10 * MAX_POINTS + 7)]
    (kept,) = _lines(line_chart("t", [("many", points, "#000")], "x", 1.0)).values()
    assert len(kept) <= MAX_POINTS + 1
    assert kept[0] == points[0] and kept[-1] == points[-1]


def test_multiturn_charts_have_a_line_and_a_bar_per_setting() -> None:
    report = {
        "rows": [
            {"setting": "off", "ttft_ms": [30.0, 50.0], "output_tok_s": 100.0},
            {"setting": "storage", "ttft_ms": [10.0, 20.0], "output_tok_s": 250.0},
        ]
    }
    distribution, rate = multiturn_charts(report)
    assert _lines(distribution) == {"off": [(30.0, 0.5), (50.0, 1.0)], "storage": [(10.0, 0.5), (20.0, 1.0)]}
    assert _bars(rate) == {"output tok/s": [100.0, 250.0]}
    assert _categories(rate) == ["off", "storage"]


def test_offline_bars_leave_out_a_baseline_that_did_not_run() -> None:
    row = {"workload": "W1", "dtype": "bfloat16", "radixserve_total_tok_s": 900.0}
    rows = [
        {
            **row,
            "transformers_total_tok_s": 300.0,
            "radixserve_out_tok_s": 90.0,
            "transformers_out_tok_s": 30.0,
        },
        {**row, "dtype": "float32", "transformers_total_tok_s": None, "radixserve_out_tok_s": 45.0}
        | {"transformers_out_tok_s": None},
    ]
    total, out = offline_charts({"comparisons": rows})
    assert _bars(total) == {"radixserve": [900.0, 900.0], "transformers": [300.0]}
    assert _categories(total) == ["W1 bfloat16", "W1 float32"]
    assert _axes(out).get_title() == "output throughput (median)"
    assert _bars(out) == {"radixserve": [90.0, 45.0], "transformers": [30.0]}
    # The baseline's one bar stands beside the first category's radixserve bar.
    (transformers_bar,) = _axes(total).containers[1].patches
    assert 0 < transformers_bar.get_x() < 0.5


def test_speculative_bars_per_case_and_setting() -> None:
    rows = [
        {"workload": "copy", "mode": "single stream", "speculative": label, "decode_tok_s": v}
        for label, v in (("off", 20.0), ("NGRAM", 45.0))
    ]
    (chart,) = speculative_charts({"rows": rows})
    assert _bars(chart) == {"off": [20.0], "NGRAM": [45.0]}
    assert _categories(chart) == ["copy, single stream"]
    # Each bar carries its value.
    assert [t.get_text() for t in _axes(chart).texts] == ["20", "45"]


def test_soak_charts_from_its_report() -> None:
    results = [Result("native", "ok", latency_s=0.1 * i) for i in range(1, 4)]
    results += [Result("abort_rid", "aborted"), Result("too_long", "expected_4xx", 400)]
    rss = {"start": {"1": 1024, "total": 1024}, "third": {}, "end": {"1": 2048, "total": 2048}}
    report = build_report(SoakConfig(), "m", results, 1.0, {}, {"idle": True, "kv_invariant": "ok"}, rss)
    assert "latencies_ms" not in report.to_dict()  # the JSON keeps p50/p99 only
    outcomes, per_kind, latency, memory = soak_charts(report)
    assert _categories(outcomes) == ["ok", "aborted", "expected_4xx"]  # no bar for 5xx: none happened
    assert _bars(outcomes) == {"requests": [3.0, 1.0, 1.0]}
    assert _categories(per_kind) == ["abort_rid", "native", "too_long"]  # kinds in name order
    assert _bars(per_kind) == {
        "ok": [0.0, 3.0, 0.0],
        "aborted": [1.0, 0.0, 0.0],
        "expected_4xx": [0.0, 0.0, 1.0],
    }
    assert _axes(latency).get_xlim() == pytest.approx((0.0, 300.0))
    assert _categories(memory) == ["start", "end"]  # no sample at a third
    assert _bars(memory) == {"MiB": [1.0, 2.0]}


def test_long_category_labels_stand_upright_in_a_taller_chart() -> None:
    short = bar_chart("t", ["a", "b"], [("s", [1.0, 2.0], "#000")], "n")
    long = bar_chart("t", [f"completion_stream_{i}" for i in range(16)], [("s", [1.0] * 16, "#000")], "n")
    assert long.get_figheight() > short.get_figheight()
    assert {label.get_rotation() for label in _axes(long).get_xticklabels()} == {90.0}
    assert {label.get_rotation() for label in _axes(short).get_xticklabels()} == {0.0}


def test_the_page_never_replaces_its_json() -> None:
    assert plot_path("out/run.json") == Path("out/run.html")
    assert plot_path("run") == Path("run.html")
    assert plot_path("run.html") == Path("run.plots.html")


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "offline", "--plot"],
        ["bench", "serving", "--plot", "--disable-tqdm"],
        ["bench", "soak", "--plot"],
        ["bench", "speculative", "--plot"],
        ["bench", "multiturn", "--plot"],
    ],
)
def test_plot_without_its_json_is_refused_before_the_run(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "--plot needs" in capsys.readouterr().err

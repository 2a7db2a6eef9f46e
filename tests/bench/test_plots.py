"""`radixserve bench --plot` (bench/plots.py over radixserve_tools/plots.py): a page of inline SVG charts
written beside the bench's JSON, one chart per plot, well-formed, nothing fetched."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

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
from radixserve_tools.plots import bar_chart, binned_rate, cdf, in_flight

SVG = "{http://www.w3.org/2000/svg}"


def _svgs(text: str) -> list[ET.Element]:
    """Every <svg> of a page, parsed: a chart that is not well-formed XML fails here."""
    return [ET.fromstring(svg) for svg in re.findall(r"<svg.*?</svg>", text, flags=re.DOTALL)]


def _texts(svg: ET.Element) -> str:
    return " ".join("".join(t.itertext()) for t in svg.iter(f"{SVG}text"))


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


def test_serving_page_beside_the_json(tmp_path: Path) -> None:
    results = [
        RequestResult(True, 10, 4, ttft_s=0.05 * i, e2e_s=0.2 * i, itl_s=[0.01, 0.02, 0.03], start_s=0.1 * i)
        for i in range(1, 6)
    ]
    results.append(RequestResult(False, error="boom"))  # failures are left out of every chart
    json_path = tmp_path / "serving.json"
    json_path.write_text("{}")
    page = write_plot(str(json_path), "bench serving <test>", serving_charts(results), {"completed": 5})
    assert page == tmp_path / "serving.html"
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.endswith("</html>")
    svgs = _svgs(text)
    titles = [_texts(s).split(" ■")[0] for s in svgs]
    assert titles == [
        "TTFT distribution",
        "ITL distribution",
        "E2E distribution",
        "output throughput",
        "requests in flight",
    ]
    assert all(len(list(s.iter(f"{SVG}polyline"))) == 1 for s in svgs)
    assert "bench serving &lt;test&gt;" in text and "&quot;completed&quot;: 5" in text
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    # The TTFT chart's x axis runs to the slowest request's TTFT (250 ms); the run to the last
    # request's end (sent at 0.5 s, 1 s long).
    assert "TTFT ms (0 to 250.0)" in _texts(svgs[0])
    assert "seconds into the run (0 to 1.5)" in _texts(svgs[4])
    assert _texts(svgs[4]).split()[-1] == "4"  # at most 4 in flight (the first ends at 0.3 s)


def test_a_run_without_successes_still_draws_empty_charts() -> None:
    charts = serving_charts([RequestResult(False, error="refused")])
    assert len(charts) == 5 and all(len(_svgs(c)) == 1 for c in charts)


def test_multiturn_charts_have_a_line_and_a_bar_per_setting() -> None:
    report = {
        "rows": [
            {"setting": "off", "ttft_ms": [30.0, 50.0], "output_tok_s": 100.0},
            {"setting": "storage", "ttft_ms": [10.0, 20.0], "output_tok_s": 250.0},
        ]
    }
    distribution, rate = (_svgs(c)[0] for c in multiturn_charts(report))
    assert len(list(distribution.iter(f"{SVG}polyline"))) == 2
    assert "off" in _texts(distribution) and "storage" in _texts(distribution)
    bars = list(rate.iter(f"{SVG}rect"))[1:]  # after the frame
    assert [float(b.get("height", 0)) for b in bars] == pytest.approx([100 / 250 * 120, 120])


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
    total, out = (_svgs(c)[0] for c in offline_charts({"comparisons": rows}))
    assert len(list(total.iter(f"{SVG}rect"))) == 1 + 3  # frame + 2 radixserve + 1 transformers
    assert "W1 bfloat16" in _texts(total) and "W1 float32" in _texts(total)
    assert "output throughput" in _texts(out)


def test_speculative_bars_per_case_and_setting() -> None:
    rows = [
        {"workload": "copy", "mode": "single stream", "speculative": label, "decode_tok_s": v}
        for label, v in (("off", 20.0), ("NGRAM", 45.0))
    ]
    (chart,) = speculative_charts({"rows": rows})
    svg = _svgs(chart)[0]
    tips = [t.text for t in svg.iter(f"{SVG}title")]
    assert tips == ["off, copy, single stream: 20", "NGRAM, copy, single stream: 45"]


def test_soak_charts_from_its_report() -> None:
    results = [Result("native", "ok", latency_s=0.1 * i) for i in range(1, 4)]
    results += [Result("abort_rid", "aborted"), Result("too_long", "expected_4xx", 400)]
    rss = {"start": {"1": 1024, "total": 1024}, "third": {}, "end": {"1": 2048, "total": 2048}}
    report = build_report(SoakConfig(), "m", results, 1.0, {}, {"idle": True, "kv_invariant": "ok"}, rss)
    assert "latencies_ms" not in report.to_dict()  # the JSON keeps p50/p99 only
    svgs = [_svgs(c)[0] for c in soak_charts(report)]
    assert len(svgs) == 4
    assert "ok" in _texts(svgs[0]) and "expected_4xx" in _texts(svgs[0]) and "5xx" not in _texts(svgs[0])
    assert "ms (0 to 300.0)" in _texts(svgs[2])
    assert "start" in _texts(svgs[3]) and "third" not in _texts(svgs[3])  # no sample at a third


def test_long_category_labels_stand_upright_in_a_taller_chart() -> None:
    short = _svgs(bar_chart("t", ["a", "b"], [("s", [1.0, 2.0], "#000")], "n"))[0]
    long = _svgs(
        bar_chart("t", [f"completion_stream_{i}" for i in range(16)], [("s", [1.0] * 16, "#000")], "n")
    )[0]
    assert int(long.get("height", 0)) > int(short.get("height", 0))
    assert any("rotate" in (t.get("transform") or "") for t in long.iter(f"{SVG}text"))


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

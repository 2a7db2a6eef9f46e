"""`radixserve bench --plot` (bench/plots.py over radixserve/plots.py): a page of inline SVG charts
written beside the bench's JSON, one chart per distribution, nothing fetched."""

from __future__ import annotations

import re
from pathlib import Path

from radixserve.bench.plots import multiturn_charts, serving_charts, write_plot
from radixserve.bench.serving import RequestResult
from radixserve.plots import cdf


def test_cdf_is_the_share_at_or_below_each_value() -> None:
    assert cdf([3.0, 1.0, 2.0, 2.0]) == [(1.0, 0.25), (2.0, 0.5), (2.0, 0.75), (3.0, 1.0)]
    assert cdf([]) == []


def test_serving_page_beside_the_json(tmp_path: Path) -> None:
    results = [
        RequestResult(True, 10, 4, ttft_s=0.05 * i, e2e_s=0.2 * i, itl_s=[0.01, 0.02, 0.03])
        for i in range(1, 6)
    ]
    results.append(RequestResult(False, error="boom"))  # failures are left out of the distributions
    json_path = tmp_path / "serving.json"
    json_path.write_text("{}")
    page = write_plot(str(json_path), "bench serving <test>", serving_charts(results), {"completed": 5})
    assert page == tmp_path / "serving.html"
    text = page.read_text()
    assert text.count("<svg") == 3 and text.count("<polyline") == 3
    assert "bench serving &lt;test&gt;" in text and "&quot;completed&quot;: 5" in text
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    # The TTFT chart's x axis runs to the slowest request's TTFT (250 ms).
    assert re.search(r"TTFT ms \(0 to 250\.0\)", text)


def test_multiturn_charts_have_a_line_per_setting() -> None:
    report = {
        "rows": [{"setting": "off", "ttft_ms": [30.0, 50.0]}, {"setting": "host", "ttft_ms": [10.0, 20.0]}]
    }
    (chart,) = multiturn_charts(report)
    assert chart.count("<polyline") == 2 and "off" in chart and "host" in chart

"""End-to-end smoke test of `radixserve bench offline` on the tiny llama checkpoint (no downloads)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve_tools.bench.workloads import make_workload

SCALE = 0.1


def test_bench_tiny_model_end_to_end(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tiny_model_dir("llama")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out = tmp_path / "report.json"
    argv = ["bench", "offline", "--model-path", str(model_dir), "--dtypes", "float32", "--repeats", "1"]
    argv += ["--hf-batch", "2", "--scale", str(SCALE), "--work-dir", str(tmp_path / "work")]
    assert main([*argv, "--out", str(out)]) == 0

    report = json.loads(out.read_text())
    results = report["results"]
    systems = {(r["system"], r["workload"]) for r in results}
    assert systems == {(s, w) for s in ("radixserve", "transformers-static") for w in ("W1", "W2", "W3")}
    for r in results:
        wl = make_workload(r["workload"], SCALE, vocab)
        # --hf-batch 2 splits the 3-request workloads, exercising the multi-batch baseline path.
        assert max(max(p) for p in wl.prompts) < vocab
        assert (r["requests"], r["max_new_tokens"]) == (wl.num_requests, wl.max_new_tokens)
        assert (r["in_tokens"], r["out_tokens"]) == (wl.in_tokens, wl.out_tokens)
        assert r["seconds"] > 0 and r["total_tok_s"] > 0 and len(r["all_seconds"]) == 1
        # seconds is rounded to 1 ms, which matters at these tiny durations.
        assert (r["in_tokens"] + r["out_tokens"]) / r["total_tok_s"] == pytest.approx(r["seconds"], abs=1e-3)
        if r["system"] == "radixserve":
            assert r["engine_stats"]["generated_tokens"] == wl.out_tokens

    w2 = next(r for r in results if r["system"] == "radixserve" and r["workload"] == "W2")
    # Three requests share a 51-token prefix; lpm must reuse it within one cold-cache run.
    assert w2["cached_tokens"][0] > 0

    rows = report["comparisons"]
    assert [(r["workload"], r["dtype"]) for r in rows] == [
        ("W1", "float32"),
        ("W2", "float32"),
        ("W3", "float32"),
    ]
    for row in rows:
        assert row["ratio_total"] == pytest.approx(
            row["radixserve_total_tok_s"] / row["transformers_total_tok_s"], abs=1e-3
        )
        # One repeat: the paired ratio is that repeat's transformers seconds / radixserve seconds.
        seconds = {r["system"]: r["all_seconds"][0] for r in results if r["workload"] == row["workload"]}
        assert row["paired_ratios"] == [round(seconds["transformers-static"] / seconds["radixserve"], 3)]
        assert row["ratio_paired"] == row["paired_ratios"][0]

    printed = capsys.readouterr().out
    assert sum(line.startswith("RESULT {") for line in printed.splitlines()) == 6
    # The systems alternate repeat by repeat: each workload's runs are radixserve, then transformers.
    runs = [line.split()[0] for line in printed.splitlines() if " rep 0: " in line]
    assert runs == ["radixserve", "transformers-static"] * 3
    assert "ratio" in printed and "W3" in printed

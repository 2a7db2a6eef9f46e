"""Prefill/decode disaggregation on this machine: the K/V transport alone, then serving latency of a
prefill server + decode server behind sglang-router against one server.

    python benchmarks/pd_disaggregation.py [--work bench-work] [--skip-serving]

1. **Transport** (distributed/kv_transfer.py on loopback, in this process): SmolLM2-135M's K/V
   (30 layers, 3 KV heads of 64, bf16: 23,040 bytes per token) for 256, 1,024 and 4,096 tokens,
   from send() on the prefill side to poll() on the decode side (the claim made beforehand), median
   of 10 each: ms, ms per 1k tokens, GB/s.
2. **Serving** (the packaged SmolLM2 GGUF in bf16; `radixserve bench serving --backend chat`, text
   prompts, since the router refuses token-id completions): a workload of long prompts mixed with
   short decodes (random prompts of 128-1,024 tokens, 16-128 output tokens, Poisson arrivals),
   against (a) one server using both cores and (b) a prefill server and a decode server with one
   core each (OMP_NUM_THREADS=1) behind `sglang-router --pd-disaggregation`. TTFT and ITL p50/p99.
   On 2 cores the halves split the machine that one server has alone: this shows where the time
   goes (decode steps no longer wait behind prefills), not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from radixserve.distributed.kv_transfer import (
    GlooDecodeTransfer,
    GlooPrefillTransfer,
    KVHandoff,
    layout_signature,
)
from radixserve.models.source import default_model_path

SMOLLM2_KV = (30, 2, 3, 64)  # layers, K and V, KV heads, head dim
TOKENS = (256, 1024, 4096)
REPEATS = 10
SERVING = [
    "--dataset", "random", "--num-prompts", "40", "--random-input-len", "1024", "--random-output-len", "128",
    "--random-range-ratio", "0.125", "--request-rate", "0.5", "--backend", "chat", "--disable-tqdm",
]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def transport() -> list[dict[str, float]]:
    layers, two, heads, dim = SMOLLM2_KV
    layout = layout_signature(SMOLLM2_KV, torch.bfloat16)
    port = _free_port()
    prefill = GlooPrefillTransfer("127.0.0.1", port, layout, timeout_s=60)
    decode = GlooDecodeTransfer("127.0.0.1", layout)
    rows = []
    room = 0
    try:
        for tokens in TOKENS:
            kv = torch.randn(layers, two, tokens, heads, dim).to(torch.bfloat16)
            seconds = []
            for _ in range(REPEATS + 1):  # the first also builds the pair's group: not counted
                room += 1
                decode.expect(room, "127.0.0.1", port)
                while prefill.stats()["peers"] == 0:
                    time.sleep(0.01)
                time.sleep(0.05)  # the claim is in the store
                started = time.perf_counter()
                prefill.send(KVHandoff(room, kv, first_token=1))
                got: list[KVHandoff] = []
                while not got:
                    decode.wait(1.0)
                    got = decode.poll()
                seconds.append(time.perf_counter() - started)
            ms = 1000 * statistics.median(seconds[1:])
            size = kv.numel() * kv.element_size()
            rows.append({"tokens": tokens, "mb": size / 1e6, "ms": ms, "ms_per_1k": ms * 1000 / tokens,
                         "gb_s": size / (ms / 1000) / 1e9})  # fmt: skip
    finally:
        prefill.close()
        decode.close()
    return rows


@contextmanager
def _process(
    cmd: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait(url: str, process: subprocess.Popen[bytes], log: Path, path: str = "/health") -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(log.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready: {log.read_text(errors='replace')[-3000:]}")


def _serve(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--dtype", "bfloat16",
            "--log-level", "warning", *flags]  # fmt: skip


def _bench(url: str, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "serving", "--base-url", url,
           "--tokenizer", str(default_model_path()), *SERVING, "--output-file", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def serving(work: Path) -> dict[str, dict[str, Any]]:
    reports: dict[str, dict[str, Any]] = {}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(_serve(port), work / "pd-single.log") as single:
        _wait(url, single, work / "pd-single.log")
        reports["one server, 2 cores"] = _bench(url, work / "pd-single.json")
    one_core = {"OMP_NUM_THREADS": "1"}
    p_port, d_port, boot, r_port = _free_port(), _free_port(), _free_port(), _free_port()
    p_url, d_url, r_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    prefill_cmd = _serve(
        p_port, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)
    )
    decode_cmd = _serve(d_port, "--disaggregation-mode", "decode")
    router_cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(r_port),
        "--pd-disaggregation", "--prefill", p_url, str(boot), "--decode", d_url, "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()), "--log-level", "warn",
    ]  # fmt: skip
    with (
        _process(prefill_cmd, work / "pd-prefill.log", one_core) as prefill,
        _process(decode_cmd, work / "pd-decode.log", one_core) as decode,
    ):
        _wait(p_url, prefill, work / "pd-prefill.log")
        _wait(d_url, decode, work / "pd-decode.log")
        with _process(router_cmd, work / "pd-router.log") as router:
            _wait(r_url, router, work / "pd-router.log", "/health")
            time.sleep(3)  # the router's first health checks of both workers
            reports["PD, 1 core each, via router"] = _bench(r_url, work / "pd-disaggregated.json")
            info = httpx.get(f"{d_url}/get_server_info", timeout=30).json()["disaggregation"]
            reports["PD, 1 core each, via router"]["transfer"] = info
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--skip-serving", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"{'tokens':>7} {'MB':>7} {'ms':>8} {'ms/1k tok':>10} {'GB/s':>6}")
    for r in transport():
        print(f"{r['tokens']:>7} {r['mb']:>7.1f} {r['ms']:>8.2f} {r['ms_per_1k']:>10.2f} {r['gb_s']:>6.2f}")
    if args.skip_serving:
        return
    columns = ("req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print(f"\n{'deployment':<30} " + " ".join(f"{c:>9}" for c in columns))
    keys = (
        "request_throughput",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    for name, report in serving(args.work).items():
        print(f"{name:<30} " + " ".join(f"{report[k]:>9.1f}" for k in keys))
        if "transfer" in report:
            t = report["transfer"]
            rate = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else 0.0
            mb = t["bytes"] / 1e6
            print(
                f"{'':<30} K/V received: {t['handoffs']} handoffs, {mb:.0f} MB, {rate:.2f} GB/s on the wire"
            )


if __name__ == "__main__":
    main()

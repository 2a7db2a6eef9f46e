"""radixserve and llama.cpp serving the same GGUF files over HTTP, default flags, taking turns.

    .venv/bin/python benchmarks/gguf_vs_llamacpp.py --llama-bin DIR FILE.gguf [FILE.gguf ...]
        [--workloads W3,W1] [--repeats 2] [--threads 2]

DIR holds llama.cpp's `llama-server` (build steps: ../shared/peers/README.md). Each file is served
by `llama-server -m FILE -t THREADS` and by `radixserve serve --model-path FILE`, one at a time, and
both get the same token-id prompts on /v1/completions (greedy, ignore_eos), new ones for each repeat
so that no prompt cache serves them:
- W3: one request, 128 prompt tokens, 128 output tokens: output tok/s including the prefill;
- W1: 32 requests of 256 prompt tokens and 64 output tokens at once: total (in + out) tok/s.
Each server's peak RSS is that of its whole process tree (psutil), sampled during the runs. Prints
a markdown table of the best of REPEATS per figure and the ratio radixserve / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

PORT = 30411
WORKLOADS: dict[str, tuple[int, int, int]] = {"W3": (1, 128, 128), "W1": (32, 256, 64)}  # requests, in, out


def prompts(name: str, repeat: int) -> list[list[int]]:
    """New prompts for each repeat: neither server's prompt cache serves a repeat."""
    count, length, _ = WORKLOADS[name]
    rng = random.Random(f"{name}-{repeat}")
    return [[rng.randrange(100, 32000) for _ in range(length)] for _ in range(count)]


def served_model() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=10) as response:
        model: str = json.loads(response.read())["data"][0]["id"]
    return model


def complete(prompt: list[int], max_tokens: int, model: str) -> int:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        tokens: int = json.loads(response.read())["usage"]["completion_tokens"]
    return tokens


def run_workload(name: str, repeat: int) -> float:
    """tok/s: W3 output tokens per second, others total tokens per second."""
    batch = prompts(name, repeat)
    out_len, model = WORKLOADS[name][2], served_model()
    started = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        produced = sum(pool.map(lambda p: complete(p, out_len, model), batch))
    seconds = time.perf_counter() - started
    if name == "W3":
        return produced / seconds
    return (produced + sum(len(p) for p in batch)) / seconds


def tree_rss(process: psutil.Process) -> int:
    try:
        members = [process, *process.children(recursive=True)]
        return sum(p.memory_info().rss for p in members if p.is_running())
    except psutil.Error:
        return 0


def serve(command: list[str], measure: Callable[[], dict[str, float]]) -> tuple[dict[str, float], int]:
    """Starts a server, waits for /health, runs `measure`, and returns its figures and peak RSS."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, done = [0], threading.Event()
    process = psutil.Process(server.pid)

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_rss(process))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"{command[0]} did not become healthy")
        sampler.start()
        return measure(), peak[0]
    finally:
        done.set()
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--workloads", default="W3,W1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args()
    names = options.workloads.split(",")
    radixserve = [
        sys.executable,
        "-m",
        "radixserve.launch_server",
        "--port",
        str(PORT),
        "--log-level",
        "warning",
    ]
    llama = [
        str(options.llama_bin / "llama-server"),
        "--port",
        str(PORT),
        "-t",
        str(options.threads),
        "--no-webui",
    ]

    def measure() -> dict[str, float]:
        return {name: max(run_workload(name, repeat) for repeat in range(options.repeats)) for name in names}

    header = " | ".join(f"{n} llama.cpp | {n} radixserve | ratio" for n in names)
    print(f"| file | {header} | RSS llama.cpp MB | RSS radixserve MB | ratio |")
    print("|---|" + "---|" * (3 * len(names) + 3))
    for path in options.files:
        theirs, their_rss = serve([*llama, "-m", str(path)], measure)
        ours, our_rss = serve([*radixserve, "--model-path", str(path)], measure)
        cells = " | ".join(f"{theirs[n]:.1f} | {ours[n]:.1f} | {ours[n] / theirs[n]:.2f}x" for n in names)
        rss = f"{their_rss / 1e6:.0f} | {our_rss / 1e6:.0f} | {our_rss / their_rss:.2f}x"
        print(f"| {path.name} | {cells} | {rss} |", flush=True)


if __name__ == "__main__":
    main()

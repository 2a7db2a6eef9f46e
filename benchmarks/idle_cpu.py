"""Idle CPU of a running server (all its processes), with and without --sleep-on-idle.

    python benchmarks/idle_cpu.py [--model-path PATH] [--seconds 60]

Starts the server twice, waits until it answers /health, lets it sit idle for the given time and
reads each process's CPU time from /proc (Linux only). Prints % of one core per process.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def tree(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [pid] + [int(p) for p in out.split()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(model_path: str | None, seconds: float, flags: list[str]) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--log-level", "warning"]
    cmd += (["--model-path", model_path] if model_path else []) + flags
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        time.sleep(3)  # let start-up work settle
        pids = tree(server.pid)
        names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode() for pid in pids}
        before = {pid: cpu_seconds(pid) for pid in pids}
        time.sleep(seconds)
        return {names[pid]: 100 * (cpu_seconds(pid) - before[pid]) / seconds for pid in pids}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    for label, flags in (("default", []), ("--sleep-on-idle", ["--sleep-on-idle"])):
        usage = measure(args.model_path, args.seconds, flags)
        parts = ", ".join(f"{name.rsplit('.', 1)[-1]} {pct:.2f}%" for name, pct in usage.items())
        print(f"{label:>16}: total {sum(usage.values()):.2f}% of one core ({parts})")


if __name__ == "__main__":
    main()

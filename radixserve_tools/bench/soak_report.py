"""The soak harness's configuration, results and report (radixserve_tools/bench/soak.py runs it), and
the RSS of a server's process tree."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from radixserve_tools.bench.serving import (
    DEFAULT_BASE_URL,
    percentile,
)

# Scenario kinds and their weights in the mix.
KIND_WEIGHTS: dict[str, float] = {
    "native": 10,
    "native_stream": 10,
    "completion": 8,
    "completion_stream": 8,
    "completion_n": 4,  # n > 1 with a seed, streaming or not
    "chat": 8,
    "chat_stream": 8,
    "disconnect_stream": 6,  # read a few chunks, then hang up
    "disconnect_wait": 3,  # hang up on a non-streaming request before it ends
    "abort_rid": 5,  # /abort_request {"rid": rid} once it streams
    "abort_prefix": 3,  # three requests sharing a rid prefix, aborted by that prefix
    "session": 5,  # open, 2-4 turns, close
    "grammar_json": 5,
    "grammar_regex": 5,
    "long_prompt": 5,  # prompt near min(context, KV pool)
    "too_long": 1,  # prompt past the context: must be a 400
}
PREFIX_GROUP = 3
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,3}"
WORDS = re.findall(
    r"\w+",
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these",
)
OUTCOMES = ("ok", "aborted", "client_disconnected", "expected_4xx", "4xx", "5xx", "transport_error")


@dataclass
class SoakConfig:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = None
    model: str | None = None  # None: the first id of GET /v1/models
    num_requests: int = 10_000
    concurrency: int = 16
    seed: int = 1
    server_pid: int | None = None
    request_timeout: float = 120.0  # seconds per HTTP request
    idle_timeout: float = 120.0  # seconds to wait for the server to go idle after the run
    max_duration: float | None = None  # stop starting new requests after this many seconds
    max_rss_growth: float = 0.05
    max_tokens: int = 128  # the largest output asked for (tiny ones are 1-4 tokens)
    out: str | None = None
    disable_tqdm: bool = False

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_tokens < 8:
            raise ValueError(f"max_tokens must be >= 8, got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_timeout > 0 or not self.idle_timeout > 0:
            raise ValueError("request_timeout and idle_timeout must be > 0")


@dataclass
class Result:
    """One HTTP generation request."""

    kind: str
    outcome: str  # one of OUTCOMES
    status: int = 200
    latency_s: float = 0.0
    error: str | None = None
    malformed: str | None = None  # the answer came back but breaks the API's promises
    unexpected: bool = False  # a 4xx or an abort where none was asked for


@dataclass
class Limits:
    """What the server allows, read from it before the run."""

    context_len: int
    max_total_tokens: int
    vocab_size: int

    @property
    def prompt_room(self) -> int:
        # A prompt must be shorter than the context and fit the KV pool with its output.
        return min(self.context_len - 1, self.max_total_tokens)


@dataclass
class SoakReport:
    config: dict[str, Any]
    model: str
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    by_status: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    malformed: int
    unexpected: int
    server_retracted: int
    server_aborted: int
    kv_invariant: str
    idle: bool
    rss_kb: dict[str, dict[str, int]]  # start, third, middle, end -> {pid: kB, "total": kB}
    rss_growth: float | None  # over the last two thirds (end vs the sample at one third)
    p50_ms: float
    p99_ms: float
    checks: dict[str, bool]
    first_errors: list[str] = field(default_factory=list)
    # Every completed request's latency, for --plot; the JSON keeps p50/p99 only.
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "passed": self.passed, "timestamp": _now()}
        del out["latencies_ms"]
        return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# RSS of the server and its descendants
# --------------------------------------------------------------------------------------------


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The parent pid is the 2nd field after the parenthesized command name.
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (that are alive now)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := _parent_of(int(entry.name))) is not None:
            parents[int(entry.name)] = ppid
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def sample_rss(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    sample = {str(p): kb for p in process_tree(pid) if (kb := rss_kb(p)) is not None}
    sample["total"] = sum(sample.values())
    return sample


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def build_report(
    config: SoakConfig,
    model: str,
    results: list[Result],
    duration: float,
    before: dict[str, Any],
    after: dict[str, Any],
    rss: dict[str, dict[str, int]],
) -> SoakReport:
    outcomes = Counter({name: 0 for name in OUTCOMES})
    outcomes.update(r.outcome for r in results)
    by_status = Counter(str(r.status) for r in results if r.outcome in ("4xx", "5xx", "expected_4xx"))
    by_kind: dict[str, Counter[str]] = {}
    for r in results:
        by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    latencies = sorted(r.latency_s * 1000 for r in results if r.outcome == "ok")
    growth = None
    if rss.get("third", {}).get("total") and rss.get("end", {}).get("total"):
        growth = rss["end"]["total"] / rss["third"]["total"] - 1.0
    malformed = sum(r.malformed is not None for r in results)
    unexpected = sum(r.unexpected for r in results)
    checks = {
        "no 5xx": outcomes["5xx"] == 0,
        "no transport errors": outcomes["transport_error"] == 0,
        "no malformed answers": malformed == 0,
        "no unexpected 4xx or aborts": unexpected == 0,
        "server idle after the run": bool(after.get("idle")),
        "kv_invariant ok": after.get("kv_invariant") == "ok",
    }
    if growth is not None:
        checks[f"RSS growth over the last two thirds <= {config.max_rss_growth:.0%}"] = (
            growth <= config.max_rss_growth
        )
    errors = [
        f"{r.kind}: {r.malformed or r.error}"
        for r in results
        if r.malformed or r.outcome in ("4xx", "5xx", "transport_error")
    ]
    return SoakReport(
        config={k: v for k, v in asdict(config).items() if k != "api_key"},
        model=model,
        duration_s=duration,
        requests=len(results),
        outcomes=dict(outcomes),
        by_status=dict(by_status),
        by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        malformed=malformed,
        unexpected=unexpected,
        server_retracted=int(after.get("retracted_reqs", 0)) - int(before.get("retracted_reqs", 0)),
        server_aborted=int(after.get("aborted_reqs", 0)) - int(before.get("aborted_reqs", 0)),
        kv_invariant=str(after.get("kv_invariant")),
        idle=bool(after.get("idle")),
        rss_kb=rss,
        rss_growth=growth,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        checks=checks,
        first_errors=errors[:10],
        latencies_ms=latencies,
    )


def write_report(report: SoakReport, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def format_report(report: SoakReport) -> str:
    width = 60
    rows = [" Soak Result ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<42}{text:>18}")

    row("Model:", report.model)
    row("Requests:", report.requests)
    row("Duration (s):", report.duration_s)
    rows.append(" Outcomes ".center(width, "-"))
    for name in OUTCOMES:
        row(f"{name}:", report.outcomes.get(name, 0))
    for status, count in sorted(report.by_status.items()):
        row(f"  HTTP {status}:", count)
    row("malformed answers:", report.malformed)
    row("unexpected 4xx / aborts:", report.unexpected)
    rows.append(" Server ".center(width, "-"))
    row("retracted requests (server):", report.server_retracted)
    row("aborted requests (server):", report.server_aborted)
    row("idle after the run:", report.idle)
    row("kv_invariant:", report.kv_invariant)
    for phase, sample in report.rss_kb.items():
        if sample:
            row(f"RSS {phase} (MiB, {len(sample) - 1} processes):", sample["total"] / 1024)
    row("RSS growth, last two thirds:", "n/a" if report.rss_growth is None else f"{report.rss_growth:+.2%}")
    rows.append(" Latency of completed requests ".center(width, "-"))
    row("p50 (ms):", report.p50_ms)
    row("p99 (ms):", report.p99_ms)
    rows.append(" Checks ".center(width, "-"))
    for name, ok in report.checks.items():
        row(f"{name}:", "PASS" if ok else "FAIL")
    rows.append("=" * width)
    rows += [f"error: {e}" for e in report.first_errors]
    return "\n".join(rows)

"""`radixserve bench offline | serving | soak | speculative | multiturn`.

offline: the in-process throughput benchmark against a transformers baseline.
speculative: decode speed with NGRAM (and a STANDALONE draft model) on and off (bench/speculative.py).
multiturn: chats that outgrow the KV pool, with and without the storage tier (bench/multiturn.py).
serving: an OpenAI-API load test against any running server (radixserve_tools/bench/serving.py).
soak: a fault and soak harness against any running server (radixserve_tools/bench/soak.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from radixserve.config.arg_types import positive_float, positive_int
from radixserve.config.server_args import CPU_ISA_CHOICES, CPU_KERNEL_CHOICES, SCHEDULE_POLICIES
from radixserve_tools.bench.plots import (
    add_plot_flag,
    multiturn_charts,
    offline_charts,
    plot_without_out,
    serving_charts,
    soak_charts,
    speculative_charts,
    write_plot_if_asked,
)
from radixserve_tools.bench.serving_datasets import DATASET_NAMES
from radixserve_tools.bench.workloads import parse_workload_names

_BENCH_DTYPES = ("bfloat16", "float32")


def _csv(choices: tuple[str, ...] | None = None) -> Any:
    def parse(spec: str) -> list[str]:
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        if choices is not None:
            bad = [s for s in items if s not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{', '.join(bad)} not in {', '.join(choices)}")
        return items

    return parse


def _workloads(spec: str) -> list[str]:
    try:
        return parse_workload_names(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _scale(spec: str) -> float:
    value = float(spec)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--scale must be in (0, 1], got {spec}")
    return value


def _ratio(spec: str) -> float:
    value = float(spec)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {spec}")
    return value


def _bench_offline(args: argparse.Namespace) -> int:
    from radixserve_tools.bench.offline import BenchConfig, format_table, run_benchmark, write_report

    if plot_without_out(args, args.out, "--out"):
        return 2
    cfg = BenchConfig(
        workloads=args.workloads,
        dtypes=args.dtypes,
        repeats=args.repeats,
        hf_batch=args.hf_batch,
        baseline=not args.no_baseline,
        work_dir=Path(args.work_dir),
        model_path=args.model_path,
        scale=args.scale,
        max_total_tokens=args.max_total_tokens,
        schedule_policy=args.schedule_policy,
        cpu_kernels=args.cpu_kernels,
        cpu_isa=args.cpu_isa,
        enable_deterministic_inference=args.enable_deterministic_inference,
    )
    report = run_benchmark(cfg, log=lambda line: print(line, flush=True))
    print()
    print(format_table(report["comparisons"]))
    if args.out:
        write_report(report, Path(args.out))
        print(f"\nwrote {args.out}")
    write_plot_if_asked(args, args.out, "bench offline", lambda: offline_charts(report))
    return 0


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `bench offline`, `bench serving` and `bench soak` on the top-level subparsers object."""
    bench: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="benchmarks: `offline` (in-process throughput vs transformers), `serving` (HTTP load test) "
        "or `soak` (fault and soak harness)",
        description="radixserve benchmarks; see `radixserve bench offline -h`, `bench serving -h` and "
        "`bench soak -h`.",
    )
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{offline,serving,soak,speculative,multiturn}"
    )
    _add_offline_parser(bench_sub)
    _add_serving_parser(bench_sub)
    _add_soak_parser(bench_sub)
    _add_speculative_parser(bench_sub)
    _add_multiturn_parser(bench_sub)
    return bench


def _add_offline_parser(bench_sub: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = bench_sub.add_parser(
        "offline",
        help="offline throughput benchmark (W1/W2/W3) against a transformers static-batch baseline",
        description=(
            "Runs the peers' token-id workloads on radixserve and on transformers `generate` in one "
            "process and prints total tok/s and the ratio radixserve/transformers. By default the model "
            "is a random-weight SmolLM2-135M built (once) under --work-dir."
        ),
    )
    bench.add_argument(
        "--workloads", type=_workloads, default=["W1", "W2", "W3"], help="comma list (default W1,W2,W3)"
    )
    bench.add_argument(
        "--dtypes",
        type=_csv((*_BENCH_DTYPES, "auto")),
        default=["bfloat16", "float32"],
        help="comma list of bfloat16,float32,auto (default the first two; auto: the server's own "
        "choice, float32 for a GGUF's quantized weights)",
    )
    bench.add_argument("--repeats", type=positive_int, default=3, help="timed runs per result; median")
    bench.add_argument("--hf-batch", type=positive_int, default=32, help="transformers static batch size")
    bench.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--work-dir", default="bench-work", help="where the random model is written")
    bench.add_argument("--out", default=None, help="write the full report as JSON here")
    add_plot_flag(bench, "--out")
    bench.add_argument(
        "--scale",
        type=_scale,
        default=1.0,
        help="shrink request counts and lengths (0 < s <= 1) for smoke runs",
    )
    bench.add_argument(
        "--model-path",
        default=None,
        help="benchmark this model instead ('default' = packaged SmolLM2 GGUF); the baseline runs "
        "only for transformers directories",
    )
    bench.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=None,
        help="KV pool size (default: fits the workload)",
    )
    bench.add_argument(
        "--schedule-policy", default="lpm", choices=SCHEDULE_POLICIES, help="radixserve policy (default lpm)"
    )
    bench.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNEL_CHOICES, help="as for the server")
    bench.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="as for the server")
    bench.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="run radixserve batch-invariant (to measure what it costs)",
    )
    bench.set_defaults(func=_bench_offline)
    return bench


def _serving_base_url(args: argparse.Namespace) -> str:
    from radixserve_tools.bench.serving import DEFAULT_BASE_URL

    if args.base_url is not None:
        if args.host is not None or args.port is not None:
            raise ValueError("give either --base-url or --host/--port, not both")
        return str(args.base_url)
    if args.host is None and args.port is None:
        return DEFAULT_BASE_URL
    return f"http://{args.host or '127.0.0.1'}:{args.port or 30000}"


def _bench_serving(args: argparse.Namespace) -> int:
    import asyncio

    from radixserve_tools.bench.serving import (
        ServingBenchConfig,
        ServingBenchError,
        format_report,
        run_serving_benchmark,
    )

    if plot_without_out(args, args.output_file, "--output-file"):
        return 2
    try:
        cfg = ServingBenchConfig(
            base_url=_serving_base_url(args),
            backend=args.backend,
            model=args.model,
            api_key=args.api_key,
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            seed=args.seed,
            random_input_len=args.random_input_len,
            random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio,
            random_vocab_size=args.random_vocab_size,
            gsp_num_groups=args.gsp_num_groups,
            gsp_prompts_per_group=args.gsp_prompts_per_group,
            gsp_system_prompt_len=args.gsp_system_prompt_len,
            gsp_question_len=args.gsp_question_len,
            gsp_output_len=args.gsp_output_len,
            dataset_path=args.dataset_path,
            tokenizer=args.tokenizer,
            sharegpt_output_len=args.sharegpt_output_len,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            request_timeout=args.request_timeout,
            warmup_requests=args.warmup_requests,
            disable_tqdm=args.disable_tqdm,
            output_file=args.output_file,
        )
        report = asyncio.run(run_serving_benchmark(cfg))
    except (ValueError, OSError, ServingBenchError) as exc:
        # Bad flags, an unreadable dataset, no model id: one line, no traceback.
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if cfg.output_file:
        print(f"wrote {cfg.output_file}")
    title = f"bench serving: {report.model}, {cfg.dataset}"
    write_plot_if_asked(args, cfg.output_file, title, lambda: serving_charts(report.results))
    # Failed requests never abort the run, but a run with no successes must not look like a pass.
    return 0 if report.metrics.completed else 1


def _add_serving_parser(bench_sub: Any) -> argparse.ArgumentParser:
    serving: argparse.ArgumentParser = bench_sub.add_parser(
        "serving",
        help="load-test a running OpenAI-compatible server (TTFT, ITL, TPOT, throughput)",
        description=(
            "Streams requests to /v1/completions (or /v1/chat/completions) of any OpenAI-compatible "
            "server and reports request and token throughput and TTFT/ITL/TPOT/E2E latency "
            "(mean, median, p99). Works against radixserve, SGLang, vLLM, llama.cpp, ..."
        ),
    )
    conn = serving.add_argument_group("server")
    conn.add_argument("--base-url", default=None, help="server URL (default http://127.0.0.1:30000)")
    conn.add_argument("--host", default=None, help="instead of --base-url (default 127.0.0.1)")
    conn.add_argument("--port", type=int, default=None, help="instead of --base-url (default 30000)")
    conn.add_argument(
        "--backend",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    conn.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    conn.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    conn.add_argument(
        "--request-timeout", type=positive_float, default=None, help="seconds per request (default none)"
    )

    data = serving.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASET_NAMES, default="random", help="(default random)")
    data.add_argument(
        "--num-prompts",
        type=positive_int,
        default=1000,
        help="requests for random and sharegpt (default 1000)",
    )
    data.add_argument("--seed", type=int, default=1, help="dataset and arrival-time seed (default 1)")
    data.add_argument("--random-input-len", type=positive_int, default=1024, help="(default 1024)")
    data.add_argument("--random-output-len", type=positive_int, default=128, help="(default 128)")
    data.add_argument(
        "--random-range-ratio",
        type=_ratio,
        default=1.0,
        help="lengths uniform in [ratio*len, len] (default 1.0: fixed lengths)",
    )
    data.add_argument(
        "--random-vocab-size",
        type=positive_int,
        default=10000,
        help="token ids drawn from [100, N) for random and generated-shared-prefix (default 10000)",
    )
    data.add_argument("--gsp-num-groups", type=positive_int, default=64, help="(default 64)")
    data.add_argument("--gsp-prompts-per-group", type=positive_int, default=16, help="(default 16)")
    data.add_argument(
        "--gsp-system-prompt-len",
        type=positive_int,
        default=2048,
        help="shared prefix tokens (default 2048)",
    )
    data.add_argument("--gsp-question-len", type=positive_int, default=128, help="(default 128)")
    data.add_argument("--gsp-output-len", type=positive_int, default=256, help="(default 256)")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset sharegpt)")
    data.add_argument(
        "--tokenizer",
        default=None,
        help="a local tokenizer dir or GGUF file: exact ShareGPT lengths; text prompts for chat",
    )
    data.add_argument(
        "--sharegpt-output-len", type=positive_int, default=None, help="fixed output length for ShareGPT"
    )

    load = serving.add_argument_group("load and sampling")
    load.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="Poisson arrivals, requests/s (default inf: all at once)",
    )
    load.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight cap")
    load.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so outputs have the dataset's lengths (default on)",
    )
    load.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="untimed requests sent one by one first (default 0)",
    )

    out = serving.add_argument_group("output")
    out.add_argument("--output-file", default=None, help="write aggregates + config as JSON here")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_plot_flag(out, "--output-file")
    serving.set_defaults(func=_bench_serving)
    return serving


def _bench_soak(args: argparse.Namespace) -> int:
    from radixserve_tools.bench.serving import ServingBenchError
    from radixserve_tools.bench.soak import main as soak_main
    from radixserve_tools.bench.soak_report import SoakConfig

    if plot_without_out(args, args.out, "--out"):
        return 2
    try:
        cfg = SoakConfig(
            base_url=_serving_base_url(args),
            api_key=args.api_key,
            model=args.model,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            seed=args.seed,
            server_pid=args.server_pid,
            request_timeout=args.request_timeout,
            idle_timeout=args.idle_timeout,
            max_duration=args.max_duration,
            max_rss_growth=args.max_rss_growth,
            max_tokens=args.max_tokens,
            out=args.out,
            disable_tqdm=args.disable_tqdm,
        )
        report = soak_main(cfg)
    except (ValueError, OSError, ServingBenchError) as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    write_plot_if_asked(args, args.out, f"bench soak: {report.model}", lambda: soak_charts(report))
    return 0 if report.passed else 1


def _add_soak_parser(bench_sub: Any) -> argparse.ArgumentParser:
    soak: argparse.ArgumentParser = bench_sub.add_parser(
        "soak",
        help="fault and soak harness against a running server (aborts, disconnects, sessions, grammars)",
        description=(
            "Sends a seeded mix of native and OpenAI requests (streaming or not, n > 1, sessions, "
            "grammars, prompts near the context, client hang-ups, aborts by rid and rid prefix) at a "
            "bounded concurrency, then checks: no 5xx, no transport errors beyond the deliberate "
            "hang-ups, no malformed answer, the server idle with kv_invariant ok, and (with "
            "--server-pid) RSS growth <= 5%% over the last two thirds. Exits 1 if a check fails."
        ),
    )
    soak.add_argument("--base-url", default=None, help="server URL (default http://127.0.0.1:30000)")
    soak.add_argument("--host", default=None, help="instead of --base-url (default 127.0.0.1)")
    soak.add_argument("--port", type=int, default=None, help="instead of --base-url (default 30000)")
    soak.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    soak.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    soak.add_argument("--num-requests", type=positive_int, default=10_000, help="(default 10000)")
    soak.add_argument("--concurrency", type=positive_int, default=16, help="scenarios in flight (default 16)")
    soak.add_argument("--seed", type=int, default=1, help="seed of the request mix (default 1)")
    soak.add_argument(
        "--max-tokens",
        type=positive_int,
        default=128,
        help="the largest output asked for (>= 8; default 128); tiny ones are 1-4 tokens",
    )
    soak.add_argument(
        "--server-pid",
        type=positive_int,
        default=None,
        help="server process id: RSS of it and its descendants at start, 1/3, 1/2 and end",
    )
    soak.add_argument(
        "--request-timeout", type=positive_float, default=120.0, help="seconds per request (default 120)"
    )
    soak.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=120.0,
        help="seconds to wait for the server to go idle after the run (default 120)",
    )
    soak.add_argument(
        "--max-duration",
        type=positive_float,
        default=None,
        help="stop starting requests after this many seconds (default: none)",
    )
    soak.add_argument(
        "--max-rss-growth", type=_ratio, default=0.05, help="allowed RSS growth, a fraction (default 0.05)"
    )
    soak.add_argument("--out", default=None, help="write the report as JSON here")
    add_plot_flag(soak, "--out")
    soak.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    soak.set_defaults(func=_bench_soak)
    return soak


def _print_report(table: str, report: dict[str, Any], out: str | None) -> int:
    """A bench's table, and its report as JSON at --out if given."""
    import json

    print()
    print(table)
    if out:
        Path(out).write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"\nwrote {out}")
    return 0


def _isa_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments --cpu-isa asks for (none for auto)."""
    return {"cpu_isa": args.cpu_isa} if args.cpu_isa != "auto" else {}


def _bench_speculative(args: argparse.Namespace) -> int:
    from radixserve_tools.bench.speculative import format_table, run_speculative_bench

    if plot_without_out(args, args.out, "--out"):
        return 2
    engine_args = _isa_args(args)
    draft = args.draft_model_path
    if args.draft_early_exit is not None:
        from radixserve_tools.bench.model import ensure_truncated_smollm2

        draft = str(ensure_truncated_smollm2(Path(args.work_dir), args.draft_early_exit))
    report = run_speculative_bench(
        args.dtype,
        args.repeats,
        Path(args.work_dir),
        engine_args=engine_args,
        draft_model_path=draft,
        num_steps=args.speculative_num_steps,
    )
    status = _print_report(format_table(report), report, args.out)
    write_plot_if_asked(args, args.out, "bench speculative", lambda: speculative_charts(report))
    return status


def _add_speculative_parser(bench_sub: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = bench_sub.add_parser(
        "speculative",
        help="decode tok/s with --speculative-algorithm NGRAM on and off (copy-heavy chats and W3)",
        description=(
            "Runs a copy-heavy chat workload on the packaged SmolLM2-135M-Instruct (single stream and "
            "batch 8) and W3 on a random SmolLM2-135M, with NGRAM speculation off and on, and prints "
            "decode tok/s, the ratio and the mean accept length."
        ),
    )
    bench.add_argument("--dtype", default="bfloat16", choices=_BENCH_DTYPES)
    bench.add_argument("--repeats", type=positive_int, default=3, help="timed runs per result; median")
    bench.add_argument("--work-dir", default="bench-work", help="where the random model is written")
    bench.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="as for the server")
    drafts = bench.add_mutually_exclusive_group()
    drafts.add_argument(
        "--draft-model-path", default=None, help="also measure STANDALONE with this draft model"
    )
    drafts.add_argument(
        "--draft-early-exit",
        type=positive_int,
        default=None,
        metavar="N",
        help="also measure STANDALONE, drafting with the packaged model's first N layers",
    )
    bench.add_argument(
        "--speculative-num-steps", type=positive_int, default=4, help="STANDALONE's drafts per step"
    )
    bench.add_argument("--out", default=None, help="write the report as JSON here")
    add_plot_flag(bench, "--out")
    bench.set_defaults(func=_bench_speculative)
    return bench


def _bench_multiturn(args: argparse.Namespace) -> int:
    from radixserve_tools.bench.multiturn import MultiTurnWorkload, format_table, run_multiturn_bench

    if plot_without_out(args, args.out, "--out"):
        return 2
    workload = MultiTurnWorkload(
        args.conversations, args.turns, args.user_tokens, args.reply_tokens, args.concurrency,
        args.pool_conversations, max(0, args.context_tokens),
    )  # fmt: skip
    engine_args = {**_isa_args(args), "device": args.device, "hicache_ratio": args.hicache_ratio}
    storage = Path(args.storage_dir) if args.storage_dir else None
    settings = tuple("storage, restarted" if s == "restarted" else s for s in args.settings.split(","))
    report = run_multiturn_bench(
        workload, args.dtype, storage, engine_args=engine_args, settings=settings, model_path=args.model_path
    )
    status = _print_report(format_table(report), report, args.out)
    write_plot_if_asked(args, args.out, "bench multiturn", lambda: multiturn_charts(report))
    return status


def _add_multiturn_parser(bench_sub: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = bench_sub.add_parser(
        "multiturn",
        help="multi-turn chats that outgrow the KV pool: the storage tier off, on, and after a restart",
        description=(
            "Runs conversations of several turns on the packaged SmolLM2-135M-Instruct, round by round, "
            "with a KV pool that holds a few of them, and prints output tok/s and TTFT p50/p99 without "
            "the storage tier, with it, and with a restarted engine on its directory."
        ),
    )
    bench.add_argument("--conversations", type=positive_int, default=64)
    bench.add_argument("--turns", type=positive_int, default=6)
    bench.add_argument("--user-tokens", type=positive_int, default=64, help="tokens of each new message")
    bench.add_argument("--reply-tokens", type=positive_int, default=32, help="tokens of each reply")
    bench.add_argument(
        "--context-tokens", type=int, default=0,
        help="tokens of each conversation's own context (a document, instructions) before its first message",
    )  # fmt: skip
    bench.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    bench.add_argument(
        "--pool-conversations", type=positive_int, default=8, help="the KV pool holds about this many whole"
    )
    bench.add_argument("--dtype", default="bfloat16", choices=_BENCH_DTYPES)
    bench.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="as for the server")
    bench.add_argument(
        "--storage-dir", default=None, help="the storage tier's directory (default: a new one)"
    )
    bench.add_argument(
        "--settings", default="off,storage,restarted",
        help="comma-separated, from off, host (L2 beside a GPU pool), storage, restarted",
    )  # fmt: skip
    bench.add_argument("--model-path", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    bench.add_argument(
        "--hicache-ratio", type=float, default=2.0, help="L2's size over the device pool (setting host)"
    )
    bench.add_argument("--out", default=None, help="write the report as JSON here")
    add_plot_flag(bench, "--out")
    bench.set_defaults(func=_bench_multiturn)
    return bench

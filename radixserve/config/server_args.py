"""ServerArgs: every knob of the engine in one dataclass, under SGLang's flag names."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.config.disaggregation_args import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_TIMEOUT_S,
    add_disaggregation_args,
    validate_disaggregation_args,
)
from radixserve.config.hicache_args import add_hicache_args, validate_hicache_args
from radixserve.config.image_args import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    add_image_args,
    validate_image_args,
)
from radixserve.config.kv_events_args import parse_kv_events_config
from radixserve.config.lora_args import DEFAULT_MAX_LORAS_PER_BATCH, add_lora_args, validate_lora_args
from radixserve.config.parallel_args import add_parallel_args, validate_parallel_args
from radixserve.config.speculative_args import add_speculative_args, validate_speculative_args

SchedulePolicyName = Literal["fcfs", "lpm", "dfs-weight", "lof", "random"]
SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "lpm", "dfs-weight", "lof", "random")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
# --quantization: unset keeps a checkpoint's own format (a GGUF's blocks stay quantized where a
# native kernel takes them); "none" loads every weight dense in --dtype (a GGUF dequantized); the
# others quantize a safetensors checkpoint's linear weights at load into that GGUF format.
QUANTIZATION_CHOICES: tuple[str, ...] = ("none", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# --kv-cache-dtype (executor/kv_sizing.py): auto is the model's dtype, but bf16 under fp32 activations
# over quantized weights on a CPU; "bf16" is SGLang's other name for bfloat16.
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = ("auto", "bfloat16", "bf16", "float32")
# --reasoning-parser (server/reasoning.py): how a reasoning model's thinking is told from its answer.
REASONING_PARSERS: tuple[str, ...] = ("deepseek-r1", "qwen3")
# --tool-call-parser (server/tool_parsers.py): the tool-call formats, under SGLang's and vLLM's names.
TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3", "mistral", "pythonic", "qwen25")
GRAMMAR_BACKENDS: tuple[str, ...] = ("xgrammar", "none")
CPU_KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "torch")
# --cpu-isa: what the native kernels are built for (kernels/native.py); auto: RADIXSERVE_CPU_ISA's
# choice, by default this CPU (-march=native).
CPU_ISA_CHOICES: tuple[str, ...] = ("auto", "amx", "avx512_bf16", "avx512", "avx2")
# "torch" is accepted as another name for torch_native (attention/registry.py).
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch_native", "cpu_native", "torch")
# --chunked-prefill-size when not given, per device type. A CPU's matmuls reach full speed well
# below 512 rows, and a smaller chunk keeps a long prompt's activations in less memory and lets
# decode steps in between sooner; a GPU wants more rows per forward to fill its units.
DEFAULT_CHUNKED_PREFILL_SIZE: dict[str, int] = {"cpu": 512, "cuda": 2048}


def chunked_prefill_tokens(size: int | None, device_type: str) -> int | None:
    """--chunked-prefill-size resolved for a device: the prompt tokens of one prefill chunk, or
    None when chunking is off (size -1)."""
    if size is None:
        return DEFAULT_CHUNKED_PREFILL_SIZE.get(device_type, DEFAULT_CHUNKED_PREFILL_SIZE["cuda"])
    return size if size > 0 else None


class InvalidArgumentError(ValueError):
    """A server argument has a value the engine cannot work with."""


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = None
    tokenizer_path: str | None = None
    # A Jinja file, or the template inline, replacing the model's chat template (models/tokenizer.py).
    chat_template: str | None = None
    reasoning_parser: str | None = None
    # --tool-call-parser (server/tool_parsers.py): the format of a model's tool calls.
    tool_call_parser: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    random_seed: int = 0
    # Serve a decoder model as an embedding model (last-token pooling); encoders always are.
    is_embedding: bool = False
    # Native CPU kernels (radixserve/kernels): auto = when they build here; native = required.
    cpu_kernels: str = "auto"
    cpu_isa: str = "auto"
    # Attention over the paged KV pool (radixserve/attention): auto picks one at startup and logs why.
    attention_backend: str = "auto"
    # Batch-invariant inference: a request's tokens and logprobs are bit-identical whatever else is
    # in the batch, whether its prefix came from the cache, and whatever the chunk size (docs/
    # architecture.md, "Batch-invariant inference").
    enable_deterministic_inference: bool = False

    # Memory
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    max_running_requests: int | None = None
    page_size: int = 1
    # Sliding-window layers keep their K/V in window slots, released once out of every window
    # (cache/swa_pool.py), where the model has such layers and nothing below refuses it.
    disable_hybrid_swa_memory: bool = False
    # Window slots in use (those tokens' sliding-layer K/V) past which the radix cache gives back
    # its least recently used prefixes' window K/V, as a fraction of the pool's tokens.
    swa_full_tokens_ratio: float = 0.8
    # Tokens of the running requests' K/V that decode attention may keep contiguous between steps,
    # on top of the pool (attention/staging.py). None: a default per device; 0: off.
    decode_staging_tokens: int | None = None

    # Scheduling
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    max_prefill_tokens: int = 16384
    # Prompt tokens per prefill chunk. None: the device's default (chunked_prefill_tokens); -1 (or
    # any value <= 0, as SGLang takes it): off.
    chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    # Request priorities (scheduler/policy.py, PriorityRule), under SGLang's flags: by default a
    # higher value runs first; a waiting request may preempt running ones it outranks by more than
    # the threshold when KV is short.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    # KV cache events over ZMQ (config/kv_events_args.py, scheduler/kv_events.py): the JSON object.
    kv_events_config: str | None = None
    # Prefill/decode disaggregation (config/disaggregation_args.py, docs/parallelism.md).
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    disaggregation_transfer_backend: str = "gloo"
    disaggregation_timeout: float = DEFAULT_TIMEOUT_S
    # The hierarchical cache (config/hicache_args.py, cache/storage_tier.py).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_size_gb: float = 16.0
    hicache_storage_page_size: int | None = None
    # Multi-LoRA serving (config/lora_args.py, scheduler/lora.py, docs/lora.md).
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    # GET /dashboard: a live page of the server's state (server/dashboard.py, docs/dashboard.md).
    enable_dashboard: bool = False
    # Append each finished request to this file, in simulate's trace format (runtime/trace_recorder.py).
    record_trace: str | None = None
    # Image inputs of vision-language models (config/image_args.py, docs/multimodal.md).
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_local_media_path: str | None = None
    enable_image_url_fetch: bool = False
    stream_interval: int = 1
    grammar_backend: str = "xgrammar"
    grammar_timeout: float = 300.0
    enable_custom_logit_processor: bool = False
    # Publish a step's results while the next forward runs (scheduler/outputs.py). Default: on
    # CUDA only; these force it off or on.
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    allow_auto_truncate: bool = False
    max_queued_requests: int | None = None
    # A request not finished this many seconds after it arrived is aborted (None: no limit).
    request_timeout: float | None = None
    # After SIGTERM / Ctrl-C, requests in flight may finish for this long; then they are aborted.
    graceful_shutdown_timeout: float = 30.0
    max_request_body_mb: float = 32.0
    enable_metrics: bool = False
    # Browser origins allowed by CORS (e.g. "https://app.example.com", or "*"); None: no CORS headers.
    allow_origins: list[str] | None = None

    # Logging and self-checks
    log_level: str = "info"
    decode_log_interval: int = 40
    # A forward step running longer than this stops the server (None: no watchdog).
    watchdog_timeout: float | None = 300.0
    # Idle children wake up every 5 s instead of every 0.5 s (to check that the server still runs).
    sleep_on_idle: bool = False

    # Speculative decoding (scheduler/speculative/; flags in config/speculative_args.py).
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8
    # STANDALONE: the draft model, and how many tokens it drafts per step (None: the default).
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 1_000_000
    # Draft whatever the index offers, instead of what pays on this machine (speculative/cost.py).
    disable_speculative_adaptive: bool = False

    # Parallelism (docs/parallelism.md): tp_size ranks share one model's weights; dp_size
    # replicas each serve a whole model (runtime/dp_router.py). A model's ranks may span nnodes
    # machines, which meet at dist_init_addr (HOST:PORT, reachable from every node).
    tp_size: int = 1
    # Pipeline parallelism: pp_size stages, each holding a contiguous share of the layers and
    # tp_size ranks of its own (docs/parallelism.md).
    pp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for flag, value, choices in (
            ("--dtype", self.dtype, DTYPES),
            ("--reasoning-parser", self.reasoning_parser, (None, *REASONING_PARSERS)),
            ("--tool-call-parser", self.tool_call_parser, (None, *TOOL_CALL_PARSERS)),
            ("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES),
            ("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES),
            ("--quantization", self.quantization, (None, *QUANTIZATION_CHOICES)),
            ("--cpu-kernels", self.cpu_kernels, CPU_KERNEL_CHOICES),
            ("--cpu-isa", self.cpu_isa, CPU_ISA_CHOICES),
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS),
        ):
            if value not in choices:
                named = ", ".join(c for c in choices if c is not None)
                raise InvalidArgumentError(f"{flag} must be one of {named}, got {value!r}")
        if self.cpu_isa != "auto" and self.cpu_kernels == "torch":
            raise InvalidArgumentError(
                f"--cpu-isa {self.cpu_isa} needs the native kernels, which --cpu-kernels torch never loads"
            )
        if self.page_size < 1:
            raise InvalidArgumentError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise InvalidArgumentError("--max-total-tokens must hold at least one page")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise InvalidArgumentError("--mem-fraction-static must be in (0, 1]")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise InvalidArgumentError("--swa-full-tokens-ratio must be in (0, 1]")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise InvalidArgumentError("--max-running-requests must be >= 1")
        if self.decode_staging_tokens is not None and self.decode_staging_tokens < 0:
            raise InvalidArgumentError("--decode-staging-tokens must be >= 0 (0 turns staging off)")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = -1  # SGLang's "off"
        if self.chunked_prefill_size is not None and 0 < self.chunked_prefill_size < self.page_size:
            raise InvalidArgumentError("--chunked-prefill-size must be at least --page-size")
        if self.max_prefill_tokens < 1:
            raise InvalidArgumentError("--max-prefill-tokens must be >= 1")
        if self.priority_scheduling_preemption_threshold < 0:
            raise InvalidArgumentError("--priority-scheduling-preemption-threshold must be >= 0")
        if self.schedule_conservativeness <= 0:
            raise InvalidArgumentError("--schedule-conservativeness must be > 0")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            backends = ", ".join(GRAMMAR_BACKENDS)
            raise InvalidArgumentError(
                f"--grammar-backend must be one of {backends}, got {self.grammar_backend!r}"
            )
        if self.watchdog_timeout is not None and self.watchdog_timeout <= 0:
            self.watchdog_timeout = None  # SGLang style: a non-positive timeout switches it off
        if self.grammar_timeout <= 0:
            raise InvalidArgumentError("--grammar-timeout must be > 0")
        if self.stream_interval < 1:
            raise InvalidArgumentError("--stream-interval must be >= 1")
        if not 0 < self.port < 65536:
            raise InvalidArgumentError(f"--port must be in 1..65535, got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise InvalidArgumentError("--max-queued-requests must be >= 1")
        if self.max_request_body_mb <= 0:
            raise InvalidArgumentError("--max-request-body-mb must be > 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            self.request_timeout = None  # as with --watchdog-timeout, a non-positive value switches it off
        if self.graceful_shutdown_timeout < 0:
            raise InvalidArgumentError("--graceful-shutdown-timeout must be >= 0")
        validate_parallel_args(self, InvalidArgumentError)
        validate_speculative_args(self, InvalidArgumentError)
        events = parse_kv_events_config(self.kv_events_config, InvalidArgumentError)
        if events is not None and self.disable_radix_cache:
            raise InvalidArgumentError("--kv-events-config needs the radix cache: drop --disable-radix-cache")
        validate_hicache_args(self, InvalidArgumentError)
        validate_disaggregation_args(self, InvalidArgumentError)
        validate_lora_args(self, InvalidArgumentError)
        validate_image_args(self, InvalidArgumentError)
        if self.enable_lora:
            not_with_lora = [
                flag
                for flag, used in (
                    ("--speculative-algorithm", self.speculative_algorithm is not None),
                    ("--disaggregation-mode", self.disaggregation_mode != "null"),
                    ("--is-embedding", self.is_embedding),
                )
                if used
            ]
            if not_with_lora:
                raise InvalidArgumentError(f"--enable-lora does not run with {', '.join(not_with_lora)} yet")

    @property
    def window_memory_refusal(self) -> str | None:
        """Why sliding-window layers cannot keep their K/V in window slots under these flags (None:
        they can, where the model and the runner allow it: executor/model_runner.py)."""
        refusals = [
            ("--disable-hybrid-swa-memory", self.disable_hybrid_swa_memory),
            ("--page-size > 1", self.page_size > 1),
            ("--speculative-algorithm", self.speculative_algorithm is not None),
            ("--enable-hierarchical-cache", self.enable_hierarchical_cache),
            ("--disaggregation-mode", self.disaggregation_mode != "null"),
            ("--pp-size > 1", self.pp_size > 1),
        ]
        used = [flag for flag, on in refusals if on]
        return None if not used else f"not with {', '.join(used)}"

    @property
    def model_ranks(self) -> int:
        """The ranks of one model (replica): tp_size per pipeline stage."""
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.model_ranks // self.nnodes

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, http: bool = True) -> None:
        """Adds every flag, grouped; http=False leaves out the HTTP server's (for offline commands).
        Every flag's default is its field's: the dataclass is the one place they are written."""
        ServerArgs._add_flags(parser, http)
        flags = {action.dest for action in parser._actions}
        parser.set_defaults(**{k: v for k, v in ServerArgs.defaults().items() if k in flags})

    @staticmethod
    def _add_flags(parser: argparse.ArgumentParser, http: bool) -> None:
        model = parser.add_argument_group("model")
        model.add_argument(
            "--model-path",
            "--model",
            dest="model_path",
            help="HF folder, .gguf file or hub id (default: the packaged SmolLM2-135M-Instruct GGUF)",
        )
        model.add_argument("--tokenizer-path", help="tokenizer folder (default: the model's)")
        model.add_argument(
            "--reasoning-parser",
            choices=REASONING_PARSERS,
            help="return a reasoning model's <think> block as reasoning_content, apart from the answer",
        )
        model.add_argument(
            "--tool-call-parser",
            choices=TOOL_CALL_PARSERS,
            help="the format of the model's tool calls, returned as tool_calls (docs/server.md)",
        )
        model.add_argument(
            "--chat-template",
            help="the chat template to use instead of the model's: a Jinja file, or the template inline",
        )
        model.add_argument(
            "--dtype",
            choices=DTYPES,
            help="auto: bfloat16 where the device has a fast path, else float32",
        )
        model.add_argument(
            "--quantization",
            choices=QUANTIZATION_CHOICES,
            help="unset: the checkpoint's own weights (a GGUF's Q4/Q5/Q6/Q8 blocks stay quantized, on "
            "native kernels); none: every weight dense in --dtype (a GGUF dequantized); q8_0, q4_0, q4_1, "
            "q5_0, q5_1: quantize a safetensors checkpoint's linear weights into that GGUF format at load",
        )
        model.add_argument(
            "--kv-cache-dtype",
            choices=KV_CACHE_DTYPE_CHOICES,
            help="the KV cache's dtype. auto: the model's, but bfloat16 where fp32 activations run over "
            "quantized weights on a CPU (half the KV memory; attention then runs in bf16)",
        )
        model.add_argument("--device", help="auto, cpu, cuda or cuda:N")
        model.add_argument("--context-length", type=int)
        model.add_argument("--random-seed", type=int)
        model.add_argument(
            "--is-embedding",
            action="store_true",
            help="serve embeddings (/v1/embeddings, /encode) from a decoder model; encoders always do",
        )
        model.add_argument(
            "--cpu-kernels",
            choices=CPU_KERNEL_CHOICES,
            help="native CPU kernels, built once per machine with its C++ compiler: auto uses them when "
            "they build, native requires them, torch uses torch ops only",
        )
        model.add_argument(
            "--cpu-isa",
            choices=CPU_ISA_CHOICES,
            help="instruction set the native CPU kernels are built for: auto is this CPU (or what "
            "RADIXSERVE_CPU_ISA names); a narrower one runs another CPU's kernel paths; amx requires AMX. "
            "One this CPU cannot run fails at startup",
        )
        model.add_argument(
            "--attention-backend",
            choices=ATTENTION_BACKENDS,
            help="attention over the paged KV cache: cpu_native (native CPU kernels: paged decode, "
            "shared-prefix cascade, AMX where the CPU has it), torch_native (torch SDPA; any device); "
            "auto picks cpu_native on a CPU where the native kernels load, else torch_native",
        )
        model.add_argument(
            "--enable-deterministic-inference",
            action="store_true",
            help="batch-invariant inference: outputs and logprobs bit-identical whatever else is in the "
            "batch, the cache hits and the chunk size (bf16 on the native CPU kernels; costs some speed)",
        )

        memory = parser.add_argument_group("memory")
        memory.add_argument(
            "--max-total-tokens",
            type=int,
            help="KV cache capacity in tokens (default: from --mem-fraction-static)",
        )
        memory.add_argument(
            "--mem-fraction-static",
            type=float,
            help="fraction of free memory after weights given to the KV cache",
        )
        memory.add_argument("--max-running-requests", type=int)
        memory.add_argument("--page-size", type=int)
        memory.add_argument(
            "--disable-hybrid-swa-memory",
            action="store_true",
            help="keep sliding-window layers' K/V in the slots every layer shares, for as long as "
            "the request (by default they are released once out of every window)",
        )
        memory.add_argument(
            "--swa-full-tokens-ratio",
            type=float,
            help="sliding-window layers' K/V tokens kept, as a fraction of the KV cache's tokens: "
            "past it the radix cache drops its least recently used prefixes' window K/V (running "
            "requests keep theirs; default 0.8)",
        )
        memory.add_argument(
            "--decode-staging-tokens",
            type=int,
            help="K/V tokens the torch decode attention keeps contiguous between steps, beyond the KV "
            "cache (default: the KV cache size up to 32768 on a CPU, 0 on CUDA; 0 turns it off; "
            "unused when the native CPU kernel reads the pool in place)",
        )

        sched = parser.add_argument_group("scheduling")
        sched.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES)
        sched.add_argument(
            "--schedule-conservativeness",
            type=float,
            help="higher reserves more KV for running requests (fewer retractions)",
        )
        sched.add_argument("--max-prefill-tokens", type=int)
        sched.add_argument(
            "--chunked-prefill-size",
            type=int,
            help="prompt tokens per prefill chunk; -1 disables chunking (default: "
            f"{DEFAULT_CHUNKED_PREFILL_SIZE['cpu']} on a CPU, "
            f"{DEFAULT_CHUNKED_PREFILL_SIZE['cuda']} on CUDA)",
        )
        sched.add_argument("--enable-mixed-chunk", action="store_true")
        sched.add_argument("--disable-radix-cache", action="store_true")
        sched.add_argument(
            "--enable-priority-scheduling",
            action="store_true",
            help="admit waiting requests by their `priority` (higher first), preempting running "
            "ones that rank lower by more than the threshold when KV is short",
        )
        sched.add_argument("--schedule-low-priority-values-first", action="store_true")
        sched.add_argument("--priority-scheduling-preemption-threshold", type=int)
        sched.add_argument(
            "--kv-events-config",
            metavar="JSON",
            help='publish KV cache events over ZMQ, e.g. \'{"publisher": "zmq", "endpoint": '
            '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\' (docs/kv_events.md)',
        )
        sched.add_argument("--stream-interval", type=int)
        sched.add_argument(
            "--grammar-backend",
            choices=GRAMMAR_BACKENDS,
            help="structured output (json_schema, regex, ebnf); none refuses such requests",
        )
        sched.add_argument("--grammar-timeout", type=float, help="seconds a grammar may take to compile")
        sched.add_argument(
            "--enable-custom-logit-processor",
            action="store_true",
            help="let requests name a logit processor class importable on the server (module:Class)",
        )
        sched.add_argument(
            "--disable-overlap-schedule",
            action="store_true",
            help="publish each step's results before the next forward (overlap is on by default on CUDA)",
        )
        sched.add_argument(
            "--enable-overlap-schedule",
            action="store_true",
            help="publish each step's results during the next forward, on a CPU too (off there by default)",
        )

        add_speculative_args(parser)
        add_hicache_args(parser)
        add_lora_args(parser)
        add_parallel_args(parser)
        add_image_args(parser)
        add_disaggregation_args(parser)
        if http:
            ServerArgs._add_http_args(parser)

        logs = parser.add_argument_group("logging")
        logs.add_argument("--log-level")
        logs.add_argument("--decode-log-interval", type=int)
        logs.add_argument(
            "--watchdog-timeout",
            type=float,
            help="seconds a forward step may run before the server dumps stacks and exits (<= 0: off)",
        )
        logs.add_argument(
            "--sleep-on-idle",
            action="store_true",
            help="when idle, wake up every 5 s instead of 0.5 s (the scheduler always blocks on its sockets)",
        )

    @staticmethod
    def _add_http_args(parser: argparse.ArgumentParser) -> None:
        server = parser.add_argument_group("HTTP server")
        server.add_argument("--host", help="address to bind (default: local only)")
        server.add_argument("--port", type=int)
        server.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
        server.add_argument("--served-model-name", help="model name in the API (default: the model path)")
        server.add_argument(
            "--allow-auto-truncate",
            action="store_true",
            help="cut prompts longer than the context instead of refusing them",
        )
        server.add_argument(
            "--max-queued-requests",
            type=int,
            help="answer 503 while more requests than this wait for their first token (default: no bound)",
        )
        server.add_argument("--max-request-body-mb", type=float)
        server.add_argument(
            "--request-timeout",
            type=float,
            help="abort a request not finished this many seconds after it arrived, with a 503 (default: off)",
        )
        server.add_argument(
            "--graceful-shutdown-timeout",
            type=float,
            help="after SIGTERM or Ctrl-C, seconds requests in flight may take to finish before they are "
            "aborted (finish reason abort); new connections are refused at once",
        )
        server.add_argument(
            "--allow-origins",
            nargs="+",
            metavar="ORIGIN",
            help="answer CORS requests from these browser origins ('*': any; default: no CORS headers)",
        )
        server.add_argument(
            "--enable-metrics", action="store_true", help="serve Prometheus metrics at GET /metrics"
        )
        server.add_argument(
            "--enable-dashboard",
            action="store_true",
            help="serve a live dashboard at GET /dashboard (behind --api-key like every route)",
        )
        server.add_argument(
            "--record-trace",
            metavar="PATH",
            help="append each finished request (arrival, prompt token ids, output length) to PATH as a "
            "JSON line that `radixserve simulate --trace-file` replays (default: off)",
        )

    @staticmethod
    def defaults() -> dict[str, Any]:
        """Each field's default value (a fresh one for fields with a factory)."""
        values = {}
        for f in dataclasses.fields(ServerArgs):
            if f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
        return values

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

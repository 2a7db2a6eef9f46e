"""Offline throughput benchmark: radixserve vs a transformers static-batch baseline, one process.

Both systems run the same token-id workloads on the same weights in the same run, so the ratio
between them is meaningful even on noisy shared machines where absolute numbers drift.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixserve_tools.bench.model import ensure_random_smollm2
from radixserve_tools.bench.workloads import Workload, make_workload, summarize

Log = Callable[[str], None]

RADIXSERVE = "radixserve"
TRANSFORMERS = "transformers-static"
# Engine stats whose per-run change says how the scheduler handled a workload.
_STAT_KEYS = ("forward_steps", "prefill_batches", "decode_steps", "cached_tokens", "generated_tokens")
_WARMUP_PROMPT_TOKENS = 16
_WARMUP_NEW_TOKENS = 4
_KV_MARGIN_TOKENS = 1024


class BenchmarkError(RuntimeError):
    """A run produced the wrong number of tokens or left the engine in a bad state."""


@dataclass
class BenchConfig:
    workloads: list[str] = field(default_factory=lambda: ["W1", "W2", "W3"])
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16", "float32"])
    repeats: int = 3
    hf_batch: int = 32
    baseline: bool = True
    work_dir: Path = Path("bench-work")
    # None: the random SmolLM2-135M built under work_dir; "default": the packaged GGUF.
    model_path: str | None = None
    scale: float = 1.0
    max_total_tokens: int | None = None
    schedule_policy: str = "lpm"
    # --cpu-kernels and --cpu-isa of the engine (config/server_args.py)
    cpu_kernels: str = "auto"
    cpu_isa: str = "auto"
    enable_deterministic_inference: bool = False

    def validate(self) -> None:
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.hf_batch < 1:
            raise ValueError("hf_batch must be >= 1")
        if not 0.0 < self.scale <= 1.0:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if not self.workloads or not self.dtypes:
            raise ValueError("need at least one workload and one dtype")


@dataclass(frozen=True)
class ModelTarget:
    label: str
    engine_path: str | None  # what Engine(model_path=...) gets; None means the packaged default
    hf_dir: Path | None  # a transformers-loadable directory, if there is one
    vocab_limit: int


def resolve_target(cfg: BenchConfig, dtype: str) -> ModelTarget:
    from radixserve.models.source import load_model_config, resolve_model_source

    if cfg.model_path is None:
        # The random model is written in bf16 and fp32; auto serves the bf16 one in the server's dtype.
        path = ensure_random_smollm2(cfg.work_dir, "bfloat16" if dtype == "auto" else dtype)
        vocab = load_model_config(resolve_model_source(path)).vocab_size
        return ModelTarget(f"random SmolLM2-135M ({path.name})", str(path), path, vocab)
    engine_path = None if cfg.model_path == "default" else cfg.model_path
    source = resolve_model_source(engine_path)
    vocab = load_model_config(source).vocab_size
    hf_dir = source.path if source.kind == "hf_dir" else None
    return ModelTarget(str(source.path), engine_path, hf_dir, vocab)


def environment_info() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _warmup_prompts(workload: Workload, batch: int) -> list[list[int]]:
    return [p[:_WARMUP_PROMPT_TOKENS] for p in workload.prompts[:batch]]


def _median_result(
    system: str, dtype: str, workload: Workload, times: list[float], extra: dict[str, Any]
) -> dict[str, Any]:
    res = summarize(workload, statistics.median(times))
    res.update(
        system=system,
        dtype=dtype,
        requests=workload.num_requests,
        max_new_tokens=workload.max_new_tokens,
        repeats=len(times),
        all_seconds=[round(t, 3) for t in times],
    )
    res.update(extra)
    return res


# ---------------------------------------------------------------------------------- radixserve


def _flush(engine: Any) -> None:
    # The KV check is answered only once the scheduler is idle, so the flush after it cannot race
    # with the retiring of the last requests.
    engine.check_kv_invariant()
    if not engine.flush_cache():
        raise BenchmarkError("flush_cache failed although the engine was idle")


def _check_outputs(outputs: list[dict[str, Any]], workload: Workload, system: str) -> None:
    want = workload.max_new_tokens
    if len(outputs) != workload.num_requests:
        raise BenchmarkError(f"{system} {workload.name}: {len(outputs)} results for {workload.num_requests}")
    for i, out in enumerate(outputs):
        got = len(out["output_ids"])
        meta = out["meta_info"]
        if got != want or meta["completion_tokens"] != want:
            raise BenchmarkError(
                f"{system} {workload.name} request {i}: {got} output ids / "
                f"{meta['completion_tokens']} completion tokens, expected {want} "
                f"(finish_reason={meta['finish_reason']})"
            )


class RadixserveSystem:
    """radixserve's Engine on one dtype; every run starts from a cold prefix cache."""

    name = RADIXSERVE

    def __init__(self, target: ModelTarget, dtype: str, workloads: list[Workload], cfg: BenchConfig):
        from radixserve.runtime.engine import Engine

        need = max(w.kv_tokens_needed() for w in workloads) + _KV_MARGIN_TOKENS
        self.target, self.cfg = target, cfg
        self.engine = Engine(
            target.engine_path,
            dtype=dtype,
            max_total_tokens=cfg.max_total_tokens or need,
            schedule_policy=cfg.schedule_policy,
            cpu_kernels=cfg.cpu_kernels,
            cpu_isa=cfg.cpu_isa,
            log_level="warning",
            enable_deterministic_inference=cfg.enable_deterministic_inference,
        )
        self.cached: dict[str, list[int]] = {}
        self.deltas: dict[str, dict[str, int]] = {}

    @staticmethod
    def _params(max_new_tokens: int) -> dict[str, Any]:
        return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}

    def warmup(self, wl: Workload) -> None:
        warm = self._params(_WARMUP_NEW_TOKENS)
        self.engine.generate(input_ids=_warmup_prompts(wl, self.cfg.hf_batch), sampling_params=warm)

    def run(self, wl: Workload) -> tuple[float, str]:
        # Cold cache every repeat: W2's gain must come from sharing inside one run.
        _flush(self.engine)
        before = self.engine.get_stats()
        t0 = time.perf_counter()
        outputs = self.engine.generate(input_ids=wl.prompts, sampling_params=self._params(wl.max_new_tokens))
        seconds = time.perf_counter() - t0
        assert isinstance(outputs, list)
        _check_outputs(outputs, wl, RADIXSERVE)
        after = self.engine.get_stats()
        self.deltas[wl.name] = {k: int(after[k]) - int(before[k]) for k in _STAT_KEYS if k in after}
        cached = sum(int(o["meta_info"]["cached_tokens"]) for o in outputs)
        self.cached.setdefault(wl.name, []).append(cached)
        return seconds, f"cached_tokens={cached}"

    def extra(self, wl: Workload) -> dict[str, Any]:
        return {
            "model": self.target.label,
            "cached_tokens": self.cached.get(wl.name, []),
            "engine_stats": self.deltas.get(wl.name, {}),
            "max_total_tokens": self.engine.max_total_tokens,
            "schedule_policy": self.cfg.schedule_policy,
            "enable_deterministic_inference": self.cfg.enable_deterministic_inference,
        }

    def close(self) -> None:
        try:
            self.engine.check_kv_invariant()
        finally:
            self.engine.shutdown()


# ---------------------------------------------------------------------------------- transformers


def _hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, batch: int) -> int:
    """Static batching as in peers/hf_static.py; returns output tokens and checks every row."""
    import torch

    n_out = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        new = out.shape[1] - width
        if new != max_new_tokens:
            raise BenchmarkError(f"{TRANSFORMERS}: generated {new} tokens, expected {max_new_tokens}")
        n_out += new * len(chunk)
    return n_out


class TransformersSystem:
    """transformers `generate` with static batches of cfg.hf_batch, as the peers' hf_static.py."""

    name = TRANSFORMERS

    def __init__(self, hf_dir: Path, dtype: str, cfg: BenchConfig):
        import torch
        from transformers import AutoModelForCausalLM

        self.hf_dir, self.cfg = hf_dir, cfg
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
        self.model = model.eval()
        self.attn = getattr(self.model.config, "_attn_implementation", None)

    def warmup(self, wl: Workload) -> None:
        _hf_generate(
            self.model, _warmup_prompts(wl, self.cfg.hf_batch), _WARMUP_NEW_TOKENS, self.cfg.hf_batch
        )

    def run(self, wl: Workload) -> tuple[float, str]:
        t0 = time.perf_counter()
        n_out = _hf_generate(self.model, wl.prompts, wl.max_new_tokens, self.cfg.hf_batch)
        seconds = time.perf_counter() - t0
        if n_out != wl.out_tokens:
            raise BenchmarkError(f"{TRANSFORMERS} {wl.name}: {n_out} output tokens != {wl.out_tokens}")
        return seconds, ""

    def extra(self, wl: Workload) -> dict[str, Any]:
        return {"model": str(self.hf_dir), "batch": self.cfg.hf_batch, "attn_implementation": self.attn}

    def close(self) -> None:
        del self.model
        gc.collect()


# ---------------------------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, dtype): both systems' throughput and radixserve / transformers.

    The systems alternate repeat by repeat, so `paired_ratios` compares runs made moments apart,
    and their median (`ratio_paired`) is the figure least moved by a machine that drifts."""
    keyed = {(r["system"], r["workload"], r["dtype"]): r for r in results}
    rows: list[dict[str, Any]] = []
    for r in results:
        if r["system"] != RADIXSERVE:
            continue
        base = keyed.get((TRANSFORMERS, r["workload"], r["dtype"]))
        hf_total = base["total_tok_s"] if base else None
        hf_out = base["out_tok_s"] if base else None
        # Same tokens on both sides, so a throughput ratio is the inverse ratio of the seconds.
        ours = r["all_seconds"]
        paired = [round(h / o, 3) for h, o in zip(base["all_seconds"], ours, strict=True)] if base else []
        rows.append(
            {
                "workload": r["workload"],
                "dtype": r["dtype"],
                "radixserve_total_tok_s": r["total_tok_s"],
                "transformers_total_tok_s": hf_total,
                "ratio_total": _ratio(r["total_tok_s"], hf_total),
                "radixserve_out_tok_s": r["out_tok_s"],
                "transformers_out_tok_s": hf_out,
                "ratio_out": _ratio(r["out_tok_s"], hf_out),
                "paired_ratios": paired,
                "ratio_paired": round(statistics.median(paired), 3) if paired else None,
            }
        )
    return rows


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Total tok/s = (input + output) / wall; W3 also shows decode (output) tok/s of one stream."""
    head = (
        f"{'workload':<8} {'dtype':<9} {'radixserve':>11} {'transformers':>12} {'ratio':>6} {'paired':>6}"
        f"   {'rs decode':>9} {'hf decode':>9} {'ratio':>6}"
    )
    lines = [
        "total tok/s ((in+out)/wall, median); decode tok/s for W3 only; "
        "paired: median of the per-repeat ratios",
        head,
        "-" * len(head),
    ]
    for r in rows:
        line = (
            f"{r['workload']:<8} {r['dtype']:<9} {_fmt(r['radixserve_total_tok_s']):>11} "
            f"{_fmt(r['transformers_total_tok_s']):>12} {_fmt(r['ratio_total'], '.2f'):>6}"
            f" {_fmt(r['ratio_paired'], '.2f'):>6}"
        )
        if r["workload"] == "W3":
            line += (
                f"   {_fmt(r['radixserve_out_tok_s']):>9} {_fmt(r['transformers_out_tok_s']):>9}"
                f" {_fmt(r['ratio_out'], '.2f'):>6}"
            )
        lines.append(line)
    return "\n".join(lines)


def run_benchmark(cfg: BenchConfig, log: Log = print) -> dict[str, Any]:
    """Run every (dtype, workload) on radixserve and on transformers, alternating repeat by repeat;
    return the full report."""
    cfg.validate()
    env = environment_info()
    log(
        f"radixserve bench: workloads={','.join(cfg.workloads)} dtypes={','.join(cfg.dtypes)} "
        f"repeats={cfg.repeats} scale={cfg.scale} cpu={env['cpu']!r} torch_threads={env['torch_threads']}"
    )
    results: list[dict[str, Any]] = []
    for dtype in cfg.dtypes:
        target = resolve_target(cfg, dtype)
        workloads = [make_workload(name, cfg.scale, target.vocab_limit) for name in cfg.workloads]
        log(f"model: {target.label} dtype={dtype}")
        baseline = cfg.baseline and target.hf_dir is not None and dtype != "auto"
        if cfg.baseline and not baseline:
            why = (
                "dtype auto is the server's own choice"
                if dtype == "auto"
                else "it is not a transformers directory"
            )
            log(f"  transformers baseline skipped for {target.label}: {why}")
        systems: list[RadixserveSystem | TransformersSystem] = []
        try:
            systems.append(RadixserveSystem(target, dtype, workloads, cfg))
            if baseline and target.hf_dir is not None:
                systems.append(TransformersSystem(target.hf_dir, dtype, cfg))
            results += _run_alternating(systems, dtype, workloads, cfg.repeats, log)
        finally:
            for system in systems:
                system.close()
    rows = compare(results)
    config = asdict(cfg)
    config["work_dir"] = str(cfg.work_dir)
    return {"config": config, "environment": env, "results": results, "comparisons": rows}


def _run_alternating(
    systems: list[RadixserveSystem | TransformersSystem],
    dtype: str,
    workloads: list[Workload],
    repeats: int,
    log: Log,
) -> list[dict[str, Any]]:
    """Each repeat runs every system once, so a slow spell of the machine hits them alike."""
    results: list[dict[str, Any]] = []
    for wl in workloads:
        for system in systems:
            system.warmup(wl)
        times: dict[str, list[float]] = {system.name: [] for system in systems}
        for rep in range(repeats):
            for system in systems:
                seconds, note = system.run(wl)
                times[system.name].append(seconds)
                log(f"  {system.name} {dtype} {wl.name} rep {rep}: {seconds:.2f}s {note}".rstrip())
        for system in systems:
            results.append(_median_result(system.name, dtype, wl, times[system.name], system.extra(wl)))
            log("RESULT " + json.dumps(results[-1]))
    return results


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

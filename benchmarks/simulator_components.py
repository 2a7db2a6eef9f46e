"""Where does a calibrated profile's error live? Each part of the engine's own prefills and extends
(linears, attention, norms, rotary embedding, activation, and the rest) timed in place
(simulator/components.py) on the calibration model and on the other model, beside the terms the
profile that simulator_validation.py fitted predicts for them.

    python benchmarks/simulator_components.py [--work bench-work] [--validation JSON] [--repeats 2]

The fit sets its parameters on whole runs' times, so a term may take up another's error and
still fit the calibration model. If it takes up an error that stays the same per token while its
own term grows with the model's width, it misprices a wider model (docs/simulator.md). Writes
WORK/simulator-components.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

from radixserve.config.server_args import ServerArgs
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.runner_config import RunnerConfig
from radixserve.models.source import load_model_config, resolve_model_source
from radixserve_tools.bench.model import ensure_random_llama_1b, ensure_random_smollm2
from radixserve_tools.simulator.components import ForwardParts, compare_parts, time_parts
from radixserve_tools.simulator.executor import ForwardRecord
from radixserve_tools.simulator.hardware import HardwareProfile
from radixserve_tools.simulator.replay import forward_kind
from radixserve_tools.simulator.trace import TraceRequest

# Prompts prefilled alone, and extends: 64 new tokens over a cached prefix of 512.
PROMPTS = (64, 256, 512)
PREFIX, EXTEND = 512, 64
# When the extend arrives: while its prefix's request still runs (it generates PREFIX_OUTPUT
# tokens), so that the extend follows with no idle spell between them, its prefix cached.
EXTEND_ARRIVAL_S, PREFIX_OUTPUT = 0.02, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--validation", type=Path, help="its JSON (default: WORK/simulator-validation.json)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    args = parser.parse_args()
    validation = json.loads((args.validation or args.work / "simulator-validation.json").read_text())
    profile = HardwareProfile.from_dict(validation["profile"])
    out: dict[str, object] = {"profile": dataclasses.asdict(profile)}
    models = {
        "calibration model": ensure_random_smollm2(args.work, "bfloat16"),
        "other model": ensure_random_llama_1b(args.work),
    }
    for name, path in models.items():
        flags = {"dtype": "bfloat16", "max_total_tokens": args.max_total_tokens, "log_level": "warning"}
        server_args = ServerArgs(model_path=str(path), **flags)
        config = load_model_config(resolve_model_source(str(path)))
        runner = ModelRunner(RunnerConfig.from_server_args(server_args))
        try:
            timed = _time(server_args, runner, args.repeats)
        finally:
            runner.close()
        kinds: dict[str, list[tuple[ForwardRecord, ForwardParts]]] = {}
        for pair in timed:
            if not pair[0].shape.decode:
                kinds.setdefault(forward_kind(pair[0]), []).append(pair)
        by_kind: dict[str, list[dict[str, object]]] = {}
        out[name] = by_kind
        for kind, pairs in kinds.items():
            rows = compare_parts(config, profile, pairs)
            print(f"\n{name} ({path.name}), {len(pairs)} forwards: {kind}")
            print("| part | measured s | predicted s | error |\n|---|---|---|---|")
            for row in rows:
                print(f"| {row.part} | {row.measured_s:.3f} | {row.predicted_s:.3f} | {row.error:+.1%} |")
            by_kind[kind] = [dataclasses.asdict(row) for row in rows]
    path = args.work / "simulator-components.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}")


def _time(args: ServerArgs, runner: ModelRunner, repeats: int) -> list[tuple[ForwardRecord, ForwardParts]]:
    """Each prompt of PROMPTS alone, and an extend over a cached prefix, `repeats` times each."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    timed = []
    for _ in range(repeats):
        for length in PROMPTS:
            timed += time_parts(args, [TraceRequest(0.0, tokens(length), 1)], runner)
        prefix = tokens(PREFIX)
        trace = [
            TraceRequest(0.0, prefix + tokens(1), PREFIX_OUTPUT),
            TraceRequest(EXTEND_ARRIVAL_S, prefix + tokens(EXTEND), 1),
        ]
        timed += time_parts(args, trace, runner)
    return timed


if __name__ == "__main__":
    main()

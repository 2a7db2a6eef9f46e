"""Command line: `radixserve serve | generate | bench | simulate`."""

from __future__ import annotations

import argparse
import json
import sys

from radixserve.config.server_args import ServerArgs


def _generate(args: argparse.Namespace) -> int:
    from radixserve.runtime.engine import Engine

    server_args = ServerArgs.from_cli_args(args)
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    engine = Engine(**{k: v for k, v in server_args.to_dict().items()})
    try:
        if args.chat:
            ids = engine.tokenize_chat([{"role": "user", "content": args.prompt}])
            result = engine.generate(input_ids=ids, sampling_params=params)
        else:
            result = engine.generate(args.prompt, params)
        assert isinstance(result, dict)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(result["text"])
        engine.check_kv_invariant()
    finally:
        engine.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from radixserve.protocol.ipc import exit_after_clean_stop
    from radixserve.server.serve import serve

    # serve() returns once the engine and its children have stopped and their files are closed.
    exit_after_clean_stop(serve(ServerArgs.from_cli_args(args)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="LLM serving engine with a radix prefix cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI-compatible and native API)",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
        "/generate and the control routes. Binds to 127.0.0.1:30000 unless told otherwise.",
    )
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="complete one prompt with the offline engine and print the text")
    gen.add_argument("prompt")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result with meta_info")
    ServerArgs.add_cli_args(gen, http=False)
    gen.set_defaults(func=_generate)

    from radixserve_tools.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from radixserve_tools.simulator.cli import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from radixserve.config.server_args import InvalidArgumentError
    from radixserve.models.config import ModelLoadError
    from radixserve.protocol.sampling_params import InvalidRequestError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (InvalidArgumentError, InvalidRequestError, ModelLoadError) as exc:
        # A usage problem, not a crash: one line the user can act on, argparse's exit code.
        parser.exit(2, f"radixserve: error: {exc}\n")
    return result


if __name__ == "__main__":
    sys.exit(main())

"""The multi-LoRA flags (SGLang's names), their checks and their command-line form.

--lora-paths takes adapters in SGLang's three forms: PATH (named after its directory), NAME=PATH,
or a JSON object {"lora_name": ..., "lora_path": ...}. Giving any turns --enable-lora on, as in
SGLang. --max-lora-rank and --lora-target-modules size the adapter pool: when not given they come
from the adapters named at startup (which must then be at least one)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# The projections an adapter may target (PEFT's module names for the Llama family).
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
DEFAULT_MAX_LORAS_PER_BATCH = 8


@dataclass(frozen=True)
class LoraRef:
    """An adapter to load: the name requests use, and its PEFT directory."""

    name: str
    path: str


class LoraFields(Protocol):
    enable_lora: bool
    lora_paths: list[str] | None
    max_loras_per_batch: int
    max_lora_rank: int | None
    lora_target_modules: list[str] | None


def parse_lora_ref(spec: str, error: type[ValueError]) -> LoraRef:
    """One --lora-paths entry: PATH, NAME=PATH, or {"lora_name": NAME, "lora_path": PATH}."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            fields = json.loads(spec)
            return LoraRef(str(fields["lora_name"]), str(fields["lora_path"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise error(f"--lora-paths {spec!r}: not a JSON object with lora_name and lora_path") from exc
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).name, spec
    if not name or not path:
        raise error(f"--lora-paths {spec!r}: expected PATH, NAME=PATH or a JSON object")
    return LoraRef(name, path)


def lora_refs(lora_paths: list[str] | None, error: type[ValueError]) -> list[LoraRef]:
    refs = [parse_lora_ref(spec, error) for spec in lora_paths or []]
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise error(
            f"--lora-paths names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
        )
    return refs


def validate_lora_args(args: LoraFields, error: type[ValueError]) -> None:
    refs = lora_refs(args.lora_paths, error)
    if refs:
        args.enable_lora = True
    if not args.enable_lora:
        return
    if args.max_loras_per_batch < 1:
        raise error("--max-loras-per-batch must be >= 1")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise error("--max-lora-rank must be >= 1")
    if args.lora_target_modules is not None:
        modules = (
            list(LORA_TARGET_MODULES) if args.lora_target_modules == ["all"] else args.lora_target_modules
        )
        unknown = sorted(set(modules) - set(LORA_TARGET_MODULES))
        if unknown:
            raise error(
                f"--lora-target-modules: {unknown} are not among {', '.join(LORA_TARGET_MODULES)} (or all)"
            )
        args.lora_target_modules = [m for m in LORA_TARGET_MODULES if m in modules]
    if not refs and (args.max_lora_rank is None or args.lora_target_modules is None):
        raise error("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    group.add_argument(
        "--lora-paths", nargs="+", metavar="ADAPTER",
        help="adapters to load at startup: PATH, NAME=PATH, or a JSON object with lora_name and lora_path",
    )  # fmt: skip
    group.add_argument(
        "--max-loras-per-batch", type=int,
        help="adapters one batch may use, and so the adapter slots kept in the device pool",
    )  # fmt: skip
    group.add_argument(
        "--max-lora-rank", type=int,
        help="the largest adapter rank the pool holds (default: the largest of --lora-paths)",
    )  # fmt: skip
    group.add_argument(
        "--lora-target-modules", nargs="+", metavar="MODULE",
        help=f"projections adapters may target: {', '.join(LORA_TARGET_MODULES)} or all "
        "(default: those --lora-paths target)",
    )  # fmt: skip

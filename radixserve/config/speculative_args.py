"""The speculative decoding flags (SGLang's names), their checks and their command-line form.

Kept apart from server_args.py, which holds the fields: one group of related knobs per module."""

from __future__ import annotations

import argparse
from typing import Protocol

SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("NGRAM", "STANDALONE")
# Drafts a STANDALONE model proposes per request per step when --speculative-num-steps is not given.
DEFAULT_DRAFT_MODEL_STEPS = 4
NGRAM_MATCH_TYPES: tuple[str, ...] = ("BFS", "PROB")


class SpeculativeFields(Protocol):
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_ngram_min_bfs_breadth: int
    speculative_ngram_max_bfs_breadth: int
    speculative_ngram_match_type: str
    speculative_ngram_branch_length: int
    speculative_ngram_capacity: int
    enable_deterministic_inference: bool


def validate_speculative_args(args: SpeculativeFields, error: type[ValueError]) -> None:
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return
    if algorithm.upper() in ("EAGLE", "EAGLE3", "NEXTN"):
        raise error(
            f"--speculative-algorithm {algorithm} needs a trained draft head, which radixserve does not "
            "run; use STANDALONE with a small model of the same tokenizer, or NGRAM"
        )
    if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        raise error(
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got {algorithm!r}"
        )
    args.speculative_algorithm = algorithm.upper()
    if args.speculative_algorithm == "STANDALONE":
        _validate_draft_model_args(args, error)
    elif args.speculative_draft_model_path is not None:
        raise error("--speculative-draft-model-path is for --speculative-algorithm STANDALONE")
    if args.speculative_num_draft_tokens < 2:
        raise error("--speculative-num-draft-tokens must be >= 2 (the last token and at least one draft)")
    low, high = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= low <= high:
        raise error("--speculative-ngram-min/max-match-window-size need 1 <= min <= max")
    if not 1 <= args.speculative_ngram_min_bfs_breadth <= args.speculative_ngram_max_bfs_breadth:
        raise error("--speculative-ngram-min/max-bfs-breadth need 1 <= min <= max")
    if args.speculative_ngram_match_type.upper() not in NGRAM_MATCH_TYPES:
        raise error(f"--speculative-ngram-match-type must be one of {', '.join(NGRAM_MATCH_TYPES)}")
    args.speculative_ngram_match_type = args.speculative_ngram_match_type.upper()
    if args.speculative_ngram_branch_length < 1 or args.speculative_ngram_capacity < 2:
        raise error("--speculative-ngram-branch-length must be >= 1 and --speculative-ngram-capacity >= 2")
    if args.enable_deterministic_inference:
        raise error(
            "--enable-deterministic-inference does not combine with speculative decoding yet: a verify "
            "step computes a request's tokens in another order than a decode step"
        )


def _validate_draft_model_args(args: SpeculativeFields, error: type[ValueError]) -> None:
    """STANDALONE drafts a chain: --speculative-num-steps tokens, so the verified chain holds that
    many plus the last sampled token (--speculative-num-draft-tokens follows from it, as in SGLang
    with a top-k of 1)."""
    if not args.speculative_draft_model_path:
        raise error("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")
    steps = args.speculative_num_steps
    if steps is None:
        steps = DEFAULT_DRAFT_MODEL_STEPS
    if steps < 1:
        raise error(f"--speculative-num-steps must be >= 1, got {steps}")
    args.speculative_num_steps = steps
    args.speculative_num_draft_tokens = steps + 1


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-algorithm",
        help="NGRAM: draft from n-grams of the requests' own and recent text; STANDALONE: a smaller "
        "model with the same tokenizer drafts (--speculative-draft-model-path); verified in one forward",
    )
    spec.add_argument(
        "--speculative-draft-model-path",
        help="STANDALONE: the draft model (a directory, a .gguf file or a hub id in the local cache)",
    )
    spec.add_argument(
        "--speculative-num-steps",
        type=int,
        help="STANDALONE: tokens the draft model proposes per request per step "
        f"(default {DEFAULT_DRAFT_MODEL_STEPS})",
    )
    spec.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        help="NGRAM: tokens verified per request per step, the last sampled one included "
        "(STANDALONE: --speculative-num-steps + 1)",
    )
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int)
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int)
    spec.add_argument("--speculative-ngram-min-bfs-breadth", type=int)
    spec.add_argument("--speculative-ngram-max-bfs-breadth", type=int)
    spec.add_argument("--speculative-ngram-match-type", help="BFS or PROB")
    spec.add_argument("--speculative-ngram-branch-length", type=int, help="the deepest a draft tree grows")
    spec.add_argument("--speculative-ngram-capacity", type=int, help="n-grams the shared index keeps")
    spec.add_argument(
        "--disable-speculative-adaptive",
        action="store_true",
        help="draft whatever the index offers, not only the tokens likely enough to pay for their "
        "verification on this machine",
    )

"""argparse types the command lines share: a bad value is one error line and exit code 2, as for
any other bad flag."""

from __future__ import annotations

import argparse


def positive_int(spec: str) -> int:
    value = int(spec)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {spec}")
    return value


def positive_float(spec: str) -> float:
    value = float(spec)  # accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {spec}")
    return value

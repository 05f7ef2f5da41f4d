"""argparse `type=` functions for the commands' counts and amounts: a value out of range is a usage error (exit 2)
naming the flag and what it takes, raised while the arguments are parsed, before anything is probed or measured."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole_number(minimum: int = 1) -> Callable[[str], int]:
    """A whole number >= `minimum` (1 for counts; 0 where none is meaningful)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: expected a whole number >= {minimum}")
        return value

    return parse


def whole_numbers(minimum: int = 1) -> Callable[[str], list[int]]:
    """A comma list of whole numbers, each >= `minimum`, at least one."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of whole numbers >= {minimum}, "
                                             "e.g. 1,8,64")
        return values

    return parse


def number(minimum: float = 0.0, *, inclusive: bool = True) -> Callable[[str], float]:
    """A finite number >= `minimum` (> `minimum` when not `inclusive`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text}: expected a number {'>=' if inclusive else '>'} {minimum:g}")
        return value

    return parse

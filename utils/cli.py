"""The scripts' command lines: a flag whose value means nothing (a negative step count, a rank of 0) is refused by
argparse, in one line that says what is allowed, before any model loads."""

from __future__ import annotations

import argparse
import math


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (exit status 2): what was wrong and what is allowed."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def at_least(minimum: int | float, why: str = "", strict: bool = False):
    """An argparse `type`: a finite number >= minimum (> minimum when `strict`), an int when `minimum` is an int.
    `why` is added to the refusal, e.g. "0 only evaluates the starting model"."""
    kind = type(minimum)
    wanted = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {minimum}"
    wanted += f" ({why})" if why else ""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text}")
        return value

    return parse


def above(minimum: float, why: str = ""):
    """An argparse `type`: a finite number > minimum."""
    return at_least(minimum, why, strict=True)

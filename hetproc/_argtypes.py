"""Checked command-line values: argparse ``type=`` functions shared by every CLI command
(``hetproc.cli`` and the model commands of ``hetproc.delegate``), so one mistake reads the
same wherever it is made: a whole line naming the value and the range it missed."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ._config import TIME_SCALE_RANGE


def time_scale(text: str) -> float:
    """A finite ``--time-scale`` within ``TIME_SCALE_RANGE``."""
    lo, hi = TIME_SCALE_RANGE
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise argparse.ArgumentTypeError(f"{text} is outside {lo} .. {hi}")
    return x


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """A whole number in ``lo .. hi``."""
    def check(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is outside {lo} .. {hi}")
        return n
    return check


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not >= 1")
    return n

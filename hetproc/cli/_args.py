"""Arguments several commands share: the platform, its time scale and clock, --json."""

from __future__ import annotations

import argparse
from typing import Any

from .._argtypes import int_in, time_scale
from .._config import CLOCKS, TIE_SEED_MAX, TIME_SCALE_RANGE


def platform_args(p: argparse.ArgumentParser, *, clock: bool = False) -> None:
    """--platform and --time-scale; ``clock``: --clock too (the commands that take it)."""
    lo, hi = TIME_SCALE_RANGE
    p.add_argument("--platform", metavar="FILE", help="platform TOML or 'i915' (default: built-in)")
    p.add_argument("--time-scale", type=time_scale, metavar="X",
                   help=f"multiply every modeled duration ({lo} .. {hi}; 0.2 runs five "
                        "times faster than real time)")
    if clock:
        p.add_argument("--clock", choices=CLOCKS,
                       help="real: the host's clock; virtual: modeled time jumps to the next "
                            "event once everything waits (default: the platform file's)")


def json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def tie_seed_arg(p: argparse.ArgumentParser, flag: str, text: str, **kw: Any) -> None:
    """A tie seed flag (the platform key ``tie_seed``'s range)."""
    p.add_argument(flag, type=int_in(0, TIE_SEED_MAX), metavar="S", help=text, **kw)

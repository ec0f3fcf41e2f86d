"""Small statistics and table helpers for the benchmarks.

Pure Python on purpose: the harness must stay importable and cheap even when
a benchmark only has a handful of samples, and we want the exact same
percentile definition for baselines and product figures so ratios compare
like with like.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO


def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (same definition as numpy's default).

    ``sorted_vals`` must already be sorted; ``q`` is in [0, 100].
    """
    if not sorted_vals:
        raise ValueError("percentile of an empty sample")
    if len(sorted_vals) == 1:
        return float(sorted_vals[0])
    pos = (len(sorted_vals) - 1) * (q / 100.0)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    frac = pos - lo
    return float(sorted_vals[lo]) * (1.0 - frac) + float(sorted_vals[hi]) * frac


def summarize(samples_ns: Iterable[float]) -> dict:
    """Summarise nanosecond samples in microseconds.

    Returns ``{"p50_us", "p99_us", "mean_us", "n"}`` plus min/max, which are
    handy when judging how noisy a run was.
    """
    vals = sorted(samples_ns)
    if not vals:
        raise ValueError("summarize() needs at least one sample")
    n = len(vals)
    return {
        "p50_us": percentile(vals, 50) / 1e3,
        "p99_us": percentile(vals, 99) / 1e3,
        "mean_us": (sum(vals) / n) / 1e3,
        "min_us": vals[0] / 1e3,
        "max_us": vals[-1] / 1e3,
        "n": n,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either side is missing or ``b`` is not positive.

    None (rather than inf/nan) keeps JSON output valid and makes "no
    baseline" explicit in the table.
    """
    if a is None or b is None:
        return None
    try:
        a = float(a)
        b = float(b)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(a) or not math.isfinite(b) or b <= 0.0:
        return None
    return a / b


def format_us(us: float | None) -> str:
    """Human unit for a duration given in microseconds (us / ms / s)."""
    if us is None:
        return "-"
    us = float(us)
    if abs(us) < 10:
        return f"{us:.2f} us"
    if abs(us) < 1e3:
        return f"{us:.1f} us"
    if abs(us) < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.3f} s"


def format_table(rows: Sequence[Sequence[str]], headers: Sequence[str],
                 right_align: Iterable[int] = ()) -> str:
    """Render string cells as aligned columns separated by two spaces."""
    right = set(right_align)
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            out.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def print_table(rows: Sequence[Sequence[str]], headers: Sequence[str],
                right_align: Iterable[int] = (), file: TextIO | None = None) -> None:
    print(format_table(rows, headers, right_align), file=file or sys.stdout, flush=True)

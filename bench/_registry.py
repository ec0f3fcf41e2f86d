"""Benchmark registry shared by the raw baselines and the product benchmarks.

A benchmark is ``fn(quick: bool) -> dict`` registered with ``@benchmark(name)``.
The returned dict must hold ``"rows"``: a list of row dicts as built by
``make_row`` (keys: metric, value_us, baseline_us, ratio, target, ok).  Any
other keys (summaries, sizes, ...) are kept verbatim in ``--json`` output.
Rows for non-duration figures may use ``value``/``baseline`` plus ``unit``
instead of the ``*_us`` keys.

Product benchmarks live in ``bench/bench_*.py``; ``python -m bench`` imports
every such module, so registering is just decorating a function there.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ._stats import ratio

BenchFn = Callable[[bool], dict]

# Insertion-ordered: the harness runs benchmarks in registration order
# (baselines first, then product modules in file-name order).
BENCHMARKS: dict[str, BenchFn] = {}


def benchmark(name: str) -> Callable[[BenchFn], BenchFn]:
    """Register ``fn(quick) -> {"rows": [...], ...}`` under ``name``."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"bad benchmark name {name!r}")

    def deco(fn: BenchFn) -> BenchFn:
        if name in BENCHMARKS and BENCHMARKS[name] is not fn:
            raise ValueError(f"benchmark {name!r} registered twice")
        BENCHMARKS[name] = fn
        return fn

    return deco


_TARGET_RE = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)\s*x?\s*$")


def check_target(r: float | None, target: str | None) -> bool | None:
    """Evaluate a target like ``"<= 1.3x"`` against ratio ``r``.

    Returns None when there is nothing to judge (no ratio, no target, or a
    free-text target the harness cannot parse).
    """
    if r is None or not target:
        return None
    m = _TARGET_RE.match(target)
    if not m:
        return None
    op, bound = m.group(1), float(m.group(2))
    return {"<=": r <= bound, ">=": r >= bound, "<": r < bound, ">": r > bound}[op]


def make_row(metric: str, value_us: float | None, baseline_us: float | None = None,
             target: str | None = None, ok: bool | None = None, **extra) -> dict:
    """Build a row; ``ratio`` = value/baseline and ``ok`` from ``target``.

    Pass ``ok`` explicitly to override the parsed target (e.g. targets that
    are not simple ratio bounds).  ``extra`` keys are carried through.
    """
    r = ratio(value_us, baseline_us)
    if ok is None:
        ok = check_target(r, target)
    row = {
        "metric": metric,
        "value_us": value_us,
        "baseline_us": baseline_us,
        "ratio": r,
        "target": target,
        "ok": ok,
    }
    row.update(extra)
    return row

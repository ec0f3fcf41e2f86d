"""What one trace record costs the process that writes it.

The trace is meant to stay on, so its price per record is the figure that matters: it is
measured here on a ring in an anonymous shared mapping (the same kind of memory a POSIX
shm segment is), next to the cost of calling an empty Python function with the same
arguments, because on a noisy shared machine only the ratio is stable.

Run: ``python -m bench._trace_bench [N]`` from the repo root.
"""

from __future__ import annotations

import mmap
import sys
import time

from ipc import Stage, TraceRing

_CAPACITY = 1 << 14


def _per_call_ns(fn, n: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` mean ns per ``fn(stage, cid, track, a0)`` call, loop included."""
    stage = int(Stage.EXEC)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(n):
            fn(stage, 42, 3, i)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def emit_cost_ns(n: int = 200_000) -> dict[str, float]:
    """Mean ns per record: ``enabled``, ``disabled`` and the ``empty_call`` baseline."""

    def empty(stage, cid=0, track=0, a0=0, a1=0, a2=0, t_ns=None):
        return None

    mem = mmap.mmap(-1, TraceRing.nbytes(_CAPACITY))
    ring = TraceRing(memoryview(mem), create=True, capacity=_CAPACITY)
    try:
        out = {"empty_call": _per_call_ns(empty, n)}
        out["enabled"] = _per_call_ns(ring.begin, n)
        ring.enabled = False
        out["disabled"] = _per_call_ns(ring.begin, n)
        return out
    finally:
        ring.close()
        mem.close()


def main(argv: list[str]) -> None:
    n = int(argv[1]) if len(argv) > 1 else 200_000
    r = emit_cost_ns(n)
    print(
        f"trace emit: enabled {r['enabled']:.0f} ns/record, disabled {r['disabled']:.0f} ns, "
        f"empty Python call {r['empty_call']:.0f} ns ({r['enabled'] / r['empty_call']:.1f}x)"
    )


if __name__ == "__main__":
    main(sys.argv)

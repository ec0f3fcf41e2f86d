"""Queue commands with operands against queue no-ops and the supervisor's path, one run.

``queue_operands`` (``python -m bench --only queue_operands``)
    Batches of 64 at depth 4 on ``gpu0`` (coherent: no cache maintenance is modeled, so
    every figure is the per-command overhead), each path in turn, in rounds alternating
    with the raw shm ring with a doorbell:

    * queue no-op           ``Queue.submit_many([0.0] * 64)``
    * queue work, 2 buffers ``Queue.submit_many([command("work", [x], [y], ms=0)] * 64)``:
                            both operands resolved against the binding table, checked,
                            modeled (default watchdog), traced, mapped on the device
    * queue copy 4 KiB      the same with a real kernel (numpy copies 4 KiB)
    * supervisor work, 2 buffers / no-op: ``Context.submit_many(..., nowait=True)``

    For each: commands/s (and its ratio to the raw ring of the same round), CPU per
    command in the supervisor, the device and the client (schedstat / process time),
    and the operand path's ratios to the queue no-op. Targets (issue 22): queue commands
    with operands >= 60k/s and >= 0.2x the ring; CPU per command <= 1.5x a queue no-op.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import hetproc

from . import _baselines, _raw
from ._registry import benchmark, make_row
from .bench_core import _platform, _wait
from .bench_fastpath import cpu_ns

_DEVICE = "gpu0"
_SIZES = {"batches": (12, 60), "rounds": (2, 3)}  # (quick, full)
TPUT_TARGET = 60_000.0
RING_RATIO = 0.2
CPU_RATIO = 1.5


def _run(submit: Callable[[int], list], batches: int, batch: int = 64,
         depth: int = 4) -> float:
    """Seconds for ``batches`` batches, ``depth`` in flight, each retired at its last
    fence (a queue runs in order) with its fences released."""
    inflight: list[list] = []
    t0 = time.monotonic_ns()
    for _ in range(batches):
        inflight.append(submit(batch))
        if len(inflight) >= depth:
            _retire(inflight.pop(0))
    while inflight:
        _retire(inflight.pop(0))
    return (time.monotonic_ns() - t0) / 1e9


def _retire(fences: list) -> None:
    _wait(fences[-1], None, "last fence of a batch", timeout=60.0)
    for f in fences:
        f.release()


def _measure(submit: Callable[[int], list], batches: int, sup: int, dev: int,
             client: hetproc.Client) -> dict[str, float]:
    s0, d0, c0 = cpu_ns(sup), cpu_ns(dev), time.process_time_ns()
    elapsed = _run(submit, batches)
    client.ping()
    s1, d1, c1 = cpu_ns(sup), cpu_ns(dev), time.process_time_ns()
    n = batches * 64
    return {"rate": n / elapsed, "supervisor": (s1 - s0) / n / 1e3,
            "device": (d1 - d0) / n / 1e3, "client": (c1 - c0) / n / 1e3}


def _paths(ctx: hetproc.Context, q: hetproc.Queue, x: hetproc.Buffer,
           y: hetproc.Buffer) -> dict[str, Callable[[int], list]]:
    work = hetproc.command("work", [x], [y], ms=0)
    copy = hetproc.command("copy", [x], [y], ms=0)
    noop = hetproc.command("work", ms=0)
    return {
        "queue no-op": lambda n: q.submit_many([0.0] * n),
        "queue work, 2 buffers": lambda n: q.submit_many([work] * n),
        "queue copy 4 KiB": lambda n: q.submit_many([copy] * n),
        "supervisor work, 2 buffers": lambda n: ctx.submit_many([work] * n, nowait=True),
        "supervisor no-op": lambda n: ctx.submit_many([noop] * n, nowait=True),
    }


@benchmark("queue_operands")
def bench_queue_operands(quick: bool) -> dict:
    batches = _SIZES["batches"][0 if quick else 1]
    results: dict[str, list[dict[str, float]]] = {}
    ring: list[float] = []
    with _platform() as (plat, states):
        c = plat.client
        ctx = c.context(_DEVICE)
        x, y = c.alloc((1024,), "float32"), c.alloc((1024,), "float32")
        with ctx.queue(slots=4096) as q:
            paths = _paths(ctx, q, x, y)
            for submit in paths.values():  # warm-up: bindings, fence pool, rings
                _run(submit, 4)
            sup, dev = c.supervisor_pid, states.pid(_DEVICE)
            for r in range(_SIZES["rounds"][0 if quick else 1]):
                ring.append(_raw.ring_throughput(_baselines.size("ring_n", quick))["msgs_per_s"])
                order = list(paths.items())
                for name, submit in (order if r % 2 == 0 else order[::-1]):
                    results.setdefault(name, []).append(_measure(submit, batches, sup, dev, c))
    return _rows(results, statistics.median(ring))


def _rows(results: dict[str, list[dict[str, float]]], ring: float) -> dict[str, Any]:
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
           for name, runs in results.items()}
    noop = med["queue no-op"]
    rows = []
    for name, m in med.items():
        judged = name == "queue work, 2 buffers"
        ok = m["rate"] >= TPUT_TARGET and m["rate"] >= RING_RATIO * ring
        rows.append(dict(make_row(
            f"{name}: throughput, batches of 64", None,
            target=f">= {TPUT_TARGET / 1000:.0f}k/s, >= {RING_RATIO}x ring" if judged else None,
            ok=ok if judged else None), value=m["rate"], baseline=ring, ratio=m["rate"] / ring,
            unit="/s"))
        for proc in ("supervisor", "device", "client"):
            rows.append(make_row(f"{name}: CPU per cmd, {proc} (vs queue no-op)", m[proc],
                                 noop[proc] if proc != "supervisor" else None))
        total, base = (m["device"] + m["client"] + m["supervisor"],
                       noop["device"] + noop["client"] + noop["supervisor"])
        rows.append(make_row(f"{name}: CPU per cmd, all processes (vs queue no-op)", total, base,
                             target=f"<= {CPU_RATIO}x" if judged else None))
    return {"rows": rows, "paths": med, "ring": ring}

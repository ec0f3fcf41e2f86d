"""What the synchronisation hazard check costs the supervisor (``hetproc.supervisor._hazards``).

``hazards`` (``python -m bench --only hazards``)
    Two platforms side by side, one with ``hazards = "error"`` (the default) and one with
    ``"off"``, the same workload on each in alternating rounds: batches of 64 ``work``
    commands on one gpu0 context, each reading a shared weight buffer and the previous
    command's output and writing its own (so every check finds a writer and readers
    unfinished, ordered by the context). The figure is the supervisor's CPU per command
    (schedstat), the best round of each; the ratio on/off is the check's price on a
    command with operands. Commands without operands skip the check entirely
    (``--only fastpath`` measures those). Target: <= 1.15x.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import hetproc

from ._registry import benchmark, make_row
from .bench_core import _platform, _wait
from .bench_fastpath import cpu_ns

_BATCH, _DEPTH = 64, 4
_SIZES = {"rounds": (2, 5), "batches": (10, 40)}  # (quick, full)


def _run(plat: hetproc.Platform, bufs: list, batches: int) -> float:
    """Supervisor CPU us per command over ``batches`` batches in flight ``_DEPTH`` deep."""
    c = plat.client
    ctx = c.context("gpu0")
    weights, a, b = bufs
    inflight: collections.deque = collections.deque()
    s0 = cpu_ns(plat.pid)
    for _ in range(batches):
        cmds = [hetproc.command("work", [weights, a if i % 2 else b], [b if i % 2 else a], ms=0)
                for i in range(_BATCH)]
        inflight.append(ctx.submit_many(cmds, nowait=True))
        if len(inflight) >= _DEPTH:
            _retire(inflight.popleft())
    while inflight:
        _retire(inflight.popleft())
    c.ping()
    s1 = cpu_ns(plat.pid)
    ctx.close()
    return (s1 - s0) / (batches * _BATCH) / 1e3


def _retire(fences: list) -> None:
    _wait(fences[-1], None, "last fence of a batch", timeout=60.0)
    for f in fences:
        f.release()


@benchmark("hazards")
def bench_hazards(quick: bool) -> dict:
    rounds, batches = (_SIZES[k][0 if quick else 1] for k in ("rounds", "batches"))
    base = hetproc.load_platform()
    best = {"error": float("inf"), "off": float("inf")}
    with _platform(dataclasses.replace(base, hazards="error")) as (on, _), \
            _platform(dataclasses.replace(base, hazards="off")) as (off, _):
        plats = {"error": on, "off": off}
        bufs = {m: [p.client.alloc(1024) for _ in range(3)] for m, p in plats.items()}
        for m in plats:  # warm-up: the fence table's semaphores, the first maps
            _run(plats[m], bufs[m], 4)
        for _ in range(rounds):
            for m in ("error", "off"):
                best[m] = min(best[m], _run(plats[m], bufs[m], batches))
                time.sleep(0.05)
        found = on.client.metrics()["hazards"]
    rows = [make_row("supervisor CPU per command with 3 operands, hazards on vs off",
                     best["error"], best["off"], target="<= 1.15x")]
    return {"rows": rows, "us_per_cmd": best, "hazards_found": found["found"],
            "checked": found["checked"]}

"""What checking every client's request costs (issue "every client is untrusted").

``validation``
    The supervisor checks every field of every request before a handler runs
    (``hetproc.supervisor._validation.check_request``: ranges, size caps, durations; for
    a submit, each command's schema and values in one pass). Measured in-process on the
    packets a client sends for a one-command submit and for a batch of 256, against
    ``ipc.decode`` of the same packet (unpack plus schema), which every request paid
    already. The ratio is the added cost relative to decoding; no target: the figure is
    for the note, and a regression shows as a jump between runs.

``doorbell_flood``
    A queue client may post its device's doorbell as often as it likes; the device takes
    every post made so far in one step (``device_workers._worker``), so a post with
    nothing written costs it a trywait, not a loop turn. Measured as the device process's
    CPU time (``/proc/<pid>/stat``) per empty post, against its CPU time per honest
    zero-duration queue record; no target (each post used to cost a whole loop turn:
    0.35x against a record, 0.01x now).
"""

from __future__ import annotations

import functools
import os
import time

from hetproc import _protocol
from hetproc._config import load_platform
from hetproc.supervisor._validation import check_request
from ipc import decode, encode

from ._registry import benchmark, make_row

_CMD = {"kernel": "relu", "ins": [1 << 32 | 1], "outs": [1 << 32 | 2], "wait": [],
        "cid": (1 << 40) | (1 << 39) | 7, "signal": 1 << 32 | 3, "ms": 0.5}


def _best_us(fn, n: int, rounds: int = 5) -> float:
    """Best of ``rounds`` timings of ``n`` calls, per call: the machine's quiet moment."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


@benchmark("validation")
def bench_validation(quick: bool) -> dict:
    limits = load_platform().limits
    n = 2000 if quick else 20000
    rows = []
    for label, cmds in (("1-command submit", 1), ("per command, batch of 256", 256)):
        frame = encode({"op": "submit", "id": 9, "ctx": 1 << 32, "cmds": [dict(_CMD)] * cmds})
        msg = decode(frame, _protocol.REQUESTS)
        calls = max(10, n // cmds)
        check_us = _best_us(functools.partial(check_request, msg, limits), calls) / cmds
        decode_us = _best_us(functools.partial(decode, frame, _protocol.REQUESTS), calls) / cmds
        rows.append(make_row(f"request check, {label}, vs its decode", check_us, decode_us))
    return {"rows": rows}


def _cpu_s(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _settled_cpu_s(pid: int) -> float:
    """The CPU time once the process stopped spending it (its work is done)."""
    last = _cpu_s(pid)
    while True:
        time.sleep(0.3)
        now = _cpu_s(pid)
        if now == last:
            return now
        last = now


@benchmark("doorbell_flood")
def bench_doorbell_flood(quick: bool) -> dict:
    import hetproc
    posts, records = (50_000, 2_000) if quick else (200_000, 10_000)
    with hetproc.Platform(time_scale=1.0) as plat:
        client = plat.client
        pid = client.metrics()["devices"]["npu0"]["pid"]
        with client.context("npu0").queue(slots=1024) as q:
            t0 = _settled_cpu_s(pid)
            for _ in range(posts):
                q._doorbell.release()
            per_post = (_settled_cpu_s(pid) - t0) / posts
            t0 = _settled_cpu_s(pid)
            for _ in range(records // 500):
                fences = q.submit_many([0.0] * 500)
                fences[-1].wait(30.0)
            per_record = (_settled_cpu_s(pid) - t0) / records
    return {"rows": [make_row("device CPU per empty doorbell post, vs per queue record",
                              per_post * 1e6, per_record * 1e6)]}

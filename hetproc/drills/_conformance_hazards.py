"""The conformance cases of synchronisation hazards (seed §4, §5): Vulkan's
synchronisation validation names three (``SYNC-HAZARD-READ-AFTER-WRITE``,
``-WRITE-AFTER-READ``, ``-WRITE-AFTER-WRITE``); each case here acts one out across two
devices sharing one buffer with no fence between them, and checks that the supervisor
refuses it (``SyncHazard`` naming the buffer, the other command and the fence that was
missing), and that the same program with that fence is served with the right data.
Registered with ``_conformance_cases.case``; ``_conformance`` imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ipc import errors

from ..client import sleep
from ._conformance_cases import CaseRun, case

SUITE = "Vulkan synchronization validation"
# What the first command does, what the second one does (unordered, then fenced), and
# what the buffer must hold once the fenced program ran.
Program = Callable[[CaseRun, list, Any, list], tuple[Any, Callable[[list], Any], float]]


def _read_after_write(c: CaseRun, bufs: list, gate: Any, out: list) -> tuple:
    """npu0 writes ``buf`` for 30 modeled ms; gpu0 reads it."""
    buf, src, dst = bufs
    npu, gpu = c.client.context("npu0", name="writer"), c.client.context("gpu0", name="reader")
    out += [npu, gpu]
    src.array()[...] = 4.0
    first = npu.submit("relu", [src], [buf], wait=[gate], ms=30)
    return first, lambda wait: gpu.submit("scale", [buf], [dst], wait=wait,
                                          params={"factor": 1.0}), 4.0


def _write_after_read(c: CaseRun, bufs: list, gate: Any, out: list) -> tuple:
    """npu0 reads ``buf`` for 30 modeled ms; cpu0 overwrites it."""
    buf, _, dst = bufs
    npu, cpu = c.client.context("npu0", name="reader"), c.client.context("cpu0", name="writer")
    out += [npu, cpu]
    first = npu.submit("relu", [buf], [dst], wait=[gate], ms=30)
    return first, lambda wait: cpu.submit("fill", [], [buf], wait=wait,
                                          params={"value": 5.0}), 5.0


def _write_after_write(c: CaseRun, bufs: list, gate: Any, out: list) -> tuple:
    """npu0 writes ``buf`` for 30 modeled ms; gpu0 writes it too."""
    buf, src, _ = bufs
    npu, gpu = c.client.context("npu0", name="first"), c.client.context("gpu0", name="second")
    out += [npu, gpu]
    first = npu.submit("relu", [src], [buf], wait=[gate], ms=30)
    return first, lambda wait: gpu.submit("fill", [], [buf], wait=wait,
                                          params={"value": 6.0}), 6.0


def _hazard_case(c: CaseRun, kind: str, program: Program) -> None:
    c.client.ping()  # fence releases still owed by the case before go out first
    base = c.counts()
    bufs = [c.client.alloc((64,), "float32") for _ in range(3)]
    buf = bufs[0]
    contexts: list = []
    # The first command waits on a gate opened once the second one was tried: it is
    # unfinished then however slow the host is.
    gate = c.client.fence()
    first, second, expected = program(c, bufs, gate, contexts)
    try:
        second([]).release()
        c.s.check(f"the unordered {kind} was refused with SyncHazard", False, "it was served")
    except errors.SyncHazard as exc:
        d = exc.detail
        c.s.check(f"the unordered {kind} was refused with SyncHazard", d["hazard"] == kind,
                  d["hazard"])
        c.s.check("it names the buffer, the other command and the missing fence",
                  (d["buffer"], d["other_cid"], d["missing_fence"])
                  == (buf.handle, first.cid, first.handle), str(d))
        c.s.check("scope request, not retryable", exc.scope == "request" and not exc.retryable,
                  f"{exc.scope}, retryable {exc.retryable}")
    gate.signal()
    fenced = second([first])
    if c.check_completes("the same program waiting on that fence is served", fenced, 5):
        c.s.check("the buffer holds what the program meant",
                  bool(np.all(buf.array() == expected)), str(buf.array()[:4]))
    _retired(c)
    for f in (first, gate):
        f.release()
    for ctx in contexts:
        ctx.close()
    for b in bufs:
        b.free()
    c.client.ping()  # (releases and frees go out with a request)
    _retired(c)  # and the cache purges npu0 runs before a block it wrote is reused
    _nothing_left(c, base)


def _nothing_left(c: CaseRun, base: dict[str, int]) -> None:
    """No count above its baseline. Not ``finish``'s equality: what an earlier case left
    to go later (a fence a killed client process imported goes when the supervisor sees
    it gone) may go while this one runs, and that is no leak of this case's."""
    deadline = time.monotonic() + 3
    while True:
        now = c.counts()
        grown = {k: (base[k], now[k]) for k in base if now[k] > base[k]}
        if not grown or time.monotonic() > deadline:
            break
        sleep(20, c.client)
        c.client.ping()
    c.s.check("nothing of it is left (no count above its baseline)", not grown,
              "none" if not grown else f"(before, after): {grown}")


def _retired(c: CaseRun) -> None:
    """Every command retired (the supervisor read their completions), the supervisor's
    own cache purges too: a fence released after that goes at once, and nothing of this
    case is left to go during the next one's."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        m = c.client.metrics()
        if not m["in_flight"] and not sum(m["queue_depth"].values()):
            return
        sleep(10, c.client)


@case("hetproc/hazard-read-after-write", SUITE,
      "npu0 writes a buffer for 30 modeled ms while gpu0 reads it without waiting: refused "
      "(SyncHazard read-after-write naming the buffer, the writer's correlation id and its "
      "fence); waiting on that fence, the read is served and sees the writer's data")
def _hazard_raw(c: CaseRun) -> None:
    _hazard_case(c, "read-after-write", _read_after_write)


@case("hetproc/hazard-write-after-read", SUITE,
      "cpu0 overwrites a buffer npu0 is still reading: refused (SyncHazard write-after-read "
      "naming the reader); waiting on the reader's fence, the write is served")
def _hazard_war(c: CaseRun) -> None:
    _hazard_case(c, "write-after-read", _write_after_read)


@case("hetproc/hazard-write-after-write", SUITE,
      "npu0 and gpu0 both write one buffer, unordered: refused (SyncHazard "
      "write-after-write naming the first writer); ordered by its fence, the last write wins")
def _hazard_waw(c: CaseRun) -> None:
    _hazard_case(c, "write-after-write", _write_after_write)

"""What waiting on a fence through its descriptor costs, against waiting on its semaphore.

``fence_fd``
    On a live platform, the host latency from a fence's signal (the host time its
    signaller stamped in the slot) to the waiter's wake-up, p50 and p99, for:

    * a command's fence (npu0, a 0 ms ``work``): ``Fence.wait`` (the semaphore, woken by
      the device directly) and ``select`` on ``Fence.fd()`` (the device pokes the
      supervisor through its completion eventfd, the supervisor writes the descriptor);
    * a user fence signalled from another thread: the semaphore, and the descriptor
      (a watched fence's signal goes through the supervisor).

    Ratios are descriptor / semaphore: the descriptor adds one supervisor hop (a wake
    and a socket write), so it costs more; no target, figures for the note.
"""

from __future__ import annotations

import select
import threading
import time

import hetproc

from ._registry import benchmark, make_row
from ._stats import summarize


def _wake_ns(client: hetproc.Client, fence: hetproc.Fence, via_fd: bool) -> float:
    if via_fd:
        select.select([fence.fd()], [], [], 5)
    else:
        fence.wait(5)
    woke = time.monotonic_ns()
    return woke - client.connection.fences.info(fence.handle)["t_host"]


def _command(client: hetproc.Client, ctx: hetproc.Context, via_fd: bool) -> float:
    f = ctx.submit("work", ms=0)
    if via_fd:
        f.fd()
    lat = _wake_ns(client, f, via_fd)
    f.release()
    return lat


def _user(client: hetproc.Client, via_fd: bool) -> float:
    f = client.fence()
    if via_fd:
        f.fd()
    t = threading.Timer(0.001, f.signal)
    t.start()
    lat = _wake_ns(client, f, via_fd)
    t.join()
    f.release()
    return lat


@benchmark("fence_fd")
def bench_fence_fd(quick: bool) -> dict:
    n = 40 if quick else 300
    rows, summary = [], {}
    with hetproc.Platform(time_scale=1.0) as plat:
        c = plat.client
        ctx = c.context("npu0")
        for label, fn in (("command fence", lambda fd: _command(c, ctx, fd)),
                          ("user fence", lambda fd: _user(c, fd))):
            sem = summarize(fn(False) for _ in range(n))
            fdw = summarize(fn(True) for _ in range(n))
            summary[label] = {"semaphore": sem, "fd": fdw}
            for q in ("p50_us", "p99_us"):
                rows.append(make_row(f"{label} wake, fd vs semaphore ({q[:3]})",
                                     fdw[q], sem[q]))
        ctx.close()
    return {"rows": rows, "summary": summary}

"""Recovery benchmarks: how fast a device's death reaches every waiter, and how fast a
reset device serves again -- each next to its raw floor measured in the same run.

* ``death_to_waiters``: SIGKILL a device with a long command in flight and four client
  threads waiting on its fence; time from the kill to each waiter waking with
  ``DeviceCrashed``. Floor: a forked child's death seen through a pidfd.
* ``reset_to_ready``: from the kill to the completion of a command submitted right after
  it (it runs on the restarted device, new epoch). Floor: fork + child ready on a pipe.
"""

from __future__ import annotations

import os
import select
import signal
import statistics
import threading
import time

import hetproc

from ._registry import benchmark, make_row

WAITERS = 4


def _pidfd_death_floor(n: int) -> list[float]:
    """Raw: kill a forked child, time until its pidfd is readable (us)."""
    samples = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, b"x")
            time.sleep(30)
            os._exit(0)
        os.close(w)
        os.read(r, 1)
        os.close(r)
        fd = os.pidfd_open(pid)
        t0 = time.perf_counter_ns()
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [], 5)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        os.waitpid(pid, 0)
        os.close(fd)
    return samples


def _fork_ready_floor(n: int) -> list[float]:
    """Raw: fork a child and wait until it says it runs (us)."""
    samples = []
    for _ in range(n):
        r, w = os.pipe()
        t0 = time.perf_counter_ns()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")
            os._exit(0)
        os.read(r, 1)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    return samples


def _kill_and_measure(plat: hetproc.Platform) -> tuple[list[float], float]:
    client = plat.client
    ctx = client.context("npu0")
    fence = ctx.submit("work", ms=5000)
    woke: list[float] = []
    ready = threading.Barrier(WAITERS + 1)

    def wait() -> None:
        ready.wait()
        try:
            fence.wait(10)
        except hetproc.DeviceCrashed:
            woke.append(time.monotonic_ns())

    threads = [threading.Thread(target=wait) for _ in range(WAITERS)]
    for t in threads:
        t.start()
    while client.metrics()["devices"]["npu0"]["state"] != "busy":
        time.sleep(0.001)
    ready.wait()
    time.sleep(0.01)  # let every waiter block on the semaphore
    pid = client.metrics()["devices"]["npu0"]["pid"]
    next_ctx = client.context("npu0")
    t_kill = time.monotonic_ns()
    os.kill(pid, signal.SIGKILL)
    while True:  # a command that reached the dying device is cancelled: submit again
        nxt = next_ctx.submit_nowait("work", ms=0)
        try:
            nxt.wait(10)
            break
        except hetproc.Cancelled:
            continue
    t_ready = client.fences.info(nxt.handle)["t_host"]
    for t in threads:
        t.join(10)
    return [(t - t_kill) / 1e3 for t in woke], (t_ready - t_kill) / 1e3


@benchmark("recovery")
def recovery(quick: bool) -> dict:
    rounds = 5 if quick else 20
    wake, reset = [], []
    with hetproc.Platform() as plat:
        for _ in range(rounds):
            w, r = _kill_and_measure(plat)
            wake += w
            reset.append(r)
    floor_death = _pidfd_death_floor(rounds)
    floor_fork = _fork_ready_floor(rounds)
    med = statistics.median
    def p99(xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]

    return {"rows": [
        make_row("kill -> every waiter woken, p50", med(wake), med(floor_death),
                 ok=med(wake) <= 5000, target_note="p50 <= 5 ms", n=len(wake)),
        make_row("kill -> every waiter woken, p99", p99(wake), p99(floor_death)),
        make_row("kill -> device serves again, p50", med(reset), med(floor_fork),
                 ok=med(reset) <= 20000, target_note="<= 20 ms", n=len(reset)),
        make_row("kill -> device serves again, max", max(reset), max(floor_fork)),
    ]}

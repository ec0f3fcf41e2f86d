"""The conformance cases of fences as file descriptors and merged fences (sync_file),
IGT ``sw_sync``'s merge and descriptor cases under their names, and of the subsystem
restart (its own platform group, whose recovery policy restarts npu0 as a subsystem).

A user fence of a client is a point on that client's timeline (sw_sync's timeline is
the process that alone may signal its fences); ``Fence.fd()`` is the sync_file, and
``merge_fences`` is ``SYNC_IOC_MERGE``. Registered with ``_conformance_cases.case``.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time

import numpy as np

from ipc import errors

from ..client import Fence, merge_fences, sleep, wait_fence_fd
from ._conformance_cases import ILLEGAL_HANDLE, CaseRun, case


def _busy(fence: Fence) -> bool:
    """sw_sync's busy: the descriptor is not readable and a zero-timeout wait times out."""
    if select.select([fence.fd()], [], [], 0)[0]:
        return False
    try:
        fence.wait(0)
        return False
    except errors.FenceTimeout:
        return True


def _release(*fences: Fence) -> None:
    for f in fences:
        f.release()


@case("sw_sync/sync_merge", "IGT sw_sync",
      "three fences of one timeline merged: the merged fence's descriptor stays busy while "
      "any is unsignalled, turns readable with the last signal, and signals at the latest "
      "modeled time of the three")
def _sync_merge(c: CaseRun) -> None:
    base = c.start()
    points = [c.client.fence() for _ in range(3)]
    merged = merge_fences(points)
    busy = [_busy(merged)]
    for f in points[:2]:
        f.signal()
        sleep(10, c.client)  # a supervisor tick or two: it would have signalled by now
        busy.append(_busy(merged))
    c.s.check("the merged fence is busy until the last point signals", all(busy), str(busy))
    points[2].signal()
    c.s.check("its descriptor turns readable", bool(select.select([merged.fd()], [], [], 5)[0]))
    c.check_completes("the merged fence signalled", merged, 1)
    c.s.check("it signalled at the latest modeled time of its points",
              merged.signal_time() == max(f.signal_time() for f in points) > 0)
    _release(*points, merged)
    c.finish(base)


@case("sw_sync/sync_merge_invalid", "IGT sw_sync",
      "merging a handle that names no fence, or another client's fence it never imported, "
      "is refused (InvalidHandle, ForeignHandle) and makes no fence")
def _sync_merge_invalid(c: CaseRun) -> None:
    base = c.start()
    good = c.client.fence()
    for label, handle, cls in (("an illegal handle", ILLEGAL_HANDLE, errors.InvalidHandle),
                               ("a foreign fence", None, errors.ForeignHandle)):
        other = None
        if handle is None:
            other = c.connect("foreign")
            handle = other.fence().handle
        try:
            merge_fences(good, Fence(c.client, handle))
            c.s.check(f"a merge with {label} is refused", False, "it made a fence")
        except cls as exc:
            c.s.check(f"a merge with {label} is refused", True, exc.name)
        if other is not None:
            other.close()
    good.release()
    c.finish(base)


@case("sw_sync/sync_merge_same", "IGT sw_sync",
      "a fence merged with itself is busy until that fence signals, then signalled")
def _sync_merge_same(c: CaseRun) -> None:
    f = c.client.fence()
    merged = merge_fences(f, f)
    c.s.check("the merge is busy while its fence is", _busy(merged))
    f.signal()
    c.check_completes("it signals with its fence", merged, 1)
    f.release()


@case("sw_sync/sync_expired_merge", "IGT sw_sync",
      "merging an already signalled fence with itself, many times over: every merge is "
      "signalled at once, and none is left behind")
def _sync_expired_merge(c: CaseRun) -> None:
    base = c.start()
    f = c.client.fence()
    f.signal()
    done = 0
    for _ in range(200):
        merged = merge_fences(f, f)
        try:
            merged.wait(0)
            done += 1
        except errors.HetprocError:
            pass
        merged.release()
    c.s.check("every merge of a signalled fence is signalled at once", done == 200,
              f"{done} of 200")
    f.release()
    c.finish(base)


@case("sw_sync/sync_multi_timeline_wait", "IGT sw_sync",
      "fences of three timelines (three clients) merged: poll() on the merged descriptor "
      "times out until every timeline signalled its fence, then returns readable")
def _sync_multi_timeline_wait(c: CaseRun) -> None:
    timelines = [c.connect(f"timeline{i}") for i in range(3)]
    points = [t.fence() for t in timelines]
    mine = [c.client.import_fence(p.export()) for p in points]
    merged = merge_fences(mine)
    poller = select.poll()
    poller.register(merged.fd(), select.POLLIN)
    timed_out = [not poller.poll(0)]
    for p in points:
        timed_out.append(not poller.poll(10))
        p.signal()
    c.s.check("poll timed out until the last timeline signalled", all(timed_out),
              str(timed_out))
    c.s.check("poll then returned readable", bool(poller.poll(5000)))
    c.check_completes("the merged fence signalled", merged, 1)
    _release(*mine, merged)


UNIX_SOCKET_CHILD = """
import socket, sys, hetproc
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + sys.argv[2])  # an abstract address
_, fds, _, _ = socket.recv_fds(sock, 16, 1)
print("busy" if not hetproc.fence_fd_done(fds[0]) else "done", flush=True)
try:
    hetproc.wait_fence_fd(fds[0], 10)
    print("signalled", flush=True)
except hetproc.HetprocError as exc:
    print(exc.name, flush=True)
"""


@case("sw_sync/sync_busy_fork_unixsocket", "IGT sw_sync",
      "a fence's descriptor handed to another process over a Unix socket (SCM_RIGHTS): "
      "there, with no connection to the platform, it is busy until this process signals "
      "the fence, then it wakes with success")
def _sync_busy_fork_unixsocket(c: CaseRun) -> None:
    f = c.client.fence()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"hetproc-conformance-{os.getpid()}-{f.handle:x}"
    listener.bind("\0" + address)  # abstract: no file to remove
    listener.listen(1)
    listener.settimeout(10)
    try:
        proc = c.spawn(UNIX_SOCKET_CHILD, address)
        conn, _ = listener.accept()
        socket.send_fds(conn, [b"f"], [f.fd()])
        conn.close()
        c.s.check("the other process sees the fence busy", c.hear(proc) == "busy")
        sleep(20, c.client)
        c.s.check("it still waits before the signal", proc.poll() is None)
        f.signal()
        c.s.check("it woke with success after the signal", c.hear(proc) == "signalled")
        c.s.check("it exited cleanly", proc.wait(10) == 0)
    finally:
        listener.close()
        f.release()


@case("hetproc/fence-fd-wait", "hetproc",
      "one fence descriptor waited on with select, poll, epoll and asyncio: none returns "
      "before the command completes (it waits for a gate fence), all see it; a merge "
      "with a failed input fails with that input's error (scope and retryability kept) "
      "through its descriptor, at once")
def _fence_fd_wait(c: CaseRun) -> None:
    ctx = c.client.context("gpu0", name="fd-wait")
    gate = c.client.fence()
    f = ctx.submit("work", wait=[gate], ms=1)
    fd = f.fd()
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    early = [bool(select.select([fd], [], [], 0.01)[0]), bool(poller.poll(0)),
             bool(ep.poll(0))]
    c.s.check("no waiter returns before the command completes", not any(early), str(early))

    async def in_a_loop() -> None:
        asyncio.get_running_loop().call_later(0.005, gate.signal)
        await f.wait_async(5)

    asyncio.run(in_a_loop())
    seen = [bool(select.select([fd], [], [], 0)[0]), bool(poller.poll(0)), bool(ep.poll(0))]
    ep.close()
    c.s.check("asyncio, then select, poll and epoll see it completed", all(seen), str(seen))
    pending, failing = c.client.fence(), c.client.fence()
    merged = merge_fences(pending, failing)
    failing.signal(errors.DeviceCrashed)
    try:
        wait_fence_fd(merged.fd(), 5)
        err: errors.HetprocError | None = None
    except errors.HetprocError as exc:
        err = exc
    c.s.check("the merge failed with its input's error, through its descriptor",
              isinstance(err, errors.DeviceCrashed) and err.scope == "device"
              and err.retryable, repr(err))
    _release(f, gate, pending, failing, merged)
    ctx.close()


@case("hetproc/fence-fd-timeline-closed", "hetproc",
      "sw_sync's timeline_closed seen through descriptors: the client that alone may "
      "signal a fence leaves without signalling it; the importer's descriptor of it, and "
      "of a merge of it, turn readable with Cancelled (scope process), never a hang")
def _fence_fd_timeline_closed(c: CaseRun) -> None:
    creator = c.connect("timeline")
    f = c.client.import_fence(creator.fence().export())
    merged = merge_fences(f)
    fds = [f.fd(), merged.fd()]
    creator.close()
    outcomes = []
    for fd in fds:
        try:
            wait_fence_fd(fd, 5)
            outcomes.append("signalled")
        except errors.HetprocError as exc:
            outcomes.append(f"{exc.name} {exc.scope}")
    c.s.check("both descriptors ended with Cancelled, scope process",
              outcomes == ["Cancelled process"] * 2, str(outcomes))
    _release(f, merged)


# -- a subsystem restart (the platform's [recovery] subsystem_restart names npu0) ---------


@case("hetproc/subsystem-restart", "hetproc", group="restart", checks=(
      "the NPU process dies and a new instance starts (a subsystem restart): the running "
      "command fails with DeviceRestarted (scope device, retryable); every context on npu0, "
      "this client's and another tenant's, and a queue on it refuse work with "
      "DeviceRestarted; gpu0's context keeps working and a new npu0 context serves; a "
      "delegated model reloads its assets from the asset cache and its retry is exact; a "
      "second crash during that recovery ends its run with a non-retryable DeviceRestarted, "
      "never a hang (vendors mock this with one-off libraries: Qualcomm's SSR)"))
def _subsystem_restart(c: CaseRun) -> None:
    base = c.start()
    other = c.connect("other-tenant")
    mine, gpu = c.client.context("npu0", name="mine"), c.client.context("gpu0", name="gpu")
    theirs = other.context("npu0", name="theirs")
    queue = theirs.queue(slots=16)
    c.client.inject("crash", device="npu0", step="in_kernel")
    running = mine.submit("work", ms=20)
    err = c.expect_failure("the running command failed with DeviceRestarted", running,
                           errors.DeviceRestarted)
    c.s.check("its scope is the device and it is retryable",
              err is not None and err.scope == "device" and err.retryable)
    running.release()
    inc = c.new_incident()
    c.s.check("the stop was confirmed by reaping and every npu0 context was lost",
              inc is not None and inc["confirmed_stop"] == "reaped"
              and any(s["step"] == "contexts_lost" for s in inc["steps"]))
    for label, submit in (("this client's context", lambda: mine.submit("work", ms=1)),
                          ("another tenant's context", lambda: theirs.submit("work", ms=1)),
                          ("the queue", lambda: queue.submit_nowait(0.1))):
        try:
            submit()
            c.s.check(f"{label} refuses work with DeviceRestarted", False, "it took work")
        except errors.DeviceRestarted as exc:
            c.s.check(f"{label} refuses work with DeviceRestarted", exc.retryable, exc.name)
    c.check_completes("gpu0's context keeps working", gpu.submit("work", ms=1), 5)
    c.next_request_succeeds("npu0")
    queue.close()
    for ctx in (mine, theirs, gpu):
        ctx.close()
    other.close()
    _delegate_restarts(c)
    c.finish(base)


def _delegate_restarts(c: CaseRun) -> None:
    """A delegated model through one restart (recovered) and a double one (not retryable)."""
    try:
        from ..delegate import (
            AssetCache,
            DelegatedModel,
            Options,
            load_model,
            mobilenet_like,
            run_reference,
        )
        model = mobilenet_like()
    except ImportError:  # the delegate needs onnx: the handles' part above still ran
        c.s.metric("delegate_part", "skipped: onnx is not installed")
        return
    import tempfile

    x = np.random.default_rng(7).random((1, 3, 32, 32), dtype=np.float32)
    want = run_reference(load_model(model), {"x": x})["prob"]
    spread = Options(min_nodes_per_partition=1, weigh_costs=False)
    app = c.connect("model-app")  # its own client: closing it lets go of all the model held
    with tempfile.TemporaryDirectory() as cache_dir, DelegatedModel.load(
            app, model, options=spread, cache=AssetCache(cache_dir)) as dm:
        c.client.inject("crash", device="npu0", step="in_kernel")
        try:
            out = dm.run({"x": x}, timeout=10)["prob"]
            exact = bool(np.allclose(out, want, rtol=1e-6, atol=0))
            c.s.check("a delegated model recovered from the restart, exactly", exact and
                      dm.load_info.get("restarts") == 1
                      and "reloaded" in dm.load_info.get("reloaded", []),
                      str(dm.load_info.get("reloaded")))
        except errors.HetprocError as exc:
            c.s.check("a delegated model recovered from the restart, exactly", False, repr(exc))
        c.client.inject("crash", device="npu0", step="in_kernel", every=1, count=0)
        t0 = time.monotonic()
        try:
            dm.run({"x": x}, timeout=10)
            err: errors.HetprocError | None = None
        except errors.HetprocError as exc:
            err = exc
        c.s.metric("double_restart_ms", round((time.monotonic() - t0) * 1000, 3))
        c.s.check("a second crash during its recovery ends the run, not retryable",
                  isinstance(err, errors.DeviceRestarted) and not err.retryable, repr(err))
        c.client.clear_faults()
        try:
            dm.run({"x": x}, timeout=10)
            c.s.check("once the crashes stop, the model runs again", True)
        except errors.HetprocError as exc:
            c.s.check("once the crashes stop, the model runs again", False, repr(exc))
    app.close()

"""The conformance cases that run on a shared platform, and what each is given.

A case is a function of a ``CaseRun`` (the drill helpers: bystander, resource counts,
expected errors; plus other clients and client processes of its own, closed when it ends),
registered with the name of the original case it mirrors, its suite and one sentence of
what it checks. ``_conformance`` adds the drill cases and runs them all.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import errors

from ..client import Fence, sleep
from . import _children
from ._drills import Drill
from ._scenario import Scenario


@dataclass(frozen=True)
class Case:
    """One conformance case: a drill (run on its own platform) or a function (run on its
    group's shared platform)."""

    name: str        # "<suite>/<case>", the original's name
    suite: str       # where the original lives
    checks: str      # what it checks, in one sentence (the README table's column)
    drill: str | None = None                 # a drill case: the drill it runs
    fn: Callable[[CaseRun], None] | None = None
    group: str = "shared"                    # the shared platform it runs on
    real_clock: str | None = None  # why it cannot run on the virtual clock (``_realclock``)


CASES: dict[str, Case] = {}


def add_case(case: Case) -> None:
    assert case.name not in CASES, case.name
    CASES[case.name] = case


def case(name: str, suite: str, checks: str, group: str = "shared", real_clock: str | None = None):
    """Register a case that runs on its group's shared platform."""
    def register(fn: Callable[[CaseRun], None]):
        add_case(Case(name, suite, checks, fn=fn, group=group, real_clock=real_clock))
        return fn
    return register


class CaseRun(Drill):
    """One case on a shared platform: the drill helpers, plus what keeps cases apart."""

    def __init__(self, s: Scenario, name: str) -> None:
        super().__init__(s, name)
        self._clients: list[Any] = []
        self._procs: list[subprocess.Popen] = []
        self._incidents = len(self.client.incidents()["history"])

    def connect(self, name: str):
        """Another client of the platform (another tenant), closed when the case ends."""
        other = self.plat.connect(name)
        self._clients.append(other)
        return other

    def spawn(self, code: str, *args: str) -> subprocess.Popen:
        """A client process of its own running ``code`` (argv[1] is the platform)."""
        proc = _children.spawn(code, self.plat.prefix, *args)
        self._procs.append(proc)
        self.s.extra_pids.append(proc.pid)
        return proc

    hear = staticmethod(_children.read_line)  # its next line ("" once closed or silent)
    tell = staticmethod(_children.tell)  # let it go on to its next step

    def expect_failure(self, name: str, fence, cls: type[errors.HetprocError],
                       timeout: float = 5.0) -> errors.HetprocError | None:
        """Check ``fence`` ends with ``cls`` (not success, not a FenceTimeout: no hang)."""
        try:
            fence.wait(timeout)
            err = None
        except errors.HetprocError as exc:
            err = exc
        self.s.check(name, isinstance(err, cls),
                     f"{err.name} (scope {err.scope})" if err else "it succeeded")
        return err

    def new_incident(self) -> dict[str, Any] | None:
        """The first incident this case caused, once every incident finished (None if
        it caused none within a few seconds)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            inc = self.client.incidents()
            if len(inc["history"]) > self._incidents and not inc["active"]:
                return inc["history"][self._incidents]
            sleep(10, self.client)  # the platform's time: the recovery goes on meanwhile
        return None

    def recovery_ms(self) -> float | None:
        """The supervisor's measure of the last incident this case caused, if any."""
        history = self.client.incidents()["history"]
        return history[-1]["recovery_ms"] if len(history) > self._incidents else None

    def tear_down(self) -> None:
        if self.bystander is not None:  # the case stopped before its finish()
            self.bystander.stop()
            self.bystander = None
        for proc in self._procs:
            _children.end(proc)
        for other in self._clients:
            other.close()
        self.client.clear_faults()


# -- DRM scheduler (KUnit) ----------------------------------------------------------------


@case("drm_sched/basic_submit", "DRM scheduler KUnit",
      "one job submitted to one context completes and its fence signals")
def _basic_submit(c: CaseRun) -> None:
    ctx = c.client.context("gpu0", name="submit")
    c.check_completes("the job completed", ctx.submit("work", ms=1), 5)
    ctx.close()


@case("drm_sched/basic_test-single-entity-queue", "DRM scheduler KUnit",
      "a queue of jobs on one context all complete, in submission order (modeled signal times)")
def _single_entity_queue(c: CaseRun) -> None:
    ctx = c.client.context("gpu0", name="queue")
    fences = [ctx.submit("work", ms=0.5) for _ in range(16)]
    _check_chain_order(c, fences)
    ctx.close()


@case("drm_sched/basic_test-multiple-independent-queues", "DRM scheduler KUnit",
      "four contexts on one device, each with its own queue of jobs submitted "
      "interleaved: every job completes, each queue in its own submission order")
def _independent_queues(c: CaseRun) -> None:
    ctxs = [c.client.context("gpu0", name=f"queue{i}") for i in range(4)]
    queues: list[list[Any]] = [[] for _ in ctxs]
    for _ in range(6):
        for q, ctx in zip(queues, ctxs):
            q.append(ctx.submit("work", ms=0.5))
    for q in queues:
        _check_chain_order(c, q)
    for ctx in ctxs:
        ctx.close()


@case("drm_sched/basic_test-dependency-chain-across-entities", "DRM scheduler KUnit",
      "a chain of jobs across contexts on three devices, each waiting on the previous "
      "one's fence, completes in chain order (modeled signal times)")
def _chain_across_entities(c: CaseRun) -> None:
    ctxs = [c.client.context(d, name=f"chain-{d}") for d in ("cpu0", "gpu0", "dsp0")]
    fences: list[Any] = []
    for i in range(12):
        prev = fences[-1:] if fences else []
        fences.append(ctxs[i % 3].submit("work", wait=prev, ms=0.5))
    _check_chain_order(c, fences)
    for ctx in ctxs:
        ctx.close()


def _check_chain_order(c: CaseRun, fences: list[Any]) -> None:
    ok = True
    try:
        fences[-1].wait(10)
        for f in fences:
            f.wait(1)
    except errors.HetprocError as exc:
        ok = c.s.check("every job completed", False, exc.name)
    if ok:
        c.s.check("every job completed", True)
        times = [f.signal_time() for f in fences]
        c.s.check("they completed in order (modeled signal times never go back)",
                  all(a <= b for a, b in zip(times, times[1:])) and times[0] > 0,
                  f"signal times {times}")
    for f in fences:
        f.release()


@case("drm_sched/priorities", "DRM scheduler KUnit",
      "jobs queued behind a busy device at low and high priority: the high-priority job "
      "completes first although submitted last")
def _priorities(c: CaseRun) -> None:
    low_ctx = c.client.context("dsp0", priority=0, name="low")
    high_ctx = c.client.context("dsp0", priority=8, name="high")
    busy = low_ctx.submit("work", ms=300)  # long enough for both to queue on a busy host
    low = low_ctx.submit("work", ms=2)
    high = high_ctx.submit("work", ms=2)
    for f in (busy, low, high):
        f.wait(5)
    c.s.check("the high-priority job completed before the low-priority one",
              0 < high.signal_time() < low.signal_time(),
              f"high {high.signal_time()}, low {low.signal_time()}")
    for f in (busy, low, high):
        f.release()
    low_ctx.close()
    high_ctx.close()


@case("drm_sched/basic_entity_cleanup", "DRM scheduler KUnit",
      "four contexts with a dependency chain of jobs are destroyed while the queue is "
      "still being processed: every fence completes (success or an error), none hangs, "
      "nothing is left behind")
def _entity_cleanup(c: CaseRun) -> None:
    base = c.start()
    ctxs = [c.client.context("gpu0", name=f"entity{i}") for i in range(4)]
    fences: list[Any] = []
    for i in range(40):
        fences.append(ctxs[i % 4].submit("work", wait=fences[-1:], ms=5))
    sleep(20, c.client)  # a few ran, the rest are queued or pushed to the device
    for ctx in ctxs:
        ctx.close()
    outcome = {"ok": 0, "failed": 0, "hung": 0}
    for f in fences:
        try:
            f.wait(c.bound_ms / 1000 * 4)
            outcome["ok"] += 1
        except errors.FenceTimeout:
            outcome["hung"] += 1
        except errors.HetprocError:
            outcome["failed"] += 1
        f.release()
    c.s.metric("entity_cleanup_outcome", outcome)
    c.s.check("every fence completed, with success or an error (none hangs)",
              outcome["hung"] == 0, str(outcome))
    try:
        ctxs[0].submit("work", ms=1)
        c.s.check("a destroyed context takes no more work", False, "it accepted a job")
    except errors.InvalidRequest as exc:
        c.s.check("a destroyed context takes no more work", True, exc.name)
    c.next_request_succeeds("gpu0")
    c.finish(base)


# -- gem_reset_stats (IGT) ----------------------------------------------------------------

HANG_AND_EXIT = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "hanging-app")
ctx = c.context("npu0", name="guilty")
c.inject("hang", device="npu0")
fence = ctx.submit("work", ms=5)
print("submitted", flush=True)
sys.stdin.readline()
if sys.argv[2] == "ctx":
    ctx.close()   # the context goes, the client stays until told
    print("closed", flush=True)
    sys.stdin.readline()
c.close()
"""


def _close_pending(c: CaseRun, what: str) -> None:
    base = c.start()
    proc = c.spawn(HANG_AND_EXIT, what)
    c.s.check("the client submitted its hanging request", c.hear(proc) == "submitted")
    if what == "ctx":
        c.tell(proc)
        c.s.check("it destroyed the context with the hang pending",
                  c.hear(proc) == "closed")
    c.tell(proc)  # now it closes its connection, the hang still pending
    c.s.check("the client exited cleanly", proc.wait(10) == 0)
    inc = c.new_incident()
    c.s.check("the pending hang was still detected and the device reset",
              inc is not None and inc["kind"] == "timeout"
              and inc["confirmed_stop"] in ("acknowledged", "reaped"),
              str(inc and (inc["kind"], inc["confirmed_stop"])))
    c.next_request_succeeds("npu0")
    c.finish(base)


@case("gem_reset_stats/close-pending-npu0", "IGT gem_reset_stats",
      "a client closes its connection while its hung request is pending: the hang is still "
      "caught and the device reset, the next request is served, the bystander is "
      "unaffected, nothing of the client remains")
def _close_pending_client(c: CaseRun) -> None:
    _close_pending(c, "client")


@case("gem_reset_stats/close-pending-ctx-npu0", "IGT gem_reset_stats",
      "the same with only the context destroyed while its hung request is pending")
def _close_pending_ctx(c: CaseRun) -> None:
    _close_pending(c, "ctx")


SUBMIT_EVERYWHERE = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "forked-app")
buf = c.alloc(1 << 14, "float32")
ctxs = [c.context(d) for d in ("cpu0", "npu0", "gpu0", "dsp0")]
fences = [ctx.submit("work", [buf], [], ms=1) for ctx in ctxs]
print("submitted", flush=True)
sys.stdin.readline()
"""


@case("gem_reset_stats/close-pending-fork-npu0", "IGT gem_reset_stats",
      "while a hang is pending on npu0, another process submits work reading one of its "
      "buffers on every device and is killed: the hang is reset, the dead process's work "
      "behind it ends, its buffer is reclaimed only once no device uses it, every device "
      "serves again, nothing is left behind")
def _close_pending_fork(c: CaseRun) -> None:
    base = c.start()
    guilty = c.client.context("npu0", name="guilty")
    c.client.inject("hang", device="npu0")
    hung = guilty.submit("work", ms=5)
    proc = c.spawn(SUBMIT_EVERYWHERE)
    c.s.check("the other process submitted on every device", c.hear(proc) == "submitted")
    proc.kill()
    proc.wait(10)
    c.expect_failure("the hung request failed with DeviceTimeout", hung, errors.DeviceTimeout)
    inc = c.new_incident()
    c.s.check("the device was reset after a confirmed stop",
              inc is not None and inc["confirmed_stop"] in ("acknowledged", "reaped"),
              str(inc and inc["confirmed_stop"]))
    hung.release()
    guilty.close()
    for device in ("cpu0", "npu0", "gpu0", "dsp0"):
        c.next_request_succeeds(device)
    c.finish(base)  # the killed process's buffer and contexts are gone: counts at baseline


@case("gem_reset_stats/unrelated-ctx-npu0", "IGT gem_reset_stats", group="replay", checks=(
      "another process's context on the same device submits while a guilty context "
      "hangs: the guilty request fails (DeviceTimeout, scope context), its context is lost "
      "and reads guilty; the unrelated request runs after the reset (replay_innocent, as "
      "i915 does), its context reads innocent and keeps working"))
def _unrelated_ctx(c: CaseRun) -> None:
    other = c.connect("unrelated")
    guilty = c.client.context("npu0", name="guilty")
    unrelated = other.context("npu0", name="unrelated")
    c.client.inject("hang", device="npu0")
    hung = guilty.submit("work", ms=5)
    sleep(20, c.client)  # the hang is on the device
    noop = unrelated.submit("work", ms=1)
    err = c.expect_failure("the guilty request failed (DeviceTimeout)", hung, errors.DeviceTimeout)
    c.s.check("its scope is the guilty context", err is not None and err.scope == "context")
    c.check_completes("the unrelated request completed", noop, 5)
    c.s.check("their reset statuses read guilty and innocent", [x.reset_status().status for x
              in (guilty, unrelated)] == ["guilty", "innocent"])
    c.check_completes("the unrelated context keeps working", unrelated.submit("work", ms=1), 5)
    try:
        guilty.submit("work", ms=1)
        c.s.check("the guilty context is lost (ContextLost)", False, "it accepted work")
    except errors.ContextLost:
        c.s.check("the guilty context is lost (ContextLost)", True)
    hung.release()
    guilty.close()
    unrelated.close()


# -- sw_sync (IGT) -------------------------------------------------------------------------


@case("sw_sync/sync_busy", "IGT sw_sync",
      "a user fence is busy (a zero-timeout wait times out) until its owner signals it, "
      "then every wait returns at once")
def _sync_busy(c: CaseRun) -> None:
    f = c.client.fence()
    try:
        f.wait(0)
        c.s.check("an unsignalled fence is busy", False, "the wait returned")
    except errors.FenceTimeout:
        c.s.check("an unsignalled fence is busy", True)
    c.s.check("signal() reports the first signal", f.signal())
    c.check_completes("after the signal the wait returns", f, 0.5)


IMPORT_AND_WAIT = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "waiter")
f = c.import_fence(int(sys.argv[2]))
print("waiting", flush=True)
try:
    f.wait(float(sys.argv[3]))
    print("signalled", flush=True)
except hetproc.HetprocError as exc:
    print(f"{exc.name} {exc.scope}", flush=True)
f.release()
c.close()
"""


@case("sw_sync/sync_busy_fork", "IGT sw_sync",
      "a fence exported to another process: that process's wait is busy until this one "
      "signals, then it wakes with success")
def _sync_busy_fork(c: CaseRun) -> None:
    f = c.client.fence()
    proc = c.spawn(IMPORT_AND_WAIT, str(f.export()), "5")
    c.s.check("the other process waits on the fence", c.hear(proc) == "waiting")
    sleep(50, c.client)
    c.s.check("it is still waiting before the signal", proc.poll() is None)
    f.signal()
    c.s.check("it woke with success after the signal", c.hear(proc) == "signalled")
    c.s.check("it exited cleanly", proc.wait(10) == 0)
    f.release()


CREATE_AND_LEAVE = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "timeline")
f = c.fence()
print(f.export(), flush=True)
sys.stdin.readline()
if sys.argv[2] == "signal":
    f.signal()
c.close()
"""


def _timeline_closed(c: CaseRun, signal_first: bool, killed: bool = False) -> None:
    proc = c.spawn(CREATE_AND_LEAVE, "signal" if signal_first else "leave")
    token = int(c.hear(proc))
    f = c.client.import_fence(token)
    if killed:
        proc.kill()
        c.s.check("its creator was killed", proc.wait(10) == -9)
    else:
        c.tell(proc)
        c.s.check("its creator closed", proc.wait(10) == 0)
    t0 = time.monotonic()
    if signal_first:
        c.check_completes("a fence signalled before its creator left stays signalled", f, 5)
    else:
        err = c.expect_failure("the unsignalled fence ends with an error, it does not hang",
                               f, errors.Cancelled)
        c.s.check("the error names the creator's process", err is not None
                  and err.scope == "process", str(err and err.scope))
        f.release()
    c.s.metric("waited_ms", round((time.monotonic() - t0) * 1000, 3))


@case("sw_sync/timeline_closed", "IGT sw_sync",
      "the process that alone may signal a fence closes without signalling it, or is "
      "killed: the importer's wait ends with an error (Cancelled, scope process) instead "
      "of hanging")
def _timeline_closed_unsignalled(c: CaseRun) -> None:
    _timeline_closed(c, signal_first=False)
    _timeline_closed(c, signal_first=False, killed=True)


@case("sw_sync/timeline_closed_signaled", "IGT sw_sync",
      "the same after it signalled: the importer's wait succeeds")
def _timeline_closed_signalled(c: CaseRun) -> None:
    _timeline_closed(c, signal_first=True)


@case("sw_sync/sync_multi_consumer", "IGT sw_sync",
      "eight threads wait on one user fence; one signal wakes every one of them, none "
      "before it")
def _multi_consumer(c: CaseRun) -> None:
    f = c.client.fence()
    signalled = threading.Event()
    results: list[bool] = []

    def consume() -> None:
        try:
            f.wait(5)
            results.append(signalled.is_set())
        except errors.HetprocError:
            results.append(False)

    threads = [threading.Thread(target=consume) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    c.s.check("no consumer woke before the signal", not results, f"{len(results)} woke early")
    signalled.set()
    f.signal()
    for t in threads:
        t.join(10)
    c.s.check("every consumer woke after the signal",
              len(results) == 8 and all(results), str(results))
    f.release()


# -- syncobj_wait (IGT) --------------------------------------------------------------------


@case("syncobj_wait/single-wait-all-submitted", "IGT syncobj_wait",
      "a wait with a timeout on submitted, unfinished work returns FenceTimeout (ETIME) "
      "after the timeout, and the fence is still good: a later wait succeeds")
def _wait_submitted(c: CaseRun) -> None:
    ctx = c.client.context("dsp0", name="slow")
    f = ctx.submit("work", ms=300)
    t0 = time.monotonic()
    try:
        f.wait(0.02)
        c.s.check("the short wait timed out", False, "the work was already done")
    except errors.FenceTimeout:
        c.s.check("the short wait timed out", True)
    c.s.metric("timed_out_after_ms", round((time.monotonic() - t0) * 1000, 3))
    c.check_completes("a later wait succeeds", f, 5)
    ctx.close()


@case("syncobj_wait/wait-all-delayed-signal", "IGT syncobj_wait",
      "a command that waits on four fences signalled one by one from another thread "
      "runs only after the last: its modeled end is at least its own duration after the "
      "last signal")
def _wait_all_delayed(c: CaseRun) -> None:
    inputs = [c.client.fence() for _ in range(4)]
    ctx = c.client.context("gpu0", name="waits-all")
    out = ctx.submit("work", wait=inputs, ms=1)

    def signal_slowly() -> None:  # on the platform's clock (modeled on the virtual one)
        for f in inputs:
            sleep(20, c.client)
            f.signal()

    t = threading.Thread(target=signal_slowly)
    t.start()
    c.check_completes("the command completed", out, 5)
    t.join(5)
    last = max(f.signal_time() for f in inputs)
    ran_ns = 1e6 * c.plat.spec.time_scale * 0.99  # its modeled 1 ms, rounding aside
    c.s.check("it ran only after the last of its fences signalled",
              last > 0 and out.signal_time() - last >= ran_ns,
              f"done {out.signal_time()}, last input {last}")
    for f in inputs:
        f.release()
    ctx.close()


@case("hetproc/dependency-failed", "hetproc",
      "a dependant on another device of a request that times out is not left waiting: it "
      "fails with DependencyFailed once its input failed (its nearest kin, IGT "
      "gem_exec_fence's await-hang, is not among the suites mirrored here)")
def _dependency_failed(c: CaseRun) -> None:
    base = c.start()
    ctx = c.client.context("npu0", name="victim")
    after = c.client.context("gpu0", name="dependant")
    c.client.inject("timeout", device="npu0")
    first = ctx.submit("work", ms=5)
    second = after.submit("work", wait=[first], ms=1)
    c.expect_failure("the dependant failed with DependencyFailed", second,
                     errors.DependencyFailed)
    c.expect_failure("its input failed with DeviceTimeout", first, errors.DeviceTimeout)
    for f in (first, second):
        f.release()
    ctx.close()
    after.close()
    c.finish(base)


ILLEGAL_HANDLE = 0x7FFF_FFF0  # never issued: its slot and generation name no fence


@case("syncobj_wait/invalid-wait-illegal-handle", "IGT syncobj_wait",
      "a command told to wait on a handle that names no fence is refused with "
      "InvalidHandle (nothing is queued, nobody waits forever); the context keeps working")
def _wait_illegal_handle(c: CaseRun) -> None:
    ctx = c.client.context("cpu0", name="waits-on-nothing")
    bogus = Fence(c.client, ILLEGAL_HANDLE)
    try:
        ctx.submit("work", wait=[bogus], ms=1)
        c.s.check("the wait on an illegal handle is refused", False, "it was queued")
    except errors.InvalidHandle as exc:
        c.s.check("the wait on an illegal handle is refused", True, exc.name)
    c.check_completes("the context keeps working", ctx.submit("work", ms=1), 5)
    ctx.close()


@case("syncobj_wait/invalid-signal-illegal-handle", "IGT syncobj_wait",
      "signalling a handle that names no fence is refused with InvalidHandle, and "
      "signalling a fence a command will signal is refused too: only its producer may")
def _signal_illegal_handle(c: CaseRun) -> None:
    try:
        Fence(c.client, ILLEGAL_HANDLE).signal()
        c.s.check("signalling an illegal handle is refused", False, "it was signalled")
    except errors.InvalidHandle as exc:
        c.s.check("signalling an illegal handle is refused", True, exc.name)
    ctx = c.client.context("dsp0", name="producer")
    f = ctx.submit("work", ms=50)
    try:
        Fence(c.client, f.handle).signal()
        c.s.check("a command's fence cannot be signalled by hand", False, "it was signalled")
    except errors.InvalidRequest as exc:
        c.s.check("a command's fence cannot be signalled by hand", True, exc.name)
    c.check_completes("the command still completes and signals it itself", f, 5)
    ctx.close()

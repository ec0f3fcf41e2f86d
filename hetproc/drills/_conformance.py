"""``hetproc conformance``: the recovery and synchronisation cases of the Linux GPU test
suites, each acted out on a live platform under the name of the case it mirrors.

A runtime engineer knows IGT's ``gem_reset_stats``, ``sw_sync`` and ``syncobj_wait``, the
DRM scheduler's KUnit tests and dEQP's robustness group by their case names; this suite
lets them find what hetproc guarantees under those names. A case is listed only where
what hetproc checks really is what the original checks (its README table says how each
maps); a drill with no counterpart in those suites keeps a ``hetproc/`` name. Mechanisms
hetproc does not have yet (bans, wedged devices, reset status queries, preempt timeouts,
subsystem restart, fence file descriptors, hazards) have no case here, not even a skipped
one: a case that cannot fail proves nothing.

How they run:

- a *drill case* runs one of the crash/reset drills (``_drills``) on its own fresh
  platform and passes when every check of the drill held;
- the other cases run one after another on a platform shared by their *group* (one
  platform per recovery policy), each with its own checks: every case leaves the
  platform as it found it (resource counts back to baseline, faults cleared, no incident
  running), which is itself checked, so a case that leaks fails rather than its neighbour.

Each case's recovery time is the supervisor's own measure of the incident the case
caused (from the watchdog's verdict or the death to the last probe), where it caused one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import errors

from .._config import PlatformSpec, load_platform
from ..client import Fence, same_code_env
from ._drills import DRILLS, Drill, drill_spec
from ._scenario import Scenario, run_on_platform

# The policy of each shared platform: i915 runs an innocent context's request again after a
# reset, which hetproc does only when asked (``replay_innocent``).
GROUPS: dict[str, dict[str, Any]] = {"shared": {}, "replay": {"replay_innocent": True}}


@dataclass(frozen=True)
class Case:
    name: str        # "<suite>/<case>", the original's name
    suite: str       # where the original lives
    checks: str      # what it checks, in one sentence (the README table's column)
    drill: str | None = None                 # a drill case: the drill it runs
    fn: Callable[[CaseRun], None] | None = None
    group: str = "shared"                    # the shared platform it runs on


CASES: dict[str, Case] = {}


def _add(case: Case) -> None:
    assert case.name not in CASES, case.name
    CASES[case.name] = case


def case(name: str, suite: str, checks: str, group: str = "shared"):
    """Register a case that runs on its group's shared platform."""
    def register(fn: Callable[[CaseRun], None]):
        _add(Case(name, suite, checks, fn=fn, group=group))
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
        proc = subprocess.Popen([sys.executable, "-c", code, self.plat.prefix, *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=same_code_env())
        self._procs.append(proc)
        self.s.extra_pids.append(proc.pid)
        return proc

    @staticmethod
    def hear(proc: subprocess.Popen) -> str:
        """The next line the process printed (empty once it closed its output)."""
        assert proc.stdout is not None
        return proc.stdout.readline().strip()

    @staticmethod
    def tell(proc: subprocess.Popen) -> None:
        """Let the process go on to its next step (it reads a line to know when)."""
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()

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
            time.sleep(0.01)
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
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for other in self._clients:
            other.close()
        self.client.clear_faults()


# -- drill cases --------------------------------------------------------------------------

_DRILL_CASES = [
    ("drm_sched/basic_timeout", "DRM scheduler KUnit", "timeout",
     "a job that never completes on its own is timed out by the watchdog (counted from its "
     "start on the device): its fence fails (DeviceTimeout, scope context), the device stops "
     "it on the cancel (acknowledged, not killed), its context is lost, the next job runs"),
    ("drm_sched/skip_reset", "DRM scheduler KUnit", "heartbeat-stall",
     "a job still making progress when the watchdog fires is not reset (verdict no hang, "
     "re-armed) and completes"),
    ("dEQP-EGL.functional.robustness.reset_context.shaders.infinite_loop.sync_status",
     "dEQP robustness", "hang",
     "a context that loops forever (ignores cancel) is reset; its fence still completes, "
     "with an error, within watchdog + grace; the context is lost; an innocent request "
     "caught in the reset is replayed; the device restarts"),
    ("hetproc/late-writer", "hetproc drill", "late-writer",
     "a hung command's buffer freed by its client stays quarantined until the device is "
     "confirmed stopped: its next owner's canary is intact"),
    ("hetproc/crash", "hetproc drill", "crash",
     "the device process dies mid-command: DeviceCrashed (scope device), reaped, restarted "
     "with a new epoch, next request served"),
    ("hetproc/lost-fence", "hetproc drill", "lost-fence",
     "a completion whose signal is lost is found and repaired by the supervisor: its "
     "dependant runs, nobody waits past watchdog + grace"),
    ("hetproc/alloc-fail", "hetproc drill", "alloc-fail",
     "an allocation fails with a retryable AllocationFailed and the retry succeeds"),
    ("hetproc/map-fail", "hetproc drill", "map-fail",
     "a failed device mapping refuses the request (MapFailed) before anything runs"),
    ("hetproc/compile-timeout", "hetproc drill", "compile-timeout",
     "a compile that overruns falls back to the CPU with the right result"),
    ("hetproc/wrong-output", "hetproc drill", "wrong-output",
     "flipped output bits pass unchecked and fail a checked request (WrongOutput)"),
    ("hetproc/oom", "hetproc drill", "oom",
     "the memory budget runs out with OutOfMemory; freeing makes room again"),
    ("hetproc/supervisor-crash", "hetproc drill", "supervisor-crash",
     "the supervisor is killed: a waiter wakes with SupervisorLost, devices exit, cleanup "
     "removes every object"),
    ("hetproc/client-crash", "hetproc drill", "client-crash",
     "a client killed with work in flight: its contexts go at once, its buffers stay "
     "quarantined while a device uses them"),
]
for _name, _suite, _drill, _checks in _DRILL_CASES:
    _add(Case(_name, _suite, _checks, drill=_drill, group=f"drill:{_drill}"))


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
    time.sleep(0.02)  # a few ran, the rest are queued or pushed to the device
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
      "hangs: the guilty request fails (DeviceTimeout, scope context) and its context is "
      "lost; the unrelated request runs after the reset (policy replay_innocent, as i915 "
      "does) and its context keeps working. Reset status queries do not exist yet: this "
      "checks what a runtime sees"))
def _unrelated_ctx(c: CaseRun) -> None:
    other = c.connect("unrelated")
    guilty = c.client.context("npu0", name="guilty")
    unrelated = other.context("npu0", name="unrelated")
    c.client.inject("hang", device="npu0")
    hung = guilty.submit("work", ms=5)
    time.sleep(0.02)  # the hang is on the device
    noop = unrelated.submit("work", ms=1)
    err = c.expect_failure("the guilty request failed with DeviceTimeout", hung,
                           errors.DeviceTimeout)
    c.s.check("its scope is the guilty context", err is not None and err.scope == "context")
    c.check_completes("the unrelated request completed", noop, 5)
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
    time.sleep(0.05)
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

    def signal_slowly() -> None:
        for f in inputs:
            time.sleep(0.02)
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


# -- running ------------------------------------------------------------------------------


SUITES = ("IGT gem_reset_stats", "IGT sw_sync", "IGT syncobj_wait", "DRM scheduler KUnit",
          "dEQP robustness", "hetproc", "hetproc drill")


def _listed(case: Case) -> tuple[int, int]:
    """Suite by suite, each in the order its cases were registered."""
    return SUITES.index(case.suite), list(CASES).index(case.name)


def conformance_cases(only: str | None = None) -> list[Case]:
    """The cases whose name matches ``only`` (a glob; a plain word matches as a
    substring), in their registered order."""
    if not only:
        return sorted(CASES.values(), key=_listed)
    pattern = only if any(ch in only for ch in "*?[") else f"*{only}*"
    chosen = [c for c in sorted(CASES.values(), key=_listed)
              if fnmatch.fnmatchcase(c.name, pattern)]
    if not chosen:
        raise errors.InvalidRequest(f"no conformance case matches {only!r} "
                                    f"(hetproc conformance --list names them)")
    return chosen


def _spec(group: str, base: PlatformSpec, recovery: dict[str, Any]) -> PlatformSpec:
    return dataclasses.replace(base, recovery={**base.recovery, **GROUPS[group], **recovery})


def _row(case: Case, ok: bool, checks: list[dict[str, Any]], metrics: dict[str, Any],
         duration_s: float, error: str | None = None) -> dict[str, Any]:
    return {"name": case.name, "suite": case.suite, "checks_what": case.checks,
            "ok": ok, "failed_checks": [c["name"] for c in checks if not c["passed"]],
            "details": {c["name"]: c["detail"] for c in checks if not c["passed"]},
            "recovery_ms": metrics.get("recovery_ms"), "error": error,
            "duration_s": round(duration_s, 3)}


def _run_drill_case(case: Case, platform_file: str | None, time_scale: float | None,
                    recovery: dict[str, Any]) -> dict[str, Any]:
    """A drill on its own fresh platform, as ``hetproc drill`` runs it, with the policy
    overrides on top of the drill's own."""
    t0 = time.monotonic()
    assert case.drill is not None
    fn, doc, _ = DRILLS[case.drill]
    spec = drill_spec(case.drill, platform_file=platform_file, time_scale=time_scale)
    spec = dataclasses.replace(spec, recovery={**spec.recovery, **recovery})
    report = run_on_platform(lambda s: fn(Drill(s, case.drill or "")), f"drill:{case.drill}",
                             doc, spec, {})
    left = report["left_behind"]
    ok = report["ok"] and not left["objects"] and not left["processes"]
    return _row(case, ok, report["checks"], report["metrics"], time.monotonic() - t0,
                report.get("error"))


def _run_group(cases: list[Case], spec: PlatformSpec, on_row: Callable[[dict], None]) -> None:
    """Every case of one group, in turn, on one platform."""
    rows: list[dict[str, Any]] = []

    def run_all(s: Scenario) -> None:
        for case in cases:
            first, t0 = len(s.checks), time.monotonic()
            run = CaseRun(s, case.name)
            error = None
            try:
                assert case.fn is not None
                case.fn(run)
            except Exception as exc:  # one case breaking must not hide the others' results
                error = f"{type(exc).__name__}: {exc}"
                s.check("ran to the end", False, error)
            finally:
                run.tear_down()
            _check_settled(s)
            mine = [{"name": c.name, "passed": c.passed, "detail": c.detail}
                    for c in s.checks[first:]]
            rows.append(_row(case, all(c["passed"] for c in mine), mine,
                             {"recovery_ms": run.recovery_ms()}, time.monotonic() - t0, error))

    report = run_on_platform(run_all, f"conformance:{cases[0].group}",
                             "conformance cases on a shared platform", spec, {})
    left = report["left_behind"]
    for row in rows:
        if left["objects"] or left["processes"]:  # whose it was cannot be told: all fail
            row["ok"] = False
            row["failed_checks"].append("the shared platform left nothing behind")
            row["details"]["the shared platform left nothing behind"] = str(left)
        on_row(row)
    if len(rows) < len(cases):  # the platform itself broke before every case ran
        for case in cases[len(rows):]:
            on_row(_row(case, False, [], {}, 0.0, report.get("error") or "did not run"))


def _check_settled(s: Scenario) -> None:
    """No incident running and no command in flight: the next case starts on a quiet
    platform (a case that leaves one behind fails here, not its neighbour)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = s.client.metrics()
        if not m["incidents"]["active"] and not m["in_flight"]:
            s.check("the platform settled (no incident running, nothing in flight)", True)
            return
        time.sleep(0.01)
    s.check("the platform settled (no incident running, nothing in flight)", False,
            f"in flight {m['in_flight']}, incidents {m['incidents']}")


def run_conformance(*, only: str | None = None, platform_file: str | None = None,
                    time_scale: float | None = None, recovery: dict[str, Any] | None = None,
                    on_row: Callable[[list[dict[str, Any]], list[str]], None] | None = None
                    ) -> dict[str, Any]:
    """Run the chosen cases; one row per case, in registered order. ``recovery``
    overrides the platforms' recovery policy (a debug policy such as ``unsafe_reclaim``
    or ``max_rearm = 0`` shows the cases that guard it failing)."""
    chosen = conformance_cases(only)
    recovery = dict(recovery or {})
    order = {c.name: i for i, c in enumerate(chosen)}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def done(row: dict[str, Any]) -> None:
        rows.append(row)
        rows.sort(key=lambda r: order[r["name"]])
        if on_row is not None:
            finished = {r["name"] for r in rows}
            on_row(list(rows), [c.name for c in chosen if c.name not in finished])

    base = load_platform(platform_file).with_time_scale(time_scale)
    for group in GROUPS:
        members = [c for c in chosen if c.group == group]
        if members:
            _run_group(members, _spec(group, base, recovery), done)
    for c in chosen:
        if c.drill is not None:
            done(_run_drill_case(c, platform_file, time_scale, recovery))
    return {"rows": rows, "ok": all(r["ok"] for r in rows),
            "passed": sum(r["ok"] for r in rows), "failed": sum(not r["ok"] for r in rows),
            "duration_s": round(time.monotonic() - t0, 3)}

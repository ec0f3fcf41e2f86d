"""Crash and reset drills: one per fault, plus the death of each kind of process.

A drill injects one failure on a live platform while a bystander client (the "camera",
on another device) keeps working, and checks what a runtime must guarantee (seed §14,
§15, §20): the error's code and scope; that no waiter waited past watchdog + grace; that
resource counts (contexts, buffers, fences, processes, ``/dev/shm`` objects) return to
their baseline; that the next request succeeds; that the fallback ran when configured;
that the other client was not affected. A drill that cannot fail is no drill: each check
trips when the mechanism it guards is broken (``--unsafe-reclaim`` shows one doing so).
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ipc import cleanup_dead, entries_with_prefix, errors

from .._config import PlatformSpec, load_platform
from ..client import now
from ..client import sleep as platform_sleep  # modeled on the virtual clock
from . import _children, _realclock
from ._bystander import Bystander
from ._leaks import alive, leftovers
from ._scenario import Scenario, run_on_platform

DRILLS: dict[str, tuple[Callable[[Drill], None], str, dict[str, Any]]] = {}


def drill(name: str, doc: str, real_clock: str | None = None, **recovery: Any):
    """Register a drill; ``recovery`` sets the platform's recovery policy for it;
    ``real_clock``: why it cannot run on the virtual clock (``_realclock``), if so."""
    def register(fn: Callable[[Drill], None]):
        DRILLS[name] = (fn, doc, recovery)
        if real_clock:
            _realclock.DRILLS[name] = real_clock
        return fn
    return register


class Drill:
    """Helpers shared by every drill, on top of the scenario's result recording."""

    def __init__(self, s: Scenario, name: str) -> None:
        self.s = s
        self.name = name
        self.plat = s.platform
        self.client = s.client
        spec = self.plat.spec
        # the longest a device may take to confirm a cancel (each has its own stop timeout)
        self.grace_ms = max(spec.engine(d.name).stop_timeout_ms for d in spec.devices)
        self.bound_ms = (spec.watchdog_ms * (1 + 2) + self.grace_ms) * spec.time_scale + 250
        self.bystander: Bystander | None = None

    # -- before / after ---------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        m = self.client.metrics()
        # Fence semaphores are kept for reuse by design (buffer segments have no name at
        # all); what must come back to baseline is every other named object.
        pooled = m["fence_semaphores"]
        return {"contexts": m["contexts"], "registered_buffers": m["registered_buffers"],
                "live_fences": m["live_fences"], "clients": m["clients"],
                "quarantined_buffers": m["quarantined_buffers"],
                "device_processes": sum(1 for d in m["devices"].values() if d["pid"]),
                "shm_objects": len(entries_with_prefix(self.plat.prefix)) - pooled}

    def sleep(self, ms: float) -> None:
        """Let ``ms`` of the platform's time pass: modeled on the virtual clock (a real
        sleep there would hold the clock, then move it without us: a determinism break)."""
        platform_sleep(ms, self.client)

    def now_ms(self) -> float:
        """The platform's now in ms (modeled on the virtual clock), to measure waits."""
        return now(self.client) / 1e6

    def start(self, bystander_device: str = "isp0") -> dict[str, int]:
        # What a case before this one dropped in a reference cycle (a fence held by the
        # frame of an exception it caught) is released when the collector finds it: now,
        # before the count, not halfway through this case, whose counts would then end
        # below the baseline and fail it for its neighbour's leftovers.
        gc.collect()
        baseline = self.counts()
        self.start_bystander(bystander_device)
        return baseline

    def start_bystander(self, device: str = "isp0") -> None:
        self.bystander = Bystander(self.plat, device)
        self.sleep(20)

    def finish(self, baseline: dict[str, int]) -> None:
        if self.bystander is not None:
            self.bystander.stop()
            self.s.check("other clients unaffected (camera kept working)",
                         not self.bystander.failures and self.bystander.done > 0,
                         f"{self.bystander.done} camera jobs done, "
                         f"failures: {self.bystander.failures}")
            self.bystander = None
        deadline = time.monotonic() + 3
        while True:  # reclamation is asynchronous: give it a moment, never forever
            counted = self.counts()
            if counted == baseline or time.monotonic() > deadline:
                break
            self.sleep(20)
        diff = {k: (baseline[k], counted[k]) for k in baseline if baseline[k] != counted[k]}
        self.s.check("resource counts back to baseline", not diff,
                     "unchanged" if not diff else f"(before, after): {diff}")
        inc = self.client.incidents()
        self.s.timeline.extend(inc["history"])
        self.s.metric("watchdog_verdicts", inc["verdicts"])
        if inc["history"]:
            self.s.metric("recovery_ms", inc["history"][-1]["recovery_ms"])

    # -- checks -----------------------------------------------------------------------

    def expect_error(self, fence, cls: type[errors.HetprocError], scope: str | None = None):
        t0 = self.now_ms()
        try:
            fence.wait(self.bound_ms / 1000 * 4)
            err = None
        except errors.HetprocError as exc:
            err = exc
        waited_ms = self.now_ms() - t0
        fence.release()
        self.s.metric("waited_ms", round(waited_ms, 3))
        got = f"{err.name} (scope {err.scope}, retryable {err.retryable}, buffers trusted " \
              f"{err.buffers_trusted}, cid {err.correlation_id:#x})" if err else "success"
        ok = isinstance(err, cls) and (scope is None or err.scope == scope)
        self.s.check(f"error is {cls.__name__}" + (f", scope {scope}" if scope else ""), ok, got)
        self.s.check("no waiter waited past watchdog + grace", waited_ms <= self.bound_ms,
                     f"waited {waited_ms:.1f} ms, bound {self.bound_ms:.1f} ms")
        return err

    def check_completes(self, name: str, fence, timeout: float = 10.0) -> bool:
        """Check that ``fence`` completes successfully; release it either way."""
        try:
            fence.wait(timeout)
            return self.s.check(name, True)
        except errors.HetprocError as exc:
            return self.s.check(name, False, exc.name)
        finally:
            fence.release()

    def next_request_succeeds(self, device: str) -> None:
        ctx = self.client.context(device, name="after")
        self.check_completes(f"the next request on {device} succeeds", ctx.submit("work", ms=1), 5)
        ctx.close()

    def incident(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            inc = self.client.incidents()
            if inc["history"] and not inc["active"]:
                return inc["history"][-1]
            self.sleep(10)
        return None


# -- the drills ---------------------------------------------------------------------------


@drill("timeout", "a command hangs but honours cancel: the watchdog cancels it, no reset")
def _timeout(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("npu0", name="victim")
    d.client.inject("timeout", device="npu0")
    err = d.expect_error(ctx.submit("work", ms=5), errors.DeviceTimeout, "context")
    inc = d.incident()
    d.s.check("device confirmed the stop itself (acknowledged, not killed)",
              inc is not None and inc["confirmed_stop"] == "acknowledged",
              str(inc and inc["confirmed_stop"]))
    d.s.check("buffers of the request reported untrusted",
              err is not None and not err.buffers_trusted)
    _check_context_lost(d, ctx)
    d.next_request_succeeds("npu0")
    ctx.close()
    d.finish(base)


@drill("hang", "a command hangs and ignores cancel: isolate (SIGKILL), restart, replay innocents",
       replay_innocent=True)
def _hang(d: Drill) -> None:
    base = d.start()
    epoch = d.client.metrics()["devices"]["npu0"]["epoch"]
    ctx = d.client.context("npu0", name="victim")
    innocent_ctx = d.client.context("npu0", name="innocent")
    d.client.inject("hang", device="npu0")
    guilty = ctx.submit("work", ms=5)
    innocent = innocent_ctx.submit("work", ms=1)  # queued behind the hang on the same device
    d.expect_error(guilty, errors.DeviceTimeout, "context")
    inc = d.incident()
    d.s.check("stop confirmed by reaping the killed process",
              inc is not None and inc["confirmed_stop"] == "reaped" and inc["killed"])
    d.check_completes("innocent command caught in the reset was replayed and succeeded",
                      innocent, 5)
    d.s.check("device restarted with a new epoch",
              d.client.metrics()["devices"]["npu0"]["epoch"] == epoch + 1)
    _check_context_lost(d, ctx)
    d.next_request_succeeds("npu0")
    ctx.close()
    innocent_ctx.close()
    d.finish(base)


@drill("late-writer", "a hung command keeps writing its output after the timeout: its buffer "
       "must stay quarantined until the device is confirmed stopped")
def _late_writer(d: Drill) -> None:
    base = d.start()
    nbytes = 1 << 16
    ctx = d.client.context("npu0", name="victim")
    out = d.client.alloc(nbytes, "uint8")
    where = (out.segment, out.offset)
    d.client.inject("late_writer", device="npu0")
    fence = ctx.submit("work", [], [out], ms=5)
    out.free()  # the client is done with it; only the hung command still references it
    d.expect_error(fence, errors.DeviceTimeout, "context")
    # The next owner: a new buffer of the same size class, filled with a canary. If the
    # block came back while the device could still write, the canary gets overwritten.
    nxt = d.client.alloc(nbytes, "uint8")
    nxt.array()[:] = 0x5A
    _check_canary(d, nxt, (nxt.segment, nxt.offset) == where, "the device stopped")
    nxt.free()
    ctx.close()
    d.next_request_succeeds("npu0")
    d.finish(base)


def _check_canary(d: Drill, nxt: Any, reused: bool, before: str) -> None:
    """After the grace period: the next owner's canary (0x5A) is intact, or the late
    writer reached it (the block was handed out before ``before``)."""
    d.sleep(d.grace_ms * d.plat.spec.time_scale * 3 + 50)
    corrupted = int(np.count_nonzero(nxt.array() != 0x5A))
    d.s.metric("next_owner_got_same_block", reused)
    d.s.metric("canary_bytes_corrupted", corrupted)
    d.s.check("no corruption of the buffer's next owner (canary intact)", corrupted == 0,
              f"{corrupted} of {nxt.nbytes} canary bytes overwritten by the late writer"
              + (f" (the block was handed out before {before})" if corrupted else ""))


@drill("queue-late-writer", "a queue command keeps writing its bound output after its "
       "watchdog: the buffer, freed by its client, must stay bound until the device is "
       "confirmed stopped")
def _late_writer_queue(d: Drill) -> None:
    base = d.start()
    nbytes = 1 << 16
    victim = d.plat.connect("victim")  # closed at the end: its fence pool goes with it
    ctx = victim.context("npu0", name="victim")
    out = victim.alloc(nbytes, "uint8")
    where = (out.segment, out.offset)
    victim.inject("late_writer", device="npu0")  # fires on this client's work only
    with ctx.queue() as q:
        fence = q.submit("work", [], [out], ms=5)
        deadline = time.monotonic() + 5  # running: its buffer is in the device's hands
        while victim.metrics()["devices"]["npu0"]["state"] != "busy" \
                and time.monotonic() < deadline:
            time.sleep(0.002)
        out.free()  # unbinds it: reclaimed once the device proved it let go
        nxt = victim.alloc(nbytes, "uint8")  # the next owner, with a canary
        nxt.array()[:] = 0x5A
        reused = (nxt.segment, nxt.offset) == where
        d.expect_error(fence, errors.DeviceTimeout)
        inc = d.incident()
        d.s.check("the queue command's own watchdog stopped it (reaped)",
                  inc is not None and inc["confirmed_stop"] == "reaped",
                  str(inc and inc["confirmed_stop"]))
    _check_canary(d, nxt, reused, "the device let go")
    nxt.free()
    victim.close()
    d.next_request_succeeds("npu0")
    d.finish(base)


@drill("crash", "the device process dies mid-command: fail its work, restart, probe")
def _crash(d: Drill) -> None:
    base = d.start()
    epoch = d.client.metrics()["devices"]["npu0"]["epoch"]
    ctx = d.client.context("npu0", name="victim")
    d.client.inject("crash", device="npu0", step="in_kernel")
    d.expect_error(ctx.submit("work", ms=20), errors.DeviceCrashed, "device")
    inc = d.incident()
    d.s.check("stop confirmed by reaping", inc is not None and inc["confirmed_stop"] == "reaped")
    d.s.check("device restarted with a new epoch",
              d.client.metrics()["devices"]["npu0"]["epoch"] == epoch + 1)
    d.next_request_succeeds("npu0")
    ctx.close()
    d.finish(base)


@drill("stopped", "the device process is stopped (SIGSTOP) mid-command: it cannot even "
       "acknowledge a cancel; the watchdog isolates it (SIGKILL), restarts it, probes")
def _stopped(d: Drill) -> None:
    base = d.start()
    dev = d.client.metrics()["devices"]["npu0"]
    ctx = d.client.context("npu0", name="victim")
    guilty = ctx.submit("work", ms=500)
    d.sleep(10)  # it runs: its watchdog counts from its start
    os.kill(dev["pid"], signal.SIGSTOP)  # ours: the platform's own device process
    d.expect_error(guilty, errors.DeviceTimeout, "context")
    inc = d.incident()
    d.s.check("stop confirmed by reaping the killed process",
              inc is not None and inc["confirmed_stop"] == "reaped" and inc["killed"])
    d.s.check("device restarted with a new epoch",
              d.client.metrics()["devices"]["npu0"]["epoch"] == dev["epoch"] + 1)
    clock = d.client.metrics().get("clock") or {}
    if clock.get("clock") == "virtual":  # the clock moved past the stopped device: said
        d.s.check("each jump past the stopped device is a determinism break naming it",
                  set(clock.get("determinism_break_devices") or {}) == {"npu0"}
                  and not clock.get("determinism_break_clients"), str(clock))
    _check_context_lost(d, ctx)
    d.next_request_succeeds("npu0")
    ctx.close()
    d.finish(base)


@drill("lost-fence", "a command completes but its fence signal is lost: nobody hangs")
def _lost_fence(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("gpu0", name="victim")
    d.client.inject("lost_fence", device="gpu0")
    t0 = d.now_ms()
    f = ctx.submit("work", ms=2)
    g = ctx.submit("work", wait=[f], ms=1)  # a dependant that would hang behind a lost fence
    g.wait(d.bound_ms / 1000 * 4)
    waited = d.now_ms() - t0
    f.release()
    g.release()
    d.s.check("no waiter waited past watchdog + grace", waited <= d.bound_ms, f"{waited:.1f} ms")
    events = [e["event"] for e in d.client.incidents()["events"]]
    d.s.check("the lost signal was detected and repaired by the supervisor",
              "lost_fence_repaired" in events, str(events))
    d.next_request_succeeds("gpu0")
    ctx.close()
    d.finish(base)


@drill("alloc-fail", "an allocation fails: a clear retryable error, nothing leaks")
def _alloc_fail(d: Drill) -> None:
    base = d.start()
    d.client.inject("alloc_fail")
    try:
        d.client.alloc(4096)
        d.s.check("error is AllocationFailed, scope request, retryable", False,
                  "allocation succeeded")
    except errors.AllocationFailed as exc:
        d.s.check("error is AllocationFailed, scope request, retryable",
                  exc.scope == "request" and exc.retryable)
    buf = d.client.alloc(4096)
    d.s.check("the retry succeeds", True)
    buf.free()
    d.next_request_succeeds("cpu0")
    d.finish(base)


@drill("map-fail", "mapping a buffer into the device fails: the request is refused, nothing runs")
def _map_fail(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("npu0", name="victim")
    buf = d.client.alloc(1024)
    buf.array()[:] = -1.0
    d.client.inject("map_fail", device="npu0")
    try:
        ctx.submit("relu", [buf], [buf])
        d.s.check("error is MapFailed", False, "submit succeeded")
    except errors.MapFailed as exc:
        d.s.check("error is MapFailed", exc.scope == "request" and exc.retryable)
    d.s.check("nothing was executed (the buffer is untouched)", bool((buf.array() == -1).all()))
    ctx.submit("relu", [buf], [buf]).wait(5)
    d.s.check("the retry succeeds", bool((buf.array() == 0).all()))
    buf.free()
    ctx.close()
    d.finish(base)


@drill("compile-timeout", "compiling for the NPU overruns: the context falls back to the CPU",
       fallback_device="cpu0")
def _compile_timeout(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("npu0", name="model")
    d.client.inject("compile_timeout", device="npu0")
    fb = ctx.prepare("matmul")
    d.s.check("fallback ran when configured (context now on cpu0)", fb == "cpu0", str(fb))
    a, b, c = d.client.alloc((8, 8)), d.client.alloc((8, 8)), d.client.alloc((8, 8))
    a.array()[:] = 1
    b.array()[:] = 2
    ctx.submit("matmul", [a, b], [c]).wait(5)
    d.s.check("the request runs on the fallback device with the right result",
              bool((c.array() == 16).all()))
    err = d.client.metrics()["last_error"] or {}
    d.s.check("the compile timeout is recorded", err.get("name") == "CompileTimeout",
              str(err.get("name")))
    for x in (a, b, c):
        x.free()
    ctx.close()
    d.finish(base)


@drill("wrong-output", "the device flips output bits: unchecked it is silent, checked it fails")
def _wrong_output(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("gpu0", name="victim")
    x, y = d.client.alloc(4096), d.client.alloc(4096)
    x.array()[:] = np.linspace(-1, 1, 4096, dtype=np.float32)
    want = np.maximum(x.array(), 0)
    d.client.inject("wrong_output", device="gpu0")
    ctx.submit("relu", [x], [y]).wait(5)
    silent = not np.array_equal(y.array(), want)
    d.s.check("unchecked execution delivers the corruption silently (why checking exists)", silent)
    d.client.inject("wrong_output", device="gpu0")
    d.expect_error(ctx.submit("relu", [x], [y], checked=True), errors.WrongOutput, "request")
    ctx.submit("relu", [x], [y], checked=True).wait(5)
    d.s.check("the retry is correct", bool(np.array_equal(y.array(), want)))
    x.free()
    y.free()
    ctx.close()
    d.finish(base)


@drill("heartbeat-stall", "the heartbeat stops while the job still progresses: verdict no hang")
def _heartbeat_stall(d: Drill) -> None:
    base = d.start()
    ctx = d.client.context("dsp0", name="long-job")
    spec = d.plat.spec
    d.client.inject("heartbeat_stall", device="dsp0")
    # Longer than the watchdog, which is named explicitly: the default would grow with the
    # command's modeled duration and never fire, and the re-arm is what this drill checks.
    f = ctx.submit("work", ms=spec.watchdog_ms * 2.5, timeout_ms=spec.watchdog_ms)
    d.check_completes("the long, progressing job completed (not killed)", f)
    verdicts = d.client.incidents()["verdicts"]
    d.s.check("watchdog verdict was 'no hang' (re-armed on progress)",
              verdicts.get("no_hang", 0) >= 1 and not verdicts.get("timed_out"), str(verdicts))
    d.next_request_succeeds("dsp0")
    ctx.close()
    d.finish(base)


@drill("oom", "the memory budget runs out: OutOfMemory, then freeing makes room again")
def _oom(d: Drill) -> None:
    base = d.start()
    held = []
    try:
        for _ in range(10_000):
            held.append(d.client.alloc(1 << 20, "uint8"))
        d.s.check("error is OutOfMemory", False, "the budget never ran out")
    except errors.OutOfMemory as exc:
        d.s.check("error is OutOfMemory", exc.retryable, f"after {len(held)} MiB: {exc}")
    for b in held[: len(held) // 2]:
        b.free()
    try:
        d.client.alloc(1 << 20, "uint8").free()
        d.s.check("freeing makes room: the next allocation succeeds", True)
    except errors.HetprocError as exc:
        d.s.check("freeing makes room: the next allocation succeeds", False, exc.name)
    for b in held[len(held) // 2:]:
        b.free()
    d.next_request_succeeds("npu0")
    d.finish(base)


@drill("supervisor-crash", "the supervisor is killed: waiters wake, devices exit, cleanup clears")
def _supervisor_crash(d: Drill) -> None:
    plat = d.plat
    pids = [plat.pid] + [x["pid"] for x in d.client.metrics()["devices"].values()]
    fence = d.client.context("npu0").submit("work", ms=5000)
    t0 = time.monotonic()
    plat.kill_supervisor()
    try:
        fence.wait(10)
        err = None
    except errors.HetprocError as exc:
        err = exc
    waited = (time.monotonic() - t0) * 1000
    d.s.check("the waiter woke with SupervisorLost", isinstance(err, errors.SupervisorLost),
              err.name if err else "success")
    d.s.check("no waiter waited past watchdog + grace", waited <= d.bound_ms, f"{waited:.1f} ms")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.01)
    d.s.check("every device process exited on its own", not alive(pids[1:]))
    try:
        d.client.ping()
        d.s.check("the next call gets a clear error", False, "it succeeded")
    except errors.PlatformError as exc:
        d.s.check("the next call gets a clear error", True, exc.name)
    report = cleanup_dead()
    # Another cleanup (a run beside this one, a user's `hetproc cleanup`) may find the dead
    # platform first: then this one does not name it, and nothing of it is left either.
    d.s.check("hetproc cleanup removed the dead platform",
              plat.prefix in report["platforms"] or not leftovers(plat.prefix)["objects"],
              "" if plat.prefix in report["platforms"] else "removed by a cleanup beside it")
    d.s.check("nothing of it remains in /dev/shm", not leftovers(plat.prefix)["objects"])


@drill("client-crash", "a client dies with work in flight: its contexts go, its buffers are "
       "reclaimed once no device uses them")
def _client_crash(d: Drill) -> None:
    # The camera starts once the doomed client is ready: while this process waits for
    # it outside hetproc (the pipe), its dated jobs would move the virtual clock anyway.
    base = d.counts()
    hold_ms = 300
    proc = _children.spawn(_children.DOOMED, d.plat.prefix, str(hold_ms))
    d.s.extra_pids.append(proc.pid)
    try:
        d.s.check("the doomed client was running", _children.read_line(proc) == "ready")
        d.start_bystander()
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
    finally:
        _children.end(proc)
    d.sleep(50)
    m = d.client.metrics()
    d.s.check("its buffers stay quarantined while the device still uses them",
              m["quarantined_buffers"] == 4, f"{m['quarantined_buffers']} quarantined")
    with_camera = 1  # the bystander's client and context are still up
    d.s.check("its client and context were torn down at once",
              m["clients"] == base["clients"] + with_camera
              and m["contexts"] == base["contexts"] + with_camera,
              f"clients {m['clients']}, contexts {m['contexts']}")
    d.finish(base)


def _check_context_lost(d: Drill, ctx) -> None:
    try:
        ctx.submit("work", ms=0)
        d.s.check("later submits on the guilty context fail at once (ContextLost)", False)
    except errors.ContextLost:
        d.s.check("later submits on the guilty context fail at once (ContextLost)", True)


# -- running ------------------------------------------------------------------------------


def drill_spec(name: str, *, platform_file: str | None = None, time_scale: float | None = None,
               unsafe_reclaim: bool = False, seed: int | None = None,
               clock: str | None = None, tie_seed: int | None = None) -> PlatformSpec:
    spec = load_platform(platform_file).with_time_scale(time_scale).with_clock(clock)
    spec = spec.with_tie_seed(tie_seed)
    _, _, recovery = DRILLS[name]
    policy = {**spec.recovery, **recovery}
    if unsafe_reclaim:
        policy["unsafe_reclaim"] = True
    changes: dict[str, Any] = {"recovery": policy}
    if seed is not None:
        changes["fault_seed"] = seed  # drives the fault plan's seeded generator
    if name == "oom":
        changes["memory_mib"] = 64
    return dataclasses.replace(spec, **changes)


def run_drill(name: str, *, platform_file: str | None = None, time_scale: float | None = None,
              unsafe_reclaim: bool = False, progress: Callable[[str], None] | None = None,
              seed: int | None = None, clock: str | None = None,
              tie_seed: int | None = None) -> dict[str, Any]:
    """Run one drill on a fresh platform; its report. ``seed`` seeds the platform's fault
    plan (a campaign runs one drill under many seeds); ``clock``: "real" or "virtual"
    (None: the platform file's); ``tie_seed``: the virtual clock's order of simultaneous
    events (None: the platform file's)."""
    if name not in DRILLS:
        near = difflib.get_close_matches(name, list(DRILLS), n=1)
        raise errors.InvalidRequest(f"no drill {name!r}" + (f" (did you mean {near[0]!r}?)" if near
                                    else "") + f"; known: {', '.join(DRILLS)}")
    fn, doc, _ = DRILLS[name]
    spec = drill_spec(name, platform_file=platform_file, time_scale=time_scale,
                      unsafe_reclaim=unsafe_reclaim, seed=seed, clock=clock,
                      tie_seed=tie_seed)
    skip = _realclock.skipped(spec, _realclock.DRILLS.get(name))
    report = (_realclock.skipped_report(f"drill:{name}", doc, spec, skip) if skip else
              run_on_platform(lambda s: fn(Drill(s, name)), f"drill:{name}", doc, spec,
                              {"unsafe_reclaim": unsafe_reclaim}, progress=progress))
    report["drill"] = name
    report["seed"] = seed
    report["tie_seed"] = spec.tie_seed if spec.clock == "virtual" else None
    return report

"""Conformance cases for what resets leave behind: reset statistics and status (IGT
``gem_reset_stats``, GL robustness), bans, and wedged devices (IGT ``gem_eio``,
``xe_wedged``). Registered with ``_conformance_cases.case``; they run on the shared
platform like the others, and each leaves it as it found it (a wedged device is
unwedged, a banned process has exited).

Bans count per process, so the cases that ban run their hangs in a client process of
their own: the platform's owner, which drives every other case, is never banned.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ipc import errors

from ..client import sleep, unwedge
from ._conformance_cases import CaseRun, case

ILLEGAL_HANDLE = 0x7FFF_FFF0  # never issued: its slot and generation name no context


def _stats(ctx: Any) -> tuple[str, int, int, int]:
    status, stats = ctx.reset_status(), ctx.reset_stats()
    return status.status, stats.resets, stats.guilty, stats.innocent


# -- gem_reset_stats: statistics -------------------------------------------------------------


@case("gem_reset_stats/params", "IGT gem_reset_stats",
      "the reset statistics query refuses what is not the caller's own context (an illegal "
      "handle: InvalidHandle; another client's context: ForeignHandle) and answers a fresh "
      "context with status none and every count at zero")
def _params(c: CaseRun) -> None:
    other = c.connect("other")
    theirs = other.context("gpu0", name="theirs")
    mine = c.client.context("gpu0", name="mine")
    for name, handle, cls in (("an illegal handle", ILLEGAL_HANDLE, errors.InvalidHandle),
                              ("another client's context", theirs.handle,
                               errors.ForeignHandle)):
        try:
            c.client.connection.request("reset_stats", ctx=handle)
            c.s.check(f"the query on {name} is refused", False, "it was answered")
        except errors.HetprocError as exc:
            c.s.check(f"the query on {name} is refused", isinstance(exc, cls), exc.name)
    c.s.check("a fresh context: status none, no reset, nothing guilty or innocent",
              _stats(mine) == ("none", 0, 0, 0), str(_stats(mine)))
    c.s.check("no reset is in progress", not mine.reset_status().in_progress)
    mine.close()
    theirs.close()


@case("gem_reset_stats/reset-stats-ctx-npu0", "IGT gem_reset_stats",
      "a context hangs npu0 while another tenant's command runs behind it and a third "
      "context on npu0 has nothing queued: after the reset the guilty context reads "
      "(guilty; 1 reset, 1 guilty, 0 innocent), the innocent one (innocent; 1, 0, 1) and "
      "the unrelated one (none; 1, 0, 0); a context on another device saw no reset")
def _reset_stats_ctx(c: CaseRun) -> None:
    base = c.start()
    other, third = c.connect("innocent-app"), c.connect("unrelated-app")
    guilty = c.client.context("npu0", name="guilty")
    innocent = other.context("npu0", name="innocent")
    unrelated = third.context("npu0", name="unrelated")
    elsewhere = third.context("gpu0", name="elsewhere")
    c.client.inject("hang", device="npu0")
    hung = guilty.submit("work", ms=5)
    sleep(20, c.client)  # the hang runs; the innocent command goes into the ring behind it
    caught = innocent.submit("work", ms=1)
    c.expect_failure("the guilty command failed (DeviceTimeout)", hung, errors.DeviceTimeout)
    c.expect_failure("the innocent command was cancelled by the reset", caught,
                     errors.CancelledByReset)
    c.s.check("the reset finished", c.new_incident() is not None)
    for name, ctx, want in (("guilty", guilty, ("guilty", 1, 1, 0)),
                            ("innocent", innocent, ("innocent", 1, 0, 1)),
                            ("unrelated", unrelated, ("none", 1, 0, 0)),
                            ("on another device", elsewhere, ("none", 0, 0, 0))):
        c.s.check(f"the {name} context's status and counts", _stats(ctx) == want,
                  f"{_stats(ctx)}, want {want}")
    c.s.check("no reset in progress once it finished",
              not any(x.reset_status().in_progress for x in (guilty, innocent, unrelated)))
    for f in (hung, caught):
        f.release()
    for ctx in (guilty, innocent, unrelated, elsewhere):
        ctx.close()
    other.close()
    third.close()
    c.finish(base)


RESET_APP = """
import json, sys, hetproc
c = hetproc.connect(sys.argv[1], sys.argv[2])
ctx = c.context("npu0", name=sys.argv[2])
if sys.argv[2] == "guilty":
    c.inject("hang", device="npu0")   # a tenant's fault: it fires on its own work only
print("ready", flush=True)
sys.stdin.readline()
f = ctx.submit("work", ms=5)
try:
    f.wait(10)
    outcome = "ok"
except hetproc.HetprocError as exc:
    outcome = exc.name
s = hetproc.ResetStats.of_process(c)
print(json.dumps([outcome, s.resets, s.guilty, s.innocent]), flush=True)
sys.stdin.readline()
c.close()
"""


@case("gem_reset_stats/reset-stats-npu0", "IGT gem_reset_stats",
      "the same per process: a process whose command hangs npu0 reads (1 reset, 1 guilty, "
      "0 innocent), a process whose command was running behind it (1, 0, 1), one with a "
      "context on npu0 and nothing queued (1, 0, 0)")
def _reset_stats_process(c: CaseRun) -> None:
    apps = {role: c.spawn(RESET_APP, role) for role in ("guilty", "innocent", "unrelated")}
    c.s.check("three client processes ready", all(c.hear(p) == "ready" for p in apps.values()))
    c.tell(apps["guilty"])
    sleep(50, c.client)  # the hang runs
    c.tell(apps["innocent"])
    got = {role: json.loads(c.hear(apps[role]) or "null") for role in ("guilty", "innocent")}
    c.new_incident()
    c.tell(apps["unrelated"])  # its command runs after the reset
    got["unrelated"] = json.loads(c.hear(apps["unrelated"]) or "null")
    want = {"guilty": ["DeviceTimeout", 1, 1, 0], "innocent": ["CancelledByReset", 1, 0, 1],
            "unrelated": ["ok", 1, 0, 0]}
    for role, expected in want.items():
        c.s.check(f"the {role} process's outcome and counts", got[role] == expected,
                  f"{got[role]}, want {expected}")
    for proc in apps.values():
        c.tell(proc)
        c.s.check("it exited cleanly", proc.wait(10) == 0)


@case("gem_reset_stats/reset-count-ctx-npu0", "IGT gem_reset_stats",
      "each reset of npu0 counts once for every context on it from its creation: a "
      "context made before two resets reads 2, one made between them 1; neither was "
      "guilty nor innocent")
def _reset_count_ctx(c: CaseRun) -> None:
    early = c.client.context("npu0", name="early")
    late = None
    for round_ in range(2):
        guilty = c.client.context("npu0", name=f"guilty{round_}")
        c.client.inject("timeout", device="npu0")
        c.expect_failure(f"hang {round_ + 1} failed (DeviceTimeout)",
                         guilty.submit("work", ms=5, timeout_ms=20), errors.DeviceTimeout)
        c.new_incident()
        guilty.close()
        if late is None:
            late = c.client.context("npu0", name="late")
    assert late is not None
    for name, ctx, want in (("early", early, ("none", 2, 0, 0)),
                            ("late", late, ("none", 1, 0, 0))):
        c.s.check(f"the {name} context's counts", _stats(ctx) == want,
                  f"{_stats(ctx)}, want {want}")
    early.close()
    late.close()


# -- gem_reset_stats: bans -------------------------------------------------------------------

BAN_APP = """
import json, sys, hetproc
c = hetproc.connect(sys.argv[1], "banned-app")
out = {}

def hang_until_banned(ctx):
    scopes = []
    for _ in range(10):
        c.inject("timeout", device="npu0")  # its own work only
        try:
            f = ctx.submit("work", ms=5, timeout_ms=20)
        except hetproc.ContextBanned as exc:
            c.clear_faults()  # the rule armed for the refused submit must not fire later
            return scopes, [exc.scope, exc.retryable]
        try:
            f.wait(10)
            scopes.append("ok")
        except hetproc.HetprocError as exc:
            scopes.append(exc.scope)
    return scopes, None

keep = c.context("npu0", name="keeps-working", recoverable=True)
first = c.context("npu0", name="hangs", recoverable=True)
out["hangs"], out["refused"] = hang_until_banned(first)
out["banned"] = first.reset_status().banned
out["other_ctx_works"] = keep.submit("work", ms=1).wait(5) is None
if sys.argv[2] == "process":
    for _ in range(2):
        out["more"] = hang_until_banned(c.context("npu0", recoverable=True))[1]
    try:
        c.context("npu0")
        out["new_context"] = "created"
    except hetproc.ContextBanned as exc:
        out["new_context"] = exc.scope
    out["old_ctx_works"] = keep.submit("work", ms=1).wait(5) is None
print(json.dumps(out), flush=True)
c.close()
"""


def _banned_app(c: CaseRun, mode: str) -> dict[str, Any]:
    proc = c.spawn(BAN_APP, mode)
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        sleep(10, c.client)  # waits in hetproc: the platform's time goes on for the app
    line = c.hear(proc)
    c.s.check("the process exited cleanly", proc.wait(30) == 0)
    return json.loads(line) if line else {}


@case("gem_reset_stats/ban-ctx-npu0", "IGT gem_reset_stats",
      "a recoverable context of a client process hangs npu0 again and again: the first two "
      "hangs fail only that command (scope request), the third (recovery.ban_hangs) bans "
      "it (scope context), and every later submit on it is refused with ContextBanned (not "
      "retryable); the process's other context and every other tenant keep working")
def _ban_ctx(c: CaseRun) -> None:
    base = c.start()
    got = _banned_app(c, "ctx")
    c.s.check("two hangs it survived, then the one that banned it",
              got.get("hangs") == ["request", "request", "context"], str(got.get("hangs")))
    c.s.check("its next submit was refused with ContextBanned, not retryable",
              got.get("refused") == ["context", False], str(got.get("refused")))
    c.s.check("its status says banned", got.get("banned") is True)
    c.s.check("the process's other context keeps working", got.get("other_ctx_works") is True)
    c.next_request_succeeds("npu0")
    c.finish(base)


@case("gem_reset_stats/ban-npu0", "IGT gem_reset_stats",
      "a client process whose contexts are banned again and again (recovery.ban_contexts "
      "of them within the window) is banned itself: a new context is refused "
      "(ContextBanned, scope process) while its unbanned context and every other tenant "
      "keep working; the ban ends with the process")
def _ban_process(c: CaseRun) -> None:
    base = c.start()
    got = _banned_app(c, "process")
    c.s.check("its third banned context was banned like the first",
              got.get("more") == ["context", False], str(got.get("more")))
    c.s.check("a new context was refused: the process is banned",
              got.get("new_context") == "process", str(got.get("new_context")))
    c.s.check("its context that never hung keeps working", got.get("old_ctx_works") is True)
    c.next_request_succeeds("npu0")
    c.finish(base)


# -- wedged devices (gem_eio, xe_wedged) -----------------------------------------------------


def _wedge(c: CaseRun, device: str) -> tuple[Any, Any]:
    """Crash ``device`` (once its command has held for 200 modeled ms) with both attempts
    to reset it failing: it is wedged. Returns the crashing context and its fence."""
    c.client.inject("reset_fail", device=device, every=1, count=2)
    c.client.inject("crash", device=device, step="before_signal")
    crasher = c.client.context(device, name="crasher")
    return crasher, crasher.submit("work", ms=200)


def _crashed(c: CaseRun, crash: tuple[Any, Any]) -> None:
    """The crashing command failed with DeviceCrashed; its context goes."""
    crasher, f = crash
    c.expect_failure("the crashed command failed (DeviceCrashed)", f, errors.DeviceCrashed)
    f.release()
    crasher.close()


def _unwedged(c: CaseRun, device: str) -> None:
    epoch = c.client.metrics()["devices"][device]["epoch"]
    out = unwedge(c.client, device)
    c.s.check("the unwedge reset the device (a new epoch)",
              out["was_wedged"] and out["epoch"] > epoch, str(out))
    c.s.check("the device no longer reads wedged",
              not c.client.metrics()["devices"][device]["wedged"])
    ctx = c.client.context(device, name="after")
    c.check_completes("the first request after the unwedge completes (no hang)",
                      ctx.submit("work", ms=1), 3)
    ctx.close()


@case("xe_wedged/basic-wedged", "IGT xe_wedged",
      "a failure injected into the reset path, twice in a row, leaves dsp0 wedged: metrics "
      "and the context's status say so, a submit fails at once with DeviceWedged (scope "
      "device, not retryable), a buffer it wrote stays readable, other devices serve; an "
      "explicit unwedge resets it (a new epoch) and the next request succeeds")
def _basic_wedged(c: CaseRun) -> None:
    base = c.start()
    ctx = c.client.context("dsp0", name="user")
    buf = c.client.alloc(64)
    buf.array()[:] = 3.0
    out = c.client.alloc(64)
    c.check_completes("a request before the wedge", ctx.submit("scale", [buf], [out],
                                                               params={"factor": 2.0}))
    _crashed(c, _wedge(c, "dsp0"))
    inc = c.new_incident()
    c.s.check("its incident records two failed resets and the wedge",
              inc is not None and inc["wedged"]
              and [s["step"] for s in inc["steps"]].count("reset_failed") == 2,
              str(inc and [s["step"] for s in inc["steps"]]))
    c.s.check("metrics say dsp0 is wedged", c.client.metrics()["devices"]["dsp0"]["wedged"])
    c.s.check("the context's status says wedged", ctx.reset_status().wedged)
    t0 = time.monotonic()
    try:
        ctx.submit("work", ms=1)
        c.s.check("a submit fails at once with DeviceWedged", False, "it was accepted")
    except errors.DeviceWedged as exc:
        c.s.check("a submit fails at once with DeviceWedged",
                  exc.scope == "device" and not exc.retryable, f"{exc.scope} {exc.retryable}")
    c.s.metric("refused_in_ms", round((time.monotonic() - t0) * 1000, 3))
    c.s.check("the buffer it wrote stays readable", bool((out.array() == 6.0).all()))
    c.next_request_succeeds("gpu0")
    _unwedged(c, "dsp0")
    c.check_completes("the old context serves again", ctx.submit("work", ms=1), 3)
    buf.free()
    out.free()
    ctx.close()
    c.finish(base)


@case("xe_wedged/wedged-at-any-timeout", "IGT xe_wedged", group="wedge_on_hang", checks=(
      "with the policy wedge_on_hang (xe's wedged_mode 2) a job that hangs npu0 wedges it at "
      "once: no cancel and no reset are tried, the hung job fails (DeviceTimeout), a job "
      "behind it ends with DeviceWedged, a submit is refused; an explicit unwedge resets "
      "it and the next request succeeds"))
def _wedged_at_any_timeout(c: CaseRun) -> None:
    base = c.start()
    guilty, other = c.client.context("npu0", name="hangs"), c.client.context("npu0")
    c.client.inject("timeout", device="npu0")  # it would honour a cancel: none is sent
    hung = guilty.submit("work", ms=5, timeout_ms=20)
    time.sleep(0.01)
    behind = other.submit("work", ms=1)
    c.expect_failure("the hung job failed (DeviceTimeout)", hung, errors.DeviceTimeout)
    c.expect_failure("the job behind it ended with DeviceWedged", behind, errors.DeviceWedged)
    inc = c.new_incident()
    steps = [s["step"] for s in inc["steps"]] if inc else []
    c.s.check("wedged at once: no cancel, no reset attempted",
              inc is not None and inc["wedged"] and "wedged" in steps
              and not {"cancel", "restart", "reset_failed"} & set(steps), str(steps))
    try:
        other.submit("work", ms=1)
        c.s.check("a submit is refused with DeviceWedged", False, "it was accepted")
    except errors.DeviceWedged:
        c.s.check("a submit is refused with DeviceWedged", True)
    for f in (hung, behind):
        f.release()
    _unwedged(c, "npu0")
    for ctx in (guilty, other):
        ctx.close()
    c.finish(base)


@case("gem_eio/in-flight-external", "IGT gem_eio",
      "commands on dsp0 waiting on a user fence nobody signalled (one in the device's "
      "ring, more queued behind it on other contexts, one on gpu0 waiting on them) when "
      "dsp0 wedges: every one ends with an error (DeviceWedged; DependencyFailed on gpu0) "
      "without the fence being signalled, none hangs; the fence signalled afterwards "
      "changes nothing; unwedged, dsp0 serves again")
def _in_flight_external(c: CaseRun) -> None:
    base = c.start()
    external = c.client.fence()
    ctxs = [c.client.context("dsp0", name=f"victim{i}") for i in range(3)]
    crash = _wedge(c, "dsp0")
    sleep(20, c.client)  # the crasher runs; they go in behind it
    victims = [ctx.submit("work", ms=1, wait=[external]) for ctx in ctxs]
    downstream = c.client.context("gpu0", name="downstream")
    after = downstream.submit("work", ms=1, wait=victims)
    _crashed(c, crash)
    for i, f in enumerate(victims):
        c.expect_failure(f"waiter {i} on the external fence ended with DeviceWedged", f,
                         errors.DeviceWedged)
    c.expect_failure("the command on gpu0 waiting on them failed (DependencyFailed)", after,
                     errors.DependencyFailed)
    external.signal()
    c.expect_failure("the external fence's signal changed nothing", victims[0],
                     errors.DeviceWedged, timeout=0.5)
    for f in [external, after, *victims]:
        f.release()
    _unwedged(c, "dsp0")
    for ctx in [*ctxs, downstream]:
        ctx.close()
    c.finish(base)


@case("gem_eio/execbuf", "IGT gem_eio",
      "on a wedged device a submit that waits for the verdict raises DeviceWedged, one "
      "that does not (submit_nowait) fails its fence with it, a user-mode queue cannot "
      "be opened; a new buffer can still be allocated, written and read")
def _execbuf(c: CaseRun) -> None:
    ctx = c.client.context("dsp0", name="user")
    _crashed(c, _wedge(c, "dsp0"))
    c.new_incident()
    for name, attempt in (("submit", lambda: ctx.submit("work", ms=1)),
                          ("queue", lambda: ctx.queue())):
        try:
            attempt()
            c.s.check(f"{name} is refused with DeviceWedged", False, "it was accepted")
        except errors.HetprocError as exc:
            c.s.check(f"{name} is refused with DeviceWedged",
                      isinstance(exc, errors.DeviceWedged), exc.name)
    nowait = ctx.submit_nowait("work", ms=1)
    c.expect_failure("submit_nowait's fence fails with DeviceWedged", nowait,
                     errors.DeviceWedged)
    nowait.release()
    buf = c.client.alloc(32)
    buf.array()[:] = 5.0
    c.s.check("a new buffer is allocated, written and read", bool((buf.array() == 5.0).all()))
    buf.free()
    _unwedged(c, "dsp0")
    ctx.close()

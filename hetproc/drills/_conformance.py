"""``hetproc conformance``: the recovery and synchronisation cases of the Linux GPU test
suites, each acted out on a live platform under the name of the case it mirrors.

A runtime engineer knows IGT's ``gem_reset_stats``, ``sw_sync`` and ``syncobj_wait``, the
DRM scheduler's KUnit tests and dEQP's robustness group by their case names; this suite
lets them find what hetproc guarantees under those names. A case is listed only where
what hetproc checks really is what the original checks (its README table says how each
maps); a drill with no counterpart in those suites keeps a ``hetproc/`` name, and so
do the synchronisation hazards Vulkan's validation layer names (``_conformance_hazards``).
Mechanisms hetproc does not have yet have no case here, not even a skipped one: a case
that cannot fail proves nothing.

The cases that run on a shared platform live in ``_conformance_cases``, in
``_conformance_sched`` (preempt timeouts), ``_conformance_timeslice`` (timeslicing),
``_conformance_fences`` (fences as descriptors and merges) and, for reset statistics,
bans and wedged devices (IGT ``gem_reset_stats``, ``gem_eio``, ``xe_wedged``), in
``_conformance_recovery``; this module adds the drill
cases and runs them. How they run:

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
import time
from collections.abc import Callable
from typing import Any

from ipc import errors

from .._config import PlatformSpec, load_platform
from ..client import sleep
from . import (
    _conformance_fences,  # noqa: F401  (registers its cases)
    _conformance_recovery,  # noqa: F401  (registers the cases on resets)
    _conformance_sched,  # noqa: F401  (registers its cases)
    _realclock,
    _timefields,
)
from ._conformance_cases import CASES, Case, CaseRun, add_case
from ._conformance_hazards import SUITE as SYNC_SUITE  # (registers its cases too)
from ._conformance_timeslice import timesliced  # (registers its case too)
from ._drills import DRILLS, Drill, drill_spec
from ._scenario import Scenario, run_on_platform

# The policy of each shared platform: i915 runs an innocent context's request again after a
# reset, which hetproc does only when asked (``replay_innocent``); an NPU whose death is a
# subsystem restart (``subsystem_restart``) loses every context on it.
GROUPS: dict[str, dict[str, Any]] = {"shared": {}, "replay": {"replay_innocent": True},
                                     "restart": {"subsystem_restart": ["npu0"]},
                                     "wedge_on_hang": {"wedge_on_hang": True},
                                     "timeslice": {}}
# Groups whose platform differs from the one given in more than its recovery policy.
GROUP_SPECS: dict[str, Callable[[PlatformSpec], PlatformSpec]] = {"timeslice": timesliced}


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
    ("hetproc/queue-late-writer", "hetproc drill", "queue-late-writer",
     "the same on a user-mode queue: a bound buffer freed while a queue command still "
     "writes it is let go only after the device is confirmed stopped (the queue command's "
     "own watchdog, DeviceTimeout); its next owner's canary is intact"),
    ("hetproc/crash", "hetproc drill", "crash",
     "the device process dies mid-command: DeviceCrashed (scope device), reaped, restarted "
     "with a new epoch, next request served"),
    ("hetproc/stopped", "hetproc drill", "stopped",
     "a device process stopped by SIGSTOP mid-command (it cannot acknowledge the cancel) "
     "is timed out (DeviceTimeout, scope context), killed after the grace, reaped and "
     "restarted; on the virtual clock each jump past it is a determinism break naming it"),
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
    add_case(Case(_name, _suite, _checks, drill=_drill, group=f"drill:{_drill}",
                  real_clock=_realclock.DRILLS.get(_drill)))


# -- running ------------------------------------------------------------------------------


SUITES = ("IGT gem_reset_stats", "IGT gem_eio", "IGT xe_wedged", "IGT sw_sync",
          "IGT syncobj_wait", "IGT sysfs_preempt_timeout", "IGT gem_exec_schedule",
          "DRM scheduler KUnit",
          "dEQP robustness", SYNC_SUITE, "hetproc", "hetproc drill")


def _listed(case: Case) -> tuple[int, int]:
    """Suite by suite (a suite not named in ``SUITES`` after them), each in the order its
    cases were registered."""
    rank = SUITES.index(case.suite) if case.suite in SUITES else len(SUITES)
    return rank, list(CASES).index(case.name)


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
    base = GROUP_SPECS.get(group, lambda spec: spec)(base)
    return dataclasses.replace(base, recovery={**base.recovery, **GROUPS[group], **recovery})


def _row(case: Case, ok: bool, checks: list[dict[str, Any]], metrics: dict[str, Any],
         duration_s: float, error: str | None = None,
         skipped: str | None = None) -> dict[str, Any]:
    return {"name": case.name, "suite": case.suite, "checks_what": case.checks,
            "ok": ok, "failed_checks": [c["name"] for c in checks if not c["passed"]],
            "details": {c["name"]: c["detail"] for c in checks if not c["passed"]},
            "recovery_ms": metrics.get("recovery_ms"), "error": error,
            "duration_s": round(duration_s, 3), "skipped": skipped,
            **dict.fromkeys(_timefields.FIELDS)}


def _skipped_row(case: Case, spec: PlatformSpec) -> dict[str, Any] | None:
    """The row of a case that needs the real clock, on the virtual one (``_realclock``)."""
    why = _realclock.skipped(spec, case.real_clock)
    return _row(case, True, [], {}, 0.0, skipped=f"needs the real clock: {why}") if why else None


def _run_drill_case(case: Case, platform_file: str | None, time_scale: float | None,
                    recovery: dict[str, Any], clock: str | None = None) -> dict[str, Any]:
    """A drill on its own fresh platform, as ``hetproc drill`` runs it, with the policy
    overrides on top of the drill's own."""
    t0 = time.monotonic()
    assert case.drill is not None
    fn, doc, _ = DRILLS[case.drill]
    spec = drill_spec(case.drill, platform_file=platform_file, time_scale=time_scale,
                      clock=clock)
    spec = dataclasses.replace(spec, recovery={**spec.recovery, **recovery})
    skipped = _skipped_row(case, spec)
    if skipped is not None:
        return skipped
    report = run_on_platform(lambda s: fn(Drill(s, case.drill or "")), f"drill:{case.drill}",
                             doc, spec, {})
    left = report["left_behind"]
    ok = report["ok"] and not left["objects"] and not left["processes"]
    return {**_row(case, ok, report["checks"], report["metrics"], time.monotonic() - t0,
                   report.get("error")), **_timefields.of_report(report)}


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
        row.update(_timefields.of_report(report))  # the shared platform's run, per group
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
        sleep(10, s.client)  # the platform's time (modeled on the virtual clock)
    s.check("the platform settled (no incident running, nothing in flight)", False,
            f"in flight {m['in_flight']}, incidents {m['incidents']}")


def run_conformance(*, only: str | None = None, platform_file: str | None = None,
                    time_scale: float | None = None, recovery: dict[str, Any] | None = None,
                    on_row: Callable[[list[dict[str, Any]], list[str]], None] | None = None,
                    clock: str | None = None) -> dict[str, Any]:
    """Run the chosen cases; one row per case, in registered order. ``recovery``
    overrides the platforms' recovery policy (a debug policy such as ``unsafe_reclaim``
    or ``max_rearm = 0`` shows the cases that guard it failing); ``clock``: every
    platform's ("real" or "virtual"; None: the file's)."""
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

    base = load_platform(platform_file).with_time_scale(time_scale).with_clock(clock)
    for group in GROUPS:
        members = [c for c in chosen if c.group == group]
        for c in [c for c in members if _skipped_row(c, base) is not None]:
            members.remove(c)
            done(_skipped_row(c, base) or {})
        if members:
            _run_group(members, _spec(group, base, recovery), done)
    for c in chosen:
        if c.drill is not None:
            done(_run_drill_case(c, platform_file, time_scale, recovery, clock))
    return {"rows": rows, "ok": all(r["ok"] for r in rows),
            "passed": sum(r["ok"] and not r["skipped"] for r in rows),
            "skipped": sum(bool(r["skipped"]) for r in rows),
            "failed": sum(not r["ok"] for r in rows),
            "duration_s": round(time.monotonic() - t0, 3)}

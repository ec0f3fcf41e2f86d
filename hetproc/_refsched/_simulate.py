"""One device's decisions and the whole simulation (the package docstring is the model)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from typing import Any

from ipc import errors

from .._config import POLICIES, SchedSpec
from ._model import DevicePolicy, Job, JobOutcome, Schedule, Task, ms_to_ns
from ._policies import MODELS, Run

# -- one device ---------------------------------------------------------------------------

_IDLE, _RUN, _SAVE, _RESTORE = "idle", "run", "save", "restore"


class _Device:
    def __init__(self, name: str, dp: DevicePolicy) -> None:
        self.name = name
        self.dp = dp
        self.policy = MODELS[dp.policy](dp)
        self.state = _IDLE
        self.run: Run | None = None   # running, or being restored
        self.since = 0                 # running: when its current segment began
        self.until = 0                 # switching: when the switch ends
        self.switches = 0
        self.rotations = 0             # timeslice switches (``_behind`` counts them)

    def _current(self) -> Run:
        """The job this device runs, saves or restores: asked only while there is one."""
        if self.run is None:
            raise errors.InternalError(f"reference simulator: {self.name} has no job")
        return self.run

    def done_at(self, t: int) -> int:
        return self._current().done_ns + (t - self.since)

    def next_event(self, t: int) -> int | None:
        """The next instant this device has something to do (>= t), None when idle."""
        if self.state in (_SAVE, _RESTORE):
            return self.until
        if self.state != _RUN:
            return None
        end = self.since + self._current().left_ns
        if not self._may_be_preempted():
            return end
        chunk = self.dp.chunk_ns
        done = self.done_at(t)
        boundary = t + (done // chunk + 1) * chunk - done  # the next one strictly after t
        return min(end, boundary)

    def _may_be_preempted(self) -> bool:
        return (self.dp.chunk_ns > 0 and self._current().job.preemptible
                and self.policy.preemptive
                and len(self.policy) > 0)

    def finish(self, t: int) -> Run | None:
        """End the running job if its work is done at ``t``."""
        if self.state != _RUN or self.since + self._current().left_ns != t:
            return None
        run = self._current()
        run.done_ns = run.job.duration_ns
        run.segments[-1][1] = t
        run.end_ns = t
        self.state, self.run = _IDLE, None
        return run

    def decide(self, t: int) -> None:
        if self.state in (_SAVE, _RESTORE) and self.until == t:
            if self.state == _SAVE:
                self.state = _IDLE
            else:
                self._resume(t)
        if self.state == _RUN and t > self.since and self._may_be_preempted():
            done, running = self.done_at(t), self._current()
            if done % self.dp.chunk_ns == 0 and 0 < done < running.job.duration_ns:
                head = self.policy.peek(t)
                if self.policy.preempts(head, running):
                    self._suspend(t, done)
                elif self._sliced(t, running):
                    self._suspend(t, done, self._behind(t, running))
        if self.state == _IDLE and len(self.policy):
            run = self.policy.pick(t)
            self.run = run
            if run.suspended:
                self._switch(_RESTORE, t)
            else:
                run.start_ns = t
                self.policy.charge(run)
                self._start(t)

    def _sliced(self, t: int, running: Run) -> bool:
        """Its timeslice is over and a job of another context, as urgent, waits."""
        slice_ns = self.dp.timeslice_ns
        return bool(slice_ns) and t - self.since >= slice_ns and any(
            r.job.context != running.job.context and not self.policy.preempts(running, r)
            and not self.policy.preempts(r, running) for r in self.policy.runs())

    def _behind(self, t: int, running: Run) -> tuple:
        """A timesliced job's new place: behind every job waiting at ``t`` (round robin;
        its context's later jobs wait for it, ``_chain_contexts``)."""
        self.rotations += 1
        return (t, (1 << 62) + self.rotations)

    def _suspend(self, t: int, done: int, order: tuple | None = None) -> None:
        run = self._current()
        run.done_ns = done
        run.segments[-1][1] = t
        run.suspended = True
        run.preempted.append([t, -1])
        if order is not None:
            run.order = order
        self.policy.add(run)
        self.run = None
        self._switch(_SAVE, t)

    def _switch(self, kind: str, t: int) -> None:
        self.switches += 1
        if self.dp.switch_ns:
            self.state, self.until = kind, t + self.dp.switch_ns
        elif kind == _SAVE:
            self.state = _IDLE
        else:
            self._resume(t)

    def _resume(self, t: int) -> None:
        run = self._current()
        run.suspended = False
        run.preempted[-1][1] = t
        self._start(t)

    def _start(self, t: int) -> None:
        self.state, self.since = _RUN, t
        self._current().segments.append([t, -1])


# -- the simulation -----------------------------------------------------------------------


def simulate_schedule(jobs: Iterable[Job | Mapping[str, Any]] = (), *,
                      tasks: Iterable[Task | Mapping[str, Any]] = (),
                      horizon_ns: int | None = None, policy: str = "priority",
                      chunk_ns: int = 0, switch_ns: int = 0, dispatch_ns: int = 0,
                      realtime_priority: int = 10, min_share: float = 0.2,
                      devices: Mapping[str, DevicePolicy | SchedSpec] | None = None,
                      timeslice_ns: int = 0) -> Schedule:
    """Simulate a task set; the model is the module's docstring.

    ``jobs``: ``Job`` records or mappings with the same keys (any ``*_ns`` time may be
    given as ``*_ms`` instead, rounded to the ns; ``after`` names awaited jobs). ``tasks``:
    periodic ``Task`` records or mappings, expanded up to ``horizon_ns`` (or their
    ``count``). ``policy``, ``chunk_ns``, ``switch_ns``, ``realtime_priority`` and
    ``min_share`` apply to every device, and so does ``timeslice_ns`` (round robin
    between jobs of equal urgency; 0: none); ``devices`` overrides them per device name (a
    ``DevicePolicy``, or a platform file's ``SchedSpec``). ``dispatch_ns``: the platform's
    modeled dispatch latency, between a job's arrival and its earliest start.
    """
    all_jobs = expand(jobs, tasks, horizon_ns)
    default = DevicePolicy(policy, chunk_ns, switch_ns, realtime_priority, min_share,
                           timeslice_ns)
    _check(all_jobs, default, dispatch_ns)
    overrides = {k: (DevicePolicy.from_spec(v) if isinstance(v, SchedSpec) else v)
                 for k, v in (devices or {}).items()}
    for dp in overrides.values():
        _check_policy(dp)
    runs = [Run(j, i) for i, j in enumerate(all_jobs)]
    by_name = {r.job.name: r for r in runs}
    for r in runs:
        for dep in r.job.after:
            by_name[dep].dependents.append(r)
            r.awaits.append(by_name[dep])
    devs = {name: _Device(name, overrides.get(name, default))
            for name in sorted({j.device for j in all_jobs})}
    _chain_contexts(runs, devs)
    _run(runs, devs, dispatch_ns)
    outcomes = tuple(JobOutcome(r.job, r.index, r.ready_ns, r.start_ns, r.end_ns,
                                _pairs(r.segments), _pairs(r.preempted))
                     for r in runs)
    return Schedule(outcomes, {n: d.switches for n, d in devs.items()},
                    {n: d.switches * d.dp.switch_ns for n, d in devs.items()},
                    {n: d.rotations for n, d in devs.items()})


def _chain_contexts(runs: list[Run], devs: dict[str, _Device]) -> None:
    """On a device that timeslices, each job waits for the previous job of its context
    (submission order): a context runs in order, and only contexts take turns."""
    last: dict[tuple[str, str], Run] = {}
    for r in runs:
        if not devs[r.job.device].dp.timeslice_ns:
            continue
        key = (r.job.device, r.job.context)
        prev = last.get(key)
        if prev is not None:
            r.follows = prev
            prev.dependents.append(r)
            r.deps_left += 1
        last[key] = r


def _pairs(spans: list[list[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((a, b) for a, b in spans)


def expand(jobs: Iterable[Job | Mapping[str, Any]] = (),
           tasks: Iterable[Task | Mapping[str, Any]] = (),
           horizon_ns: int | None = None) -> list[Job]:
    """The task set as ``Job`` records in submission order: the jobs as given, then the
    periodic tasks' jobs by release (at one release, in task order)."""
    out = [_as_job(j) for j in jobs]
    periodic = [j for t in tasks for j in _as_task(t).jobs(horizon_ns)]
    periodic.sort(key=lambda j: j.arrival_ns)  # stable: one release keeps task order
    return out + periodic


def _run(runs: list[Run], devs: dict[str, _Device], dispatch_ns: int) -> None:
    pending: list[tuple[int, tuple[int, int], int]] = []  # (ready, order, index)

    def release(run: Run, ready: int) -> None:
        run.ready_ns = ready
        heapq.heappush(pending, (ready, run.order, run.index))

    for r in runs:
        if not r.deps_left:
            release(r, r.job.arrival_ns + dispatch_ns)
    left = len(runs)
    t = 0
    while left:
        times = [d.next_event(t) for d in devs.values()]
        if pending:
            times.append(pending[0][0])
        due = [x for x in times if x is not None]
        if not due:  # unreachable: every job is released once its awaited jobs end
            raise errors.InternalError("reference simulator: jobs left with nothing to do")
        t = max(t, min(due))
        for dev in devs.values():
            ended = dev.finish(t)
            if ended is None:
                continue
            left -= 1
            for dep in ended.dependents:
                dep.deps_left -= 1
                if not dep.deps_left:
                    waits = max([a.end_ns + a.job.handoff_ns for a in dep.awaits]
                                + [dep.follows.end_ns if dep.follows else 0])
                    release(dep, max(dep.job.arrival_ns + dispatch_ns, waits))
        while pending and pending[0][0] <= t:
            run = runs[heapq.heappop(pending)[2]]
            devs[run.job.device].policy.add(run)
        for dev in devs.values():
            dev.decide(t)


# -- input --------------------------------------------------------------------------------

_TIMES = ("duration", "arrival", "deadline", "handoff", "period", "offset")


def _ns_keys(spec: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A mapping's ``*_ms`` times as ``*_ns`` (rounded), the rest as given."""
    out = dict(spec)
    for base in _TIMES:
        ms = out.pop(f"{base}_ms", None)
        if ms is not None:
            if f"{base}_ns" in out:
                raise errors.InvalidRequest(f"{what}: both {base}_ms and {base}_ns given")
            out[f"{base}_ns"] = ms_to_ns(_number(ms, f"{what}: {base}_ms"))
    return out


def _as_job(spec: Job | Mapping[str, Any]) -> Job:
    if isinstance(spec, Job):
        return spec
    return _build(Job, spec, "job")


def _as_task(spec: Task | Mapping[str, Any]) -> Task:
    if isinstance(spec, Task):
        task = spec
    else:
        task = _build(Task, spec, "task")
    for key in ("period_ns", "duration_ns", "deadline_ns", "offset_ns", "count"):
        _nonnegative(getattr(task, key), f"task {task.name!r}: {key}")
    if task.period_ns <= 0:
        raise errors.InvalidRequest(f"task {task.name!r}: period_ns must be positive")
    return task


def _build(cls: type, spec: Mapping[str, Any], what: str) -> Any:
    if not isinstance(spec, Mapping):
        raise errors.InvalidRequest(f"a {what} is a {cls.__name__} or a mapping, "
                                    f"not {type(spec).__name__}")
    fields = _ns_keys(spec, f"{what} {spec.get('name', '?')!r}")
    if "after" in fields:
        fields["after"] = tuple(fields["after"])
    try:
        return cls(**fields)
    except TypeError as exc:
        raise errors.InvalidRequest(f"{what} {spec.get('name', '?')!r}: {exc}") from None


def _number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise errors.InvalidRequest(f"{what}: {x!r} is not a finite number")
    return float(x)


def _nonnegative(x: Any, what: str) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise errors.InvalidRequest(f"{what}: {x!r} is not a non-negative integer (ns)")


def _check_policy(dp: DevicePolicy) -> None:
    if dp.policy not in MODELS:
        raise errors.InvalidRequest(f"policy {dp.policy!r}: one of {', '.join(POLICIES)}")
    _nonnegative(dp.chunk_ns, "chunk_ns")
    _nonnegative(dp.switch_ns, "switch_ns")
    _nonnegative(dp.timeslice_ns, "timeslice_ns")


def _check(jobs: list[Job], dp: DevicePolicy, dispatch_ns: int) -> None:
    _check_policy(dp)
    _nonnegative(dispatch_ns, "dispatch_ns")
    names: set[str] = set()
    for j in jobs:
        if not isinstance(j.name, str) or j.name in names:
            raise errors.InvalidRequest(f"job name {j.name!r}: a string, given once")
        names.add(j.name)
        for key in ("duration_ns", "arrival_ns", "deadline_ns", "handoff_ns"):
            _nonnegative(getattr(j, key), f"job {j.name!r}: {key}")
        _number(j.weight, f"job {j.name!r}: weight")
        if isinstance(j.priority, bool) or not isinstance(j.priority, int):
            raise errors.InvalidRequest(f"job {j.name!r}: priority {j.priority!r} is not an int")
    for j in jobs:
        for dep in j.after:
            if dep not in names or dep == j.name:
                raise errors.InvalidRequest(f"job {j.name!r} waits for {dep!r}, no other job")
    _check_acyclic(jobs)


def _check_acyclic(jobs: list[Job]) -> None:
    after = {j.name: j.after for j in jobs}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for root in after:
        stack = [(root, iter(after[root]))]
        if state.get(root):
            continue
        state[root] = 1
        while stack:
            name, it = stack[-1]
            dep = next(it, None)
            if dep is None:
                state[name] = 2
                stack.pop()
            elif state.get(dep) == 1:
                raise errors.InvalidRequest(f"jobs wait for each other in a cycle through {dep!r}")
            elif not state.get(dep):
                state[dep] = 1
                stack.append((dep, iter(after[dep])))

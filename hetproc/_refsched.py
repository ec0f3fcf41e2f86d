"""The reference scheduling simulator: the schedule a device ought to produce, job by job.

Pure Python over plain numbers, importable without a platform: a task set, a policy, a
chunk and a switch cost in; every job's modeled start, end, preemptions and deadline miss
out (``simulate_schedule``). It is the specification the product's scheduler and device
are measured against (``hetproc.drills`` compares real runs with it, and
``python -m bench --only sched_reference`` prints how far they are).

The model, precisely
--------------------

Time is integer ns on one modeled clock. A duration given in ms is rounded to the nearest
ns (4.35 ms is 4,350,000 ns), never truncated.

Jobs. A job has a device, a context, a client (the unit of fair sharing; jobs that name
none share one), a priority, an arrival, a duration, an optional absolute deadline, a
weight (fair sharing), a hand-off delay, a preemptible flag and the names of jobs it waits
for (``after``). A periodic task is expanded into jobs: release ``offset + k * period``,
absolute deadline release plus its relative deadline (the period by default), name
``task#k``. Jobs are numbered in submission order: the order given, explicit jobs first,
then the tasks' jobs by release and, at one release, by task order.

Ready. A job is ready at ``max(arrival + dispatch, every awaited job's end + its
hand-off)``. Its fences signal at ``end + hand-off``. It misses its deadline when its end
is later than its deadline (a job without a deadline never misses).

Devices are independent, each with the same policy, chunk and switch cost (or its own,
given per device); they meet only through ``after``. A device is idle, running one job,
or switching (saving or restoring a context, ``switch_ns`` long, nothing runs).

Decisions. At every instant ``t`` the simulator first ends every job whose work is done
at ``t``, then adds every job ready at or before ``t`` to its device's policy, then lets
each device (in name order) decide:

- a switch that ends at ``t``: a save leaves the device free; a restore resumes its job;
- a running job at one of its chunk boundaries (below) is suspended when the job the
  policy would pick next (``peek``) preempts it (``preempts``: strictly higher priority
  under ``priority``; a strictly earlier deadline under ``edf``; under ``mixed`` a higher
  class, or within the real-time class a strictly earlier deadline). The suspended job
  goes back to its policy's queue with the work it has left, and the device saves it;
- a free device picks the policy's next job at ``t`` (suspended jobs compete like any
  other: they resume in policy order). A suspended one is restored first, then resumes.

Preemption is to any depth: a job that preempted another can itself be preempted at its
own chunk boundaries, and every suspended job resumes when the policy picks it.
``fifo`` and ``fair`` never preempt; a job with ``preemptible=False`` is never suspended.

Chunk boundaries. Counted on the job's own executed work: the instants at which the work
it has done is a positive multiple of ``chunk_ns`` and less than its duration, reached
while it runs. Not the instant it starts or resumes: a job that starts or resumes runs
at least ``min(chunk, what is left)`` before it can be suspended. ``chunk_ns = 0``: never
preempted. A job no longer than a chunk has no boundary.

Switch cost. ``switch_ns`` is charged on every context switch of a preemption: once to
save the suspended job (from the boundary, before anything else runs) and once to restore
it (just before it runs again); a nested preemption pays its own save and restore. A job
that starts after another ended pays nothing: the finished one has nothing to save. A
suspended job's time off the device (both switches included) is its ``preempted``
interval ``(suspended at, running again at)``.

Policies, the semantics of ``hetproc.supervisor._scheduler`` (ties below):

- ``fifo``: arrival order.
- ``priority``: the highest priority first; within one level, clients share fairly by
  start-time fair queueing: each client has a virtual time, charged ``duration / weight``
  when one of its jobs first starts (what it will run, charged once); the backlogged
  client with the least virtual time goes first; a client whose queue was empty joins at
  the current virtual time (the virtual time of the last pick), so idling earns no burst.
  One virtual time per client, whatever the level. Within a client, arrival order.
- ``edf``: the earliest absolute deadline first; jobs without one after, in arrival order.
- ``fair``: the fair queueing above, alone (no levels).
- ``mixed``: priority >= ``realtime_priority`` is real-time (EDF), >= 1 always-on (fair),
  0 third-party (fair). Real-time first, except that always-on goes first when its recent
  share is below ``min_share`` and the most urgent real-time job still meets its deadline
  after it (slack = deadline - now - its remaining work >= the always-on job's remaining
  work); always-on before third-party. Recent shares: every first start multiplies the
  three classes' served time by 0.9 and adds the job's duration to its class.

Ties: equal priority (equal virtual time), equal deadline, equal arrival: arrival order,
then submission order.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ipc import errors

from ._config import POLICIES, SchedSpec

MS = 1_000_000
NO_DEADLINE = (1 << 63) - 1
_DECAY = 0.9  # the mixed policy's recent shares, per first start (as the product's)


def ms_to_ns(ms: float) -> int:
    """Modeled ms to ns, rounded to the nearest ns (not truncated: 4.35 ms is 4,350,000)."""
    return int(round(float(ms) * MS))


@dataclass(frozen=True)
class Job:
    """One job of a task set (times in modeled ns; ``deadline_ns`` absolute, 0 = none)."""

    name: str
    duration_ns: int
    arrival_ns: int = 0
    device: str = "npu0"
    context: str = ""
    client: str = ""
    priority: int = 0
    deadline_ns: int = 0
    preemptible: bool = True
    weight: float = 1.0
    handoff_ns: int = 0
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """A periodic task: a job every ``period_ns`` from ``offset_ns``, ``count`` of them
    (0: every release before the horizon). ``deadline_ns`` is relative (0: the period)."""

    name: str
    period_ns: int
    duration_ns: int
    deadline_ns: int = 0
    offset_ns: int = 0
    count: int = 0
    device: str = "npu0"
    context: str = ""
    client: str = ""
    priority: int = 0
    preemptible: bool = True
    weight: float = 1.0
    handoff_ns: int = 0

    def jobs(self, horizon_ns: int | None = None) -> list[Job]:
        if self.count:
            n = self.count
        elif horizon_ns is not None:
            n = max(0, -(-(horizon_ns - self.offset_ns) // self.period_ns))
        else:
            raise errors.InvalidRequest(f"task {self.name!r}: give it a count, or a horizon")
        rel = self.deadline_ns or self.period_ns
        return [Job(f"{self.name}#{k}", self.duration_ns, self.offset_ns + k * self.period_ns,
                    self.device, self.context or self.name, self.client, self.priority,
                    self.offset_ns + k * self.period_ns + rel, self.preemptible, self.weight,
                    self.handoff_ns) for k in range(n)]


@dataclass(frozen=True)
class DevicePolicy:
    """One device's scheduling parameters, in ns."""

    policy: str = "priority"
    chunk_ns: int = 0
    switch_ns: int = 0
    realtime_priority: int = 10
    min_share: float = 0.2

    @classmethod
    def from_spec(cls, spec: SchedSpec, time_scale: float = 1.0) -> "DevicePolicy":
        """A platform file's ``[device.scheduler]``, its ms and us rounded to ns."""
        return cls(spec.policy, ms_to_ns(spec.chunk_ms * time_scale),
                   int(round(spec.switch_us * time_scale * 1000)), spec.realtime_priority,
                   spec.min_share)


@dataclass(frozen=True)
class JobOutcome:
    """What one job did: its modeled start (first instant it ran), end, the intervals it
    ran (``segments``) and was off the device while suspended (``preempted``)."""

    job: Job
    index: int               # submission order
    ready_ns: int
    start_ns: int
    end_ns: int
    segments: tuple[tuple[int, int], ...]
    preempted: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def signal_ns(self) -> int:
        return self.end_ns + self.job.handoff_ns

    @property
    def missed(self) -> bool:
        return bool(self.job.deadline_ns) and self.end_ns > self.job.deadline_ns

    @property
    def lateness_ns(self) -> int:
        """End minus deadline (negative: early); 0 for a job without a deadline."""
        return self.end_ns - self.job.deadline_ns if self.job.deadline_ns else 0

    @property
    def response_ns(self) -> int:
        return self.end_ns - self.job.arrival_ns


@dataclass(frozen=True)
class Schedule:
    """Every job's outcome (in submission order) and each device's switches."""

    jobs: tuple[JobOutcome, ...]
    switches: dict[str, int]
    switch_ns: dict[str, int]

    def job(self, name: str) -> JobOutcome:
        for o in self.jobs:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def misses(self) -> tuple[JobOutcome, ...]:
        return tuple(o for o in self.jobs if o.missed)

    def table(self) -> list[dict[str, Any]]:
        """One plain row per job (ns), for printing or JSON."""
        return [{"job": o.name, "device": o.job.device, "context": o.job.context,
                 "priority": o.job.priority, "arrival_ns": o.job.arrival_ns,
                 "start_ns": o.start_ns, "end_ns": o.end_ns, "deadline_ns": o.job.deadline_ns,
                 "missed": o.missed, "preempted": [list(p) for p in o.preempted]}
                for o in self.jobs]


# -- the policies (the semantics of hetproc.supervisor._scheduler, over _Run records) -----


class _Run:
    """A job's state during the simulation."""

    __slots__ = ("job", "index", "order", "ready_ns", "done_ns", "start_ns", "end_ns",
                 "segments", "preempted", "suspended", "deps_left", "dependents", "awaits")

    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.index = index
        self.order = (job.arrival_ns, index)  # every tie: arrival, then submission
        self.ready_ns = -1
        self.done_ns = 0           # work done so far
        self.start_ns = -1
        self.end_ns = -1
        self.segments: list[list[int]] = []
        self.preempted: list[list[int]] = []
        self.suspended = False
        self.deps_left = len(job.after)
        self.dependents: list[_Run] = []
        self.awaits: list[_Run] = []

    @property
    def left_ns(self) -> int:
        return self.job.duration_ns - self.done_ns

    @property
    def deadline(self) -> int:
        return self.job.deadline_ns or NO_DEADLINE


class _Book:
    """Start-time fair queueing's shared state: a virtual time per client and the clock
    (the virtual time of the last pick)."""

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.clock = 0.0

    def charge(self, run: _Run) -> None:
        key = run.job.client
        self.vtime[key] = self.vtime.get(key, self.clock) + run.job.duration_ns / _weight(run)


class _FairQueue:
    """Per-client queues in arrival order; the least-served backlogged client first."""

    def __init__(self, book: _Book) -> None:
        self.book = book
        self.queues: dict[str, list[tuple[tuple[int, int], _Run]]] = {}

    def __len__(self) -> int:
        return len(self.queues)

    def add(self, run: _Run) -> None:
        key = run.job.client
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = []
            book = self.book
            book.vtime[key] = max(book.vtime.get(key, 0.0), book.clock)
        heapq.heappush(q, (run.order, run))

    def _best(self) -> str:
        vt = self.book.vtime
        return min(self.queues, key=lambda k: (vt[k], self.queues[k][0][0]))

    def peek(self) -> _Run:
        return self.queues[self._best()][0][1]

    def pop(self) -> _Run:
        key = self._best()
        q = self.queues[key]
        run = heapq.heappop(q)[1]
        if not q:
            del self.queues[key]
        book = self.book
        book.clock = max(book.clock, book.vtime[key])
        return run


def _weight(run: _Run) -> float:
    w = float(run.job.weight or 1.0)
    return w if w > 1e-3 else 1e-3


class _Policy:
    preemptive = False

    def __init__(self, dp: DevicePolicy) -> None:
        self.dp = dp

    def __len__(self) -> int:
        raise NotImplementedError

    def add(self, run: _Run) -> None:
        raise NotImplementedError

    def peek(self, now: int) -> _Run:
        raise NotImplementedError

    def pick(self, now: int) -> _Run:
        raise NotImplementedError

    def charge(self, run: _Run) -> None:
        """Its first start: what it will run is charged once (fair shares)."""

    def preempts(self, new: _Run, running: _Run) -> bool:
        return False


class _Fifo(_Policy):
    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.heap: list[tuple[tuple[int, int], _Run]] = []

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, run: _Run) -> None:
        heapq.heappush(self.heap, (run.order, run))

    def peek(self, now: int) -> _Run:
        return self.heap[0][1]

    def pick(self, now: int) -> _Run:
        return heapq.heappop(self.heap)[1]


class _Edf(_Fifo):
    preemptive = True

    def add(self, run: _Run) -> None:
        heapq.heappush(self.heap, ((run.deadline, *run.order), run))

    def preempts(self, new: _Run, running: _Run) -> bool:
        return new.deadline < running.deadline


class _Fair(_Policy):
    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.fq = _FairQueue(_Book())
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, run: _Run) -> None:
        self.n += 1
        self.fq.add(run)

    def peek(self, now: int) -> _Run:
        return self.fq.peek()

    def pick(self, now: int) -> _Run:
        self.n -= 1
        return self.fq.pop()

    def charge(self, run: _Run) -> None:
        self.fq.book.charge(run)


class _Priority(_Policy):
    preemptive = True

    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.book = _Book()  # one virtual time per client, whatever the level
        self.levels: dict[int, _FairQueue] = {}
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, run: _Run) -> None:
        self.n += 1
        fq = self.levels.get(run.job.priority)
        if fq is None:
            fq = self.levels[run.job.priority] = _FairQueue(self.book)
        fq.add(run)

    def peek(self, now: int) -> _Run:
        return self.levels[max(self.levels)].peek()

    def pick(self, now: int) -> _Run:
        top = max(self.levels)
        fq = self.levels[top]
        run = fq.pop()
        if not len(fq):
            del self.levels[top]
        self.n -= 1
        return run

    def charge(self, run: _Run) -> None:
        self.book.charge(run)

    def preempts(self, new: _Run, running: _Run) -> bool:
        return new.job.priority > running.job.priority


_TP, _AO, _RT = 0, 1, 2


class _Mixed(_Policy):
    preemptive = True

    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.parts = (_Fair(dp), _Fair(dp), _Edf(dp))  # by class: third-party, always-on, RT
        self.served = [0.0, 0.0, 0.0]

    def klass(self, run: _Run) -> int:
        p = run.job.priority
        return _RT if p >= self.dp.realtime_priority else _AO if p >= 1 else _TP

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def add(self, run: _Run) -> None:
        self.parts[self.klass(run)].add(run)

    def _choose(self, now: int) -> _Policy:
        tp, ao, rt = self.parts
        if len(rt) and len(ao):
            total = sum(self.served)
            starved = total > 0 and self.served[_AO] < self.dp.min_share * total
            head, other = rt.peek(now), ao.peek(now)
            if starved and head.deadline - now - head.left_ns >= other.left_ns:
                return ao
            return rt
        if len(rt):
            return rt
        return ao if len(ao) else tp

    def peek(self, now: int) -> _Run:
        return self._choose(now).peek(now)

    def pick(self, now: int) -> _Run:
        return self._choose(now).pick(now)

    def charge(self, run: _Run) -> None:
        k = self.klass(run)
        self.served = [s * _DECAY for s in self.served]
        self.served[k] += run.job.duration_ns
        self.parts[k].charge(run)

    def preempts(self, new: _Run, running: _Run) -> bool:
        kn, kr = self.klass(new), self.klass(running)
        if kn != kr:
            return kn > kr
        return kn == _RT and new.deadline < running.deadline


_POLICIES: dict[str, type[_Policy]] = {
    "fifo": _Fifo, "priority": _Priority, "edf": _Edf, "fair": _Fair, "mixed": _Mixed}
assert tuple(sorted(_POLICIES)) == tuple(sorted(POLICIES)), "a policy without a model"


# -- one device ---------------------------------------------------------------------------

_IDLE, _RUN, _SAVE, _RESTORE = "idle", "run", "save", "restore"


class _Device:
    def __init__(self, name: str, dp: DevicePolicy) -> None:
        self.name = name
        self.dp = dp
        self.policy = _POLICIES[dp.policy](dp)
        self.state = _IDLE
        self.run: _Run | None = None   # running, or being restored
        self.since = 0                 # running: when its current segment began
        self.until = 0                 # switching: when the switch ends
        self.switches = 0

    def done_at(self, t: int) -> int:
        return self.run.done_ns + (t - self.since)

    def next_event(self, t: int) -> int | None:
        """The next instant this device has something to do (>= t), None when idle."""
        if self.state in (_SAVE, _RESTORE):
            return self.until
        if self.state != _RUN:
            return None
        run = self.run
        end = self.since + run.left_ns
        if not self._may_be_preempted():
            return end
        chunk = self.dp.chunk_ns
        done = self.done_at(t)
        boundary = t + (done // chunk + 1) * chunk - done  # the next one strictly after t
        return min(end, boundary)

    def _may_be_preempted(self) -> bool:
        return (self.dp.chunk_ns > 0 and self.run.job.preemptible and self.policy.preemptive
                and len(self.policy) > 0)

    def finish(self, t: int) -> _Run | None:
        """End the running job if its work is done at ``t``."""
        run = self.run
        if self.state != _RUN or self.since + run.left_ns != t:
            return None
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
            done = self.done_at(t)
            if done % self.dp.chunk_ns == 0 and 0 < done < self.run.job.duration_ns:
                head = self.policy.peek(t)
                if self.policy.preempts(head, self.run):
                    self._suspend(t, done)
        if self.state == _IDLE and len(self.policy):
            run = self.policy.pick(t)
            self.run = run
            if run.suspended:
                self._switch(_RESTORE, t)
            else:
                run.start_ns = t
                self.policy.charge(run)
                self._start(t)

    def _suspend(self, t: int, done: int) -> None:
        run = self.run
        run.done_ns = done
        run.segments[-1][1] = t
        run.suspended = True
        run.preempted.append([t, -1])
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
        run = self.run
        run.suspended = False
        run.preempted[-1][1] = t
        self._start(t)

    def _start(self, t: int) -> None:
        self.state, self.since = _RUN, t
        self.run.segments.append([t, -1])


# -- the simulation -----------------------------------------------------------------------


def simulate_schedule(jobs: Iterable[Job | Mapping[str, Any]] = (), *,
                      tasks: Iterable[Task | Mapping[str, Any]] = (),
                      horizon_ns: int | None = None, policy: str = "priority",
                      chunk_ns: int = 0, switch_ns: int = 0, dispatch_ns: int = 0,
                      realtime_priority: int = 10, min_share: float = 0.2,
                      devices: Mapping[str, DevicePolicy | SchedSpec] | None = None
                      ) -> Schedule:
    """Simulate a task set; the model is the module's docstring.

    ``jobs``: ``Job`` records or mappings with the same keys (any ``*_ns`` time may be
    given as ``*_ms`` instead, rounded to the ns; ``after`` names awaited jobs). ``tasks``:
    periodic ``Task`` records or mappings, expanded up to ``horizon_ns`` (or their
    ``count``). ``policy``, ``chunk_ns``, ``switch_ns``, ``realtime_priority`` and
    ``min_share`` apply to every device; ``devices`` overrides them per device name (a
    ``DevicePolicy``, or a platform file's ``SchedSpec``). ``dispatch_ns``: the platform's
    modeled dispatch latency, between a job's arrival and its earliest start.
    """
    all_jobs = expand(jobs, tasks, horizon_ns)
    default = DevicePolicy(policy, chunk_ns, switch_ns, realtime_priority, min_share)
    _check(all_jobs, default, dispatch_ns)
    overrides = {k: (DevicePolicy.from_spec(v) if isinstance(v, SchedSpec) else v)
                 for k, v in (devices or {}).items()}
    for dp in overrides.values():
        _check_policy(dp)
    runs = [_Run(j, i) for i, j in enumerate(all_jobs)]
    by_name = {r.job.name: r for r in runs}
    for r in runs:
        for dep in r.job.after:
            by_name[dep].dependents.append(r)
            r.awaits.append(by_name[dep])
    devs = {name: _Device(name, overrides.get(name, default))
            for name in sorted({j.device for j in all_jobs})}
    _run(runs, devs, dispatch_ns)
    outcomes = tuple(JobOutcome(r.job, r.index, r.ready_ns, r.start_ns, r.end_ns,
                                tuple(map(tuple, r.segments)), tuple(map(tuple, r.preempted)))
                     for r in runs)
    return Schedule(outcomes, {n: d.switches for n, d in devs.items()},
                    {n: d.switches * d.dp.switch_ns for n, d in devs.items()})


def expand(jobs: Iterable[Job | Mapping[str, Any]] = (),
           tasks: Iterable[Task | Mapping[str, Any]] = (),
           horizon_ns: int | None = None) -> list[Job]:
    """The task set as ``Job`` records in submission order: the jobs as given, then the
    periodic tasks' jobs by release (at one release, in task order)."""
    out = [_as_job(j) for j in jobs]
    periodic = [j for t in tasks for j in _as_task(t).jobs(horizon_ns)]
    periodic.sort(key=lambda j: j.arrival_ns)  # stable: one release keeps task order
    return out + periodic


def _run(runs: list[_Run], devs: dict[str, _Device], dispatch_ns: int) -> None:
    pending: list[tuple[int, tuple[int, int], int]] = []  # (ready, order, index)

    def release(run: _Run, ready: int) -> None:
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
        times = [x for x in times if x is not None]
        if not times:  # unreachable: every job is released once its awaited jobs end
            raise errors.InternalError("reference simulator: jobs left with nothing to do")
        t = max(t, min(times))
        for dev in devs.values():
            ended = dev.finish(t)
            if ended is None:
                continue
            left -= 1
            for dep in ended.dependents:
                dep.deps_left -= 1
                if not dep.deps_left:
                    waits = max(a.end_ns + a.job.handoff_ns for a in dep.awaits)
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
    if dp.policy not in _POLICIES:
        raise errors.InvalidRequest(f"policy {dp.policy!r}: one of {', '.join(POLICIES)}")
    _nonnegative(dp.chunk_ns, "chunk_ns")
    _nonnegative(dp.switch_ns, "switch_ns")


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


"""The simulator's records: a job, a periodic task, a device's policy, what each job did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc import errors

from .._config import SchedSpec

MS = 1_000_000
NO_DEADLINE = (1 << 63) - 1


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
    timeslice_ns: int = 0  # round robin between equal urgency (0: run to completion)

    @classmethod
    def from_spec(cls, spec: SchedSpec, time_scale: float = 1.0,
                  timeslice_ms: float | None = None) -> DevicePolicy:
        """A platform file's ``[device.scheduler]``, its ms and us rounded to ns;
        ``timeslice_ms``: the device's resolved one (``PlatformSpec.engine``), when its
        own table leaves it to the platform."""
        if timeslice_ms is None:
            timeslice_ms = spec.timeslice_ms or 0.0
        return cls(spec.policy, ms_to_ns(spec.chunk_ms * time_scale),
                   int(round(spec.switch_us * time_scale * 1000)), spec.realtime_priority,
                   spec.min_share, ms_to_ns(timeslice_ms * time_scale))


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
    timeslices: dict[str, int] = field(default_factory=dict)  # switches a timeslice made

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

"""The supervisor's composition: the one place its parts are built and wired.

``compose`` builds the tables (``_tables``: every named object, each recorded in the
manifest before it exists), then each part in dependency order, each given what it uses
in its constructor, and returns them as ``Parts``. Three cycles are closed here, once, by
a setter that asserts it runs once; they and the edges up to the loop are listed in
``_server``'s docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import posix_ipc

from device_workers import STATE_DTYPE, StateSlot, state_table
from ipc import PENDING, FenceTable, Manifest, Segment, errors

from .._config import PlatformSpec
from ._bandwidth import DdrQuota
from ._clock import ClockOwner
from ._commands import Commands
from ._descriptors import DescriptorBudget, raise_descriptor_limit
from ._devices import Command, DeviceHandle
from ._doorbell import PokingDoorbell
from ._evidence import Evidence
from ._failures import Failures
from ._faultplan import FaultPlan
from ._fencefds import FenceFdRequests, FenceFds
from ._handoff import Handoff
from ._hazards import Hazards
from ._iommu import Iommu
from ._lifetimes import Lifetimes
from ._memlog import MemLog
from ._memory import Memory
from ._metrics import Metrics
from ._policy import Policy
from ._queue_bindings import Binder
from ._queues import Queues
from ._records import ClientRec, Registry
from ._recovery import Recovery
from ._requests import Handler, handler_table
from ._requests_commands import CommandRequests
from ._requests_conn import ConnectionRequests
from ._requests_memory import MemoryRequests
from ._requests_reports import ReportRequests
from ._resets import ResetRequests, Resets

FENCE_CAPACITY = 8192


class NamedObjects:
    """The named objects the supervisor creates, each recorded in the manifest before
    it exists, so ``hetproc cleanup`` never misses one if we are killed."""

    def __init__(self, manifest: Manifest, prefix: str) -> None:
        self.manifest = manifest
        self.prefix = prefix
        self.segments: list[Segment] = []

    def new_segment(self, suffix: str, size: int, *, recorded: bool = False) -> Segment:
        """``recorded``: its name is in the manifest already (``record_all``)."""
        name = self.prefix + suffix
        if not recorded:
            self.record("shm", name)
        seg = Segment.create(name, size)
        self.segments.append(seg)
        return seg

    def record(self, kind: str, name: str) -> None:
        self.manifest.add_object(kind, name)
        self.manifest.write()

    def record_semaphores(self, names: list[str]) -> None:
        self.record_all([("sem", name) for name in names])

    def record_all(self, objects: list[tuple[str, str]]) -> None:
        """Record ``(kind, name)`` objects about to be made, in one manifest write."""
        for kind, name in objects:
            self.manifest.add_object(kind, name)
        self.manifest.write()

    def remove_segments(self) -> None:
        for seg in self.segments:
            seg.close()
            seg.unlink()


@dataclass(frozen=True, eq=False)
class Parts:
    """The supervisor's parts, built by ``compose`` (see ``_server`` for what each does)."""

    reg: Registry
    pool: Memory
    state_segment: Segment
    faults: FaultPlan
    iommu: Iommu
    evidence: Evidence
    failures: Failures
    lifetimes: Lifetimes
    handoff: Handoff
    commands: Commands
    queues: Queues
    recovery: Recovery
    ddr: DdrQuota
    metrics: Metrics
    fencefds: FenceFds
    requests: dict[str, Handler]
    vclock: ClockOwner | None  # the virtual clock's owner (None: the real clock)


def compose(spec: PlatformSpec, named: NamedObjects, *,
            tell: Callable[[ClientRec, dict], None], spawn: Callable[[DeviceHandle], None],
            stop: Callable[[], None], spec_dict: dict[str, Any] | None = None) -> Parts:
    """Every part, in dependency order. ``tell`` puts a notice into a client's socket,
    ``spawn`` forks a device, ``stop`` ends the loop: the loop's, handed down.
    ``spec_dict``: ``spec.to_dict()`` if made already (by the platform starter)."""
    reg, pool, state_segment = _tables(spec, named)
    faults = FaultPlan(list(spec.faults), seed=spec.fault_seed)
    memlog = MemLog()
    iommu = Iommu(spec.iommu, memlog, reg.scaled_ns)
    evidence = Evidence(reg, named.prefix, named.new_segment)
    failures = Failures(reg, evidence.note_error, tell)
    lifetimes = Lifetimes(reg, pool, iommu, failures)
    handoff = Handoff(reg, lifetimes, iommu, memlog)
    commands = Commands(reg, lifetimes, handoff, faults, evidence, failures)
    lifetimes.purge_with(commands.purge)  # cycle 1: a purge is a device command
    policy = Policy.from_dict(spec.recovery)
    binder = Binder(reg, iommu, handoff, lifetimes, faults,
                    barrier=lambda dev, then: commands.submit_system(dev, then=then),
                    unsafe=policy.unsafe_reclaim)
    queues = Queues(reg, pool, failures, tell, binder, handoff, faults,
                    restart_devices=policy.subsystem_restart)
    resets = Resets(policy, reg, commands, faults, spawn)
    recovery = Recovery(policy, reg, commands, evidence, spawn, queue_owed=queues.owed,
                        queue_timing=queues.watch.timing_on, resets=resets)
    commands.watch(recovery)  # cycle 2: recovery hears of completions from the engine
    queues.watch.watch_with(recovery)  # cycle 3: a queue command's timeout is an incident
    ddr = DdrQuota(spec)
    fencefds = FenceFds(reg, lifetimes, failures)
    hazards = Hazards(reg, evidence, spec.hazards)
    vclock = (ClockOwner(reg, named.new_segment, autojump_ms=spec.autojump_ms,
                         recovery=recovery, queues=queues, tie_seed=spec.tie_seed,
                         leases=spec.clock_leases)
              if spec.clock == "virtual" else None)
    metrics = Metrics(reg, pool, recovery, handoff, evidence, queues, ddr, named.prefix,
                      hazards=hazards, fencefds=fencefds,
                      clock=vclock.metrics if vclock is not None else None)
    platform = {"prefix": named.prefix, "platform": spec.name, "supervisor_pid": os.getpid(),
                "fence_segment": reg.fences.segment.name, "state_segment": state_segment.name,
                "time_scale": spec.time_scale, "devices": [d.name for d in spec.devices],
                "spec": spec.to_dict() if spec_dict is None else spec_dict}
    requests = handler_table({
        "connection": ConnectionRequests(reg, evidence, platform=platform, stop=stop,
                                         owner_pid=os.getppid(), clock=vclock),
        "memory": MemoryRequests(reg, pool, lifetimes, iommu, handoff, faults, failures, memlog,
                                 queues),
        "commands": CommandRequests(reg, pool, commands, iommu, handoff, faults, evidence, queues,
                                    ddr, hazards, fallback_device=policy.fallback_device),
        "reports": ReportRequests(reg, commands, recovery, faults, evidence, metrics,
                                  faults_changed=queues.faults_changed),
        "resets": ResetRequests(reg, resets),
        "fencefds": FenceFdRequests(fencefds),
    })
    return Parts(reg, pool, state_segment, faults, iommu, evidence, failures, lifetimes,
                 handoff, commands, queues, recovery, ddr, metrics, fencefds, requests, vclock)


def _tables(spec: PlatformSpec, named: NamedObjects) -> tuple[Registry, Memory, Segment]:
    """The fence table, the state table, the buffer pool, and one ring, doorbell and
    completion eventfd per device: every named object, each recorded first."""
    prefix = named.prefix  # every name recorded at once, before any of them exists
    named.record_all([("shm", prefix + "fences"), ("shm", prefix + "state")]
                     + [(kind, f"{prefix}{what}.{d.name}") for d in spec.devices
                        for kind, what in (("shm", "ring"), ("sem", "bell"))])
    fseg = named.new_segment("fences", FenceTable.segment_bytes(FENCE_CAPACITY), recorded=True)
    fences = FenceTable(named.prefix, fseg, create=True, on_new_semaphores=named.record_semaphores)
    n = len(spec.devices)
    state_segment = named.new_segment("state", n * STATE_DTYPE.itemsize, recorded=True)
    state = state_table(state_segment.map, n)
    slots = [StateSlot(state_segment.map, i) for i in range(n)]
    devices: dict[str, DeviceHandle] = {}
    clients: dict[Any, ClientRec] = {}

    def segment_dropped(sid: int) -> None:
        """A buffer segment is gone from the supervisor: devices unmap it; a connection
        that held it unmapped it already (at its free) or is gone."""
        for dev in devices.values():
            dev.forget_segment(sid)
        for client in clients.values():
            client.segments.discard(sid)

    # Buffer segments have no name (nothing to record or clean up): they reach clients
    # and devices as descriptors only (``_memory``, ``ipc._fdpass``). A tenant's pool
    # spans the whole budget (its segments are sparse: pages come on first touch); its
    # quota (``_quotas``) and the budget bound what it holds; the platform's descriptors
    # bound what every tenant holds together (``_descriptors``).
    def descriptors_held() -> int:
        waiting = sum(len(fds) for c in clients.values() for _, fds in c.outfds)
        waiting += sum(d.segs.waiting_fds for d in devices.values() if d.segs is not None)
        return len(clients) + pool.descriptors + waiting

    descriptors = DescriptorBudget(raise_descriptor_limit(), descriptors_held)
    pool = Memory(named.prefix, budget=spec.memory_mib << 20, room=descriptors.check,
                  on_drop=segment_dropped)

    def inputs_ready(cmd: Command) -> bool:
        try:
            for h in cmd.wait:  # (asked several times per command: no generator)
                if fences.poll(h)[0] == PENDING:
                    return False
            return True
        except errors.HetprocError:
            return False

    for index, dspec in enumerate(spec.devices):
        ring = named.new_segment(f"ring.{dspec.name}", DeviceHandle.ring_bytes(), recorded=True)
        bell_name = f"{named.prefix}bell.{dspec.name}"
        bell = (PokingDoorbell if spec.clock == "virtual" else posix_ipc.Semaphore)(
            bell_name, posix_ipc.O_CREX, initial_value=0)
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        devices[dspec.name] = DeviceHandle(
            dspec, index, named.prefix, ring, bell, efd,
            window_ns=round(dspec.scheduler.window_ms * spec.time_scale * 1e6),
            lead_ns=round(dspec.scheduler.commit_lead_ms * 1e6),  # host time: not scaled
            timeslice_ns=round(spec.engine(dspec.name).timeslice_ms * spec.time_scale * 1e6),
            time_scale=spec.time_scale, state=slots[index], inputs_ready=inputs_ready,
            segment_of=pool.segments.get)
    reg = Registry(spec, fences, devices, slots, state, clients=clients, descriptors=descriptors)
    return reg, pool, state_segment

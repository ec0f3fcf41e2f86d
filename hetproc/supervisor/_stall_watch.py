"""The stall watch: a device that owes work yet shows no sign of moving is stalled.

``Recovery`` asks it about every device that owes work (a pushed command not finished, or
a queue record, ``_queues.owed``): the device's signs of life -- state, done counter,
progress, ring read index, and, when only queue records are owed, its heartbeat -- must
change within a quiet bound, the device's ``heartbeat_interval_ms`` (0: no check), scaled,
never under ``QUIET_FLOOR_NS``. A device that is runnable and has had less CPU than the
bound since it went quiet waits for the host, not for itself: excused and counted
(``idle_host_lag``), on the real clock only (on the virtual one no host is late).

On the virtual clock the bound is an event the clock jumps to (``deadlines``), and one
modeled ns before it the device is woken to look (``hetproc.supervisor._clock``): a live
device shows a sign then, as it does between its real-time slices on the real clock, and
a stalled one does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers import StateSlot as S
from ipc import clock

if TYPE_CHECKING:
    import collections

    from ._device_cpu import DeviceCpu
    from ._devices import DeviceHandle
    from ._records import Registry

# The least quiet time that is a stall: five idle wake-ups (a device wakes every 50 ms).
QUIET_FLOOR_NS = 250_000_000


@dataclass
class _Quiet:
    """A device owing work whose signs of life have not changed since ``since``."""

    signature: tuple
    since: int
    cpu: int
    bound: int  # how long it may stay quiet (0: no hang check on this device)
    excused: bool = False


def timed(dev: DeviceHandle, slot: Any) -> bool:
    """The device runs a command of ours: the command watchdog's case."""
    if slot.u32[S.STATE] != DeviceState.BUSY:
        return False
    cmd = dev.pushed.get(slot.u64[S.CURRENT_SEQ])
    return cmd is not None and cmd.pidx == slot.u64[S.CURRENT_PIDX]


class StallWatch:
    """Each device's quiet since when (see the module docstring). ``queue_owed(dev)``:
    records its queues hold for it; ``queue_timing(device)``: the queue watch times the
    queue command it runs (that command's watchdog decides)."""

    def __init__(self, reg: Registry, device_cpu: DeviceCpu,
                 verdicts: collections.Counter[str],
                 queue_owed: Callable[[DeviceHandle], int],
                 queue_timing: Callable[[str], bool]) -> None:
        self.reg = reg
        self.device_cpu = device_cpu
        self.verdicts = verdicts
        self.queue_owed = queue_owed
        self.queue_timing = queue_timing
        self._quiet: dict[str, _Quiet] = {}  # by device: owing work, no sign of moving

    def forget(self, device: str) -> None:
        if self._quiet:  # (every watchdog tick, for every device: mostly empty)
            self._quiet.pop(device, None)

    def deadlines(self) -> list[tuple[str, int]]:
        """(device, instant) at which each quiet device would be called stalled."""
        return [(name, q.since + q.bound) for name, q in self._quiet.items() if q.bound]

    def look(self, dev: DeviceHandle, now: int) -> float | None:
        """How long (ms) ``dev`` has been stalled, once it is; None while it is not. A
        running command the command watchdog (or the queue watch) times is left to it:
        a late writer sleeping between its stores shows no sign of moving, yet its own
        watchdog decides."""
        slot = self.reg.slots[dev.index]
        # (every loop turn, for every device that owes work: the cheap tests first;
        # each is a plain look, so their order changes no outcome)
        if (not dev.pid or dev.paused or timed(dev, slot) or not self.owes_work(dev, slot)
                or self.queue_timing(dev.name)):
            self._quiet.pop(dev.name, None)
            return None
        signature: tuple[int, ...] = (dev.epoch, slot.u32[S.STATE], slot.u64[S.DONE],
                                      slot.u64[S.PROGRESS], slot.u64[S.CURRENT_PIDX],
                                      dev.commands.tail)
        if not dev.pushed:
            # Only queue records are owed. They are a client's writing (a scribbled head
            # owes nothing the device can see), and a record waiting for its inputs does
            # not move the counters: the device's heartbeat, which its loop keeps while it
            # waits, must have stopped too. A process stopped or hung beats no more.
            signature += (slot.u64[S.HEARTBEAT],)
        quiet = self._quiet.get(dev.name)
        if quiet is None or quiet.signature != signature:
            beat = self.reg.engine(dev).heartbeat_interval_ms  # 0: no hang check
            bound = max(self.reg.scaled_ns(beat), QUIET_FLOOR_NS) if beat else 0
            self._quiet[dev.name] = _Quiet(signature, now, self.device_cpu.stamp(dev), bound)
            return None
        if not quiet.bound or now - quiet.since < quiet.bound:
            return None
        runnable, cpu = self.device_cpu.read(dev)
        if (clock.virtual is None and runnable and cpu >= 0 and quiet.cpu >= 0
                and cpu - quiet.cpu < quiet.bound):
            if not quiet.excused:  # waiting for the host's CPU, not stalled: note it once
                quiet.excused = True
                self.reg.note_event("watchdog", device=dev.name, verdict="idle_host_lag",
                                    cpu_ms=round((cpu - quiet.cpu) / 1e6, 3))
            self.verdicts["idle_host_lag"] += 1
            return None
        del self._quiet[dev.name]
        self.verdicts["stalled"] += 1
        return (now - quiet.since) / 1e6

    def owes_work(self, dev: DeviceHandle, slot: Any) -> bool:
        """A pushed command the device has not finished, or a queue record it has not.
        A command that ran and only waits to signal after its hand-off delay
        (``delay_ns``) is not owed: nothing moves then."""
        taken = slot.u64[S.CURRENT_PIDX]
        return (any(c.delay_ns == 0 or c.pidx > taken for c in dev.pushed.values())
                or bool(self.queue_owed(dev)))

"""The command watchdog for queue commands, which the supervisor never pushed.

A device notes the queue command it takes in that queue's binding table (its cid and its
watchdog timeout: the record's own ``timeout_ms``, else the default budget the supervisor
gives a submit, by the same formula). This watch times it as ``_recovery`` times a pushed
command: from its start on the device (the state table's ``started_ns``), re-armed while
the device's progress moves (``max_rearm`` times), the deadline moved for host lag (a
device waiting for a CPU is not hung). Past it, the command timed out: a queue command
has no ring position to cancel, so the incident isolates the device at once (SIGKILL);
its reaping confirms the stop, the running record's fence fails with ``DeviceTimeout``
(the rest of the queue with ``CancelledByReset``), and only then are the queue's bound
buffers let go (``_queue_bindings``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers import StateSlot as S
from ipc import BindingTable, clock, errors

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._records import Registry
    from ._recovery import Recovery

_MIN_EXTENSION_NS = 2_000_000
LOOK_EVERY_NS = 1_000_000  # the loop turns far more often under load: a look per ms is plenty


@dataclass
class _Timed:
    cid: int
    qid: int
    timeout_ns: int
    deadline: int
    progress: int
    cpu: int
    rearms: int = 0
    lagged: bool = False


class QueueWatch:
    """``tables(dev)``: (qid, binding table) of each queue with terms on ``dev``."""

    def __init__(self, reg: Registry, tables: Callable[[DeviceHandle], Iterable[tuple[int,
                                                                                   BindingTable]]]
                 ) -> None:
        self.reg = reg
        self.tables = tables
        self.recovery: Recovery | None = None  # set by ``watch_with`` (composition)
        self.timing: dict[str, _Timed] = {}
        # The queue command each device was reset for, by device: (cid, error), until its
        # owed records are failed (``take_verdict``).
        self.verdicts: dict[str, tuple[int, errors.HetprocError]] = {}
        self._looked = 0  # when ``tick`` last looked (ns)

    def watch_with(self, recovery: Recovery) -> None:
        assert self.recovery is None, "one recovery runs the incidents"
        self.recovery = recovery

    def tick(self, now: int) -> None:
        rec = self.recovery
        if rec is None or (now - self._looked < LOOK_EVERY_NS and clock.virtual is None):
            return  # (on the virtual clock now stands still between jumps: look each time)
        self._looked = now
        for dev in self.reg.devices.values():
            if not dev.pid or dev.paused or dev.name in rec.active:
                self.timing.pop(dev.name, None)
                continue
            running = self._running(dev)
            if running is None:
                self.timing.pop(dev.name, None)
                continue
            self._check(dev, running, now)

    def _running(self, dev: DeviceHandle) -> tuple[int, int, int, int] | None:
        """(cid, qid, timeout ns, started ns) of the queue command ``dev`` runs, or None."""
        slot = self.reg.slots[dev.index]
        if slot.u32[S.STATE] != DeviceState.BUSY or slot.u64[S.CURRENT_SEQ] != 0:
            return None
        cid = int(slot.u64[S.CURRENT_CID])
        started = int(slot.u64[S.STARTED])
        if not cid or slot.u64[S.CURRENT_CID] != cid or slot.u32[S.STATE] != DeviceState.BUSY:
            return None
        for qid, table in self.tables(dev):
            noted, timeout = table.watched()
            if noted == cid and timeout:
                return cid, qid, int(timeout), started
        return None

    def _check(self, dev: DeviceHandle, running: tuple[int, int, int, int], now: int) -> None:
        cid, qid, timeout, started = running
        slot, rec = self.reg.slots[dev.index], self.recovery
        assert rec is not None
        t = self.timing.get(dev.name)
        if t is None or t.cid != cid:
            self.timing[dev.name] = _Timed(cid, qid, timeout, started + timeout,
                                           int(slot.u64[S.PROGRESS]), rec.device_cpu.stamp(dev))
            return
        if now < t.deadline or self._host_lag(dev, t):
            return
        progress = int(slot.u64[S.PROGRESS])
        if progress != t.progress and t.rearms < rec.policy.max_rearm:
            t.rearms, t.progress, t.deadline = t.rearms + 1, progress, now + t.timeout_ns
            rec.verdicts["no_hang"] += 1
            self.reg.note_event("watchdog", device=dev.name, cid=cid, verdict="no_hang",
                                rearm=t.rearms, queue=qid)
            return
        del self.timing[dev.name]
        rec.verdicts["timed_out"] += 1
        self._time_out(dev, t)

    def _host_lag(self, dev: DeviceHandle, t: _Timed) -> bool:
        """As ``Recovery._host_lag``: a runnable device that has had less CPU than its
        budget since the command started waits for the host; its deadline moves."""
        assert self.recovery is not None
        unused = self.recovery.device_cpu.unused_budget(dev, t.timeout_ns, t.cpu)
        if not unused:
            return False
        if not t.lagged:
            self.reg.note_event("watchdog", device=dev.name, cid=t.cid, verdict="host_lag",
                                queue=t.qid)
            t.lagged = True
        self.recovery.verdicts["host_lag"] += 1
        t.deadline = clock.now_ns() + max(unused, _MIN_EXTENSION_NS)
        return True

    def _time_out(self, dev: DeviceHandle, t: _Timed) -> None:
        """The incident: marked, then the device isolated at once (nothing can cancel a
        queue command); the reaping is the confirmed stop (``Recovery.on_device_death``)."""
        rec = self.recovery
        assert rec is not None
        inc = rec.new_incident("timeout", dev, None)
        exc = errors.DeviceTimeout(
            f"{dev.name}: queue {t.qid}'s command ran past its {t.timeout_ns / 1e6:.1f} ms "
            f"watchdog", correlation_id=t.cid, detail={"incident": inc.id})
        inc.error = exc.to_dict()
        inc.reason = f"queue {t.qid}'s command {t.cid:#x} timed out"
        inc.step("mark", cid=t.cid, queue=t.qid, rearms=t.rearms)
        self.verdicts[dev.name] = (t.cid, exc)
        rec.isolate(dev, inc)

    def deadlines(self) -> list[tuple[str, int]]:
        """(device, instant) of each timed queue command's watchdog deadline: events
        the virtual clock jumps to (``_clock``)."""
        return [(name, t.deadline) for name, t in self.timing.items()]

    def timing_on(self, device: str) -> bool:
        """A queue command on ``device`` is being timed now."""
        return device in self.timing

    def take_verdict(self, dev: DeviceHandle, cid: int) -> errors.HetprocError | None:
        """The error of the queue command ``dev`` was reset for, if it is ``cid``."""
        got = self.verdicts.get(dev.name)
        if got is None or got[0] != cid:
            return None
        del self.verdicts[dev.name]
        return got[1]

    def device_gone(self, dev: DeviceHandle) -> None:
        self.timing.pop(dev.name, None)
        self.verdicts.pop(dev.name, None)

    def metrics(self) -> dict[str, Any]:
        return {"timing": len(self.timing)}

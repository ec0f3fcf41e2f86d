"""How much CPU a device process has had, and whether it is runnable now.

What lets the watchdog (``_recovery``) tell a device that waits for the host's CPU (a
loaded machine: lag, excused and counted) from one that hangs (it sleeps, or spins
through its whole budget).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ipc import clock

if TYPE_CHECKING:
    from ._devices import DeviceHandle


class DeviceCpu:
    """Whether a device process is runnable now, and how much CPU it has had (ns, the
    first field of ``/proc/<pid>/schedstat``), read with ``pread`` on descriptors kept
    per device (a few us a look). What lets the watchdog tell a device that waits for
    the host's CPU from one that hangs."""

    def __init__(self) -> None:
        self._fds: dict[str, tuple[int, int, int]] = {}  # device -> (pid, stat fd, schedstat fd)

    def read(self, dev: DeviceHandle) -> tuple[bool, int]:
        """``(runnable, cpu_ns)``; ``(False, -1)`` when the process cannot be read."""
        state, cpu = self._look(dev)
        return state == b"R", cpu

    def stopped(self, dev: DeviceHandle) -> bool:
        """Whether the process is stopped by a signal (SIGSTOP, a tracer): it shows no
        sign of life until somebody continues it, however long anything waits for it."""
        return self._look(dev)[0] in (b"T", b"t")

    def _look(self, dev: DeviceHandle) -> tuple[bytes, int]:
        """``(state letter, cpu_ns)``; ``(b"", -1)`` when the process cannot be read."""
        entry = self._fds.get(dev.name)
        if entry is None or entry[0] != dev.pid:
            self._forget(dev.name)
            try:
                stat = os.open(f"/proc/{dev.pid}/stat", os.O_RDONLY)
            except OSError:
                return b"", -1
            try:
                sched = os.open(f"/proc/{dev.pid}/schedstat", os.O_RDONLY)
            except OSError:
                os.close(stat)
                return b"", -1
            entry = self._fds[dev.name] = (dev.pid, stat, sched)
        try:
            state = os.pread(entry[1], 512, 0).rpartition(b")")[2].split()[0]
            return state, int(os.pread(entry[2], 128, 0).split()[0])
        except (OSError, ValueError, IndexError):
            return b"", -1

    def stamp(self, dev: DeviceHandle) -> int:
        """The CPU ``dev`` has had, for a later ``unused_budget`` (-1: none to compare
        with). On the virtual clock -1 without a look: nothing compares it there, and the
        two reads of ``/proc`` were most of what a command's watch cost the supervisor."""
        if clock.virtual is not None:
            return -1
        return self.read(dev)[1]

    def unused_budget(self, dev: DeviceHandle, budget_ns: int, cpu_at_start: int) -> int:
        """The CPU ``dev`` has not had of ``budget_ns`` since ``cpu_at_start`` while it is
        runnable: > 0 means it waits for the host, not for itself (0: no excuse; a hung
        device sleeps, or spins and so uses its budget). On the virtual clock, never:
        modeled time does not move while a device works, so the host cannot make it late."""
        if clock.virtual is not None:
            return 0
        runnable, cpu = self.read(dev)
        if not runnable or cpu < 0 or cpu_at_start < 0:
            return 0
        return max(0, budget_ns - (cpu - cpu_at_start))

    def _forget(self, name: str) -> None:
        entry = self._fds.pop(name, None)
        if entry is not None:
            os.close(entry[1])
            os.close(entry[2])


Threads = dict[int, tuple[int, int, bool]]  # tid -> (cpu ns, runqueue wait ns, runnable)


def thread_times(pid: int) -> Threads | None:
    """Per thread of process ``pid``: the CPU it has had and how long it waited,
    runnable, for one (``schedstat``), and whether it is runnable now (``stat``); None
    when the process cannot be read."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: Threads = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                cpu, wait = f.read().split()[:2]
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            out[int(tid)] = (int(cpu), int(wait), state == b"R")
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out


def slept_and_ran(before: Threads, after: Threads, wall_ns: int) -> tuple[int, int]:
    """Of ``wall_ns``, how long a process slept by its own choice (every thread seen
    both times asleep: the least over them; a thread that runs or waits for a CPU is work
    in progress) and the most CPU one thread had (work, or a spin). A thread runnable now
    is taken to have waited for the time not accounted yet (the kernel adds a wait to
    ``schedstat`` only when it ends), not slept; what a thread waited for a CPU is the
    host's load, in neither figure."""
    slept, ran_most = wall_ns, 0
    for tid, (cpu, wait, runnable) in after.items():
        if tid not in before:
            continue
        ran, waited = cpu - before[tid][0], wait - before[tid][1]
        ran_most = max(ran_most, ran)
        slept = min(slept, 0 if runnable else max(0, wall_ns - ran - waited))
    return slept, ran_most

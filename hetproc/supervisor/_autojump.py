"""How long client processes have held the virtual clock by their own doing, and which
devices a signal stopped (``StoppedDevices``): what may hold it, and when it moves anyway.

The clock waits for every client process to be in a hetproc wait (``_clock``). One that
stays outside (``time.sleep``, its own socket, a spin) holds it for ``autojump_ms`` real
ms; then the clock moves anyway, a determinism break. What counts is the client's own
time, measured per process from when it was last seen entering or leaving a hetproc
wait (its waiter slots' generations changed) or the clock last moved:

* asleep outside hetproc (every thread: ``time.sleep``, its own socket) for
  ``autojump_ms``, counted from its last request (``heard``: a client that frees
  hundreds of buffers one request after another talks to us all along);
* or at work -- computing, spinning, a loop of requests that waits for modeled time --
  for ``SPIN_FACTOR`` times ``autojump_ms`` of CPU;
* what its threads waited, runnable, for a CPU is the host's load and counts for
  neither (``slept_and_ran``): a client that computes on a loaded machine holds the
  clock as long as the host makes it wait.

Nothing here runs per command: a process's threads are read (``/proc``) only once it has
been outside a wait for a quarter of ``autojump_ms``, and again when that is up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ._device_cpu import Threads, slept_and_ran, thread_times

# A client that keeps talking to the supervisor without a hetproc wait (requests in a loop
# that waits for modeled time) holds the clock this many times ``autojump_ms``.
SPIN_FACTOR = 10
# However a client holds it (a host that never gives it a CPU), the clock moves after
# this many times ``autojump_ms`` of real time.
HELD_FACTOR = 100


@dataclass
class _Outside:
    """One process's stretch outside hetproc waits."""

    gens: tuple[int, ...]   # its waiter slots' generations, as first seen
    since: int              # real ns it was first seen so
    base: tuple[int, Threads] | None = None  # (real ns, its threads' CPU times then)


class Holders:
    """The client processes outside hetproc waits, and how long each has held the clock."""

    def __init__(self, autojump_ns: int) -> None:
        self.autojump_ns = autojump_ns
        self.outside: dict[int, _Outside] = {}
        self.last_heard = 0  # real ns of the last request read from any client

    def heard(self) -> None:
        self.last_heard = time.monotonic_ns()

    def note(self, gens: dict[int, tuple[int, ...]]) -> None:
        """The processes outside hetproc waits now, with their slots' generations: one
        whose slots changed since it was last seen so begins a new stretch."""
        t, old = time.monotonic_ns(), self.outside
        self.outside = {pid: o if (o := old.get(pid)) is not None and o.gens == g
                        else _Outside(g, t) for pid, g in gens.items()}

    def held(self, moved_at: int) -> int:
        """Real ns every process outside has held the clock (since the last move)."""
        if not self.outside:
            return 0
        return time.monotonic_ns() - max(moved_at, *(o.since for o in self.outside.values()))

    def spinning(self, moved_at: int) -> bool:
        """Held for ``SPIN_FACTOR`` times ``autojump_ms`` in real time (their requests in
        flight then no longer keep the clock from looking further)."""
        return self.held(moved_at) >= SPIN_FACTOR * self.autojump_ns

    def verdict(self, moved_at: int) -> dict[str, Any] | None:
        """None while the processes outside may hold the clock on; else the break's
        figures (held, the least asleep since a request, the least CPU had, in ms)."""
        t, aj = time.monotonic_ns(), self.autojump_ns
        held = self.held(moved_at)
        if held < aj // 4:
            return None
        start = t - held
        figures = [self._own(pid, o, t, start) for pid, o in self.outside.items()]
        silent = t - max(start, self.last_heard)
        slept = min(min(s, silent) for s, _ in figures)
        ran = min(r for _, r in figures)
        if slept < aj and ran < SPIN_FACTOR * aj and held < HELD_FACTOR * aj:
            return None
        return {"held_ns": held, "slept_ms": round(slept / 1e6, 3),
                "ran_ms": round(ran / 1e6, 3)}

    def _own(self, pid: int, o: _Outside, t: int, since: int) -> tuple[int, int]:
        """(slept, ran) of process ``pid`` over ``t - since``: all of it slept until its
        threads were first read (a quarter of ``autojump_ms`` in), then
        ``slept_and_ran`` of the time since."""
        if o.base is None or o.base[0] < since:
            threads = thread_times(pid)
            o.base = (t, threads) if threads is not None else None
            return t - since, 0
        t0, before = o.base
        after = thread_times(pid)
        if after is None:
            return t - since, 0
        slept, ran = slept_and_ran(before, after, t - t0)
        return (t0 - since) + slept, ran


STOP_LOOK_NS = 5_000_000  # real ns between looks for stopped devices while the clock is held


class StoppedDevices:
    """The devices stopped by a signal (SIGSTOP, a tracer), once the clock has not moved
    for ``autojump_ms`` real ms: such a device never blocks, so nothing else would ever
    move the clock (the watchdog that catches it on the real clock could not fire). It
    then counts as blocked with no wake, and the jump is a determinism break naming it;
    its state words stand still, so the watchdog may take its first sight of the
    command it stopped in. Looked for only then, and every few ms: a running platform
    pays one clock read per turn. A device found stopped is looked at again on every
    later turn, with no new wait, for as long as it stays stopped: each jump past it
    would hold the clock ``autojump_ms`` again for what is known already."""

    def __init__(self, autojump_ns: int, devices: dict[str, Any], cpu: Any) -> None:
        self.autojump_ns = autojump_ns
        self.devices = devices  # by name: ``DeviceHandle``s (their pids change on restart)
        self.cpu = cpu          # ``_device_cpu.DeviceCpu``: whether a process is stopped
        self.known: frozenset[str] = frozenset()  # found stopped, still so
        self._next_look = 0  # real ns: when a held clock may look again

    def look(self, moved_at: int) -> frozenset[str]:
        """The devices stopped now, the clock having last moved at real ns ``moved_at``."""
        devices, cpu = self.devices, self.cpu
        if self.known:
            self.known = frozenset(name for name in self.known
                                   if devices[name].pid and cpu.stopped(devices[name]))
            if self.known:
                return self.known
        t = time.monotonic_ns()
        if t - moved_at < self.autojump_ns or t < self._next_look:
            return frozenset()
        self._next_look = t + STOP_LOOK_NS
        self.known = frozenset(dev.name for dev in devices.values()
                               if dev.pid and cpu.stopped(dev))
        return self.known

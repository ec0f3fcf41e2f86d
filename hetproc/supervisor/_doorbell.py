"""A device's doorbell on the virtual clock, and the posts it holds back.

Every post pokes the device's waiter slot first (``ipc.clock``), so the clock never moves
past news the device has not seen; a device asleep on an input fence is woken by a nudge
of that fence (it does not sleep on its doorbell then).

A post made while a client may still bring more at this instant is held (``HeldPosts``)
until no client runs: whatever the clients bring at one instant reaches the devices
together (``ClockOwner.turn`` rings them). Rung at once, a device chose among what the
first of two requests of one instant had brought: in multi_tenant's EDF a camera and a
voice command, submitted at one instant on two connections, ran camera first (the voice
preempting it 50 us later) or voice first, as the host ran. A jump's wake rings at once
(``ring``): every client waits then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import posix_ipc

from ipc import FenceTable, clock, nudge_fence


class PokingDoorbell(posix_ipc.Semaphore):
    """A device's doorbell on the virtual clock (see the module docstring)."""

    waiter: clock.Waiter | None = None
    fences: FenceTable | None = None
    held: HeldPosts | None = None
    index = 0  # the device's: held posts ring in device order

    def release(self) -> None:
        held = self.held
        if held is not None and held.holding and (held.serving or held.clients_running()):
            held.hold(self)
            return
        self.ring()

    def ring(self) -> None:
        """Post now: poke the slot, nudge the fence it sleeps on, post the semaphore."""
        self.poke()
        self.post()

    def poke(self) -> None:
        """Say there is news in the slot (``ring``'s first half)."""
        if self.waiter is not None:
            self.waiter.poke()

    def post(self) -> None:
        """Wake the device: nudge the fence it sleeps on, post the semaphore (``ring``'s
        second half, after ``poke``)."""
        waiter = self.waiter
        if waiter is not None:
            fence = waiter.fence()
            if fence and self.fences is not None:
                nudge_fence(self.fences, fence)
        super().release()


def ring_all(bells: list[PokingDoorbell]) -> None:
    """Ring several devices at one instant: every slot is poked before any device is
    woken. Rung one by one, the first woken could block again before the next was poked,
    find every other device blocked with no news, and wake the loop for nothing (a loop
    turn per frame of a pipeline, whose three doorbells ring together)."""
    for bell in bells:
        bell.poke()
    for bell in bells:
        bell.post()


class HeldPosts:
    """The doorbell posts held while a client may still bring more at this instant (the
    loop serves a request: ``with held:``, or a client process is not in a hetproc wait
    or has a request unread or unserved: ``clients_running``), by device: rung once no
    client runs, or after ``limit_ns`` of real time (a client that stays outside hetproc
    waits holds them no longer). A post made while every client waits with nothing of
    it unread (a device's progress) rings at once. Once the platform stops, nothing is
    held (``stop_holding``)."""

    def __init__(self, limit_ns: int, clients: Mapping[Any, Any],
                 waiters: list[clock.Waiter], unread: Callable[[], bool]) -> None:
        self.limit_ns = limit_ns
        self._clients = clients  # the registry's connections (each a ``clock_slot``)
        self._waiters = waiters  # every waiter slot, by index
        self._unread = unread  # whether a client's socket holds bytes not read yet
        self.serving = False
        self.holding = True  # until the platform stops (``stop_holding``)
        self._bells: dict[int, PokingDoorbell] = {}
        self._since = 0

    def clients_running(self) -> bool:
        """Whether a client may still bring more at this instant: a request read and not
        served, a process not in a hetproc wait, or bytes not read yet. By process, not
        by connection: a slot says blocked only when every thread of its process waits,
        and a connection no thread waits on says running (a process waiting on one of
        its three connections held every post, a turn and a hand-off each)."""
        waiters = self._waiters
        blocked: dict[int, bool] = {}
        for client in self._clients.values():
            if client.pending or client.reader.buffered:
                return True
            slot = client.clock_slot
            if slot < 0:
                continue
            if waiters[slot].snapshot() is None:
                blocked.setdefault(client.pid, False)
            else:
                blocked[client.pid] = True
        return not all(blocked.values()) or self._unread()

    def __enter__(self) -> None:
        self.serving = True

    def __exit__(self, *exc: object) -> None:
        self.serving = False

    def __bool__(self) -> bool:
        return bool(self._bells)

    def hold(self, bell: PokingDoorbell) -> None:
        if not self._bells:
            self._since = time.monotonic_ns()
        self._bells[bell.index] = bell

    def overdue(self) -> bool:
        return bool(self._bells) and time.monotonic_ns() - self._since >= self.limit_ns

    def ring(self) -> None:
        """Ring every held post, in device order."""
        bells = [self._bells[i] for i in sorted(self._bells)]
        self._bells.clear()
        ring_all(bells)

    def stop_holding(self) -> None:
        """Ring what is held, and every post from now on at once: the platform stops, and
        a device must hear its stop now (held, it heard it only by its own timeout)."""
        self.holding = False
        self.ring()

    def clear(self) -> None:
        self._bells.clear()

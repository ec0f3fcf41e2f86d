"""How a device waits under the virtual clock: it never sleeps for modeled time.

Where the real clock holds (``_hold.hold_until``), a device on the virtual clock says in
its waiter slot until which modeled instant it is blocked (``ipc.clock.Waiter``) and sleeps
on its doorbell until the supervisor has moved the clock there and posted the doorbell
(a real slice is the fallback). A wait for an input fence names the fence too, so the
supervisor sees a device about to wake the moment the fence completes, and nudges that
fence when it wants the device (the clock came to its wake, a command, a cancel). A real
kernel still runs in real time: the device is not blocked then, and the clock does not
move.

A hold may also move the clock itself, without blocking, when the supervisor leased it the
clock at the jump that woke it (``ipc.clock``'s lease): to each of its own wakes before
the lease's bound, for as long as it tells nobody anything (``Outbox.told``) and does not
block -- the end of a map, of a kernel, of a write-back, then, idle, its hand-off signal's
instant, one after the other, with no jump between them.

Progress (the counter the watchdog re-arms on) is counted once per modeled instant at
which a wait is entered, poked or reaches its wake, never for a real slice that ended:
how many slices end is the host's doing. Counted per slice, a device stopped by a
signal 10 ms into a long command was re-armed once or not (its ``DeviceTimeout`` 200 ms
apart) as the host ran (``_look``).

Order (``Waiter``): read the supervisor's pokes (``begin``), then look at the work
(cancel, preemption, the ring), then say "blocked" (``block``): a command pushed after the
look is news the supervisor sees the device has not seen, so it never jumps past it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import posix_ipc

from ipc import FenceTable, clock, errors, wait_fence_once

from . import _hold
from ._state import StateSlot

_CURRENT_SEQ = StateSlot.CURRENT_SEQ

NO_WAKE = clock.NO_WAKE
DOORBELL_SLICE_S = 0.05  # real time between looks when nobody posts (a lost post is harmless)
FENCE_SLICE_S = 0.05      # between looks when nobody nudges the fence (a lost nudge is harmless)


class Device(Protocol):
    """What the waits use of the device worker (``_worker.DeviceWorker``)."""

    boot: Any
    intake: Any
    outbox: Any
    preempt: Any
    fences: FenceTable
    doorbell: posix_ipc.Semaphore
    delayed: list
    u32: Any
    u64: Any
    queues: Any
    counts_progress: bool

    def fire_due_signals(self) -> None: ...
    def beat(self) -> None: ...
    def drain(self) -> None: ...
    def between_chunks(self) -> None: ...
    def _swallow_posts(self) -> None: ...
    def _fetch_segments(self) -> None: ...


class DeviceWaits:
    """One device's waits on the virtual clock (its waiter slot and its doorbell); made
    once, at the device's start, it takes over every ``hold_until`` of the process."""

    def __init__(self, device: Device, vclock: clock.VirtualClock) -> None:
        self.device = device
        self.now = vclock.now_ns
        self.slot = vclock.waiter(device.boot.index)
        self.vclock = vclock
        self.devices = range(device.boot.device_count)
        self.index = device.boot.index
        self.told = 0  # the outbox's ``told`` when the device last blocked (``_block``)
        self._counted_at = 0  # the instant a wait's look last counted as progress
        self._poked = 0  # the slot's pokes then (``_look``)
        device.fences.model_now = vclock.now_ns  # what a fence it fails is stamped with
        _hold.use_virtual(self.hold)

    def run(self) -> None:
        """The device's loop: its turn (``DeviceWorker.run``), in this module's order,
        blocked between turns until a post or the next hand-off signal's instant."""
        dev, slot, u32 = self.device, self.slot, self.device.u32
        while not dev.intake.stopped and os.getppid() == dev.boot.parent_pid:
            slot.begin()
            dev.fire_due_signals()
            dev.beat()
            dev.drain()
            wake = dev.delayed[0][0] if dev.delayed else NO_WAKE
            if dev.queues.turn_again():
                continue  # records left past the turn's refusals: the next turn, at once
            if not dev.intake.stopped and wake > self.now():
                if not dev.queues and self._leased(0, wake):
                    continue  # our hand-off's instant, and nobody else's before it
                if self._block(wake, dev.doorbell):
                    dev._swallow_posts()
                else:
                    dev._fetch_segments()  # idle: unmap segments that are gone
            u32[StateSlot.WAKES] = (u32[StateSlot.WAKES] + 1) & 0xFFFFFFFF

    def hold(self, until: int, between: Callable[[], None]) -> None:
        """Until the clock reaches ``until``, calling ``between`` (cancel, preemption) on
        every wake, woken sooner at a preemption's chunk boundary. Returns at once,
        without calling ``between``, if already due."""
        dev, slot, now = self.device, self.slot, self.now
        wake = 0  # (the wait was just entered: its first look counts)
        while True:
            slot.begin()
            if now() >= until:
                return
            self._look(between, wake)
            t = dev.preempt.next_point()
            wake = until if t is None or t <= now() or t > until else t
            # A hand-off signal of an earlier command falls due while this one holds: we
            # wake then to fire it (``between``), as a real hold's slices do, so that its
            # consumers start when it says, not when this hold ends.
            if dev.delayed and now() < dev.delayed[0][0] < wake:
                wake = dev.delayed[0][0]
            seq = dev.u64[_CURRENT_SEQ]
            if seq and self._leased(seq, wake):
                continue  # leased: our instant, and nobody else's before it
            if dev.outbox.records:  # ours go out first: the supervisor needs them
                dev.outbox.flush()
            self._block(wake, dev.doorbell)

    def _look(self, between: Callable[[], None], wake: int) -> None:
        """``between`` (cancel, preemption, hand-offs) on a wait's wake, counted as
        progress when the wait was just entered (``wake`` 0), or, once per instant, when
        the clock came to ``wake`` (the one it blocked for) or the supervisor poked it
        since the last look (the module docstring): a poke made at an instant is seen at
        that instant (the clock waits for news), a slice's end is not."""
        dev, now = self.device, self.now()
        poked, self._poked = self._poked, self.slot.poked()
        counts = not wake or ((now >= wake or poked != self._poked)
                              and now != self._counted_at)
        if counts:
            self._counted_at = now
        dev.counts_progress = counts
        try:
            between()
        finally:
            dev.counts_progress = True

    def _leased(self, seq: int, wake: int) -> bool:
        """Moved the clock to ``wake`` on a lease (``ipc.clock``): the command ``seq`` it
        covers holds (0: idle past it, no queue of ours: the stall watch judges a device
        owing queue records by the instants the loop sees), nothing told since the
        device last blocked."""
        outbox = self.device.outbox
        return (not outbox.records and outbox.told == self.told
                and self.vclock.advance_leased(self.index, seq, wake, self.slot.gen()))

    def fence(self, handle: int, deadline: int) -> int:
        """Wait for an input fence until modeled ``deadline``: its error code, or
        ``FenceTimeout`` once the clock passed the deadline. Woken too when a hand-off
        signal of ours comes due (``between_chunks`` fires it)."""
        dev, slot, now = self.device, self.slot, self.now
        wake = 0
        while True:
            slot.begin()
            self._look(dev.between_chunks, wake)
            if now() >= deadline:
                raise errors.FenceTimeout(f"fence {handle:#x} still pending at the deadline")
            wake = min(deadline, dev.delayed[0][0]) if dev.delayed else deadline
            if wake <= now():
                continue
            slot.block(wake, handle)
            self._wake_supervisor()
            try:
                # A poke that came before the fence was named here found no fence to
                # nudge: look again at once rather than sleep through it.
                code = None if slot.has_news() else wait_fence_once(dev.fences, handle,
                                                                    FENCE_SLICE_S)
            finally:
                slot.clear()
            if code is not None:
                return code
            dev._swallow_posts()  # nudged (the clock came to our wake) or a slice ended

    def _wake_supervisor(self) -> None:
        """Just blocked: if every other device is blocked too, this may be the last
        wait the clock waits for, and the supervisor looks at once (its eventfd) rather
        than at its next tick. A device that blocks while a peer runs leaves it be: the
        peer's block will ring (a client's wait rings when every device is blocked)."""
        if self.vclock.all_blocked(self.devices, but=self.device.boot.index,
                                   pending=self.device.fences.pending):
            self.device.outbox.poke()

    def input_slice(self, handle: int, deadline: int) -> int:
        """One slice of a queue record's wait for an input (``_queue_inputs``; the caller
        read its pokes and looked at the other work first): blocked on the fence until
        modeled ``deadline`` or a hand-off signal of ours is due. The fence's code, or
        ``FenceTimeout`` when the slice ends first."""
        dev, slot = self.device, self.slot
        wake = min(deadline, dev.delayed[0][0]) if dev.delayed else deadline
        slot.block(wake, handle)
        self._wake_supervisor()
        try:  # (as ``fence``: a poke before the fence was named is looked at at once)
            code = None if slot.has_news() else wait_fence_once(dev.fences, handle,
                                                                FENCE_SLICE_S)
        finally:
            slot.clear()
        if code is None:
            dev._swallow_posts()  # nudged (the clock came to our wake, or news) or a slice
            raise errors.FenceTimeout(f"fence {handle:#x}: the slice ended")
        return code

    def _block(self, wake: int, doorbell: posix_ipc.Semaphore) -> bool:
        """Blocked until ``wake`` on the doorbell, one real slice; True when it was posted.
        The supervisor is woken to look if this may be the last wait (``_wake_supervisor``)."""
        slot = self.slot
        self.told = self.device.outbox.told  # a lease from the jump that wakes us starts here
        slot.block(wake)
        self._wake_supervisor()
        try:
            doorbell.acquire(DOORBELL_SLICE_S)
            return True
        except posix_ipc.BusyError:
            return False
        finally:
            slot.clear()

"""The virtual clock's owner: modeled time that moves only when the platform is quiescent.

Under ``clock = "virtual"`` the supervisor creates the clock segment (``ipc._clock``) under
the platform's prefix, installs it as this process's clock (the devices it forks inherit
it), hands each client connection a waiter slot at hello, and, once per loop turn, looks
whether the whole platform waits (``turn``)::

    1. the waiters' slots first: every device blocked (in a hold until its wake, idle, or
       on an input fence still pending) with no poke it has not seen; every client
       process blocked in a hetproc wait on one of its connections (a fence wait,
       ``hetproc.sleep``), its fence still pending and its deadline ahead
    2. then the traffic: no client socket readable, no partial or unserved packet, no
       reply unsent, no completion record uncollected, no device killed or dead and not
       reaped yet, no request (cancel, park, preempt) written into a device's slot since
       it was last poked, no queue record written since its device was last poked (the
       rings' heads, read after the clients' slots)
    3. then the loop's timers run at this instant (``settle``) and step 1 and 2 again --
       unless the loop's own timers of this turn ran while every waiter already waited
       as it does now (``timers_seen``: no slot's ``gen`` moved since) -- and the jump: the
       clock moves to the earliest next event -- a device's wake, a scheduler's next
       decision (``DeviceHandle.wake_ns``; nothing is decided ahead on this clock,
       ``commit_lead_ms`` is 0), a command's watchdog deadline or preempt timeout, a
       queue command's watchdog deadline, the stall watch's bound, an incident's grace,
       a client's wait deadline -- and the devices whose wake came are poked and their
       doorbells posted (the fence a device sleeps on is nudged: it does not sleep on its
       doorbell then)
    4. once those devices are blocked again (steps 1 and 2), the clients' deadlines come
       to the new instant (``released_ns``): a client whose wait's deadline or sleep's
       end came is nudged on its fences, or its connection's bell; when nobody's came,
       nobody was woken and the platform is as quiet as step 1 and 2 found it: the same
       turn jumps on (``jumps_after_release``), a turn per instant, not two

Step 4 is the order of one instant: what the devices do at it (a command's end, a
signal, a hand-off) comes before any client's deadline at it, so a client that sleeps to
the instant a command ends sees it done, every run (with one step, which of the two the
host ran first decided). The watchdog takes its first sight of a command only from a
device that is blocked (``Recovery.settled``): its state words then stand still.

Nobody polls for the moment the platform becomes quiescent: the last waiter to block
wakes the loop (a device's eventfd when every other device is blocked, a client's
one-way ping when every device is), so a jump waits for no tick (``jumps_on_tick``
counts the few that did: two waiters blocking at once, each seeing the other run).

Reading the slots before the sockets is what makes it safe: a client marks itself blocked
only after its last packet was written, so a packet written before the flag is always
seen in step 2. A device reads its pokes before it looks at its ring (``_vclock``), so a
command pushed after that look shows as news it has not seen.

A client process blocked on one connection counts as blocked with all its connections
(scenario code holding several connections); the client library says blocked only while
every thread of the process that used hetproc waits (``hetproc.client._vclock``). A
client that stays outside hetproc waits (``time.sleep``, its own socket, a spin) while
everything else waits holds the clock for ``autojump_ms`` real ms; then the clock jumps
anyway and the jump counts as a determinism break, naming the client (``metrics``). The
time counted is its own (``_autojump``): asleep outside hetproc since its last request,
or ten times as long at work (CPU), never what it waited for a CPU.
A jump that wakes one device alone, in a hold of a command the loop has seen running,
leases it the clock up to the next event of anybody else (``ipc.clock``'s lease): the
device moves through its own next instants (a map's end, a kernel's, a write-back's, its
hand-off's) without a jump each, until it tells anybody anything or blocks. The loop
sees the same instants in the same order, fewer times (``jumps_by_devices`` counts the
moves it did not make).
The platform file's ``clock_leases = false`` turns it off (to compare).
Every event due at the new instant is released in the same jump; the devices are woken by
index, or in an order the platform's ``tie_seed`` permutes (only that order: the
supervisor's own decisions due then are made in its usual order).
A device's doorbell post made while a client may still bring more at this instant is held
(``_doorbell.HeldPosts``) and rung, in device order, by the first turn that finds the
platform quiet with no client running: what two requests of one instant bring reaches a
device together, whatever the host ran between them.
"""

from __future__ import annotations

import random
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from device_workers import StateSlot as S
from ipc import Segment, clock, nudge_fence
from ipc.errors import HetprocError

from ._autojump import Holders, StoppedDevices
from ._doorbell import HeldPosts, PokingDoorbell, ring_all
from ._preempt_timeout import waited_since
from ._records import ClientRec, Registry
from ._recovery import Recovery
from ._stall_watch import timed

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._queues import Queues

NO_WAKE = clock.NO_WAKE
# What a loop turn did to the clock (``ClockOwner.turn``).
STILL, RELEASED, RELEASED_QUIET, JUMPED = range(4)


class ClockOwner:
    """The virtual clock of one platform: its segment, its waiter slots, its jumps."""

    def __init__(self, reg: Registry, new_segment: Callable[[str, int], Segment], *,
                 autojump_ms: float, recovery: Recovery, queues: Queues | None = None,
                 tie_seed: int = 0, leases: bool = True) -> None:
        self.reg = reg
        self.recovery = recovery
        self.queues = queues  # user-mode queues: their rings' heads and their watch
        devices, clients = len(reg.devices), reg.spec.limits.max_clients
        self.clock = clock.VirtualClock(
            new_segment("clock", clock.segment_bytes(devices, clients)), create=True)
        clock.install(self.clock)  # this process's now, and every device's it forks
        reg.fences.model_now = self.clock.now_ns  # what the fences we fail are stamped with
        self.segment_name = self.clock.segment.name
        self._free_slots = list(range(devices + clients - 1, devices - 1, -1))
        # A view of every waiter slot, made once (the turn reads the clients' each time).
        self._slot_waiters = [self.clock.waiter(i) for i in range(devices + clients)]
        self.waiters = self._slot_waiters[:devices]
        self.autojump_ns = round(autojump_ms * 1e6)
        # The devices' doorbell posts, held while a client may bring more at this instant.
        self.held = HeldPosts(self.autojump_ns, reg.clients, self._slot_waiters,
                              lambda: self._readable()[1])
        for dev in reg.devices.values():
            self.waiters[dev.index].reset()
            if isinstance(dev.doorbell, PokingDoorbell):
                dev.doorbell.waiter = self.waiters[dev.index]
                dev.doorbell.fences = reg.fences
                dev.doorbell.held, dev.doorbell.index = self.held, dev.index
            dev.lead_ns = 0  # nothing is decided ahead: nothing moves while anybody works
        self.holders = Holders(self.autojump_ns)  # clients outside hetproc waits
        # A device found stopped stands still too: the watchdog must take its first sight
        # of the command it stopped in, or the jumps went past it to a client's deadline.
        recovery.settled = lambda dev: (not self.waiters
                                        or self.waiters[dev.index].snapshot() is not None
                                        or dev.name in self.stopped.known)
        self.breaks = 0
        self.tick_jumps = 0  # jumps the loop's tick found (no waiter woke it)
        self.chained_jumps = 0  # jumps in the turn of a release that woke no client
        self.turns = 0  # loop turns that looked whether the platform waits
        self.jump_nudged = False  # the last jump woke a client (``_jump``)
        self.break_clients: dict[str, int] = {}
        self.break_devices: dict[str, int] = {}
        self._moved_at = time.monotonic_ns()  # real ns of the last jump (or the start)
        self.stopped = StoppedDevices(self.autojump_ns, reg.devices, recovery.device_cpu)
        self._timed_stopped: frozenset[str] = frozenset()  # stopped when the timers last ran
        # The requests last seen in each device's state slot (cancel, park, preempt): a
        # change is news the device must look at before the clock may move.
        self._requests = [(0, 0, 0)] * devices
        # The queue heads last seen per device: records written since are news the
        # device must look at (a client's record reaches it with no supervisor hop).
        self._heads: list[tuple[int, ...]] = [()] * devices
        self.settle: Callable[[], None] = lambda: None  # the loop's timers (``tick``)
        # The waiters' generations when the loop's timers last began (``timers_seen``); None:
        # unknown, the turn settles.
        self._marked: list[int] | None = None
        # The view before the timers of the last jump, when every device was blocked after
        # them (the loop sets it: ``timers_seen``).
        self.jump_view: tuple[int, list[int]] | None = None
        self._slots = devices + clients
        # (device, deadline) of the watches that judge a device by its signs of life when
        # the deadline comes -- each running command's watchdog, the queue watch's, the
        # stall watch's -- as the last ``_timers`` found them (the jump wakes each
        # device one modeled ns before).
        self._looks: list[tuple[str, int]] = []
        # What ``_readable`` polls (the devices' pidfds, the clients' sockets), kept while
        # it stays the same.
        self._polled: tuple[tuple[int, ...], tuple[Any, ...]] = ((), ())
        self._poller = select.poll()
        self._device_fds: frozenset[int] = frozenset()
        # The order devices whose wakes fall on the same instant are woken in: by index,
        # or a permutation the tie seed fixes.
        self._order = sorted(reg.devices.values(), key=lambda d: d.index)
        if tie_seed:
            random.Random(tie_seed).shuffle(self._order)
        self.leases = leases  # (``_lease``)

    # -- connections ----------------------------------------------------------------

    def admit(self, client: ClientRec) -> dict[str, Any]:
        """A waiter slot for a new connection (hello): where it says it is blocked."""
        if not self._free_slots:  # (never: one slot per limits.max_clients)
            raise HetprocError("no waiter slot left on the clock segment")
        slot = self._free_slots.pop()
        self._slot_waiters[slot].reset()
        client.clock_slot = slot
        client.clock_bell = self.reg.fences.allocate()
        return {"segment": self.segment_name, "slot": slot, "bell": client.clock_bell}

    def device_spawned(self, index: int) -> None:
        """A new device process: not blocked, no news owed (whatever the last one said),
        no lease (the last one's was for a command it no longer runs)."""
        self.waiters[index].reset()
        self.clock.revoke()

    def client_gone(self, client: ClientRec) -> None:
        if client.clock_bell:
            self.reg.fences.release(client.clock_bell)
            client.clock_bell = 0
        if client.clock_slot >= 0:
            self._slot_waiters[client.clock_slot].reset()
            self._free_slots.append(client.clock_slot)
            client.clock_slot = -1

    # -- the jump ---------------------------------------------------------------------

    def turn(self, busy: bool, on_tick: bool = False, heard: bool = False) -> int:
        """Move the clock if the platform is quiescent (the module docstring's steps);
        ``busy``: the loop has work of its own this turn; ``on_tick``: nothing woke the
        loop (no waiter said it might be the last: counted); ``heard``: a client's bytes
        were read this turn (it talks to us: not silent outside hetproc, ``_autojump``).
        ``JUMPED`` when the clock moved (the loop's timers are due at the new instant),
        ``RELEASED`` when only the clients' deadlines came to now (step 4: nothing of the
        loop's is due), ``RELEASED_QUIET`` when that woke no client (the platform is
        still quiet: look again at once), else ``STILL``."""
        if heard:
            self.holders.heard()
        self.turns += not busy
        if self.held.overdue():
            self.held.ring()  # (a client outside hetproc waits: ``HeldPosts``)
        now = self.clock.now_ns()
        marked, self._marked = self._marked, None
        stopped = self.stopped.look(self._moved_at) if not busy else frozenset()
        quiet = None if busy else self._quiet(now, stopped)
        if quiet is None:
            return STILL
        if marked != self.clock.generations(self._slots) or stopped != self._timed_stopped:
            # Somebody ran since the loop's timers looked, or a device was found stopped
            # since (it stands still now: ``settled``): they look again at this instant
            # (a watchdog's first sight of a command, before a jump can pass its
            # deadline), and so does step 1 and 2.
            self._timed_stopped = stopped
            self.settle()
            quiet = self._quiet(now, stopped)
            if quiet is None:
                return STILL
        if self.clock.now_ns() != now:
            return STILL  # a lessee moved it while we looked: it rings when it blocks
        if self.held and not quiet[1]:
            self.held.ring()  # no client runs: the devices see what this instant brought
            return STILL
        wakes, running = quiet
        # The devices are done with this instant: the clients' deadlines come to it
        # before the clock moves on (every device's event at an instant comes before
        # any client's deadline then: ``_jump``).
        release = self.clock.released_ns() < now
        wakes += [dev.wake_ns for dev in self.reg.devices.values() if dev.wake_ns > 0]
        wakes += self._timers()
        later = [t for t in wakes if t > now]
        if not later and not release:  # nothing to move to (it waits for a client):
            return STILL                # no jump, no break
        broke = bool(stopped or running)
        if stopped:  # held for autojump_ms already (``StoppedDevices``): move now
            self._count_break(sorted({c.name for c in running}), stopped,
                              time.monotonic_ns() - self._moved_at)
        elif running and not self._autojump(running):
            return STILL
        if release:
            # A client whose deadline came runs at this instant first; with none, the
            # platform is as quiet as it was, and the clock moves on in this same turn
            # (so does a break: one break, not two).
            nudged = self._release_clients(now)
            if not later:
                return RELEASED if nudged else RELEASED_QUIET
            if nudged and not broke:
                return RELEASED
            self.chained_jumps += 1
        later.sort()
        self._jump(later[0], later[1] if len(later) > 1 and not broke else later[0])
        self.tick_jumps += on_tick
        return JUMPED

    def timers_seen(self, quiet: bool) -> bool:
        """The loop's timers (``settle``) are about to run. Marks the slots' ``gen``s: a
        turn after them that finds them unchanged and the platform quiet knows the timers
        saw the platform as it is (the clock moves only in ``turn``) and skips them. True
        when they need not run now either: they would repeat the jump's own (``jump_view``:
        kept when every device was blocked after them) at one instant on the same
        platform: the loop ``quiet`` (no event, no backlog), no ``gen`` moved (no device
        ran), and nothing else they read moves without a ``gen``: no incident in
        progress, no user-mode queue (a client writes records without one)."""
        view, jumped, self.jump_view = self.view(), self.jump_view, None
        self._marked = view[1]  # (one strided copy of every slot)
        return (quiet and jumped is not None and view == jumped
                and (self.queues is None or not self.queues.open_queues)
                and not self.recovery.active and not self.recovery.probing)

    def view(self) -> tuple[int, list[int]]:
        """The instant and every slot's ``gen``: equal to an earlier view, nobody entered
        or left a wait in between and the clock stood still."""
        return self.clock.now_ns(), self.clock.generations(self._slots)

    def devices_blocked(self) -> bool:
        """Every device blocked with no news (as a device that blocks last sees it)."""
        return self.clock.all_blocked(range(len(self.waiters)), pending=self.reg.fences.pending)

    def _quiet(self, now: int, stopped: frozenset[str] = frozenset(),
               ) -> tuple[list[int], list[ClientRec]] | None:
        """Steps 1 and 2: the waiters' wakes and the connections of client processes
        that are not in a hetproc wait; None when something runs or is in flight.
        ``stopped``: devices that count as blocked with no wake (``StoppedDevices``).
        A client that has talked without a hetproc wait for ``SPIN_FACTOR`` times
        ``autojump_ms`` (``Holders.spinning``): its requests in flight no longer count."""
        if self._new_requests():
            return None
        wakes = self._device_wakes(now, stopped)
        clients = self._client_wakes(now) if wakes is not None else None
        # The heads after the clients' slots: a record is written before its writer
        # blocks, so a blocked writer's records are seen here.
        if wakes is None or clients is None or self._queue_news():
            return None
        devices, talking = self._traffic()
        if devices or (talking and not self.holders.spinning(self._moved_at)):
            return None
        return wakes + clients[0], clients[1]

    def _new_requests(self) -> bool:
        """A request written into a device's state slot since the last look (a cancel,
        a park, a preemption): the device is poked to look at it."""
        news = False
        slots, seen = self.reg.slots, self._requests
        for dev in self.reg.devices.values():
            slot = slots[dev.index]
            u64 = slot.u64
            words = (u64[S.CANCEL_PIDX], slot.u32[S.PARK], u64[S.PREEMPT_PIDX])
            if words != seen[dev.index]:
                seen[dev.index] = words
                dev.doorbell.release()
                news = True
        return news

    def _queue_news(self) -> bool:
        """Records written into a device's queues since the last look (the rings'
        heads moved; no supervisor hop tells of a record): the device is poked to look
        at them (until it has, its slot shows news it has not seen)."""
        if self.queues is None or (not self.queues.open_queues and not any(self._heads)):
            return False  # no queue, and none since the last look: no head can move
        news = False
        for dev in self.reg.devices.values():
            heads = tuple(q.ring.head for q in self.queues.open_queues.values()
                          if q.device == dev.name)
            if heads != self._heads[dev.index]:
                self._heads[dev.index] = heads
                if heads:
                    dev.doorbell.release()
                    news = True
        return news

    def _timers(self) -> list[int]:
        """The supervisor's own next events: each running command's watchdog deadline
        and preempt timeout, the stall watch's and the queue watch's deadlines, each
        incident's grace before the kill. One modeled ns before each watch's deadline
        its device is woken to look (``_jump``, from ``_looks``, which this fills): a
        device that holds counts progress then, as it does between chunks on the real
        clock, and a hung one does not. (One pass over the pushed commands: it runs at
        every quiet turn.)"""
        reg = self.reg
        out = [inc.grace_deadline for inc in self.recovery.active.values()
               if inc.grace_deadline and not inc.confirmed]
        looks = self.recovery.stall.deadlines()
        if self.queues is not None:
            looks += self.queues.watch.deadlines()
        for dev in reg.devices.values():
            pushed = dev.pushed
            if not pushed:
                continue
            # (``waited_since`` is None without a preempt timeout, or without a preemptor
            # pushed -- the commands ``pushed.plain`` does not count: not asked then)
            preempt_ms = (reg.engine(dev).preempt_timeout_ms
                          if len(pushed) > pushed.plain and dev.preemptive else 0)
            for cmd in pushed.values():
                if not cmd.watch_deadline:
                    continue
                looks.append((dev.name, cmd.watch_deadline))
                if preempt_ms:
                    since = waited_since(reg, dev, cmd)
                    if since is not None:
                        out.append(since + reg.scaled_ns(preempt_ms))
        for _, deadline in looks:
            out += (deadline - 1, deadline)
        self._looks = looks
        return out

    def _device_wakes(self, now: int, stopped: frozenset[str]) -> list[int] | None:
        wakes = []
        wedged, waiters = self.reg.wedged, self.waiters
        for dev in self.reg.devices.values():
            if not dev.pid and dev.name in wedged:
                continue  # down for good: it waits for nothing
            if stopped and dev.name in stopped:  # blocked, no wake, whatever its slot says
                continue  # (a fence it sleeps on may have completed: it cannot run)
            snap = waiters[dev.index].snapshot() if dev.pid else None
            if snap is None:
                return None
            wake, fences = snap
            if wake <= now:  # blocked after the jump that reached its wake looked: wake it
                _ring(dev)
                return None
            if fences and self._any_done(fences):
                return None  # about to run
            if wake != NO_WAKE:
                wakes.append(wake)
        return wakes

    def _client_wakes(self, now: int) -> tuple[list[int], list[ClientRec]] | None:
        """The blocked clients' deadlines and the connections of processes that are not
        blocked at all; None when one is about to run."""
        wakes: list[int] = []
        blocked: dict[int, bool] = {}
        released = self.clock.released_ns()
        waiters = self._slot_waiters
        for client in self.reg.clients.values():
            if not client.id or client.clock_slot < 0:
                return None  # saying hello
            snap = waiters[client.clock_slot].snapshot()
            if snap is None:
                blocked.setdefault(client.pid, False)
                continue
            wake, fences = snap
            # (a wake in (released, now]: it waits for the devices to be done with now)
            if wake <= released or (fences and self._any_done(fences)):
                return None
            blocked[client.pid] = True
            if wake != NO_WAKE:
                wakes.append(wake)
        running = [c for c in self.reg.clients.values() if not blocked[c.pid]]
        gens: dict[int, tuple[int, ...]] = {}
        for c in running:  # (its slots' generations: it entered or left a wait since?)
            gens[c.pid] = gens.get(c.pid, ()) + (waiters[c.clock_slot].gen(),)
        self.holders.note(gens)
        return wakes, running

    def _any_done(self, fences: tuple[int, ...]) -> bool:
        """Whether a fence a waiter sleeps on completed, or was recycled (it is about to
        run, or wakes to find out): as ``devices_blocked`` and the waiters judge it."""
        pending = self.reg.fences.pending
        return not all(pending(fence) for fence in fences)

    def _traffic(self) -> tuple[bool, bool]:
        """``(devices, clients)``: what is in flight that the slots cannot show. The
        devices': a completion not collected, a device killed or dead and not reaped yet
        (its slot says what it did before it died). The clients': bytes not read or not
        served, a reply not sent. The descriptors of both are polled at once (one
        system call, on a poller kept while the set stays the same)."""
        for dev in self.reg.devices.values():
            if dev.completions.depth():
                return True, False
        for inc in self.recovery.active.values():
            if inc.killed and not inc.confirmed:
                return True, False
        for c in self.reg.clients.values():
            if c.pending or c.reader.buffered or c.outbuf:
                return self._readable()[0], True
        return self._readable()

    def _readable(self) -> tuple[bool, bool]:
        """Whether a device's descriptor (its pidfd: it died) and whether a client's
        socket is readable now."""
        pidfds = tuple([d.pidfd for d in self.reg.devices.values() if d.pidfd >= 0])
        conns = tuple(self.reg.clients)
        key = (pidfds, conns)
        if key != self._polled:
            self._poller = select.poll()
            for fd in (*pidfds, *conns):
                self._poller.register(fd, select.POLLIN)
            self._polled = key
            self._device_fds = frozenset(pidfds)
        ready = self._poller.poll(0) if pidfds or conns else ()
        devices = any(fd in self._device_fds for fd, _ in ready)
        return devices, len(ready) > devices

    def _autojump(self, running: list[ClientRec]) -> bool:
        """Only clients outside hetproc waits hold the clock: True once they held it
        long enough by their own doing (``_autojump.Holders``); the jump is then a
        determinism break, counted and named."""
        detail = self.holders.verdict(self._moved_at)
        if detail is None:
            return False
        self._count_break(sorted({c.name for c in running}), frozenset(),
                          detail.pop("held_ns"), **detail)
        return True

    def _count_break(self, clients: list[str], devices: frozenset[str], held_ns: int,
                     **detail: float) -> None:
        """A jump that did not wait for everybody: counted, its holders named."""
        self.breaks += 1
        for name in clients:
            self.break_clients[name] = self.break_clients.get(name, 0) + 1
        for name in devices:
            self.break_devices[name] = self.break_devices.get(name, 0) + 1
        self.reg.note_event("determinism_break", clients=clients, devices=sorted(devices),
                            now_ns=self.clock.now_ns(), held_ms=round(held_ns / 1e6, 3),
                            **detail)

    def _jump(self, t: int, after: int) -> None:
        """The clock to ``t``; the devices whose wake came, or whose command's watchdog
        looks at the next ns (``_timers``), are poked, in the tie seed's order. The
        clients' deadlines come to ``t`` once those devices are blocked again (a later
        ``turn``), or at once when none was woken. ``after``: the next event but the
        one at ``t`` (``t`` itself when two are due then): a device woken alone may
        have the clock until then (``_lease``)."""
        self._moved_at = time.monotonic_ns()
        self.clock.advance(t)
        looking = {name for name, deadline in self._looks if deadline == t + 1}
        woken = []
        for dev in self._order:
            snap = self.waiters[dev.index].snapshot()
            if snap is not None and (snap[0] <= t or dev.name in looking):
                woken.append(dev)
        if len(woken) == 1 and after > t and not looking:
            self._lease(woken[0], after)
        _ring(*woken)
        # Clients whose deadline came run now: each talks to us or pings when it blocks.
        self.jump_nudged = not woken and self._release_clients(t)

    def _lease(self, dev: DeviceHandle, until: int) -> None:
        """Lease the clock to ``dev`` up to ``until`` if it holds in a command the loop
        has seen running (its watchdog timed: every deadline of it is among the events
        ``until`` bounds; ``timed``), for the run this jump wakes it to (the bound is
        the next event as this jump sees the platform); never to a queue's command (the
        stall watch judges it by the instants the loop sees) or a device in another
        state."""
        slot = self.reg.slots[dev.index]
        if not self.leases or not timed(dev, slot):
            return
        cmd = dev.pushed[slot.u64[S.CURRENT_SEQ]]
        if cmd.watch_deadline:
            # Its slot's ``gen`` before its doorbell: one wake from here (a device caught
            # changing its slot has an odd ``gen``, which no wake matches: no lease).
            self.clock.lease(dev.index, cmd.seq, until, self.waiters[dev.index].gen())

    def _release_clients(self, t: int) -> bool:
        """The clients' deadlines come to ``t`` (the devices did what was due then).
        True when a client's deadline came (it was nudged: it runs)."""
        self._moved_at = time.monotonic_ns()
        self.clock.release()
        nudged = False
        waiters = self._slot_waiters
        for client in self.reg.clients.values():
            snap = waiters[client.clock_slot].snapshot() if client.clock_slot >= 0 else None
            if snap is not None and snap[0] <= t:  # a wait's deadline, a sleep's end came:
                nudged = True
                for handle in (*snap[1], client.clock_bell):  # it looks at once (a
                    if handle:  # thread on a fence, or sleeping on the bell)
                        nudge_fence(self.reg.fences, handle)
        return nudged

    def close(self) -> None:
        """Unmap the clock (before its segment goes, at shutdown)."""
        self.held.clear()
        for dev in self.reg.devices.values():
            if isinstance(dev.doorbell, PokingDoorbell):
                dev.doorbell.waiter = dev.doorbell.held = None
        self.waiters = self._slot_waiters = []
        self.clock.close()

    def metrics(self) -> dict[str, Any]:
        return {"clock": "virtual", "now_ns": self.clock.now_ns(), "jumps": self.clock.jumps,
                "jumps_by_devices": self.clock.leased_moves,
                "jumps_on_tick": self.tick_jumps, "jumps_after_release": self.chained_jumps,
                "loop_turns": self.turns,
                "determinism_breaks": self.breaks,
                "determinism_break_clients": dict(self.break_clients),
                "determinism_break_devices": dict(self.break_devices)}


def _ring(*devs: DeviceHandle) -> None:
    """Wake ``devs`` now: the clock came to their wakes (every client waits then)."""
    bells = [dev.doorbell for dev in devs]
    if all(isinstance(bell, PokingDoorbell) for bell in bells):
        ring_all(bells)
    else:
        for bell in bells:
            bell.release()

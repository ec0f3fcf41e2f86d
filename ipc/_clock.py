"""The clock seam: real time (CLOCK_MONOTONIC) or a virtual clock in shared memory.

A platform runs on one of two clocks. ``RealClock`` is the host's monotonic clock, the one
every wait used before a seam existed. ``VirtualClock`` reads the modeled "now" from one
u64 word of a small shared segment that the supervisor creates under the platform's
prefix; only the supervisor writes that word, and only forward (it jumps to the next event
once every process of the platform waits, see ``hetproc.supervisor._clock``).

Beside the word, the segment holds one *waiter slot* per device and per client
connection, where that process says it is blocked and until which modeled instant::

    word 0        now_ns       the modeled now (supervisor; only grows)
    word 1        jumps        how many times it moved (supervisor)
    word 2        released_ns  the instant clients' deadlines have come to (supervisor;
                  only grows, never past now_ns): a jump moves now_ns and wakes the
                  devices whose instant came; once they are all blocked again, the
                  clients' waits and sleeps due then end (``hetproc.supervisor._clock``)
    words 3-6     the lease: device index + 1 (0: none), the command it covers, the
                  instant it ends at, the device slot's ``gen`` when the jump that
                  granted it found the device blocked (supervisor, at a jump)
    word 7        target       where the supervisor's last jump went (supervisor)
    word 8        moves        how many times a device moved now_ns under a lease
    slots         16 words each: wake, fence, seen, gen, poked, then more fences (device
                  slots: poked is the supervisor's, the rest the waiter's)

``wake`` is 0 while the waiter runs, ``NO_WAKE`` when it blocks with no instant of its own
(idle, a hang, a wait without a deadline), else the modeled instant it blocks until.
``fence`` is the fence handle it sleeps on (0: none): a fence that completed means the
waiter is about to run, whatever ``wake`` says. A client process whose threads wait on
several fences names up to ``MAX_FENCES`` of them (``fence`` and the words after ``poked``,
the first 0 ending the list). ``poked`` counts the supervisor's calls
for the waiter's attention (a command pushed, a cancel, the clock moved to its wake) and
``seen`` the count the waiter had read before it last looked at its work: a waiter with
``seen != poked`` has news it has not seen. ``gen`` grows on every change of the slot, so
a reader that saw the same ``gen`` before and after reading the slot saw one registration.

**The lease.** Most instants of a busy platform belong to one device alone: the end of a
command's map, of its kernel, of its write-back, with nothing else due before the next.
When the supervisor jumps to such an instant it may *lease* the clock to the device it
wakes, for the command it saw running, up to (not including) the platform's next event
of anybody else's. The device then moves ``now_ns`` itself (``advance_leased``) to each
of its own wakes before that bound -- in that command, and idle once it ended (its
hand-off signal's instant) -- instead of blocking for a jump per instant, for as long as
it tells nobody anything and does not block: a fence it
signals, a record it sends or its next block ends the lease (the bound was the next
event as the jump saw the platform: once anybody else runs, it may be earlier). The
instants and their order are the same as with a jump per instant: nobody else had an
event before the bound, and nobody could have seen the device in between.

Only one writer of ``now_ns`` at a time: the supervisor jumps only while every device is
blocked (the lessee, blocked, no longer advances) or stopped by a signal. A device
stopped in the middle of ``advance_leased`` may store its instant after the supervisor
jumped past it; it finds the jump count moved, and puts back the supervisor's target
(word 7, written before the count).

Process-wide seam: a device or supervisor process belongs to one platform, so it installs
its clock once (``install``) and reads ``now_ns()`` through this module; a client process
may hold connections to several platforms, so each connection carries its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._segments import Segment

REAL, VIRTUAL = "real", "virtual"
CLOCKS = (REAL, VIRTUAL)
NO_WAKE = (1 << 64) - 1        # blocked with no modeled instant of its own
VIRTUAL_EPOCH_NS = 1_000_000_000  # where a virtual clock starts (never 0: 0 means unset)
_HEADER_WORDS = 16
# Jumps a lessee's store looks for before it leaves the word as it is: one is the race
# the repair is for; a word that keeps moving is written by somebody else (the segment
# is writable to every process of the platform), and no loop waits on that.
_REPAIRS = 4
# The header's words (see the module docstring).
NOW, JUMPS, RELEASED, LEASE_DEVICE, LEASE_SEQ, LEASE_UNTIL, LEASE_GEN, TARGET, MOVES = range(9)
SLOT_WORDS = 16
WAKE, FENCE, SEEN, GEN, POKED, MORE = range(6)
MAX_FENCES = 1 + SLOT_WORDS - MORE  # fences one slot can name


def segment_bytes(devices: int, clients: int) -> int:
    return (_HEADER_WORDS + SLOT_WORDS * (devices + clients)) * 8


class RealClock:
    """The host's monotonic clock: what every wait used before the seam."""

    virtual = False
    now_ns = staticmethod(time.monotonic_ns)


class Waiter:
    """One waiter slot: a process's "I am blocked until" (see the module docstring).
    The waiter writes it; the supervisor reads it (``snapshot``) and pokes it."""

    __slots__ = ("_q", "_i")

    def __init__(self, words: memoryview, slot: int) -> None:
        self._q = words
        self._i = _HEADER_WORDS + slot * SLOT_WORDS

    def block(self, wake: int, fence: int = 0) -> None:
        """Say this process is blocked until modeled ``wake`` (``NO_WAKE``: none), on
        ``fence`` if any. Call ``begin`` first, before the last look at the work."""
        q, i = self._q, self._i
        q[i + GEN] += 1
        q[i + FENCE] = fence
        q[i + WAKE] = wake
        q[i + GEN] += 1

    def block_on(self, wake: int, fences: tuple[int, ...]) -> None:
        """``block`` on any of ``fences`` (at most ``MAX_FENCES``; a client whose threads
        wait on several)."""
        assert len(fences) <= MAX_FENCES, len(fences)
        q, i = self._q, self._i
        q[i + GEN] += 1
        for k, fence in enumerate(fences[1:]):
            q[i + MORE + k] = fence
        if 0 < len(fences) < MAX_FENCES:  # the list ends there
            q[i + MORE + len(fences) - 1] = 0
        q[i + FENCE] = fences[0] if fences else 0
        q[i + WAKE] = wake
        q[i + GEN] += 1

    def begin(self) -> None:
        """Read the supervisor's pokes before looking at the work: a poke after this is
        news the next ``block`` does not cover (``seen != poked``)."""
        q, i = self._q, self._i
        q[i + SEEN] = q[i + POKED]

    def clear(self) -> None:
        """Running again."""
        q, i = self._q, self._i
        if q[i + WAKE]:
            q[i + GEN] += 1
            q[i + WAKE] = 0
            q[i + GEN] += 1

    def reset(self) -> None:
        """A fresh slot (the supervisor, before handing it out): nothing blocked, no news."""
        q, i = self._q, self._i
        for k in range(SLOT_WORDS):
            q[i + k] = 0

    def poke(self) -> None:
        """The supervisor wants the waiter's attention (then posts its semaphore)."""
        self._q[self._i + POKED] += 1

    def poked(self) -> int:
        """How many pokes the slot has had (a count only the supervisor moves)."""
        return self._q[self._i + POKED]

    def has_news(self) -> bool:
        """A poke came since the last ``begin`` (the waiter's own view)."""
        q, i = self._q, self._i
        return q[i + SEEN] != q[i + POKED]

    def gen(self) -> int:
        """How many times the slot changed (twice per block or clear): a reader that
        sees another value has seen the waiter enter or leave a wait."""
        return self._q[self._i + GEN]

    def fence(self) -> int:
        """The (first) fence the waiter sleeps on (0: none, or it runs)."""
        return self._q[self._i + FENCE] if self._q[self._i + WAKE] else 0

    def snapshot(self) -> tuple[int, tuple[int, ...]] | None:
        """``(wake, fences)`` of a waiter blocked with no unseen news, read consistently;
        None while it runs, changes its slot, or has news it has not seen."""
        q, i = self._q, self._i
        gen = q[i + GEN]
        if gen & 1:
            return None
        wake, fence = q[i + WAKE], q[i + FENCE]
        if not wake or q[i + SEEN] != q[i + POKED]:  # (most looks end here: it runs)
            return None
        fences: tuple[int, ...] = ()
        if fence:
            fences = (fence,)
            for k in range(i + MORE, i + SLOT_WORDS):
                if not q[k]:
                    break
                fences += (q[k],)
        if q[i + GEN] != gen:  # it changed its slot while we read: no consistent view
            return None
        return wake, fences


class VirtualClock:
    """Modeled time that moves only when the supervisor says so (a u64 word in shared
    memory). Every process reads it; only the supervisor's ``advance`` writes it."""

    virtual = True

    def __init__(self, segment: Segment, *, create: bool = False) -> None:
        self.segment = segment
        self._q = memoryview(segment.map).cast("Q")
        if create:
            self._q[NOW] = self._q[RELEASED] = self._q[TARGET] = VIRTUAL_EPOCH_NS
        q = self._q
        self.now_ns: Callable[[], int] = lambda: q[0]
        # What a client's deadline is compared with: the devices act at an instant first.
        self.released_ns: Callable[[], int] = lambda: q[2]

    @property
    def jumps(self) -> int:
        return self._q[JUMPS]

    @property
    def leased_moves(self) -> int:
        """How many times a device moved the clock under a lease."""
        return self._q[MOVES]

    def advance(self, t: int) -> None:
        """Move the clock to ``t`` (the supervisor only; never back), revoking any lease.
        The order is the lease's protocol (``advance_leased``): the target, no lease, the
        count, then the word."""
        q = self._q
        assert t >= q[NOW], (t, q[NOW])
        q[TARGET] = t
        q[LEASE_DEVICE] = 0
        q[JUMPS] += 1
        q[NOW] = t

    def lease(self, device: int, seq: int, until: int, gen: int) -> None:
        """Let ``device`` move the clock itself, while it runs command ``seq``, to any
        instant before ``until``, until it blocks again (the supervisor, right after a
        jump that wakes it, blocked with its slot's ``gen`` at ``gen``)."""
        q = self._q
        q[LEASE_SEQ] = seq
        q[LEASE_UNTIL] = until
        q[LEASE_GEN] = gen
        q[LEASE_DEVICE] = device + 1

    def revoke(self) -> None:
        """No lease (a device process replaced)."""
        self._q[LEASE_DEVICE] = 0

    def advance_leased(self, device: int, seq: int, t: int, gen: int) -> bool:
        """The lessee moves the clock to ``t``: True when its lease (this device, this
        command -- ``seq`` 0: idle, past it --, ``t`` before the bound, the device's slot
        at ``gen``: woken once since the grant, not blocked again) allowed it, else False
        and nothing moved.

        A store racing a supervisor's jump (this device stopped by a signal between its
        look and its store) is repaired: a moved jump count means the supervisor may have
        written its target before our store, and the word gets the later of both."""
        q = self._q
        jumps = q[JUMPS]
        if (q[LEASE_DEVICE] != device + 1 or (seq and q[LEASE_SEQ] != seq)
                or q[LEASE_GEN] + 2 != gen or not q[NOW] < t < q[LEASE_UNTIL]):
            return False
        self._store_leased(t, jumps)
        return True

    def _store_leased(self, t: int, jumps: int) -> None:
        """``advance_leased``'s store, the lease checked when the jump count was ``jumps``."""
        q = self._q
        q[NOW] = t
        q[MOVES] += 1
        for _ in range(_REPAIRS):  # (only when stopped mid-way: see the docstring)
            if q[JUMPS] == jumps:
                return
            jumps = q[JUMPS]
            q[NOW] = max(t, q[TARGET])

    def release(self) -> None:
        """Let the clients' deadlines come to now (the supervisor only, once every device
        has done what was due at this instant)."""
        self._q[2] = self._q[0]

    def waiter(self, slot: int) -> Waiter:
        return Waiter(self._q, slot)

    def generations(self, slots: int) -> list[int]:
        """The ``gen`` word of the first ``slots`` waiter slots: a slot whose ``gen`` did
        not change between two reads was not registered anew in between (a waiter that
        runs and blocks again moves it)."""
        start = _HEADER_WORDS + GEN
        return self._q[start:start + slots * SLOT_WORDS:SLOT_WORDS].tolist()

    def all_blocked(self, slots: range, but: int = -1,
                    pending: Callable[[int], bool] | None = None) -> bool:
        """Whether every waiter of ``slots`` (but ``but``) is blocked with no news: the
        one that blocks now may be the platform's last, and wakes the supervisor.
        ``pending``: whether a fence is still pending (``FenceTable.pending``); a waiter
        asleep on one that completed is about to run, and says so itself when it blocks
        again (the supervisor judges it so: waking it now would find it running)."""
        q = self._q
        for slot in slots:
            if slot == but:
                continue
            i = _HEADER_WORDS + slot * SLOT_WORDS
            if not q[i + WAKE] or q[i + SEEN] != q[i + POKED]:
                return False
            fence = q[i + FENCE]
            if fence and pending is not None and not pending(fence):
                return False
        return True

    def close(self) -> None:
        """Unmap the word (its segment's creator unlinks it)."""
        self.now_ns = self.released_ns = lambda: 0
        self._q.release()


# -- the process-wide seam (devices and the supervisor: one platform per process) -------

now_ns: Callable[[], int] = time.monotonic_ns
virtual: VirtualClock | None = None


def install(clock: VirtualClock) -> None:
    """Make ``clock`` this process's clock (once, at start): ``now_ns`` reads it."""
    global now_ns, virtual
    virtual = clock
    now_ns = clock.now_ns


__all__ = ["RealClock", "VirtualClock", "Waiter", "NO_WAKE", "CLOCKS", "REAL", "VIRTUAL",
           "MAX_FENCES",
           "segment_bytes", "install"]

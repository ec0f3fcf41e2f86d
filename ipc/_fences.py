"""Fences: a state word in shared memory plus a POSIX semaphore to sleep on.

Layout: one shared table of fixed 48-byte slots. A slot holds its generation, state
(pending / signalled / error), error code, the id of who signalled it, the *modeled* signal
time (CLOCK_MONOTONIC, shared by every process), the request's correlation id, and the
host's own signal time. A device stamps the modeled end of the command (plus its
hand-off), not the moment its host process got round to the post, so a consumer on another
device anchors its own modeled start to the producer's timeline (invariant 8); a host
signaller (a client, the supervisor) stamps now. The host time beside it is what host
latency measurements (``bench/``) read.

A handle is ``generation << 32 | slot``. Every operation checks the generation first, so
a stale handle, or a late signal from a command that was killed, can never complete or
touch a slot that was recycled for a newer fence (invariant 3).

Waking many waiters with one semaphore: the signaller writes the outcome, then posts once;
each waiter that wakes and finds the fence done posts again before returning, passing the
token on. A waiter that arrives late finds the state word already final and never sleeps.
A waiter that wakes on a token left over from an older generation finds the fence still
pending and sleeps again. The supervisor drains the semaphore when it recycles a slot.

Only the table's creator (the supervisor) allocates and releases slots and creates
semaphores (lazily, in chunks, so steady-state fence creation costs no ``sem_open``).
Anyone may signal, wait and read.

A fence someone watches through a file descriptor (``_fencefd``) or a merge carries the
*watched* bit (the owner word's top bit, set by the creator): whoever signals it sets
``poked`` on its own table, and a device or client that sees it tells the supervisor,
which completes the descriptors; the owner tag that readers compare never includes it.
"""

from __future__ import annotations

import ctypes
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc

from . import errors
from ._segments import Segment

PENDING, SIGNALLED, FAILED = 0, 1, 2
SLOT_BYTES = 48
SEM_CHUNK = 64
SLOT_DTYPE = np.dtype([
    ("gen", "<u4"), ("state", "<u4"), ("error", "<u4"), ("signaller", "<u4"),
    ("t_ns", "<u8"), ("cid", "<u8"), ("t_host", "<u8"), ("owner", "<u8"),
])
_W32, _W64 = SLOT_BYTES // 4, SLOT_BYTES // 8  # a slot's width in u32 and u64 words
assert SLOT_DTYPE.itemsize == SLOT_BYTES
# A slot from its state word to t_host (offset 4): state, error, signaller, t_ns, cid, t_host.
_CLEAR = struct.Struct("<3I4Q")  # state, error, signaller, t_ns, cid, t_host, owner
assert _CLEAR.size == SLOT_BYTES - 4
WATCHED = 1 << 63         # in the owner word: someone watches this fence (see above)
_OWNER_MASK = WATCHED - 1
# The longest one sleep of the main thread lasts: a signal that comes meanwhile (Ctrl-C,
# a test runner's timeout) is handled at most this much later (see ``_take``).
MAIN_SLICE_S = 0.05


def make_handle(slot: int, gen: int) -> int:
    return (gen << 32) | slot


def split_handle(handle: int) -> tuple[int, int]:
    return handle & 0xFFFFFFFF, handle >> 32


# A correlation id (seed §22) is ``client id << 40 | origin | sequence``: the client that
# asked, then who numbered the request -- the supervisor (origin 0, its own counter), a
# client (``CID_BY_CLIENT``, the cid it put on its command) or the supervisor for a copy
# it inserted at a hand-off (``CID_BY_HANDOFF``) -- so ids from different numberers never
# collide, and a trace reader tells who a request belongs to from the id alone.
CID_CLIENT_SHIFT = 40
CID_BY_CLIENT = 1 << 39
CID_BY_HANDOFF = 1 << 38
_CID_SEQ = CID_BY_HANDOFF - 1


def make_cid(client_id: int, seq: int, origin: int = 0) -> int:
    return (client_id << CID_CLIENT_SHIFT) | origin | seq


def split_cid(cid: int) -> tuple[int, int, int]:
    """``(client id, origin, sequence)``: ``make_cid`` reversed."""
    return cid >> CID_CLIENT_SHIFT, cid & (CID_BY_CLIENT | CID_BY_HANDOFF), cid & _CID_SEQ


def watch(table: FenceTable, handle: int) -> None:
    """Mark a live fence of ``table`` watched (its creator does, once a descriptor or a
    merge depends on it): its signallers then set ``poked``. Reuse clears the mark."""
    slot, gen = split_handle(handle)
    if table._owns(slot, gen):
        table._u64[slot * _W64 + 5] |= WATCHED


class FenceTable:
    """A table of fences over one shared segment; see the module docstring."""

    def __init__(self, prefix: str, segment: Segment, *, create: bool,
                 on_new_semaphores: Callable[[list[str]], None] = lambda names: None) -> None:
        self.prefix = prefix
        self.segment = segment
        # The now a signaller stamps as its host time, and a host signaller as the modeled
        # time too (None: the host's monotonic clock; a platform on the virtual clock
        # sets its clock's ``now_ns``, ``ipc._clock``).
        self.model_now: Callable[[], int] | None = None
        self.capacity = segment.size // SLOT_BYTES
        self.slots = np.ndarray(self.capacity, SLOT_DTYPE, buffer=segment.map)  # slow path
        # Hot path: typed views (an item store costs ~40 ns; a numpy field store ~1 us).
        # Slot i: u32 [12i] gen, [12i+1] state, [12i+2] error, [12i+3] signaller;
        #         u64 [6i+2] t_ns (modeled), [6i+3] cid, [6i+4] t_host, [6i+5] owner.
        self._u32 = memoryview(segment.map).cast("B").cast("I")
        self._u64 = memoryview(segment.map).cast("B").cast("Q")
        self._raw = memoryview(segment.map).cast("B")
        self._sems: dict[int, posix_ipc.Semaphore] = {}
        self._creator = create
        self._on_new_sems = on_new_semaphores
        self._free: list[int] = []
        self._sem_slots = 0  # slots [0, _sem_slots) have a semaphore
        # Set by ``signal`` when it completed a watched fence; whoever acts on it (wakes
        # the supervisor, sweeps the watches) clears it.
        self.poked = False
        if create and not segment.created:  # a segment just created reads zero already
            self.slots[:] = 0

    @staticmethod
    def segment_bytes(capacity: int) -> int:
        return capacity * SLOT_BYTES

    def sem_name(self, slot: int) -> str:
        return f"{self.prefix}f{slot}"

    # -- creator side -----------------------------------------------------------------

    def allocate(self, cid: int = 0, owner: int = 0) -> int:
        """A new pending fence; raises ``OutOfMemory`` when every slot is live.
        ``owner``: the tag of the client connection it belongs to (0: the supervisor's),
        what a device checks before it signals a fence named in a queue record."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        u32, i = self._u32, slot * _W32
        gen = (u32[i] + 1) & 0xFFFFFFFF or 1
        u32[i + 1] = PENDING
        u32[i + 2] = u32[i + 3] = 0
        u64, j = self._u64, slot * _W64
        u64[j + 2] = u64[j + 4] = 0
        u64[j + 3] = cid
        u64[j + 5] = owner
        u32[i] = gen  # publish last: until now, old handles still saw the old generation
        return (gen << 32) | slot  # make_handle

    def allocate_many(self, count: int, owner: int = 0) -> list[int]:
        """``count`` new pending fences (``allocate`` each, in one call, cid 0, one
        ``owner``): all of them, or ``OutOfMemory`` and none."""
        out: list[int] = []
        free, u32, clear, raw = self._free, self._u32, _CLEAR.pack_into, self._raw
        for _ in range(count):
            if not free:
                try:
                    self._grow()
                except errors.OutOfMemory:
                    for handle in out:
                        self.release(handle)
                    raise
            slot = free.pop()
            i = slot * _W32
            gen = (u32[i] + 1) & 0xFFFFFFFF or 1
            # state PENDING, error, signaller, t_ns, cid, t_host: 0, the owner, in one store
            clear(raw, slot * SLOT_BYTES + 4, PENDING, 0, 0, 0, 0, 0, owner)
            u32[i] = gen  # publish last (see allocate)
            out.append((gen << 32) | slot)
        return out

    def release_many(self, handles: list[int]) -> None:
        """``release`` each (a stale handle is skipped, as there)."""
        u32, cap, sems, free = self._u32, self.capacity, self._sems, self._free
        for handle in handles:
            slot, gen = handle & 0xFFFFFFFF, handle >> 32
            if not (slot < cap and gen and u32[slot * _W32] == gen):
                continue
            u32[slot * _W32] = (gen + 1) & 0xFFFFFFFF  # see release
            sem = sems.get(slot)
            if sem is None:
                sem = self._sem(slot)
            while sem.value > 0:
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break
            free.append(slot)

    def release(self, handle: int) -> None:
        """Recycle a fence's slot. Its handle, and every copy of it, goes stale at once."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32  # split_handle, _owns: inline
        u32 = self._u32
        if not (slot < self.capacity and gen and u32[slot * _W32] == gen):
            return
        # A generation of its own for the free slot: no handle ever matches it, so a late
        # signal between now and the next allocate() touches nothing.
        u32[slot * _W32] = (gen + 1) & 0xFFFFFFFF
        sem = self._sems.get(slot)
        if sem is None:
            sem = self._sem(slot)
        while sem.value > 0:  # drain tokens passed between waiters: the next fence starts at 0
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                break
        self._free.append(slot)

    def _grow(self) -> None:
        if self._sem_slots >= self.capacity:
            raise errors.OutOfMemory(f"fence table full ({self.capacity} live fences)")
        start, stop = self._sem_slots, min(self._sem_slots + SEM_CHUNK, self.capacity)
        names = [self.sem_name(slot) for slot in range(start, stop)]
        self._on_new_sems(names)  # recorded before they exist: cleanup never misses one
        for slot, name in zip(range(start, stop), names):
            self._sems[slot] = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=0)
        self._sem_slots = stop
        self._free.extend(range(stop - 1, start - 1, -1))

    # -- anyone -----------------------------------------------------------------------

    def _owns(self, slot: int, gen: int) -> bool:
        return 0 <= slot < self.capacity and gen != 0 and self._u32[slot * _W32] == gen

    def _sem(self, slot: int) -> posix_ipc.Semaphore:
        sem = self._sems.get(slot)
        if sem is None:
            try:
                sem = self._sems[slot] = posix_ipc.Semaphore(self.sem_name(slot))
            except posix_ipc.ExistentialError:
                # Unlinked under us: only a teardown does that (a dead supervisor's
                # platform removed by `hetproc cleanup`), so the platform is gone.
                raise errors.SupervisorLost(
                    f"fence slot {slot}'s semaphore is gone: its platform was torn down "
                    "(the supervisor died and a cleanup removed its objects)") from None
        return sem

    def check(self, handle: int) -> None:
        """Raise ``StaleHandle`` / ``InvalidHandle`` unless ``handle`` names a live fence."""
        slot, gen = split_handle(handle)
        if not 0 <= slot < self.capacity or gen == 0:
            raise errors.InvalidHandle(f"fence handle {handle:#x} names no slot")
        if self._u32[slot * _W32] != gen:
            raise errors.StaleHandle(f"fence handle {handle:#x} is stale (slot reused)")

    def signal(self, handle: int, error: int = 0, signaller: int = 0, t_ns: int = 0) -> bool:
        """Complete a fence (``error`` 0) or fail it with an error code; wakes all waiters.

        ``t_ns``: the modeled signal time to stamp (0: now).

        Returns False, touching nothing, when the handle is stale or the fence already
        completed: the first outcome is final (a late signal never overrides an error).
        """
        slot, gen = handle & 0xFFFFFFFF, handle >> 32  # slot >= 0 by construction
        u32, i = self._u32, slot * _W32
        if not (slot < self.capacity and gen and u32[i] == gen and u32[i + 1] == PENDING):
            return False
        # First: a cold sem_open must not sit between stamp and wake.
        sem = self._sems.get(slot) or self._sem(slot)
        u32[i + 2] = error
        u32[i + 3] = signaller
        # On the virtual clock the host's signal time is the modeled now too: a platform
        # on it has one clock (nothing there may compare with the host's).
        now = time.monotonic_ns() if self.model_now is None else self.model_now()
        u64, j = self._u64, slot * _W64
        u64[j + 2] = t_ns or now
        u64[j + 4] = now
        u32[i + 1] = FAILED if error else SIGNALLED  # the outcome is written before the wake-up
        sem.release()
        if u64[j + 5] & WATCHED:
            self.poked = True
        return True

    def poll(self, handle: int) -> tuple[int, int]:
        """``(state, error)`` without blocking; raises on a stale handle."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        u32 = self._u32
        if not (0 <= slot < self.capacity and gen > 0 and u32[slot * _W32] == gen):
            self.check(handle)  # raises, saying which
        i = slot * _W32
        return u32[i + 1], u32[i + 2]

    def wait(self, handle: int, timeout: float) -> int:
        """Block until the fence completes; returns its error code (0 = success).

        Raises ``FenceTimeout`` when ``timeout`` seconds pass first, ``StaleHandle`` if the
        fence was recycled meanwhile. Every call has a deadline: there is no wait forever.
        """
        slot, gen = split_handle(handle)
        self.check(handle)
        u32, i = self._u32, slot * _W32
        if u32[i + 1] != PENDING:
            return u32[i + 2]
        deadline = time.monotonic() + timeout
        sem = self._sem(slot)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.FenceTimeout(f"fence {handle:#x} still pending after {timeout:.3f} s")
            if not _take(sem, remaining):
                continue  # the loop re-checks the deadline and raises
            if u32[i] != gen:
                sem.release()
                raise errors.StaleHandle(f"fence {handle:#x} was recycled while waited on")
            if u32[i + 1] != PENDING:
                sem.release()  # pass the token on to the next waiter
                return u32[i + 2]
            # A token left from an older generation: swallow it and sleep again.

    def set_cid(self, handle: int, cid: int) -> None:
        """Stamp the correlation id of the command that will signal this fence: done by
        whoever binds the fence to its command (the supervisor for fences it makes, the
        client for fences it picks from its pool), so a waiter can name its producer."""
        slot, gen = split_handle(handle)
        if self._owns(slot, gen):
            self._u64[slot * _W64 + 3] = cid

    def producer(self, handle: int) -> tuple[int, int, int]:
        """``(cid, signaller, t_ns)`` of a fence's outcome, cheaply (no numpy): who a
        waiter was really waiting for, and the modeled time it signalled. Zeros for a
        stale handle."""
        slot, gen = split_handle(handle)
        if not self._owns(slot, gen):
            return 0, 0, 0
        return self._u64[slot * _W64 + 3], self._u32[slot * _W32 + 3], self._u64[slot * _W64 + 2]

    def pending_owner(self, handle: int) -> int:
        """The owner tag of a live, pending fence; -1 otherwise (one read for both)."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        if not (0 <= slot < self.capacity and gen and self._u32[slot * _W32] == gen
                and self._u32[slot * _W32 + 1] == PENDING):
            return -1
        return self._u64[slot * _W64 + 5] & _OWNER_MASK

    def owner(self, handle: int) -> int:
        """The owner tag of a live fence, pending or not; -1 for a stale handle."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        if not self._owns(slot, gen):
            return -1
        return self._u64[slot * _W64 + 5] & _OWNER_MASK

    def outcome(self, handle: int) -> tuple[int, int, int, int, bool]:
        """``(state, error word, cid, modeled signal ns, watched)`` of a live fence (no
        numpy); state -1 for a stale handle."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        if not self._owns(slot, gen):
            return -1, 0, 0, 0, False
        i, j = slot * _W32, slot * _W64
        return (self._u32[i + 1], self._u32[i + 2], self._u64[j + 3], self._u64[j + 2],
                bool(self._u64[j + 5] & WATCHED))

    def pending(self, handle: int) -> bool:
        """Still pending: False once it completed, and for a stale handle (its slot was
        recycled; a waiter on it wakes to find out)."""
        slot, gen = handle & 0xFFFFFFFF, handle >> 32
        return self._owns(slot, gen) and self._u32[slot * _W32 + 1] == PENDING

    def info(self, handle: int) -> dict:
        slot, gen = split_handle(handle)
        rec = self.slots[slot]
        return {"slot": slot, "gen": gen, "state": int(rec["state"]), "error": int(rec["error"]),
                "signaller": int(rec["signaller"]), "t_ns": int(rec["t_ns"]),
                "cid": int(rec["cid"]), "t_host": int(rec["t_host"])}

    def free_count(self) -> int:
        """Fences that can still be allocated (free slots plus slots never used)."""
        return len(self._free) + self.capacity - self._sem_slots

    def semaphore_count(self) -> int:
        return self._sem_slots

    def live_count(self) -> int:
        return self._sem_slots - len(self._free)

    def close(self, unlink: bool = False) -> None:
        self._u32.release()
        self._u64.release()
        self._raw.release()
        # A fence kept past its platform's stop asks a closed table: it gets PlatformClosed,
        # not a released memoryview's ValueError (nor a crash), at no cost to the open path.
        self._u32 = self._u64 = self._raw = _CLOSED
        del self.slots
        for sem in self._sems.values():
            if unlink and self._creator:
                try:
                    sem.unlink()
                except posix_ipc.ExistentialError:
                    pass
            sem.close()
        self._sems.clear()


class _ClosedWords:
    """What a closed table's word views become: every read or write says it is closed."""

    def _closed(self, *args: object) -> int:
        raise errors.PlatformClosed("the platform is stopped or this client closed it: its "
                                    "fences can no longer be read")

    __getitem__ = __setitem__ = _closed


_CLOSED: Any = _ClosedWords()


def wait_once(table: FenceTable, handle: int, timeout: float) -> int | None:
    """One sleep on the fence: its error code once it completed, None when the sleep
    ended (a ``nudge``, a token of an older generation, ``timeout``) with the fence
    still pending. For waits that look at something else too between sleeps (the
    virtual clock's): a nudge wakes them at once, where ``FenceTable.wait`` sleeps again."""
    slot, gen = split_handle(handle)
    table.check(handle)
    u32, i = table._u32, slot * _W32
    if u32[i + 1] == PENDING:
        if not _take(table._sem(slot), timeout):
            return None
        if u32[i] != gen:
            table._sem(slot).release()
            raise errors.StaleHandle(f"fence {handle:#x} was recycled while waited on")
        if u32[i + 1] == PENDING:
            return None
        table._sem(slot).release()  # pass the token on to the next waiter
    return u32[i + 2]


def nudge(table: FenceTable, handle: int) -> None:
    """Wake a waiter of a pending fence without completing it (a token its ``FenceTable.wait``
    swallows, its ``wait_once`` returns None on). A stale or completed fence: nothing."""
    slot, gen = split_handle(handle)
    u32, i = table._u32, slot * _W32
    if slot < table.capacity and gen and u32[i] == gen and u32[i + 1] == PENDING:
        table._sem(slot).release()


def _take(sem: posix_ipc.Semaphore, timeout: float) -> bool:
    """Take one token of ``sem`` within ``timeout`` seconds: whether it was taken.

    A signal never ends a sleep here. posix_ipc turns the EINTR of ``sem_timedwait`` into
    ``SignalError`` and drops whatever the Python handler raised, so in the main thread,
    where Python handlers run, a harmless signal (a SIGCHLD handler, a profiler's timer)
    failed the wait and one that meant something (Ctrl-C's KeyboardInterrupt, a test
    runner's timeout) lost its exception. There the signals are held for one sleep of at
    most ``MAIN_SLICE_S`` and let through after it: a handler runs then, where Python
    would run it, and its exception rises from here intact (a token taken meanwhile is
    put back, for the next waiter). Other threads run no Python handler: an EINTR there
    is only a shorter sleep."""
    if threading.current_thread() is not threading.main_thread():
        try:
            sem.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        return True
    _SIGNALS.hold()
    taken = False
    try:
        sem.acquire(min(timeout, MAIN_SLICE_S))
        taken = True
    except posix_ipc.BusyError:
        pass
    finally:
        try:
            _SIGNALS.let_through()
        except BaseException:
            if taken:
                sem.release()  # a handler raised: the token is the next waiter's
            raise
    return taken


class _MainThreadSignals:
    """Hold every signal of the main thread, then let them through and run their Python
    handlers. Through the C library where it can: ``signal.pthread_sigmask`` returns the
    previous mask as a set of ``Signals``, and building that set of every signal cost
    about 150 us, a wake of a semaphore six times over."""

    _SIGSET_BYTES = 128  # glibc's sigset_t; a larger buffer than needed does no harm

    def __init__(self) -> None:
        self._all = signal.valid_signals()
        self._previous: Any = None
        self._mask: Any = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            mask = libc.pthread_sigmask
            every = ctypes.create_string_buffer(self._SIGSET_BYTES)
            if libc.sigfillset(every) != 0:
                return
            check = ctypes.pythonapi.PyErr_CheckSignals
        except (OSError, AttributeError):
            return  # the signal module's own, slower
        mask.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        mask.restype = ctypes.c_int
        check.argtypes, check.restype = [], ctypes.c_int  # (it raises what a handler raised)
        self._mask, self._every, self._check = mask, every, check
        self._saved = ctypes.create_string_buffer(self._SIGSET_BYTES)

    def hold(self) -> None:
        if self._mask is None:
            self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, self._all)
        elif self._mask(signal.SIG_BLOCK, self._every, self._saved) != 0:
            raise OSError(ctypes.get_errno(), "pthread_sigmask")

    def let_through(self) -> None:
        """Restore the mask; a handler of a signal that came meanwhile runs now, and
        what it raises rises from here."""
        if self._mask is None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)
            return
        self._mask(signal.SIG_SETMASK, self._saved, None)  # a handler may run right here
        self._check()  # or here, where the interpreter did not run it yet


_SIGNALS = _MainThreadSignals()

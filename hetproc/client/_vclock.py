"""A client's waits under the virtual clock: blocked in modeled time, never in real time.

A connection to a platform on the virtual clock gets a waiter slot at hello (``ipc._clock``,
``hetproc.supervisor._clock``). A wait says in it that this process is blocked -- on which
fence, until which modeled instant -- only after its last packet was written (every
request is written whole before it returns), then sleeps on the fence's semaphore,
ending when the fence completes or the clock passes its deadline (the jump there nudges
the fence; a real slice is the fallback); the slot is cleared when the wait ends. A
deadline is compared with the clock's ``released_ns``, not its now: at one instant the
devices act first, then the clients' deadlines come (``hetproc.supervisor._clock``).
``sleep`` blocks on no fence: it sleeps on its connection's bell, which the jump to its
end nudges. A fence wait that ends at an instant the devices still act at (its fence
was signalled by one of them) goes on as a sleep to that instant (``_settle``): the
waiter sees the instant once every device is done with it. A wait that begins with
every device blocked may be the last one the clock waits for: it pings the supervisor,
which looks at once.

Every wait keeps a real deadline too (``REAL_BACKSTOP_S`` past the modeled timeout's
worth of real time, or when the supervisor dies), so nothing blocks forever even if the
clock never moves.

Threads. A process is blocked only while every thread of it that has used hetproc on
the virtual clock (a request, a submit, a wait: a *known* thread, until it ends) is in a
hetproc wait; the slots of its connections then name the earliest deadline and the
fences its threads wait on (``_Threads``). A thread that never called hetproc is
invisible: what it does (signal a user fence, wake a known thread by other means) may
come after the clock moved. A known thread that blocks elsewhere (``time.sleep``, a
lock, ``Thread.join``, its own socket) holds the clock, as a single-threaded client
outside hetproc does: after ``autojump_ms`` the clock moves anyway, a determinism break.
More than ``ipc.clock.MAX_FENCES`` fences waited on one connection at once count as
running, as such a client does.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ipc import clock, errors, wait_fence_once

if TYPE_CHECKING:
    from ._connection import Connection

# A fence wait looks at the clock (its deadline) and the supervisor this often if no
# nudge comes: a fallback, the jump to its deadline nudges it, but a supervisor that died
# is seen only here. (Each slice is a wake-up of the client: at 2 ms they were most of its
# wake-ups on a busy pipeline.) With other known threads it also looks for ended ones
# (``_Threads.look``), which hold the clock until then: sooner, well within any
# ``autojump_ms``.
FENCE_SLICE_S = 0.01
THREADS_SLICE_S = 0.002
SLEEP_SLICE_S = 0.0005  # ``sleep`` polls the clock word this often (no bell: an old supervisor)
BELL_SLICE_S = 0.02     # ``sleep`` on its bell looks this often if no nudge comes
REAL_BACKSTOP_S = 60.0  # real seconds a wait goes on if the clock stops moving


class _Threads:
    """This process's threads that used hetproc on the virtual clock, and the wait each
    is in (None: running); see the module docstring. Every change publishes the whole
    process's state into the slots of its connections, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waits: dict[threading.Thread, tuple[Connection, int, int] | None] = {}
        self.conns: weakref.WeakSet[Connection] = weakref.WeakSet()
        # The one connection whose slot says blocked, as the last publish left them (None:
        # none, or several: only while several threads are known; ``_publish``).
        self._shown: Callable[[], Connection | None] = _nobody

    def known(self, conn: Connection) -> None:
        """The calling thread uses hetproc on ``conn`` (a request, a submit)."""
        me = threading.current_thread()
        if me not in self.waits or conn not in self.conns:
            with self.lock:
                self.waits.setdefault(me, None)
                self.conns.add(conn)
                self._publish()

    def wait(self, conn: Connection, wake: int, fence: int = 0) -> None:
        """The calling thread waits on ``conn`` until modeled ``wake``, on ``fence``
        (None: it runs again)."""
        with self.lock:
            self.waits[threading.current_thread()] = (conn, wake, fence)
            self.conns.add(conn)
            self._publish()

    def run(self) -> None:
        with self.lock:
            self.waits[threading.current_thread()] = None
            self._publish()

    def alone(self) -> bool:
        """Only one known thread (the caller): none can end while it waits."""
        return len(self.waits) <= 1

    def look(self) -> None:
        """Publish again (a waiting thread, now and then): a known thread that ended
        since holds the clock no more."""
        with self.lock:
            if None in self.waits.values():  # (all waiting: no ended thread can matter)
                self._publish()

    def _publish(self) -> None:
        if len(self.waits) == 1:
            ((thread, w),) = self.waits.items()
            if thread is threading.current_thread():
                self._publish_one(w)
                return
        self._publish_all()

    def _publish_one(self, w: tuple[Connection, int, int] | None) -> None:
        """The common case, one known thread (the caller: so it is alive), without the
        walks of ``_publish_all``: at most one slot says blocked, that of the connection
        it waits on. (A client holding several connections -- multi_tenant's tenants --
        published every wait and every end of one into each of them.)"""
        shown = self._shown()
        if shown is not None and shown.waiter is not None and (w is None or shown is not w[0]):
            shown.waiter.clear()
        waiter = w[0].waiter if w is not None else None
        if w is None or waiter is None:
            self._shown = _nobody
            return
        waiter.block_on(w[1], (w[2],) if w[2] else ())
        self._shown = weakref.ref(w[0])

    def _publish_all(self) -> None:
        for t in [t for t in self.waits if not t.is_alive()]:
            del self.waits[t]
        waits = list(self.waits.values())
        blocked = all(w is not None for w in waits)
        shown: list[Connection] = []
        for conn in list(self.conns):
            waiter = conn.waiter
            if waiter is None:
                continue
            mine = [w for w in waits if w is not None and w[0] is conn]
            fences = tuple(dict.fromkeys(w[2] for w in mine if w[2]))
            if blocked and mine and len(fences) <= clock.MAX_FENCES:
                waiter.block_on(min(w[1] for w in mine), fences)
                shown.append(conn)
            else:
                waiter.clear()
        # (Several shown: several threads wait, and the next publish walks them all again.)
        self._shown = weakref.ref(shown[0]) if len(shown) == 1 else _nobody


def _nobody() -> None:
    return None


THREADS = _Threads()


def _forget_in_child() -> None:
    """A forked child is a process of its own to the clock: its parent's threads and
    connections are not its own. Kept, its first wait published into its parent's
    waiter slots (clearing them while the parent waited: the clock held, never moved)."""
    global THREADS
    THREADS = _Threads()


os.register_at_fork(after_in_child=_forget_in_child)


def wait_fence(conn: Connection, handle: int, timeout_s: float) -> int:
    """The fence's error code once it completes (0: signalled); ``FenceTimeout`` once
    the modeled clock passed ``timeout_s`` from now, ``SupervisorLost`` if it died."""
    fences = conn.fences
    assert conn.waiter is not None
    now, released = conn.clock.now_ns, _released(conn)
    deadline = _deadline(now(), timeout_s)
    backstop = time.monotonic() + REAL_BACKSTOP_S + min(timeout_s, REAL_BACKSTOP_S)
    THREADS.wait(conn, deadline, handle)
    _last_wait(conn)
    try:
        while True:
            code = wait_fence_once(fences, handle,
                                   FENCE_SLICE_S if THREADS.alone() else THREADS_SLICE_S)
            if code is not None:
                if released() < now():  # woken at an instant the devices still act at
                    _settle(conn, now())
                return code
            if released() >= deadline:
                raise errors.FenceTimeout(
                    f"fence {handle:#x} still pending after {timeout_s:.3f} s (virtual clock)")
            if time.monotonic() > backstop:  # not modeled time: say what ran out
                raise errors.FenceTimeout(
                    f"fence {handle:#x} still pending, and the virtual clock did not reach "
                    f"the wait's {timeout_s:.3f} s deadline in {REAL_BACKSTOP_S:.0f} s of "
                    "real time (something outside hetproc holds it)")
            if not conn.supervisor_alive():
                raise errors.SupervisorLost("the supervisor died while this fence was pending")
            THREADS.look()
    finally:
        THREADS.run()


def wait_handle(conn: Connection, handle: int, timeout_s: float) -> int:
    """A wait on a raw fence handle on the connection's clock: ``FenceTable.wait`` on the
    real clock, ``wait_fence`` (modeled time, registered) on the virtual one."""
    if conn.waiter is None:
        return conn.fences.wait(handle, timeout_s)
    return wait_fence(conn, handle, timeout_s)


def sleep(conn: Connection, seconds: float) -> None:
    """Block until the modeled clock has moved ``seconds`` on."""
    assert conn.waiter is not None
    _settle(conn, conn.clock.now_ns() + round(seconds * 1e9), seconds)


def _settle(conn: Connection, until: int, seconds: float = 0.0) -> None:
    """Block until the clients' deadlines have come to modeled ``until``: the devices did
    what was due until then (``sleep``). A fence wait that ends at an instant the devices
    still act at (a device signalled it and other devices wake at that instant too) ends
    with this too, for ``until`` the instant itself: its waiter goes on once every
    device is done with the instant, whatever the host ran first, as a sleep's end
    does. (A fence that completed at an earlier instant, the instant done, costs
    nothing.)"""
    released = _released(conn)
    backstop = time.monotonic() + REAL_BACKSTOP_S + seconds
    THREADS.wait(conn, until)
    _last_wait(conn)
    try:
        while released() < until:
            if not conn.supervisor_alive():
                raise errors.SupervisorLost("the supervisor died while the virtual clock "
                                            "was waited for")
            if time.monotonic() > backstop:  # alive: something holds the clock
                raise errors.Timeout(
                    f"the virtual clock did not come to the wait's end in "
                    f"{REAL_BACKSTOP_S:.0f} s of real time: a device that never blocks or "
                    "a process outside hetproc waits holds it (metrics()['clock'])")
            if conn.clock_bell:  # nudged by the jump that reaches ``until``
                wait_fence_once(conn.fences, conn.clock_bell, BELL_SLICE_S)
            else:
                time.sleep(SLEEP_SLICE_S)
            THREADS.look()
    finally:
        THREADS.run()


def _released(conn: Connection) -> Callable[[], int]:
    """What a deadline of ours is compared with: the instant the supervisor let clients'
    deadlines come to, once the devices did what was due then (a device's event and a
    client's deadline at one instant: the device's first, whatever the host's order)."""
    return getattr(conn.clock, "released_ns", conn.clock.now_ns)


def _last_wait(conn: Connection) -> None:
    """A wait that begins with every device blocked may be the one the clock waits for:
    the supervisor is woken (a one-way ping) to look at once, not at its next tick."""
    if isinstance(conn.clock, clock.VirtualClock) and conn.clock.all_blocked(
            conn.clock_devices, pending=conn.fences.pending):
        try:
            conn.notify("ping")
        except errors.HetprocError:
            pass  # the wait finds a lost supervisor out by itself


def _deadline(now: int, timeout_s: float) -> int:
    if timeout_s == float("inf") or timeout_s * 1e9 >= clock.NO_WAKE - now:
        return clock.NO_WAKE
    return now + round(timeout_s * 1e9)

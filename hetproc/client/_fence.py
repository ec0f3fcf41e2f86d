"""``Fence``: a completion event in the platform's fence table, waited on in this process.

A wait sleeps on the fence's semaphore in shared memory: the device (or whoever signals)
wakes it, and no request goes to the supervisor on that path. The fence's error word says
at once what failed (scope, retryability, whether buffers are still trusted); the
supervisor's full record, when the waiter wants the message and evidence, comes ahead of
the wake for the failures the supervisor sets, and is asked for otherwise.

A fence is also a file descriptor (``Fence.fd()``, sync_file's model, ``ipc._fencefd``):
readable once it completed, for select, poll, epoll and asyncio (``wait_async``), and
for any process it is handed to (``wait_fence_fd``). The supervisor writes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ipc import PENDING, errors, fence_fd_status, fence_fd_wait

from . import _vclock

if TYPE_CHECKING:
    from ._client import Client
    from ._queue import Queue

_LIVENESS_SLICE = 0.05   # a long fence wait re-checks the supervisor this often
_DETAIL_WAIT_S = 0.25    # how long a failed wait asks for the supervisor's record


class Fence:
    """A completion event: a command's output fence, or a user fence the caller signals.

    ``wait()`` blocks until it is signalled and raises the error the command failed with;
    ``done()`` and ``error()`` look without blocking. A Fence the client got at creation
    (``Context.submit``, ``Client.fence``, ``Client.import_fence``) gives its slot back
    when released or dropped; ``Fence(client, handle)`` names a fence known by handle and
    never does (to wait on, or to pass in ``wait=``: the supervisor checks the right).
    """

    def __init__(self, client: Client, handle: int, *, cid: int = 0, seq: int = 0,
                 owned: bool = False, may_signal: bool = False) -> None:
        self.client = client
        self._conn = client.connection
        self.handle = handle
        self.cid = cid
        self.seq = seq
        # The supervisor granted this client the right to signal it (it created the user
        # fence, or imported it with the signal right): signal in shared memory directly.
        self._may_signal = may_signal
        # Only the object the client got at creation releases the fence when dropped; a
        # Fence built around a known handle (e.g. one shared by another process) never does.
        self._released = not owned
        self._queue: Queue | None = None  # set by the queue whose command signals it
        self._fd = -1  # ``fd()``'s descriptor, once asked for; closed with the Fence

    def done(self) -> bool:
        """True once the fence is signalled or failed (no wait, no request)."""
        state, _ = self._conn.fences.poll(self.handle)
        return state != PENDING

    def signal_time(self) -> int:
        """The modeled time (CLOCK_MONOTONIC ns) the fence was signalled at: the producer's
        modeled end plus its hand-off, exact even when the host posted it late. 0 while
        pending."""
        if not self.done():
            return 0
        return self._conn.fences.producer(self.handle)[2]

    def wait(self, timeout: float | None = None) -> None:
        """Block until done. Raises the command's error (a ``HetprocError`` completed from
        the supervisor's record when it has one), ``FenceTimeout`` after ``timeout``
        seconds, ``SupervisorLost`` if the supervisor dies meanwhile, ``InvalidRequest``
        for a negative or NaN ``timeout``.

        ``timeout=None`` (the default) is ``DEFAULT_TIMEOUT`` (30 s): no wait is forever by
        accident. ``hetproc.FOREVER`` waits as long as it takes -- only because the caller
        asked -- and still ends with ``SupervisorLost`` if the supervisor dies."""
        timeout = self.client.default_timeout if timeout is None else timeout
        if not timeout >= 0:  # also refuses nan
            raise errors.InvalidRequest(f"wait timeout must be >= 0 seconds, got {timeout!r}")
        code = self._sleep(timeout)
        if code:
            raise self._explained(code)

    def _sleep(self, timeout: float) -> int:
        """Sleep on the semaphore in slices, checking the supervisor between them;
        returns the fence's error code (0: signalled), the wait traced as a WAKE slice."""
        trace, fences, conn = self._conn.trace, self._conn.fences, self._conn
        if conn.waiter is not None:  # the virtual clock: a wait in modeled time
            return self._sleep_virtual(timeout)
        t_wait = trace.wait_begin(self.cid)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                code = fences.wait(self.handle, max(0.0, min(remaining, _LIVENESS_SLICE)))
                break
            except errors.FenceTimeout:
                if remaining <= _LIVENESS_SLICE:
                    # The wait ends here too: its WAKE slice is closed, not left open.
                    trace.wait_end(self.cid, t_wait, errors.FenceTimeout.code)
                    raise errors.FenceTimeout(
                        f"fence {self.handle:#x} still pending after {timeout:.3f} s",
                        correlation_id=self.cid) from None
                if not conn.supervisor_alive():
                    trace.wait_end(self.cid, t_wait, errors.SupervisorLost.code)
                    raise errors.SupervisorLost(
                        "the supervisor died while this fence was pending",
                        correlation_id=self.cid) from None
        trace.wait_end(self.cid, t_wait, code)
        return code

    def _sleep_virtual(self, timeout: float) -> int:
        """``_sleep`` on the virtual clock (``_vclock``): the timeout counts modeled time."""
        trace = self._conn.trace
        t_wait = trace.wait_begin(self.cid)
        try:
            code = _vclock.wait_fence(self._conn, self.handle, timeout)
        except errors.HetprocError as exc:
            exc.correlation_id = self.cid
            trace.wait_end(self.cid, t_wait, exc.code)
            raise
        trace.wait_end(self.cid, t_wait, code)
        return code

    def error(self) -> errors.HetprocError | None:
        """The error this fence failed with, None if pending or successful (from the
        fence's error word alone: no request)."""
        _, word = self._conn.fences.poll(self.handle)
        return self._error(word) if word else None

    def _error(self, word: int) -> errors.HetprocError:
        # Built from the fence's own error word: no round trip on the failure path, so a
        # waiter knows scope, retryability and buffer trust the moment it wakes.
        name = errors.error_class(word & 0xFFFF).__name__
        return errors.error_from_word(
            word, f"{name}: request {self.cid:#x} failed (Fence.error_detail() has the "
                  f"supervisor's record)", correlation_id=self.cid)

    def _explained(self, word: int) -> errors.HetprocError:
        """The error of the fence's word, completed from the supervisor's record when it
        has one: its message, evidence (frozen window, incident) and, for a failure that
        began as an exception in a device process, the remote traceback as the cause.

        The word alone answers scope, retryability and buffer trust at once. A failure
        the supervisor sets (reset, crash, cancel, dependency) has its record sent to this
        process before the wake, so it is read from the socket with no round trip (the
        supervisor may be busy restarting the device). A failure the device signals
        itself has its record one supervisor turn later: that one is asked for, for a
        short while only, and never when the supervisor is gone."""
        err = self._error(word)
        if self._queue is not None:  # no supervisor on that path: the device's note
            return self._queue.explain(self.handle, word, self.cid) or err
        deadline = time.monotonic() + _DETAIL_WAIT_S
        record = self._conn.failure_record(self.handle)
        while record is None and self._conn.supervisor_alive():
            try:
                record = self.error_detail()
            except errors.HetprocError:
                return err
            if record is None:
                if time.monotonic() > deadline:
                    return err
                time.sleep(0.002)
        if record is None:
            return err
        full = errors.HetprocError.from_dict(record)
        full.correlation_id = self.cid
        return full

    def error_detail(self) -> dict[str, Any] | None:
        """The supervisor's full record of this fence's failure (message, detail), None
        while it has none. Read from the socket when it came ahead of the wake, asked
        for otherwise (the request's errors: ``ForeignHandle`` for a fence this client
        may not see, ``PlatformClosed`` after ``close``)."""
        return (self._conn.failure_record(self.handle)
                or self._conn.request("fence_error", fence=self.handle)["error"])

    def signal(self, error: type[errors.HetprocError] | None = None) -> bool:
        """Signal a user fence (or fail it with an error class): wakes every waiter.

        The right to signal is the supervisor's to grant: the fence's creator has it, and
        an importer its owner exported it to with ``signal=True``. Such a Fence signals in
        shared memory at once (a fence wake, no round trip). Any other Fence (one built
        around a handle) asks the supervisor, which checks the right: ``NotPermitted`` or
        ``ForeignHandle`` if the client has none. False if it was signalled already."""
        if self._may_signal and not self._conn.fences.outcome(self.handle)[4]:
            # (A watched fence goes by request: the supervisor completes its descriptors
            # and merges at once instead of on its next tick.)
            return self._conn.fences.signal(self.handle, error().wire if error else 0,
                                            signaller=0xFFFF)
        fields = {"error": error.code} if error else {}
        return self._conn.request("fence_signal", fence=self.handle, **fields)["signalled"]

    def release(self) -> None:
        """Let the platform recycle this fence (batched into the next request) and close
        its descriptor. Dropping the last reference to a Fence does the same; a Fence
        built around a handle releases nothing but its descriptor."""
        self.close_fd()
        if not self._released:
            self._released = True
            self._conn.release_fence(self.handle)

    def __del__(self) -> None:
        # A list append and a close: safe in a finalizer; the message goes with the next
        # request.
        if getattr(self, "_fd", -1) >= 0:
            self.close_fd()
        if not getattr(self, "_released", True):  # an owned fence nobody released
            self._released = True
            self._conn.release_fence(self.handle)

    # -- as a file descriptor (sync_file) ------------------------------------

    def fd(self) -> int:
        """A descriptor that turns readable once this fence is signalled or failed, and
        stays so: for ``select``, ``poll``, ``epoll``, an event loop. It belongs to this
        Fence (the same one on every call) and closes with it (``release``, ``close_fd``,
        the Fence dropped, the client closed); ``os.dup`` it to keep it longer, or hand it
        to another process (``socket.send_fds``), which waits on it with
        ``hetproc.wait_fence_fd``. Never ``read`` it: every holder peeks at the one
        record it holds. Readable without its fence done only when the platform is gone
        (``wait_fence_fd`` then says ``SupervisorLost`` or ``PlatformClosed``).
        ``QuotaExceeded`` past ``limits.client_fence_fds`` pending descriptors."""
        if self._fd < 0:
            (fd,) = self._conn.request("fence_fd", fence=self.handle)["fds"]
            self._fd = self._conn.fence_fds.add(fd)
        return self._fd

    def close_fd(self) -> None:
        """Close the descriptor ``fd()`` made, if any (the supervisor lets go of its end
        once the fence completes)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self._conn.fence_fds.close(fd)

    async def wait_async(self, timeout: float | None = None) -> None:
        """``wait()`` for asyncio: the running loop watches ``fd()`` (no thread, no
        polling), then the outcome is read as ``wait`` reads it: the command's error
        raised, ``FenceTimeout`` after ``timeout`` seconds (default: the client's
        default timeout), ``SupervisorLost`` / ``PlatformClosed`` if the platform went."""
        import asyncio  # only callers of this pay for the import

        timeout = self.client.default_timeout if timeout is None else timeout
        if not timeout >= 0:
            raise errors.InvalidRequest(f"wait timeout must be >= 0 seconds, got {timeout!r}")
        fd = self.fd()
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        def on_readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await asyncio.wait_for(ready, None if timeout == FOREVER_S else timeout)
        except TimeoutError:
            raise errors.FenceTimeout(f"fence {self.handle:#x} still pending after "
                                      f"{timeout:.3f} s", correlation_id=self.cid) from None
        finally:
            loop.remove_reader(fd)
        status = fence_fd_status(fd)
        if status is not None and (status.handle != self.handle or self._conn.closed):
            # the platform went, or this client did: the descriptor's word is all there is
            raise status.error() or errors.PlatformClosed("the fence descriptor ended")
        self.wait(0)

    # -- sharing -------------------------------------------------------------

    def export(self, signal: bool = False) -> int:
        """A token another client turns into this fence with ``import_fence``: to wait on
        it, and with ``signal=True`` also to signal it. ``StaleHandle`` if this fence was
        released."""
        try:
            return self._conn.request("export", fence=self.handle, signal=bool(signal))["token"]
        except errors.StaleHandle:
            raise errors.StaleHandle(f"fence {self.handle:#x} was released") from None

    def __repr__(self) -> str:
        return f"Fence({self.handle:#x}, cid={self.cid:#x})"


FOREVER_S = float("inf")


def merge_fences(*fences: Fence | Iterable[Fence]) -> Fence:
    """``Client.merge_fences`` of the fences' client: a fence that signals when all of
    them do and fails with the first error (sync_file's merge). Fences or iterables of
    them; all of one client (``InvalidRequest`` otherwise)."""
    flat: list[Fence] = []
    for f in fences:
        flat.extend([f] if isinstance(f, Fence) else f)
    if not flat:
        raise errors.InvalidRequest("merge_fences needs at least one fence")
    client = flat[0].client
    if any(f.client is not client for f in flat):
        raise errors.InvalidRequest("merge_fences: the fences belong to different clients "
                                    "(import them into one first)")
    return client.merge_fences(flat)


def wait_fence_fd(fd: int, timeout: float) -> None:
    """Wait, in any process, on a fence descriptor (``Fence.fd()``, perhaps handed over a
    Unix socket): returns once the fence signalled, raises its error (class, scope and
    retryability from the fence's error word), ``FenceTimeout`` after ``timeout``
    seconds, ``SupervisorLost`` if the platform's supervisor died."""
    status = fence_fd_wait(fd, timeout)
    err = status.error()
    if err is not None:
        raise err


def fence_fd_done(fd: int) -> bool:
    """True once a fence descriptor completed (no wait)."""
    return fence_fd_status(fd) is not None


__all__ = ["Fence", "merge_fences", "wait_fence_fd", "fence_fd_done"]

"""``Connection``: one client's control channel to its supervisor, and what rides on it.

A ``Client`` and every object it hands out (``Context``, ``Buffer``, ``Fence``, ``Queue``)
hold the client's ``Connection`` and go through the calls documented here; nothing else
of the connection is theirs to touch. It owns::

    the socket and its lock   one request at a time; replies matched by id
    request ids, cids         the ids of this client's requests and commands
    the segment cache         every shared segment mapped into this process (handed over
                              as descriptors with the replies, or attached by name)
    the fence table           the platform's fences, mapped (waits and polls need no socket)
    the fence pool            output fences a no-wait submit picks without a round trip
    fences to release, frees  batched into the next request: a finalizer only appends
    the failure inbox         records the supervisor sends ahead of a fence's wake
    fence descriptors         the ``Fence.fd()`` descriptors open in this process: closed
                              by their Fence, the rest when the connection closes
    the trace writer          this process's trace ring (``ClientTrace``)

Inside, there is one reader of the socket (``_read``: it maps the descriptors a frame
brings, files notices, and hands back replies), one writer (``_send``), and one place that
turns a broken or stalled socket into the error the caller sees (``_failure``).

Thread safety: the lock serialises every use of the socket and of the batches sent with
it; fence waits, polls and the trace writer take no connection lock.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import socket
import threading
import weakref
from typing import Any

from ipc import (
    CID_BY_CLIENT,
    Channel,
    FenceTable,
    Segment,
    SegmentCache,
    clock,
    decode,
    encode,
    errors,
    make_cid,
    pack_frame,
)

from .. import _protocol
from . import _vclock
from ._trace_ring import ClientTrace

REQUEST_TIMEOUT = 10.0
_RECORDS_KEPT = 4096    # failure records kept for waiters that have not woken yet
# Fences asked for at once: FIRST_FENCE_BATCH on a connection's first ask, twice as many
# after each time a submitter had to wait for fences, up to FENCE_BATCH. Every fence slot
# the platform's table ever hands out costs it a named semaphore (~40 us to create and
# remove): a short-lived client (a test, a drill, a tool) takes a few dozen fences, a
# steady one (a camera, a voice model) keeps the size the ask ahead keeps up with, and a
# pipeline submitting in bursts reaches the full batch in a few asks. Below half the
# ask's size in the pool, the next is asked for ahead (one way).
FIRST_FENCE_BATCH = 16
FENCE_BATCH = 256
_DOOR_WAIT_S = 0.2      # how long a refused hello looks for the supervisor's reason
_PING_FRAME = pack_frame(encode({"op": "ping", "id": 0}))


class _Doubling:
    """A size that doubles when told, up to a ceiling (the fence asks)."""

    __slots__ = ("size", "ceiling")

    def __init__(self, first: int, ceiling: int) -> None:
        self.size, self.ceiling = first, ceiling

    def grow(self) -> None:
        self.size = min(self.ceiling, 2 * self.size)


class Connection:
    """The control connection of one client; see the module docstring.

    ``Connection(address)`` connects (``PlatformClosed`` if nobody listens there);
    ``hello`` introduces the client and maps what the platform shares with it. Every
    request after that raises the supervisor's error for a refused request,
    ``RequestTimeout`` when the supervisor does not answer in ``timeout`` seconds,
    ``SupervisorLost`` when it died, ``PlatformClosed`` when the connection is closed or
    broke otherwise.
    """

    def __init__(self, address: str, timeout: float = REQUEST_TIMEOUT) -> None:
        #: seconds a send or a reply may take before ``RequestTimeout``
        self.timeout = timeout
        # Guards the socket, ``closed``, the ids and the batches below; held for a whole
        # request, so a reply always reaches the thread that sent its request.
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last_id = 0  # the highest request id sent: replies above it are not ours
        self._cids = itertools.count(1)
        self._to_release: list[int] = []  # fences dropped: one message with the next request
        self._fence_pool: list[int] = []
        self._fence_asks = _Doubling(FIRST_FENCE_BATCH, FENCE_BATCH)
        self._refill_id = 0  # the fence_create sent ahead of need, its reply not read yet
        # Failure records the supervisor sent ahead of their fences' wakes, by fence
        # (bounded: the oldest go first; a waiter missing one asks instead).
        self._inbox: collections.OrderedDict[int, dict] = collections.OrderedDict()
        #: the descriptors of ``Fence.fd()`` open in this process
        self.fence_fds = FenceFds()
        #: the last notice that named no fence (a refusal at the door, a warning)
        self.last_notice: dict | None = None
        self.closed = False
        self._in_use = _Usable(self)  # what ``_usable`` returns: one object, no generator
        self.client_id = 0
        self.prefix = ""
        self.supervisor_pid = 0
        self._sup_pidfd = -1  # until hello names the supervisor: a reset during it is clean
        #: every shared segment mapped in this process, by id or name
        self.segments = SegmentCache()
        self._frees = _Frees(self.segments)
        self.fences: FenceTable  #: the platform's fences, mapped by ``hello``
        #: the platform's clock (``ipc.clock``): real until ``hello`` says virtual, then
        #: this connection's waiter slot on it (``_vclock``; None on the real clock)
        self.clock: clock.RealClock | clock.VirtualClock = clock.RealClock()
        self.waiter: clock.Waiter | None = None
        #: a fence of this connection's that never completes: ``hetproc.sleep`` sleeps on
        #: it, the supervisor nudges it when the clock reached the sleep's end (0: none)
        self.clock_bell = 0
        self.clock_devices = range(0)  # the device slots of the clock segment
        self.trace = ClientTrace.disabled()  #: this process's trace ring (after ``hello``)
        try:
            self.channel = Channel.connect(address, timeout)
        except OSError as exc:
            raise errors.PlatformClosed(
                f"cannot reach the platform at {address!r}: {exc}") from None

    # -- opening and closing ----------------------------------------------------------

    def hello(self, **fields: Any) -> dict[str, Any]:
        """Introduce this client (``hello``'s fields) and map the fence table and the
        trace ring the supervisor shares; returns its answer. A connection refused at
        the door raises the supervisor's reason (``OutOfMemory`` past its client limit,
        ``QuotaExceeded``, ``NotPermitted``), ``PlatformClosed`` if it gave none; the
        connection is closed then."""
        try:
            info = self.request("hello", **fields)
        except errors.PlatformClosed:
            notice = self.last_notice or self._door_notice()
            self.channel.close()
            if notice:
                raise errors.HetprocError.from_dict(notice) from None
            raise
        self.client_id = info["client_id"]
        self.prefix = info["prefix"]
        self.supervisor_pid = info["supervisor_pid"]
        self.fences = FenceTable(self.prefix, self.segments.get(info["fence_segment"]),
                                 create=False)
        vclock = info.get("clock")
        if vclock is not None:
            self.clock = clock.VirtualClock(self.segments.get(vclock["segment"]))
            self.waiter = self.clock.waiter(vclock["slot"])
            self.clock_bell = int(vclock.get("bell") or 0)
            self.clock_devices = range(len(info["devices"]))
            self.fences.model_now = self.clock.now_ns
        # After the clock: our records share the platform's timeline (invariant 8). Looked
        # up at each stamp, since a closed clock reads 0 rather than a released map.
        self.trace = ClientTrace(self.segments, self.fences, info.get("trace"),
                                 now=lambda: self.clock.now_ns())
        try:
            self._sup_pidfd = os.pidfd_open(self.supervisor_pid)
        except OSError:
            self._sup_pidfd = -1
        return info

    def close(self) -> None:
        """Close the socket (the supervisor then frees all this client held, deferred
        frees included) and unmap everything; later requests raise ``PlatformClosed``.
        Closing twice is harmless."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.channel.close()
        self._frees.waiting.clear()
        self.fence_fds.close_all()
        self.trace.close()
        fences = getattr(self, "fences", None)  # None: hello failed before mapping it
        if fences is not None:
            fences.close()
        if isinstance(self.clock, clock.VirtualClock):
            with _vclock.THREADS.lock:  # no thread of ours writes the slot after this
                self.waiter = None
                self.clock.close()
        self.segments.close()
        if self._sup_pidfd >= 0:
            os.close(self._sup_pidfd)
            self._sup_pidfd = -1

    # -- requests ---------------------------------------------------------------------

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send request ``op`` and return the supervisor's reply (a dict of its results).
        Fences released and frees that became due go ahead of it, in the same lock.
        Raises as the class docstring says; a ``RequestTimeout`` after a whole send can
        ``retry()`` under the same id (the supervisor runs a request at most once)."""
        with self._usable():
            return self._exchange({"op": op, "id": next(self._ids), **fields})

    def notify(self, op: str, **fields: Any) -> None:
        """Send ``op`` one way (id 0): no reply comes, so nothing is waited for. Raises
        ``PlatformClosed`` / ``SupervisorLost`` if the socket broke, ``RequestTimeout``
        if the message could not go out in ``timeout`` seconds (the connection is closed
        then: part of it may be in the stream)."""
        with self._usable():
            if op == "ping" and not fields:  # a virtual-clock wait's: the same bytes always
                try:
                    _write_frame(self.channel.sock, _PING_FRAME, self.timeout)
                except OSError as exc:
                    raise self._failure(exc, {"op": op, "id": 0}, sent=False) from None
                return
            self._send({"op": op, "id": 0, **fields}, flush=False)

    def next_cid(self) -> int:
        """A fresh correlation id for one of this client's commands (it names the
        command in fences, errors and the trace)."""
        return make_cid(self.client_id, next(self._cids), CID_BY_CLIENT)

    def take_fences(self, n: int) -> list[int]:
        """``n`` output fences from this client's pool. The pool is refilled ahead of
        need: below half the next batch a ``fence_create`` goes out one way and its reply
        is read with whatever comes next, so a submitter does not wait for a round trip
        (it waits only when it takes more than the pool holds). ``PlatformClosed`` once
        closed: the pool's fences went with the connection."""
        with self._usable():
            pool, asks = self._fence_pool, self._fence_asks
            # The submitter waits for fences (not only for the reading of a batch asked
            # for ahead that came back already): the asks grow.
            short = len(pool) < n and not (self._refill_id and self.channel.ready())
            while self._refill_id and len(pool) < n:
                try:  # the refill on its way: its reply fills the pool
                    self._read(self.timeout)
                except OSError as exc:
                    ask = {"op": "fence_create", "id": self._refill_id}
                    raise self._failure(exc, ask, sent=True) from None
            while len(pool) < n:
                want = min(1024, max(asks.size, n - len(pool)))
                msg: dict[str, Any] = {"op": "fence_create", "id": next(self._ids),
                                       "count": want}
                pool += self._exchange(msg)["fences"]
            if short:
                asks.grow()
            taken = pool[:n]
            del pool[:n]
            if len(pool) < asks.size // 2 and not self._refill_id:
                req_id = next(self._ids)  # the next batch, asked for without waiting
                self._last_id = max(self._last_id, req_id)
                self._send({"op": "fence_create", "id": req_id, "count": asks.size},
                           flush=True)
                self._refill_id = req_id
            return taken

    def release_fence(self, handle: int) -> None:
        """Let the platform recycle ``handle``; told with the next request. Only a list
        append: safe in a finalizer."""
        self._to_release.append(handle)

    def own_segment(self, handle: int, segment: int) -> None:
        """Buffer ``handle`` has ``segment`` to itself (it is exportable): unmap the
        segment when the buffer is freed."""
        self._frees.own_segment(handle, segment)

    def free(self, handle: int, views: list[weakref.ref]) -> None:
        """Free buffer ``handle`` now, or, while one of ``views`` (weak references to
        its numpy views) is alive, with the first request after the last one is gone:
        the block can never be handed to another tenant under a live view."""
        if _alive(views):
            with self._lock:
                self._frees.wait_for_views(handle, views)
            return
        self.request("free", buf=handle)
        with self._lock:
            self._frees.unmap_own(handle)

    def segment(self, key: str | int) -> Segment:
        """The mapping of segment ``key`` (``PlatformClosed`` if this process has none:
        the client closed, or the segment was never handed over)."""
        try:
            return self.segments.get(key)
        except KeyError:
            raise errors.PlatformClosed(f"segment {key!r} is not mapped in this process "
                                        "(client closed?)") from None

    # -- the supervisor ---------------------------------------------------------------

    def supervisor_alive(self) -> bool:
        """False once the supervisor process is gone (read from its pidfd; no request)."""
        if self._sup_pidfd < 0:
            return True
        ready, _, _ = select.select([self._sup_pidfd], [], [], 0)
        return not ready

    def failure_record(self, fence: int) -> dict[str, Any] | None:
        """The supervisor's record of ``fence``'s failure if it has reached this process:
        read from what the socket already holds, without a request."""
        with self._lock:
            if fence not in self._inbox and not self.closed:
                try:
                    while self.channel.ready():
                        _discard(self._read(self.timeout))  # a late reply
                except (OSError, errors.HetprocError):
                    pass  # a broken channel is reported by the next request
            return self._inbox.get(fence)

    # -- the one writer, the one reader, the one error mapping (lock held) ------------

    def _usable(self) -> _Usable:
        """``with self._usable():`` the lock held, the connection open (else
        ``PlatformClosed``), the calling thread known to the virtual clock."""
        return self._in_use

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply. Replies are matched by id: a late
        reply to a request that timed out is discarded when it comes."""
        self._last_id = max(self._last_id, msg["id"])
        self._send(msg, flush=True)
        try:
            return _protocol.result_of(msg["op"], self._reply_to(msg["id"]))
        except OSError as exc:
            raise self._failure(exc, msg, sent=True) from None

    def _send(self, msg: dict[str, Any], *, flush: bool) -> None:
        """Write ``msg`` whole (``flush``: after the releases and frees that are due)."""
        try:
            if flush:
                self._flush()
            self._write(msg)
        except OSError as exc:
            raise self._failure(exc, msg, sent=False) from None

    def _write(self, msg: dict[str, Any]) -> None:
        _write_frame(self.channel.sock, pack_frame(encode(msg)), self.timeout)

    def _flush(self) -> None:
        """Fences dropped and frees deferred until their last view went: one message
        each, ahead of the request."""
        if self._to_release:
            # Swap first: a Fence dropped by another thread during the send must
            # land in the new list, not in the one already sent.
            pending, self._to_release = self._to_release, []
            self._write({"op": "fence_release", "id": 0, "fences": pending})
        if self._frees.waiting:  # checked inline: most requests have nothing to free
            ready = self._frees.due()
            if ready:
                self._write({"op": "free_many", "id": 0, "bufs": ready})
                for h in ready:
                    self._frees.unmap_own(h)

    def _reply_to(self, req_id: int) -> dict[str, Any]:
        while True:
            reply = self._read(self.timeout)
            if reply is None:
                continue  # a notice, filed
            if reply["id"] != req_id:
                _discard(reply)
                if 0 < reply["id"] <= self._last_id:
                    continue  # the late answer to a request that timed out: discarded
                raise errors.BadPacket(f"reply id {reply['id']} answers no request sent "
                                       f"(last sent {self._last_id})")
            if not reply["ok"]:
                _discard(reply)
                raise errors.HetprocError.from_dict(reply.get("error") or {})
            return reply

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """One frame off the socket: the segments it hands over are mapped (for every
        frame, a discarded one too, so that descriptors stay in step with frames), and a
        notice (id 0) is filed; returns the reply, None for a notice."""
        reply = decode(self.channel.recv(timeout), _protocol.REPLIES)
        self._take_descriptors(reply)
        if reply["id"] != 0:
            if reply["id"] != self._refill_id:
                return reply
            # The batch of fences asked for ahead: into the pool. A refusal (the fence
            # quota) is left for the request that needs the fences to meet.
            self._refill_id = 0
            if reply["ok"] and type(reply.get("fences")) is list and all(
                    type(h) is int for h in reply["fences"]):
                self._fence_pool += reply["fences"]
            return None
        fence, error = reply.get("fence"), reply.get("error")
        if type(fence) is not int or not isinstance(error, dict):
            self.last_notice = error
            return None
        self._inbox[fence] = error
        while len(self._inbox) > _RECORDS_KEPT:
            self._inbox.popitem(last=False)
        return None

    def _take_descriptors(self, reply: dict[str, Any]) -> None:
        """Take the descriptors a reply hands over (they came with the stream,
        SCM_RIGHTS, in order): the buffer segments it names (``segs``) are mapped; a
        fence descriptor follows them (``fds``: how many), and replaces its count."""
        segs, n = reply.get("segs"), reply.get("fds")
        if n is not None and (type(n) is not int or not 0 < n <= 1):
            raise errors.BadPacket(f"malformed descriptor count {n!r}")
        if segs and (not isinstance(segs, list) or not all(
                isinstance(s, list) and len(s) == 2 and all(type(v) is int for v in s)
                for s in segs)):
            raise errors.BadPacket(f"malformed segment list {segs!r}")
        fds = self.channel.take_fds(len(segs)) if segs else []
        for i, ((sid, size), fd) in enumerate(zip(segs or [], fds)):
            try:
                self.segments.add(Segment.from_fd(fd, sid, size=size))
            except (OSError, ValueError) as exc:
                for rest in fds[i + 1:]:
                    os.close(rest)
                raise errors.BadPacket(
                    f"segment {sid} handed over is not mappable: {exc}") from None
        if n:
            reply["fds"] = self.channel.take_fds(n)

    def _failure(self, exc: OSError, msg: dict[str, Any], *, sent: bool) -> errors.HetprocError:
        """The error a caller sees for a socket that failed while ``msg`` went out
        (``sent`` False) or while its reply was awaited."""
        op, req_id = msg["op"], msg["id"]
        if not isinstance(exc, TimeoutError):
            return self._lost(f"control channel broke during {op!r}: {exc}")
        if sent:
            err = errors.RequestTimeout(
                f"the supervisor did not answer {op!r} (request {req_id}) within "
                f"{self.timeout} s; it was sent whole, so it may still take effect: retry() "
                "resends it under the same id, and the supervisor runs it at most once",
                detail={"may_take_effect": True, "op": op, "request_id": req_id})
            err.resend = lambda: self._resend(msg)
            return err
        # The supervisor stopped reading; part of a packet may be in the stream, so the
        # connection cannot be trusted again: closing it releases all we held.
        self.closed = True
        self.channel.close()
        return errors.RequestTimeout(
            f"could not send {op!r} within {self.timeout} s; connection closed",
            detail={"may_take_effect": False, "op": op, "request_id": req_id})

    def _resend(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._usable():
            return self._exchange(msg)

    def _lost(self, why: str) -> errors.HetprocError:
        if self.supervisor_alive():
            return errors.PlatformClosed(why)
        return errors.SupervisorLost(f"the supervisor (pid {self.supervisor_pid}) died; {why}")

    def _door_notice(self) -> dict | None:
        """The supervisor's word on a connection it refused at accept (sent before it
        closed), if it can still be read."""
        try:
            self._read(_DOOR_WAIT_S)
        except (OSError, errors.HetprocError):
            pass
        return self.last_notice


class _Usable:
    """The context manager ``Connection._usable`` hands out (one per connection: its
    state is the connection's lock). A class, not a ``contextlib`` generator: it is
    entered for every submit and fence batch, and a generator costs a few
    microseconds more each time."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        conn = self._conn
        if conn.waiter is not None:  # a thread that uses hetproc holds the virtual clock
            _vclock.THREADS.known(conn)
        conn._lock.acquire()
        if conn.closed:
            conn._lock.release()
            raise errors.PlatformClosed("this client is closed")

    def __exit__(self, *exc: object) -> None:
        self._conn._lock.release()


class FenceFds:
    """The fence descriptors open in this process (``Fence.fd()``): each closed once, by
    its Fence or, for the rest, when the connection closes; a number that is not ours
    (any more) is left alone, since it may name another file by now."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def add(self, fd: int) -> int:
        self._open.add(fd)
        return fd

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)


class _Frees:
    """The connection's bookkeeping of buffer frees: frees that wait for the buffer's
    last numpy view to go (so a block is never handed to another tenant under a live
    view), and the segments exportable buffers have to themselves (unmapped once the
    buffer is freed). The connection's lock guards every change but ``own_segment``'s
    single dict store."""

    def __init__(self, segments: SegmentCache) -> None:
        self.waiting: dict[int, list[weakref.ref]] = {}  # handle -> its views
        self._own_segments: dict[int, int] = {}  # exportable buffer handle -> its segment
        self._segments = segments

    def own_segment(self, handle: int, segment: int) -> None:
        self._own_segments[handle] = segment

    def wait_for_views(self, handle: int, views: list[weakref.ref]) -> None:
        self.waiting[handle] = views

    def due(self) -> list[int]:
        """The waiting frees whose last view is gone, taken off the list."""
        ready = [h for h, views in list(self.waiting.items()) if not _alive(views)]
        for h in ready:
            del self.waiting[h]
        return ready

    def unmap_own(self, handle: int) -> None:
        """A freed exportable buffer's segment holds nothing else of ours: unmap it (the
        supervisor hands it again if this client imports the buffer later)."""
        sid = self._own_segments.pop(handle, None)
        if sid is not None:
            self._segments.forget(sid)


def _write_frame(sock: socket.socket, frame: bytes, timeout: float) -> None:
    """Write ``frame`` whole, or raise (``TimeoutError`` after ``timeout`` seconds: a
    stopped supervisor must not block us forever). A frame that fits the socket's buffer
    -- nearly every one -- goes out in one non-blocking ``send``: a socket with a timeout
    polls before every send, and setting the timeout is a system call of its own (three
    calls per message where one does)."""
    if sock.gettimeout() != 0.0:  # a read left a timeout on it
        sock.settimeout(0.0)
    try:
        sent = sock.send(frame)
    except BlockingIOError:
        sent = 0
    if sent < len(frame):  # the buffer is full: the rest within the deadline
        sock.settimeout(timeout)
        sock.sendall(memoryview(frame)[sent:])


def _discard(reply: dict[str, Any] | None) -> None:
    """Close the descriptors of a reply nobody takes (a late one, a refusal)."""
    fds = reply.get("fds") if reply else None
    if isinstance(fds, list):
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _alive(views: list[weakref.ref]) -> bool:
    return any(r() is not None for r in views)


__all__ = ["Connection", "REQUEST_TIMEOUT"]

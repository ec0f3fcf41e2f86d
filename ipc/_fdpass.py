"""Buffer segments handed to a process as descriptors (SCM_RIGHTS), never by name.

A buffer segment is anonymous (``Segment.anonymous_segment``): no process can open it;
it reaches another process only as a descriptor its creator sends. The supervisor and
each device share one ``SOCK_SEQPACKET`` socket pair (made before the device is forked,
so nobody else holds either end); one message per datagram::

    ADD  sid size  + 1 descriptor   map this segment under id ``sid``
    DROP sid 0     + 0 descriptors  the segment is gone: unmap it

``SegmentSender`` (the supervisor) never blocks: messages it cannot send yet wait in
order, with their own duplicates of the descriptors, and ``flush`` retries; the
supervisor sends a segment before the first command that uses it goes into the ring,
so the device finds it waiting when it reads that command. ``SegmentReceiver`` (the
device) reads what is waiting without blocking and checks every message: a message of
the wrong size, kind or descriptor count, a descriptor that is not the announced size,
or truncated control data is garbage -- its descriptors are closed, ``on_garbage`` is
told why, and reading goes on. Nothing on this socket can wedge the device.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable

from ._segments import Segment, SegmentCache

_MSG = struct.Struct("<4sB3xQQ")
_MAGIC = b"hpsg"
ADD, DROP = 1, 2
MAX_SID = (1 << 63) - 1


def segment_socketpair() -> tuple[socket.socket, socket.socket]:
    """(the sender's end, the receiver's end); both close on exec."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class SegmentSender:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.sent: set[int] = set()          # ids the receiver holds (or will, in order)
        self._out: deque[tuple[bytes, list[int]]] = deque()
        self.messages = 0

    def add(self, seg: Segment) -> bool:
        """Queue ``seg`` for the receiver unless it has it already. Only an anonymous
        segment whose creator kept its descriptor travels (ValueError otherwise: a named
        one is opened by name, and its id would not fit the message). False, with
        nothing queued, when no descriptor is left for the duplicate that waits in the
        queue (so that the segment may be dropped meanwhile): try again later."""
        sid = seg.key
        if not isinstance(sid, int) or seg.fd < 0:
            raise ValueError(f"segment {sid!r} has no descriptor to pass")
        if sid in self.sent:
            return True
        try:
            fd = os.dup(seg.fd)
        except OSError:
            return False
        self._out.append((_MSG.pack(_MAGIC, ADD, sid, seg.size), [fd]))
        self.sent.add(sid)
        return True

    def drop(self, sid: int) -> None:
        if sid in self.sent:
            self.sent.discard(sid)
            self._out.append((_MSG.pack(_MAGIC, DROP, sid, 0), []))

    def flush(self) -> bool:
        """Send what waits; True when nothing is left (False: the receiver is behind,
        or gone -- the caller retries later)."""
        out = self._out
        while out:
            msg, fds = out[0]
            try:
                if fds:
                    socket.send_fds(self.sock, [msg], fds)
                else:
                    self.sock.send(msg)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return False
            out.popleft()
            self.messages += 1
            for fd in fds:
                os.close(fd)
        return True

    @property
    def waiting(self) -> int:
        return len(self._out)

    @property
    def waiting_fds(self) -> int:
        """Descriptors held for messages not sent yet (each ADD holds one)."""
        return sum(len(fds) for _, fds in self._out)

    def close(self) -> None:
        for _, fds in self._out:
            for fd in fds:
                os.close(fd)
        self._out.clear()
        self.sent.clear()
        self.sock.close()


class SegmentReceiver:
    def __init__(self, sock: socket.socket, cache: SegmentCache, *,
                 on_drop: Callable[[int], None] = lambda sid: None,
                 on_garbage: Callable[[str], None] = lambda why: None) -> None:
        sock.setblocking(False)
        self.sock = sock
        # ``drain`` runs every time a device's ring runs dry and nearly always finds
        # nothing: a poll says so for a sixth of a failed ``recvmsg`` and its exception.
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.cache = cache
        self.on_drop = on_drop
        self.on_garbage = on_garbage
        self.received = 0
        self.garbage = 0
        self.closed = False

    def drain(self) -> int:
        """Take every message waiting (never blocks); returns how many were good."""
        good = 0
        if self.closed or not self._poll.poll(0):  # (a hang-up is reported: it reads)
            return good
        while not self.closed:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, _MSG.size + 1, 4)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._garbage(f"segment socket failed: {exc}", [])
                self.closed = True
                break
            if not data and not fds:
                self.closed = True  # the sender is gone
                break
            if self._take(data, fds, flags):
                good += 1
        return good

    def _take(self, data: bytes, fds: list[int], flags: int) -> bool:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(data) != _MSG.size:
            return self._garbage(f"a message of {len(data)} bytes (flags {flags:#x})", fds)
        magic, kind, sid, size = _MSG.unpack(data)
        if magic != _MAGIC or not 0 < sid <= MAX_SID:
            return self._garbage(f"a message with magic {magic!r} and id {sid}", fds)
        if kind == DROP and not fds:
            self.on_drop(sid)
            self.cache.forget(sid)
            self.received += 1
            return True
        if kind != ADD or len(fds) != 1 or not 0 < size <= MAX_SID:
            return self._garbage(f"kind {kind} with {len(fds)} descriptors", fds)
        try:
            seg = Segment.from_fd(fds[0], sid, size=size)  # closes the descriptor
        except (OSError, ValueError) as exc:
            return self._garbage(f"segment {sid} is not mappable: {exc}", [])
        self.cache.add(seg)
        self.received += 1
        return True

    def _garbage(self, why: str, fds: list[int]) -> bool:
        close_all(fds)
        self.garbage += 1
        self.on_garbage(why)
        return False

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def close_all(fds: Iterable[int]) -> None:
    """Close each of ``fds``, one already closed (or never open) included: descriptors
    that arrived with a message nobody will take, or that a child must not keep."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

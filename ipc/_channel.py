"""The control channel: length-prefixed msgpack frames over a Unix stream socket.

A stream socket tells each side at once when the other dies (EOF or ECONNRESET), which is
how the supervisor notices a crashed client and a client notices a crashed supervisor.
``FrameReader`` is the non-blocking half the supervisor's selector feeds; ``Channel`` is
the blocking, deadline-bound half a client uses.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from . import errors
from ._packets import MAX_PACKET, encode

_HDR = struct.Struct("<I")
MAX_FDS_PER_READ = 32  # descriptors one read may carry (a reply carries a few at most)


def pack_frame(body: bytes) -> bytes:
    """Length-prefix one encoded packet (see ``ipc.encode``)."""
    return _HDR.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into frames; an oversize length means the stream is garbage."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes read that are not a whole frame yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while len(self._buf) >= _HDR.size:
            (n,) = _HDR.unpack_from(self._buf, 0)
            if n > MAX_PACKET:
                raise errors.BadPacket(f"frame length {n} exceeds {MAX_PACKET}: stream is corrupt")
            if len(self._buf) < _HDR.size + n:
                break
            frames.append(bytes(self._buf[_HDR.size:_HDR.size + n]))
            del self._buf[:_HDR.size + n]
        return frames


class Channel:
    """Blocking request/response client side; every receive has a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = FrameReader()
        self._pending: list[bytes] = []
        # Descriptors that came with the stream (SCM_RIGHTS), in order: a frame that
        # announces n of them takes the first n (``take_fds``), which arrived with or
        # before its bytes.
        self.fds: list[int] = []

    @classmethod
    def connect(cls, address: str, timeout: float = 5.0) -> Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address)
        return cls(sock)

    def send_bytes(self, frame: bytes) -> None:
        self.sock.settimeout(None)
        self.sock.sendall(frame)

    def send(self, msg: Mapping[str, Any]) -> None:
        self.send_bytes(pack_frame(encode(msg)))

    def recv(self, timeout: float) -> bytes:
        """One frame; ``TimeoutError`` past the deadline, ``ConnectionError`` on EOF."""
        deadline = time.monotonic() + timeout
        while not self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no reply on the control channel")
            self.sock.settimeout(remaining)
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, 1 << 16, MAX_FDS_PER_READ)
            except TimeoutError:
                raise TimeoutError("no reply on the control channel") from None
            self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise errors.BadPacket("descriptors were lost in transit (control data "
                                       "truncated): the channel cannot be trusted")
            if not data:
                raise ConnectionError("control channel closed by the other side")
            self._pending.extend(self._reader.feed(data))
        return self._pending.pop(0)

    @property
    def buffered(self) -> bool:
        """Frames already read off the socket and not yet taken: one ``recv`` may bring
        several, so a readable socket is not the only sign that one is waiting."""
        return bool(self._pending)

    def ready(self) -> bool:
        """A frame is read already or the socket holds bytes: ``recv`` will not wait."""
        if self._pending:
            return True
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def take_fds(self, n: int) -> list[int]:
        """The next ``n`` descriptors received; BadPacket if fewer came."""
        if n > len(self.fds):
            raise errors.BadPacket(f"a reply announced {n} descriptors, {len(self.fds)} came")
        taken, self.fds = self.fds[:n], self.fds[n:]
        return taken

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        try:
            self.sock.close()
        except OSError:
            pass

"""Fences as file descriptors (sync_file): one pollable descriptor per watched fence.

::

    supervisor (the only writer)              any process that holds the descriptor
    ┌─────────────────────────────┐ socketpair ┌───────────────────────────────────┐
    │ its end, kept while the     │◀──────────▶│ the reader's end: readable once   │
    │ fence is pending; on the    │            │ the record is in, or once the     │
    │ outcome: one record, close  │            │ supervisor's end closed (EOF)     │
    └─────────────────────────────┘            └───────────────────────────────────┘

A fence descriptor is one end of a Unix stream socket pair; the supervisor keeps the
other end while the fence is pending. When the fence completes (signalled or failed) the
supervisor writes one ``Status`` record -- the fence's handle, error word, correlation id
and modeled signal time -- and closes its end. From then on the reader's end is readable
for good: ``select``, ``poll``, ``epoll`` and asyncio's ``add_reader`` all see it, and
every holder reads the record with ``MSG_PEEK`` (``status``), so no reader consumes it
for another. The descriptor can be handed to any process (``socket.send_fds``, SCM_RIGHTS)
and waited on there with ``wait`` alone, no connection to the platform needed.

Why a socket pair and not an eventfd: an eventfd nobody writes stays silent forever, so a
waiter whose supervisor died would sleep to its own deadline. Here the kernel closes the
supervisor's end when it dies, the reader's end turns readable with EOF and no record,
and ``status`` answers ``SupervisorLost`` at once: no fence descriptor ever hangs. The
record travels in the descriptor itself, so a process that was handed only the
descriptor learns the outcome (and the error's scope and retryability, from the word).

The writer never blocks: the record (``RECORD.size`` bytes) goes into the empty buffer of
a fresh socket, sent non-blocking, once; a reader that closed its end early costs a
refused send, ignored. Readers must not ``read`` the descriptor (that would consume the
record for every other holder): ``status`` and ``wait`` only peek.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import dataclass

from . import errors

RECORD = struct.Struct("<4sIQQQ")  # magic, error word, fence handle, cid, modeled t_ns
_MAGIC = b"hpff"


@dataclass(frozen=True)
class Status:
    """A completed fence as its descriptor tells it: ``word`` 0 means signalled."""

    handle: int
    word: int
    cid: int
    t_ns: int

    def error(self) -> errors.HetprocError | None:
        """The error the word describes (None for success): class, scope, retryability
        and buffer trust, from the word alone."""
        if not self.word:
            return None
        name = errors.error_class(self.word & 0xFFFF).__name__
        return errors.error_from_word(self.word, f"{name}: fence {self.handle:#x} failed "
                                      f"(request {self.cid:#x})", correlation_id=self.cid)


def new_pair() -> tuple[socket.socket, socket.socket]:
    """``(the writer's end, the reader's end)``, both close-on-exec; the writer's end is
    non-blocking (its one send must never wait)."""
    keep, give = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    keep.setblocking(False)
    keep.shutdown(socket.SHUT_RD)  # nothing ever comes back: the reader only peeks
    give.shutdown(socket.SHUT_WR)
    return keep, give


def complete(keep: socket.socket, handle: int, word: int = 0, cid: int = 0, t_ns: int = 0,
             error: errors.HetprocError | None = None) -> None:
    """Write the outcome (the fence's error ``word``, or that of ``error``: a descriptor
    ended without its fence) into the writer's end and close it (never blocks, never
    raises: a reader that already closed its end has nobody left to tell)."""
    if error is not None:
        word = error.wire
    try:
        keep.send(RECORD.pack(_MAGIC, word, handle, cid, t_ns))
    except OSError:
        pass
    keep.close()


def status(fd: int) -> Status | None:
    """The outcome a fence descriptor holds, without consuming it; None while pending.

    EOF with no record: the writer went away without one (the supervisor died), which is
    a ``Status`` whose word is ``SupervisorLost``'s, never a wait that cannot end."""
    if not select.select([fd], [], [], 0)[0]:
        return None
    sock = socket.socket(fileno=os.dup(fd))
    try:
        data = sock.recv(RECORD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise errors.InvalidHandle(f"descriptor {fd} is no fence descriptor: {exc}") from None
    finally:
        sock.close()
    if not data:
        return Status(0, errors.SupervisorLost().wire, 0, 0)
    if len(data) < RECORD.size:
        return None  # the rest of the record is on its way
    magic, word, handle, cid, t_ns = RECORD.unpack(data)
    if magic != _MAGIC:
        raise errors.InvalidHandle(f"descriptor {fd} holds no fence record")
    return Status(handle, word, cid, t_ns)


def wait(fd: int, timeout: float) -> Status:
    """Block until the fence descriptor ``fd`` completes (any process may: it needs
    nothing but the descriptor); returns its ``Status`` (``Status.error()`` says how it
    failed). ``FenceTimeout`` after ``timeout`` seconds: every wait has a deadline."""
    if not timeout >= 0:
        raise errors.InvalidRequest(f"wait timeout must be >= 0 seconds, got {timeout!r}")
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        found = status(fd)
        if found is not None:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise errors.FenceTimeout(f"fence descriptor {fd} still pending after "
                                      f"{timeout:.3f} s")
        # poll sleeps in the kernel; a partial record wakes it again at once, so sleep
        # a little between looks then (it is only ever a few bytes away).
        if poller.poll(max(1, int(min(remaining, 1.0) * 1000))):
            time.sleep(0.0001)


__all__ = ["RECORD", "Status", "new_pair", "complete", "status", "wait"]

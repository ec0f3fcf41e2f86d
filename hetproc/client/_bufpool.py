"""A pool of shared buffers that come back only when every consumer's fence says so (§17).

::

    acquire() ──▶ producer writes it (its command's fence is the *acquire* fence)
                  consumers import it, wait on the acquire fence, run, and each gives a
                  *release* fence
    release(buf, release fences) ──▶ pending ──(every release fence completed)──▶ free

The reference count (the owner's handle, each importer's) only keeps the memory alive;
it says nothing about whether a device still reads it. So a buffer is never handed out
again while any release fence of its last use is pending -- a fence that *failed* counts
as completed: its command will not touch the buffer any more.

The pool takes the release fences it is given and releases them once they completed.
Single-threaded: one thread (the producer's) acquires and releases.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ipc import PENDING, errors

from . import _vclock

if TYPE_CHECKING:
    from ._buffer import Buffer
    from ._client import Client
    from ._fence import Fence

_SLICE_S = 0.05  # a wait re-checks the other pending buffers this often


@dataclass(frozen=True)
class PoolStatistics:
    size: int
    free: int
    pending: int           # released, waiting for release fences
    in_use: int            # handed out, not released yet
    acquired: int          # hand-outs so far
    recycled: int          # buffers that came back after their fences completed
    waited: int            # acquires that had to wait for a release fence


class BufferPool:
    """``count`` buffers of one shape, allocated up front (a camera's buffer queue)."""

    def __init__(self, client: Client, count: int, shape: Sequence[int] | int,
                 dtype: Any = "uint8", **alloc: Any) -> None:
        if count < 1:
            raise errors.InvalidRequest(f"a pool needs at least one buffer, got {count}")
        self.client = client
        self.buffers: list[Buffer] = []
        try:
            # Exportable by default: a pool's buffers are made to be shared with consumers.
            alloc.setdefault("exportable", True)
            for _ in range(count):
                self.buffers.append(client.alloc(shape, dtype, **alloc))
        except BaseException:
            self.close()
            raise
        self._index = {b.handle: i for i, b in enumerate(self.buffers)}
        self._free: deque[int] = deque(range(count))
        self._pending: dict[int, list[Fence]] = {}
        self._out: set[int] = set()
        self._acquired = self._recycled = self._waited = 0
        self.freed_at_ns: list[int] = [0] * count  # when each buffer last came back

    def acquire(self, timeout: float = 5.0) -> Buffer:
        """The next free buffer, oldest first. Waits (up to ``timeout`` s) for release
        fences; ``FenceTimeout`` if none completed in time, ``ResourceError`` if every
        buffer is handed out and none was released (no fence could ever free one)."""
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            self._collect()
            if self._free:
                i = self._free.popleft()
                self._out.add(i)
                self._acquired += 1
                self._waited += waited
                return self.buffers[i]
            if not self._pending:
                raise errors.ResourceError(
                    f"all {len(self.buffers)} pool buffers are handed out; none was released")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                n = sum(1 for fs in self._pending.values() for f in fs if _pending(f))
                raise errors.FenceTimeout(f"no pool buffer came back within {timeout:.3f} s "
                                          f"({n} release fences pending)")
            waited = True
            oldest = next(iter(self._pending.values()))
            fence = next((f for f in oldest if _pending(f)), None)
            if fence is not None:
                try:
                    _vclock.wait_handle(self.client.connection, fence.handle,
                                        min(remaining, _SLICE_S))
                except (errors.FenceTimeout, errors.InvalidHandle):
                    pass  # re-check everything; a recycled fence counts as completed

    def release(self, buf: Buffer, fences: Iterable[Fence] = ()) -> None:
        """Give ``buf`` back; it is free again once every fence in ``fences`` completed.
        The pool takes the fences and releases them then."""
        i = self._index.get(buf.handle)
        if i is None or i not in self._out:
            raise errors.InvalidRequest(f"{buf!r} is not a buffer this pool handed out")
        self._out.discard(i)
        self._pending[i] = list(fences)
        self._collect()

    def pending_fences(self, buf: Buffer) -> list[Fence]:
        """The release fences ``buf`` still waits for (empty once it is free)."""
        i = self._index.get(buf.handle)
        return [f for f in self._pending.get(i, []) if _pending(f)] if i is not None else []

    def _collect(self) -> None:
        for i, fences in list(self._pending.items()):
            if any(_pending(f) for f in fences):
                continue
            del self._pending[i]
            for f in fences:
                f.release()
            self.freed_at_ns[i] = time.monotonic_ns()
            self._free.append(i)
            self._recycled += 1

    def statistics(self) -> PoolStatistics:
        """How the pool's buffers stand now (free, waiting for release fences, out) and
        what it did so far, as a frozen ``PoolStatistics``."""
        self._collect()
        return PoolStatistics(len(self.buffers), len(self._free), len(self._pending),
                              len(self._out), self._acquired, self._recycled, self._waited)

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for pending release fences, then free every buffer."""
        deadline = time.monotonic() + timeout
        while getattr(self, "_pending", None) and time.monotonic() < deadline:
            self._collect()
            if self._pending:
                time.sleep(0.002)
        for b in self.buffers:
            b.free()  # the platform still defers reclaim while a command holds it
        self.buffers = []

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pending(fence: Fence) -> bool:
    try:
        state, _ = fence.client.fences.poll(fence.handle)
    except errors.InvalidHandle:
        return False  # recycled: it completed and its last holder let go
    return state == PENDING

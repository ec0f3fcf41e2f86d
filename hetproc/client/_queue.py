"""``Queue``: submit straight to a device, no supervisor hop (a user-mode queue).

``Context.queue()`` asks the supervisor for a ring on the context's device; after that a
submit is a record written into shared memory plus one semaphore post, and the device
signals the fence the client waits on: one process hop each way, as user-mode queues on
current GPUs. The supervisor stays in charge of control and recovery (see
``hetproc.supervisor._queues``); the device checks every record (``device_workers._queues``).

A queue runs ``work`` commands (a modeled duration, input fences): the timing and
scheduling workloads whose granularity the per-command cost limits. Commands with buffers
go through ``Context.submit``, where the supervisor validates and maps them.

When the device is reset, its queues are lost (as on a GPU): their pending fences fail
with ``CancelledByReset`` (``DeviceCrashed`` for the one running) and further submits
raise ``CancelledByReset``; open a new queue once the device serves again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import posix_ipc

from ipc import QUEUE_OPEN, QueueRing, encode_queue_record, errors

from ._fence import Fence

if TYPE_CHECKING:
    from ._context import Context

FULL_WAIT_S = 5.0  # how long a submit waits for a free slot before it says so


class Queue:
    """A submission queue of ``slots`` records on one context's device; see the module
    docstring. Made by ``Context.queue()``; a context manager that closes it.

    ``submit_nowait`` / ``submit_many`` raise ``InvalidRequest`` for a duration out of
    range, ``InvalidHandle`` once the queue is closed and ``CancelledByReset`` once a reset
    lost it; a command that cannot be written (the ring stayed full, the queue ended
    meanwhile) fails its fence instead, so the error surfaces at ``Fence.wait()``.
    """

    def __init__(self, ctx: Context, slots: int = 256) -> None:
        client = self.client = ctx.client
        conn = self._conn = client.connection
        self.ctx = ctx
        info = conn.request("queue_open", ctx=ctx.handle, slots=int(slots))
        self.qid, self.sid, self.slots = info["qid"], info["sid"], info["slots"]
        self.max_hold_ns = info["max_hold_ns"]
        self._scale = client.time_scale
        seg = conn.segments.get(self.sid)
        self._ring = QueueRing(memoryview(seg.map)[:info["bytes"]], self.slots)
        self._doorbell = posix_ipc.Semaphore(info["doorbell"])
        self._qseq = self._ring.head  # 0 on a new ring
        self._closed = False
        self._failed_here: dict[int, dict] = {}  # fences this process failed (``_fail_unseen``)

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Queue {self.qid} on {self.ctx.device}, {self.slots} slots>"

    # -- submitting -------------------------------------------------------------------

    def submit_nowait(self, ms: float = 0.0, *, wait: Iterable[Fence] = (),
                      at_ns: int | None = None) -> Fence:
        """One ``work`` command of ``ms`` modeled milliseconds (times the platform's time
        scale) after the fences in ``wait``; returns the fence it signals."""
        return self.submit_many([ms], wait=wait, at_ns=at_ns)[0]

    def submit_many(self, durations_ms: Sequence[float], *, wait: Iterable[Fence] = (),
                    at_ns: int | None = None) -> list[Fence]:
        """One ``work`` command per duration, in order, with one doorbell post; the
        first waits on ``wait`` (the rest follow it in queue order anyway)."""
        self._check_open()
        conn, client = self._conn, self.client
        n = len(durations_ms)
        holds = [self._hold_ns(ms) for ms in durations_ms]
        waits = [f.handle for f in wait]
        handles = conn.take_fences(n)
        cids = [conn.next_cid() for _ in range(n)]
        cmds = [{"cid": c, "signal": h} for c, h in zip(cids, handles)]
        t_submit = conn.trace.now()
        conn.trace.bind(cmds)
        arrive = time.monotonic_ns() if at_ns is None else int(at_ns)
        ring = self._ring
        put, first = ring.put, ring.head
        written = time.monotonic_ns()
        for i in range(n):
            record = encode_queue_record(self._qseq + 1, cids[i], handles[i], arrive,
                                         holds[i], waits if i == 0 else (), t_written=written)
            if not put(record) and not self._wait_for_space(record):
                self._fail(handles[i:], errors.ResourceError(
                    f"queue {self.qid} stayed full for {FULL_WAIT_S} s: the device is not "
                    f"draining it", retryable=True))
                break
            self._qseq += 1
        self._doorbell.release()  # a barrier too: the head is out before the state is read
        if ring.state != QUEUE_OPEN:
            self._fail_unseen(first, handles)
        conn.trace.submitted(cmds, t_submit)
        fences = [Fence(client, h, cid=c, owned=True) for h, c in zip(handles, cids)]
        for f in fences:
            f._queue = self
        return fences

    def _fail_unseen(self, first: int, handles: list[int]) -> None:
        """The queue ended while these records went in: fail the fences of those the
        supervisor did not see (at or past the head it read; ``ipc._queues``)."""
        deadline = time.monotonic() + FULL_WAIT_S
        while self._ring.ended_at < 0 and time.monotonic() < deadline:
            time.sleep(0.0001)  # the supervisor publishes it in the same turn
        ended = self._ring.ended_at
        self._fail([h for i, h in enumerate(handles) if ended < 0 or first + i >= ended],
                   errors.CancelledByReset(f"queue {self.qid} on {self.ctx.device} ended "
                                           f"while this command was written"))

    def _fail(self, handles: list[int], exc: errors.HetprocError) -> None:
        """Fail our own fences (a command that never reached, or will never leave, the
        ring): the error is kept for ``explain`` before the wake."""
        fences = self._conn.fences
        for handle in handles:
            if fences.pending(handle):
                self._failed_here[handle] = exc.to_dict()
                fences.signal(handle, exc.wire)

    def _hold_ns(self, ms: float) -> int:
        ms = float(ms)
        if not 0.0 <= ms < float("inf"):
            raise errors.InvalidRequest(f"a duration must be a finite number of ms >= 0, got {ms}")
        hold = round(ms * self._scale * 1e6)
        if hold > self.max_hold_ns:
            raise errors.InvalidRequest(f"{ms} ms is past the {self.max_hold_ns / 1e6:g} ms "
                                        f"(modeled) a queue command may run")
        return hold

    def _wait_for_space(self, record: bytes) -> bool:
        """The ring is full: wake the device and give it time to drain, within a bound.
        False when the record did not go in: the queue ended (its fences are failed with
        the others, ``_fail_unseen``) or it stayed full."""
        self._doorbell.release()
        deadline = time.monotonic() + FULL_WAIT_S
        while not self._ring.put(record):
            if self._ring.state != QUEUE_OPEN or time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidHandle(f"queue {self.qid} is closed")
        if self._ring.state != QUEUE_OPEN:
            recovery = self.ctx.client.info["spec"].get("recovery") or {}
            if self.ctx.device in (recovery.get("subsystem_restart") or ()):
                raise errors.DeviceRestarted(f"queue {self.qid} on {self.ctx.device} was "
                                             f"lost: the device restarted; open a new one on "
                                             f"a new context")
            raise errors.CancelledByReset(f"queue {self.qid} on {self.ctx.device} was lost "
                                          f"in a device reset: open a new one")

    def explain(self, fence: int, word: int, cid: int) -> errors.HetprocError | None:
        """The error of a failed queue command, from the supervisor's record (a reset or
        a close: sent ahead of the wake) or the device's note in the ring."""
        record = self._failed_here.pop(fence, None) or self._conn.failure_record(fence)
        if record is None and not self._closed:
            note = self._ring.find_note(fence)
            if note is not None and note[0] == word & 0xFFFF:
                record = {"code": note[0], "message": note[1]}
        if record is None:
            return None
        err = errors.HetprocError.from_dict(record)
        err.correlation_id = cid
        return err

    def pending(self) -> int:
        """Records written and not finished yet."""
        return self._ring.head - self._ring.tail

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Detach the queue and unmap its ring; records not finished yet fail with
        ``Cancelled``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.request("queue_close", queue=self.qid)
        except errors.InvalidHandle:
            pass  # lost in a reset meanwhile: the supervisor dropped it already
        finally:
            self._ring.release()
            self._doorbell.close()
            self._conn.segments.forget(self.sid)

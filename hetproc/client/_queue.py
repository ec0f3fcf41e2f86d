"""``Queue``: submit straight to a device, no supervisor hop (a user-mode queue).

``Context.queue()`` asks the supervisor for a ring on the context's device; after that a
submit is a record written into shared memory plus one semaphore post, and the device
signals the fence the client waits on: one process hop each way, as user-mode queues on
current GPUs. The supervisor stays in charge of control and recovery (see
``hetproc.supervisor._queues``); the device checks every record (``device_workers._queues``).

A queue runs what ``Context.submit`` runs: ``submit(kernel, ins, outs, wait=, params=,
ms=)`` means the same, and what the supervisor refuses the queue refuses with the same
error class. A buffer is bound to the queue once, on its first use (or ``bind``): the
supervisor checks it as it checks a submit's operand and puts it in the queue's binding
table; from then on the device checks each record's operands against that table. A
bound buffer is let go on ``unbind``, ``free`` or ``close``, and reclaimed only once the
device proved it will not touch it any more. A buffer the device cannot take as it is
(one a submit would copy or reformat first) is refused at bind.

When the device is reset, its queues are lost (as on a GPU): their pending fences fail
with ``CancelledByReset`` (``DeviceCrashed`` for the one running) and further submits
raise ``CancelledByReset``; open a new queue once the device serves again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import posix_ipc

from ipc import (
    QUEUE_CHECKED,
    QUEUE_MODELED,
    QUEUE_OPEN,
    QUEUE_TIMEOUT,
    QueueRing,
    encode_queue_record,
    errors,
)

from ._command import command
from ._fence import Fence
from ._vclock import wait_handle

if TYPE_CHECKING:
    from ._buffer import Buffer
    from ._context import Context

FULL_WAIT_S = 5.0  # how long a submit waits for a free slot before it says so
MAX_RECORD_NS = 3600 * 10**9  # the longest duration or timeout a record carries


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
        self.kernels: tuple[str, ...] = tuple(info.get("kernels") or ("work",))
        self._ring.kernels = len(self.kernels)
        self._kernel_index = {k: i for i, k in enumerate(self.kernels)}
        self._bound: dict[int, tuple[int, int]] = {}  # buffer handle -> (slot, generation)
        self._perms: dict[int, str] = {}

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Queue {self.qid} on {self.ctx.device}, {self.slots} slots>"

    # -- submitting -------------------------------------------------------------------

    def submit(self, kernel: str, ins: Iterable[Buffer] = (), outs: Iterable[Buffer] = (),
               *, wait: Iterable[Fence] = (), params: dict | None = None,
               ms: float | None = None, timeout_ms: float | None = None,
               checked: bool = False, at_ns: int | None = None) -> Fence:
        """One command, as ``Context.submit`` means it (``hetproc.command``'s arguments):
        ``kernel`` reads ``ins`` and writes ``outs`` after the fences in ``wait``, for
        ``ms`` modeled ms (default: the platform's timing model); returns its fence. A
        buffer not bound yet is bound first (a request to the supervisor, once)."""
        return self.submit_many([command(kernel, ins, outs, wait=wait, params=params, ms=ms,
                                         timeout_ms=timeout_ms, checked=checked)],
                                at_ns=at_ns)[0]

    def submit_nowait(self, ms: float = 0.0, *, wait: Iterable[Fence] = (),
                      at_ns: int | None = None) -> Fence:
        """One ``work`` command of ``ms`` modeled milliseconds (times the platform's time
        scale) after the fences in ``wait``; returns the fence it signals."""
        return self.submit_many([ms], wait=wait, at_ns=at_ns)[0]

    def submit_many(self, cmds: Sequence[float | dict[str, Any]], *, wait: Iterable[Fence] = (),
                    at_ns: int | None = None) -> list[Fence]:
        """Commands in order, with one doorbell post: each a ``hetproc.command`` dict (as
        ``Context.submit_many`` takes them) or a number, a ``work`` command of that many
        ms. ``wait``: fences the first waits on too (the rest follow it in queue order)."""
        self._check_open()
        conn, client = self._conn, self.client
        n = len(cmds)
        extra = [f.handle for f in wait]
        parts = [self._record_parts(c, extra if i == 0 else []) for i, c in enumerate(cmds)]
        handles = conn.take_fences(n)
        cids: list[int] = [c["cid"] if type(c) is dict and c.get("cid") else conn.next_cid()
                           for c in cmds]
        traced = [{"cid": c, "signal": h} for c, h in zip(cids, handles)]
        t_submit = conn.trace.now()
        conn.trace.bind(traced)
        now = conn.clock.now_ns  # the platform's (modeled on the virtual clock)
        arrive = now() if at_ns is None else int(at_ns)
        ring = self._ring
        put, first = ring.put, ring.head
        written = now()
        for i in range(n):
            kernel, hold, waits, kw = parts[i]
            record = encode_queue_record(self._qseq + 1, cids[i], handles[i], arrive, hold,
                                         waits, kernel, t_written=written, **kw)
            if not put(record) and not self._wait_for_space(record):
                self._fail(handles[i:], errors.ResourceError(
                    f"queue {self.qid} stayed full for {FULL_WAIT_S} s: the device is not "
                    f"draining it", retryable=True))
                break
            self._qseq += 1
        self._doorbell.release()  # a barrier too: the head is out before the state is read
        if ring.state != QUEUE_OPEN:
            self._fail_unseen(first, handles)
        conn.trace.submitted(traced, t_submit)
        fences = [Fence(client, h, cid=c, owned=True) for h, c in zip(handles, cids)]
        for f in fences:
            f._queue = self
        return fences

    def _record_parts(self, c: float | dict[str, Any],
                      extra: list[int]) -> tuple[int, int, list[int], dict[str, Any]]:
        """(kernel index, hold ns, waits, the record's other fields) of one command,
        checked as far as this process can (the device checks the rest)."""
        if type(c) is not dict:
            return 0 if "work" not in self._kernel_index else self._kernel_index["work"], \
                self._hold_ns(c), extra, {}
        kernel = c.get("kernel")
        index = self._kernel_index.get(kernel) if type(kernel) is str else None
        if index is None:
            raise errors.UnsupportedOp(f"{self.ctx.device} does not run {kernel!r} "
                                       f"(it runs: {', '.join(self.kernels)})")
        kw: dict[str, Any] = {"flags": 0}
        ms = c.get("ms")
        hold = 0
        if ms is None:
            kw["flags"] |= QUEUE_MODELED
        else:
            hold = self._hold_ns(ms)
        if c.get("timeout_ms") is not None:  # (the device bounds it as a submit's is)
            kw["flags"] |= QUEUE_TIMEOUT
            kw["timeout_ns"] = self._ns(c["timeout_ms"], "a timeout")
        if c.get("checked"):
            kw["flags"] |= QUEUE_CHECKED
        if c.get("params"):
            try:
                kw["params"] = msgpack.packb(c["params"], use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise errors.InvalidRequest(f"params cannot be encoded: {exc}") from None
        if c.get("ins"):
            kw["ins"] = [self._binding(h) for h in c["ins"]]
        if c.get("outs"):
            kw["outs"] = [self._binding(h) for h in c["outs"]]
        return index, hold, list(c.get("wait") or ()) + extra, kw

    # -- bindings -----------------------------------------------------------------------

    def bind(self, buf: Buffer) -> str:
        """Bind ``buf`` to this queue now (its first use does it otherwise); returns the
        rights its records get ("r", "w", "rw"). Raises what a submit naming it would
        (``ForeignBuffer``, ``IommuFault``, ``DtypeError``...)."""
        self._binding(buf.live_handle())
        return self._perms[buf.handle]

    def unbind(self, buf: Buffer) -> None:
        """Records may no longer name ``buf``; the supervisor lets go of it once the device
        proved it will not touch it (``free`` unbinds too)."""
        handle = buf.handle
        if self._bound.pop(handle, None) is not None:
            try:
                self._conn.request("queue_unbind", queue=self.qid, buf=handle)
            except errors.InvalidHandle:
                if self._closed or self._ring.state == QUEUE_OPEN:
                    raise
                # lost in a reset: the supervisor let go of its bindings with it

    def _binding(self, handle: int) -> tuple[int, int]:
        got = self._bound.get(handle)
        if got is None:
            self._check_open()
            try:
                reply = self._conn.request("queue_bind", queue=self.qid, buf=handle)
            except errors.InvalidHandle:
                # A reset may end the queue after the look above and before the request:
                # the supervisor marks the ring before it forgets the queue, so the ring
                # says so now, and the submit raises what a lost queue's submit raises.
                self._check_open()
                raise
            got = self._bound[handle] = (reply["slot"], reply["gen"])
            self._perms[handle] = reply["perm"]
        return got

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

    def _ns(self, ms: Any, what: str = "a duration") -> int:
        """A finite number of ms >= 0, scaled to ns (within what a record holds)."""
        if isinstance(ms, bool) or not isinstance(ms, (int, float)):
            raise errors.BadPacket(f"{what} must be a number, got {type(ms).__name__}")
        ms = float(ms)
        if not 0.0 <= ms < float("inf") or ms * self._scale * 1e6 > MAX_RECORD_NS:
            raise errors.InvalidRequest(f"{what} must be a finite number of ms >= 0, got {ms}")
        return round(ms * self._scale * 1e6)  # as the supervisor scales a submit's

    def _hold_ns(self, ms: Any) -> int:
        hold = self._ns(ms)
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
        ring, conn = self._ring, self._conn
        while not ring.put(record):
            if ring.state != QUEUE_OPEN or time.monotonic() > deadline:
                return False
            if conn.waiter is None:
                time.sleep(0.0002)
                continue
            try:  # a wait in modeled time, for the oldest record's fence: then a slot frees
                wait_handle(conn, ring.slot_signal(ring.tail), FULL_WAIT_S)
            except errors.HetprocError:
                pass  # not ours, or failed: the ring's state and the put say what next
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

"""User-mode submission queues: the supervisor's part is control, not the hot path.

A client opens a queue on one of its contexts (``queue_open``). The supervisor makes the
ring (``ipc.QueueRing`` over an anonymous segment from the client's memory budget), hands
its descriptor to that connection (in the reply) and to the context's device (on its
segment socket), then attaches it on the device with a control record in the device's
own command ring, carrying what the device must enforce: whose fences the queue may
complete (the owner tag stamped in the fence table by ``fence_create``), the fences of
others it imported (records may wait on those and on its own, as submits may; each later
import follows as a ``qgrant`` record), which tenant it is, the longest
modeled duration a record may ask (the platform's watchdog), the dependency timeout and
the dispatch latency. From then on the client writes records and rings the device's
doorbell; the device checks and runs them (``device_workers._queues``). The supervisor
sees none of it, which is the point: one process hop instead of three.

It stays in charge of everything else:

* **close / client gone** -- a detach record goes to the device in ring order, then the
  segment is dropped (the device releases its view of it first);
* a queue ended while its client writes: see ``ipc._queues`` (``ended``): the client
  fails what the supervisor could not have seen, so no record is left pending;
* **device reset** (any confirmed stop that ends the device process: crash, kill by the
  watchdog, a stall) -- every queue on that device is lost, as a GPU reset loses the
  user-mode queues on it: the supervisor reads the records the device still owed
  (``[tail, head)``, which includes the one it was running: a slot is freed only when
  its command finishes), fails each one's fence -- only fences owned by that queue's
  client, whatever a scribbled record names -- with ``CancelledByReset`` (or
  ``DeviceCrashed`` for the command the device was running), marks the ring LOST and
  tells the client. The client opens a new queue on the restarted device.

* **stall** -- records owed (``owed``) count as work for the watchdog's stall check
  (``_recovery``), judged by the device's own signs (counters and heartbeat), never by
  the ring a client writes.

What a queue does not do (yet): buffer operands (a record names no buffer, so there is
nothing to validate, map, or reclaim: ``work`` commands only -- modeled durations and
fence dependencies), fault injection rules, the command watchdog (a record's duration is
bounded instead), the supervisor's scheduling policy (queue records run when no command
the supervisor scheduled is ready on that device, round robin between queues).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers import StateSlot as S
from ipc import QUEUE_CLOSED, QUEUE_LOST, Block, QueueRing, encode, errors, queue_bytes

from .. import _protocol
from ._devices import RING_SLOTS
from ._memory import sid_of

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._failures import Failures
    from ._memory import Memory
    from ._records import ClientRec, ContextRec, Registry

MIN_SLOTS, MAX_SLOTS = 16, 4096
_BARRIER = threading.Lock()


def _full_barrier() -> None:
    """A locked instruction (a mutex taken and given back): the store before it is
    visible to other CPUs before any load after it (x86 may otherwise reorder them)."""
    with _BARRIER:
        pass
MAX_PER_CLIENT = 8       # queues one client process may hold open (all its connections)
MAX_GRANTS = 256         # imported fences named when a queue attaches (device: MAX_QUEUE_GRANTS)
MAX_PER_DEVICE = 32      # queues one device reads (each costs it a look per idle turn)


@dataclass(eq=False)
class QueueRec:
    qid: int
    client: ClientRec
    ctx: ContextRec
    device: str
    block: Block
    ring: QueueRing
    slots: int

    @property
    def sid(self) -> int:
        return int(self.block.segment)


class Queues:
    """Every open queue of the platform (see the module docstring). ``failures``: the
    failure path its owed records' fences take; ``tell`` sends a client the notice that
    its queue was lost."""

    def __init__(self, reg: Registry, pool: Memory, failures: Failures,
                 tell: Callable[[ClientRec, dict], None],
                 restart_devices: tuple[str, ...] = ()) -> None:
        """``restart_devices``: those whose death is a subsystem restart (``_recovery``):
        their queues are lost with ``DeviceRestarted``."""
        self.restart_devices = frozenset(restart_devices)
        self.reg = reg
        self.pool = pool
        self.failures = failures
        self.tell = tell
        self.open_queues: dict[int, QueueRec] = {}
        self._ids = 0
        self.stats = {"opened": 0, "closed": 0, "lost": 0, "fences_failed": 0}

    def _device(self, name: str) -> DeviceHandle:
        return self.reg.devices[name]

    # -- requests -----------------------------------------------------------------------

    def open(self, client: ClientRec, ctx: ContextRec, slots: int,
             hand: Callable[[ClientRec, int], list]) -> dict[str, Any]:
        """``hand(client, sid)``: the reply's ``segs`` entry for the ring's segment."""
        dev = self._may_open(client, ctx, slots)
        nbytes = queue_bytes(slots)
        block, seg, segs = self._make_ring(client, dev, nbytes, hand)
        self._ids += 1
        q = QueueRec(self._ids, client, ctx, dev.name, block,
                     QueueRing(memoryview(seg.map)[:nbytes], slots), slots)
        spec, scaled = self.reg.spec, self.reg.scaled_ns
        self._control(dev, {"op": "qattach", "qid": q.qid, "sid": q.sid, "slots": slots,
                            "tag": client.id, "max_hold_ns": scaled(spec.watchdog_ms),
                            "dep_timeout_ns": scaled(spec.dependency_timeout_ms),
                            "dispatch_ns": scaled(spec.dispatch_us / 1000.0), "first": 0,
                            "grants": self._imported_fences(client), "tenant": client.pid})
        self.open_queues[q.qid] = q
        self.stats["opened"] += 1
        return {"qid": q.qid, "sid": q.sid, "slots": slots, "bytes": nbytes,
                "doorbell": dev.doorbell.name, "tag": client.id,
                "max_hold_ns": scaled(spec.watchdog_ms), "segs": segs}

    def _imported_fences(self, client: ClientRec) -> list[int]:
        """The fences of others ``client`` imported: its records may wait on them, as its
        submits may (``_validation.fence_rec``). Later imports follow (``fence_imported``)."""
        return [h for h, rec in self.reg.fence_recs.items()
                if client.id in rec.importers][:MAX_GRANTS]

    def fence_imported(self, client: ClientRec, handle: int) -> None:
        """``client`` imported ``handle``: its open queues' records may wait on it now."""
        for q in self.open_queues.values():
            if q.client is client:
                self._control(self._device(q.device), {"op": "qgrant", "qid": q.qid,
                                                       "fence": handle})

    def _may_open(self, client: ClientRec, ctx: ContextRec, slots: int) -> DeviceHandle:
        """The device a queue may be opened on now; the limits' errors otherwise."""
        if slots < MIN_SLOTS or slots > MAX_SLOTS or slots & (slots - 1):
            raise errors.InvalidRequest(f"queue slots must be a power of two in "
                                        f"{MIN_SLOTS}..{MAX_SLOTS}, got {slots}")
        tenant = {id(c) for c in self.reg.tenant(client)}  # every connection of its process
        if sum(id(q.client) in tenant for q in self.open_queues.values()) >= MAX_PER_CLIENT:
            raise errors.QuotaExceeded(f"{MAX_PER_CLIENT} queues open in this client process")
        dev = self._device(ctx.device)
        if sum(q.device == dev.name for q in self.open_queues.values()) >= MAX_PER_DEVICE:
            raise errors.QuotaExceeded(f"{MAX_PER_DEVICE} queues open on {dev.name}")
        if not dev.pid or dev.paused or dev.segs is None:
            raise errors.ResourceError(f"{dev.name} is resetting: open the queue again "
                                       f"once it serves", retryable=True)
        if dev.commands.depth() >= RING_SLOTS - 2:
            raise errors.ResourceError(f"{dev.name}'s command ring is full", retryable=True)
        return dev

    def _make_ring(self, client: ClientRec, dev: DeviceHandle, nbytes: int,
                   hand: Callable[[ClientRec, int], list]) -> tuple[Block, Any, list]:
        """The ring's segment from the tenant's budget, its descriptor on its way to the
        client (in the reply) and to the device (before the record that names it)."""
        try:
            block = self.pool.allocate(client.pid, nbytes, exportable=True)
        except MemoryError as exc:
            raise errors.OutOfMemory(f"no memory for a queue of {nbytes} bytes: {exc}") from None
        sid = sid_of(block)
        seg = self.pool.segments[sid]
        sender = dev.segs  # None only while the device is (re)starting
        try:
            if sender is None:
                raise errors.ResourceError(f"{dev.name} is starting: open the queue again",
                                           retryable=True)
            segs = hand(client, sid)
        except errors.HetprocError:
            self.pool.free(block)
            raise
        sender.add(seg)
        if not sender.flush():
            sender.drop(sid)
            client.segments.discard(sid)
            self.pool.free(block)
            raise errors.ResourceError(f"{dev.name} is not taking descriptors now: open the "
                                       f"queue again", retryable=True)
        return block, seg, segs

    def close(self, client: ClientRec, qid: int) -> dict[str, Any]:
        q = self.open_queues.get(qid)
        if q is None or q.client is not client:
            raise errors.InvalidHandle(f"queue {qid} is not open on this connection")
        self._end(q, QUEUE_CLOSED, None, "the queue was closed")
        self.stats["closed"] += 1
        return {}

    # -- what ends queues -----------------------------------------------------------------

    def client_gone(self, client: ClientRec) -> None:
        """Nobody is left to write or to wait (its fences fail with the client's)."""
        for q in [q for q in self.open_queues.values() if q.client is client]:
            self._drop(q, QUEUE_CLOSED)

    def context_gone(self, ctx: ContextRec) -> None:
        for q in [q for q in self.open_queues.values() if q.ctx is ctx]:
            self._end(q, QUEUE_CLOSED, None, "its context was destroyed")

    def device_gone(self, dev: DeviceHandle, why: str) -> None:
        """The device process ended (its stop is confirmed): lose its queues."""
        for q in [q for q in self.open_queues.values() if q.device == dev.name]:
            self._end(q, QUEUE_LOST, dev, why)
            self.stats["lost"] += 1
            lost = (errors.DeviceRestarted if dev.name in self.restart_devices
                    else errors.CancelledByReset)
            self.tell(q.client, _protocol.notice(lost(
                f"queue {q.qid} on {dev.name} was lost: {why}").to_dict(), queue=q.qid))

    def _end(self, q: QueueRec, state: int, dev: DeviceHandle | None, why: str) -> None:
        """Set the state first (a submit sees it), then fail what was owed, then drop.
        The order against a client writing at the same time: ``ipc._queues``."""
        q.ring.set_state(state)
        _full_barrier()
        self.stats["fences_failed"] += self._fail_owed(q, dev, why)
        self._drop(q, state, tell_device=dev is None)

    def _fail_owed(self, q: QueueRec, dev: DeviceHandle | None, why: str) -> int:
        """Fail the fences of the records the device owed (``dev``: it was reset; None:
        the queue was closed), then publish the head read (``ipc._queues``). The records
        are the client's writing: a fence fails only if it is that client's and pending."""
        ring, fences, tag = q.ring, self.reg.fences, q.client.id
        running = self._running_cid(dev) if dev is not None else -1
        tail, head = ring.tail, ring.head
        failed = 0
        for i in range(tail, tail + min(max(head - tail, 0), q.slots)):
            try:
                rec = ring.read(i)
            except errors.BadPacket:
                continue
            if fences.pending_owner(rec.signal) != tag:
                continue
            exc = self._owed_error(q, dev, why, rec.cid, i == tail and rec.cid == running)
            self.failures.fail(exc, [rec.signal], noted=0)  # its record reaches the owner first
            failed += 1
        ring.set_ended_at(head)  # what the client must fail itself starts here
        return failed

    def _running_cid(self, dev: DeviceHandle) -> int:
        """The cid of the queue command the device was running when it stopped, or -1."""
        slot = self.reg.slots[dev.index]
        if slot.u64[S.CURRENT_SEQ] == 0 and slot.u32[S.STATE] in (DeviceState.BUSY,
                                                                 DeviceState.WAITING):
            return int(slot.u64[S.CURRENT_CID])
        return -1

    def _owed_error(self, q: QueueRec, dev: DeviceHandle | None, why: str, cid: int,
                    running: bool) -> errors.HetprocError:
        if dev is None:
            return errors.Cancelled(f"queue {q.qid}: {why}", correlation_id=cid)
        if dev.name in self.restart_devices:
            return errors.DeviceRestarted(f"queue {q.qid} on {dev.name} was lost: {why}",
                                          correlation_id=cid, detail={"device": dev.name})
        if running:
            return errors.DeviceCrashed(f"{dev.name} stopped while running queue {q.qid}'s "
                                        f"command: {why}", correlation_id=cid)
        return errors.CancelledByReset(f"queue {q.qid} on {dev.name} was lost: {why}",
                                       correlation_id=cid)

    def _drop(self, q: QueueRec, state: int, tell_device: bool = True) -> None:
        del self.open_queues[q.qid]
        q.ring.set_state(state)
        if tell_device:
            dev = self._device(q.device)
            if dev.pid:
                self._control(dev, {"op": "qdetach", "qid": q.qid})
        q.ring.release()
        q.client.segments.discard(q.sid)
        self.pool.free(q.block)  # the devices drop the segment after the detach record

    def _control(self, dev: DeviceHandle, record: dict[str, Any]) -> None:
        """A control record in the device's ring, in order with its commands. The ring
        keeps a slot for these (``open`` refuses when it is full), and a detach that
        does not fit is not needed: the segment's drop detaches the queue as well."""
        if dev.commands.try_put(encode(record)):
            dev.doorbell.release()

    def owed(self, dev: DeviceHandle) -> int:
        """Records the queues on ``dev`` hold and the device has not finished, as far as
        the rings say (indices that cannot be count as none)."""
        total = 0
        for q in self.open_queues.values():
            if q.device == dev.name:
                n = q.ring.head - q.ring.tail
                total += n if 0 < n <= q.slots else 0
        return total

    def metrics(self) -> dict[str, int]:
        return {"open": len(self.open_queues), **self.stats}

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

* **operands** -- a record names buffers the client bound to the queue
  (``_queue_bindings``: checked once at bind, let go only after the device proved it will
  not touch them); the device checks every operand of every record against the binding
  table, and applies the supervisor's models (``device_workers._queues``);

* **faults and the watchdog** -- the fault rules that would hit the client's commands on
  that device go to the device with the queue (``qattach``) and again whenever they
  change (``qfaults``); a queue command is timed like a pushed one (``_queue_watch``).

What a queue does not do (yet): the supervisor's scheduling policy (queue records run
when no command the supervisor scheduled is ready on that device, round robin between
queues), inserted copies (a buffer the device cannot take as it is is refused at bind),
``lost_fence`` faults, and the DDR bytes of its commands in the supervisor's counters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from device_workers import DeviceState
from device_workers import StateSlot as S
from ipc import (
    QUEUE_CLOSED,
    QUEUE_LOST,
    BindingTable,
    Block,
    QueueRing,
    encode,
    errors,
    queue_bytes,
)

from .. import _protocol
from . import _quotas as quota
from ._devices import RING_SLOTS
from ._memory import sid_of
from ._queue_bindings import Binder, BindingSet, make_table
from ._queue_terms import QueueTerms
from ._queue_watch import QueueWatch

if TYPE_CHECKING:
    from ._devices import DeviceHandle
    from ._failures import Failures
    from ._faultplan import FaultPlan, FaultRule
    from ._handoff import Handoff
    from ._memory import Memory
    from ._records import BufferRec, ClientRec, ContextRec, Registry

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
    table_block: Block | None = None
    bindings: BindingSet | None = None
    # The fault rules its device was given, in that order, and how often each had fired
    # there when last looked at (``harvest``): the device's counts go to these rules.
    forwarded: list[FaultRule] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)

    @property
    def sid(self) -> int:
        return int(self.block.segment)


class Queues:
    """Every open queue of the platform (see the module docstring). ``failures``: the
    failure path its owed records' fences take; ``tell`` sends a client the notice that
    its queue was lost."""

    def __init__(self, reg: Registry, pool: Memory, failures: Failures,
                 tell: Callable[[ClientRec, dict], None], binder: Binder, handoff: Handoff,
                 faults: FaultPlan, restart_devices: tuple[str, ...] = ()) -> None:
        """``restart_devices``: those whose death is a subsystem restart (``_restarts``):
        their queues are lost with ``DeviceRestarted``."""
        self.restart_devices = frozenset(restart_devices)
        self.reg = reg
        self.pool = pool
        self.failures = failures
        self.tell = tell
        self.binder = binder
        self.handoff = handoff
        self.faults = faults
        self.watch = QueueWatch(reg, self._tables)
        self.terms = QueueTerms(reg, handoff, faults)
        # One count per rule whichever path it fires on: a draw here first brings in the
        # devices' firings; a firing here re-sends the devices their rules.
        faults.before_draw = self.harvest
        faults.on_fire = self.faults_changed
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
        try:
            tblock, table = make_table(self.pool, client, dev)
        except errors.HetprocError:
            client.segments.discard(sid_of(block))
            self.pool.free(block)
            raise
        self._ids += 1
        q = QueueRec(self._ids, client, ctx, dev.name, block,
                     QueueRing(memoryview(seg.map)[:nbytes], slots), slots, tblock,
                     BindingSet(table))
        q.ring.kernels = len(dev.spec.ops)  # its records name the device's ops
        spec, scaled = self.reg.spec, self.reg.scaled_ns
        self._control(dev, {"op": "qattach", "qid": q.qid, "sid": q.sid, "slots": slots,
                            "tag": client.id, "max_hold_ns": scaled(spec.watchdog_ms),
                            "dep_timeout_ns": scaled(spec.dependency_timeout_ms),
                            "dispatch_ns": scaled(spec.dispatch_us / 1000.0), "first": 0,
                            "grants": self._imported_fences(client), "tenant": client.pid,
                            "table": sid_of(tblock), "terms": self.terms.terms(q, dev)})
        self.open_queues[q.qid] = q
        self.stats["opened"] += 1
        return {"qid": q.qid, "sid": q.sid, "slots": slots, "bytes": nbytes,
                "doorbell": dev.doorbell.name, "tag": client.id,
                "max_hold_ns": scaled(spec.watchdog_ms), "segs": segs,
                "kernels": list(dev.spec.ops)}

    def harvest(self) -> None:
        """Count the rules' firings on the devices' queues against the rules."""
        for q in self.open_queues.values():
            self.terms.harvest(q)

    def faults_changed(self) -> None:
        """A rule was armed or cleared: each queue's device hears which apply now."""
        for q in self.open_queues.values():
            self._control(self._device(q.device), {"op": "qfaults", "qid": q.qid,
                                                   "rules": self.terms.fault_rules(q)})

    # -- bindings (``_queue_bindings``) ----------------------------------------------------

    def bind(self, client: ClientRec, qid: int, handle: Any) -> dict[str, Any]:
        q = self._own(client, qid)
        assert q.bindings is not None
        return self.binder.bind(q.bindings, q.ctx, self._device(q.device), handle)

    def unbind(self, client: ClientRec, qid: int, handle: Any) -> dict[str, Any]:
        q = self._own(client, qid)
        assert q.bindings is not None
        dev = self._device(q.device)
        n = self.binder.unbind(q.bindings, q.ctx, dev, [handle], bool(dev.pid))
        if not n:
            raise errors.InvalidRequest(f"buffer {handle!r} is not bound to queue {qid}")
        return {}

    def buffer_released(self, client: ClientRec, buf: BufferRec) -> None:
        """``client`` let go of ``buf`` (a free, an importer's free): its queues unbind it,
        and the buffer is reclaimed only once their devices let go."""
        for q in self.open_queues.values():
            if q.client is client and q.bindings is not None \
                    and self.binder.bound_to(q.bindings, buf):
                dev = self._device(q.device)
                self.binder.unbind(q.bindings, q.ctx, dev, [buf.handle], bool(dev.pid))

    def _own(self, client: ClientRec, qid: Any) -> QueueRec:
        q = self.open_queues.get(qid) if isinstance(qid, int) else None
        if q is None or q.client is not client:
            raise errors.InvalidHandle(f"queue {qid} is not open on this connection")
        return q

    def _tables(self, dev: DeviceHandle) -> list[tuple[int, BindingTable]]:
        return [(q.qid, q.bindings.table) for q in self.open_queues.values()
                if q.device == dev.name and q.bindings is not None]

    def tick(self, now: int) -> None:
        """The queue commands' watchdog (``_queue_watch``)."""
        if self.open_queues:
            self.watch.tick(now)

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
        quota.check_queue_share(client, dev.name, MAX_PER_DEVICE, [
            q.client.pid for q in self.open_queues.values() if q.device == dev.name])
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
            self.pool.mapping(sid)  # the supervisor reads the ring: it maps it
            segs = hand(client, sid)
        except errors.HetprocError:
            self.pool.free(block)
            raise
        if not sender.add(seg):
            client.segments.discard(sid)
            self.pool.free(block)
            raise errors.DescriptorsExhausted(f"no descriptor to hand {dev.name} the queue's "
                                              "ring: open it again later") from None
        if not sender.flush():
            sender.drop(sid)
            client.segments.discard(sid)
            self.pool.free(block)
            raise errors.ResourceError(f"{dev.name} is not taking descriptors now: open the "
                                       f"queue again", retryable=True)
        return block, seg, segs

    def close(self, client: ClientRec, qid: int) -> dict[str, Any]:
        q = self._own(client, qid)
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
        self.watch.device_gone(dev)

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
        running = _running_cid(self.reg, dev) if dev is not None else -1
        tail, head = ring.tail, ring.head
        failed = 0
        for i in range(tail, tail + min(max(head - tail, 0), q.slots)):
            try:
                rec = ring.read(i)
            except errors.BadPacket:
                continue
            if fences.pending_owner(rec.signal) != tag:
                continue
            exc = _owed_error(q, dev, why, rec.cid, i == tail and rec.cid == running)
            if dev is not None and dev.name in self.restart_devices:
                exc = errors.DeviceRestarted(f"queue {q.qid} on {dev.name} was lost: {why}",
                                             correlation_id=rec.cid, detail={"device": dev.name})
            if dev is not None and i == tail:
                exc = self.watch.take_verdict(dev, rec.cid) or exc
            self.failures.fail(exc, [rec.signal], noted=0)  # its record reaches the owner first
            failed += 1
        ring.set_ended_at(head)  # what the client must fail itself starts here
        return failed

    def _drop(self, q: QueueRec, state: int, tell_device: bool = True) -> None:
        """``tell_device`` False: the device process is gone (reaped), so what was bound
        is let go at once; else after the detach record and a barrier behind it."""
        del self.open_queues[q.qid]
        q.ring.set_state(state)
        dev = self._device(q.device)
        alive = tell_device and bool(dev.pid)
        if alive:
            self._control(dev, {"op": "qdetach", "qid": q.qid})
        if q.bindings is not None:
            self.binder.unbind(q.bindings, q.ctx, dev, list(q.bindings.by_handle), alive)
            q.bindings.table.release()
        q.ring.release()
        q.client.segments.discard(q.sid)
        self.pool.free(q.block)  # the devices drop the segment after the detach record
        if q.table_block is not None:
            self.pool.free(q.table_block)

    def _control(self, dev: DeviceHandle, record: dict[str, Any]) -> None:
        """A control record in the device's ring, in order with its commands. The ring
        keeps a slot for these (``open`` refuses when it is full), and a detach that
        does not fit is not needed: the segment's drop detaches the queue as well."""
        if dev.commands.try_put(encode(record)):
            dev.doorbell.release()

    def owed(self, dev: DeviceHandle) -> int:
        """Records the queues on ``dev`` hold and the device has not finished, as far as
        the rings say (indices that cannot be count as none). None while the queue
        watchdog times the command it runs: those records are that watchdog's to judge
        (as the command watchdog's are, ``Recovery.watch_queue``)."""
        if not self.open_queues or self.watch.timing_on(dev.name):
            return 0  # (asked for every device on every timer turn: no queue, at once)
        total = 0
        for q in self.open_queues.values():
            if q.device == dev.name:
                n = q.ring.head - q.ring.tail
                total += n if 0 < n <= q.slots else 0
        return total

    def metrics(self) -> dict[str, int]:
        bound = sum(len(q.bindings.by_handle) for q in self.open_queues.values()
                    if q.bindings is not None)
        return {"open": len(self.open_queues), **self.stats, "bindings": bound,
                **{f"bindings_{k}": v for k, v in self.binder.stats.items()}}


def _running_cid(reg: Registry, dev: DeviceHandle) -> int:
    """The cid of the queue command the device was running when it stopped, or -1."""
    slot = reg.slots[dev.index]
    if slot.u64[S.CURRENT_SEQ] == 0 and slot.u32[S.STATE] in (DeviceState.BUSY,
                                                             DeviceState.WAITING):
        return int(slot.u64[S.CURRENT_CID])
    return -1


def _owed_error(q: QueueRec, dev: DeviceHandle | None, why: str, cid: int,
                running: bool) -> errors.HetprocError:
    if dev is None:
        return errors.Cancelled(f"queue {q.qid}: {why}", correlation_id=cid)
    if running:
        return errors.DeviceCrashed(f"{dev.name} stopped while running queue {q.qid}'s "
                                    f"command: {why}", correlation_id=cid)
    return errors.CancelledByReset(f"queue {q.qid} on {dev.name} was lost: {why}",
                                   correlation_id=cid)

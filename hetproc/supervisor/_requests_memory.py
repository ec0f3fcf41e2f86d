"""Requests on memory and fences: allocation and free, fences, mappings, export and
import (the rules: ``_iommu``; the lifetimes: ``_lifetimes``), and the memory log.

A buffer's segment reaches a connection as a descriptor with the reply that first names
it (``segs``, attached by the loop); a client unmaps a buffer's own segment when it
frees the buffer, so a later import hands the descriptor again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ipc import errors

from . import _quotas as quota
from . import _validation as check
from ._failures import CLIENT
from ._iommu import covers
from ._memory import sid_of
from ._records import BufferRec, ClientRec, Registry, nbytes_of
from ._requests import hand_segment

if TYPE_CHECKING:
    from ._failures import Failures
    from ._faultplan import FaultPlan
    from ._handoff import Handoff
    from ._iommu import Iommu
    from ._lifetimes import Lifetimes
    from ._memlog import MemLog
    from ._memory import Memory
    from ._queues import Queues


class MemoryRequests:
    def __init__(self, reg: Registry, pool: Memory, lifetimes: Lifetimes, iommu: Iommu,
                 handoff: Handoff, faults: FaultPlan, failures: Failures,
                 memlog: MemLog, queues: Queues) -> None:
        self.reg, self.pool, self.lifetimes, self.iommu = reg, pool, lifetimes, iommu
        self.handoff, self.faults, self.failures, self.memlog = handoff, faults, failures, memlog
        self.queues = queues  # an imported fence may be waited on from the client's queues

    # -- buffers ------------------------------------------------------------------------

    def alloc(self, client: ClientRec, msg: dict) -> dict:
        shape, dtype, strides = check.check_layout(msg["shape"], msg["dtype"], msg.get("strides"),
                                                   self.reg.spec.memory_mib << 20)
        nbytes = nbytes_of(shape, dtype, strides)
        extra = self.handoff.alloc_options(msg, shape)  # layout, usage, placement
        quota.check_alloc(self.reg, client, nbytes + extra["byte_offset"])
        rule = self.faults.draw("alloc", client=(client.id, client.name))
        if rule is not None:
            cls = errors.OutOfMemory if rule.kind == "oom" else errors.AllocationFailed
            raise cls(f"allocation of {nbytes} bytes failed (injected {rule.kind})")
        exportable = bool(msg.get("exportable", False))
        try:
            # A tenant is a process: its connections share one pool, nobody else's.
            block = self.pool.allocate(client.pid, nbytes + extra["byte_offset"],
                                       exportable=exportable)
        except MemoryError as exc:
            raise errors.OutOfMemory(str(exc)) from None
        try:
            segs = hand_segment(self.reg, self.pool, client, sid_of(block))
        except BaseException:
            self.pool.free(block)
            raise
        buf = self.lifetimes.register(BufferRec(0, block, shape, dtype, strides, nbytes, client,
                                                exportable=exportable, **extra))
        return {**self.handoff.describe(buf), "segs": segs}

    def _own_segment_of(self, handle: object) -> int | None:
        """The segment of an exportable buffer (one of its own), else None."""
        try:
            buf = self.reg.buffers.get(handle)
        except errors.HetprocError:
            return None
        return buf.block.segment if buf.exportable else None

    def free(self, client: ClientRec, msg: dict) -> dict:
        self._unbind_from_queues(client, msg["buf"])
        own = self._own_segment_of(msg["buf"])
        dropped = self.lifetimes.drop_import(client, msg["buf"])  # an importer lets go
        if dropped is not None:
            client.segments.discard(own)
            client.read_only_segments.discard(own)
            return dropped
        buf = check.buffer_of(self.reg, client, msg["buf"])
        reclaimed = self.lifetimes.release_buffer(buf)
        client.segments.discard(own)
        return {"reclaimed": reclaimed}

    def _unbind_from_queues(self, client: ClientRec, handle: Any) -> None:
        """A buffer the client lets go leaves its queues' bindings first: it is reclaimed
        only once their devices let go of it too (``_queue_bindings``)."""
        if not self.queues.open_queues:
            return
        try:
            buf = self.reg.buffers.get(handle)
        except errors.HetprocError:
            return  # the free itself says why
        self.queues.buffer_released(client, buf)

    def free_many(self, client: ClientRec, msg: dict) -> dict:
        """Frees the client deferred until its last numpy view of each buffer was gone
        (sent with its next request); a handle no longer valid is skipped, not an error."""
        for handle in msg["bufs"]:
            try:
                self.free(client, {"buf": handle})
            except errors.InvalidRequest:
                pass
        return {}

    # -- fences -------------------------------------------------------------------------

    def fence_create(self, client: ClientRec, msg: dict) -> dict:
        count = msg.get("count", 1)  # 1..1024, checked with the packet
        quota.check_fences(self.reg, client, count)
        return {"fences": self.lifetimes.new_fences(client, count)}

    def fence_release(self, client: ClientRec, msg: dict) -> dict:
        self.lifetimes.release_fences(client, msg["fences"])  # ints: checked with the packet
        return {}

    def fence_error(self, client: ClientRec, msg: dict) -> dict:
        rec = self.reg.fence_recs.get(msg["fence"])
        if rec is None:
            raise errors.StaleHandle(f"fence {msg['fence']:#x} is not live")
        if not (client.privileged or rec.client is client or client.id in rec.importers):
            raise errors.ForeignHandle(f"fence {msg['fence']:#x} belongs to another client")
        return {"error": rec.error}

    def fence_signal(self, client: ClientRec, msg: dict) -> dict:
        """Signal (or fail) a user fence: its owner may, and an importer the owner granted
        the signal right to; nobody may signal a fence a command will signal."""
        handle = check.check_signal_right(self.reg, client, msg["fence"])
        code = msg.get("error", 0)
        if code:
            failure = errors.error_class(code)(f"failed by client {client.name!r}")
            # A client's word, no runtime failure of the platform's: not noted.
            _, completed = self.failures.fail(failure, [handle], noted=0, signaller=CLIENT)
            return {"signalled": bool(completed)}
        return {"signalled": self.reg.fences.signal(handle, 0, signaller=CLIENT)}

    # -- mappings and sharing (rules in ``_iommu``) ------------------------------------------

    def map(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"])
        buf = self.iommu.resolve(client, msg["buf"], self.reg.buffers)
        who = (client.id, client.name)
        if self.faults.rules and self.faults.draw("map", ctx.device, client=who):  # seed §15
            raise errors.MapFailed(f"mapping buffer {buf.handle:#x} into {ctx.device} failed "
                                   "(injected)")
        m = self.iommu.map(ctx, buf, msg.get("perm", "rw"))
        return {"perm": m.perm}

    def unmap(self, client: ClientRec, msg: dict) -> dict:
        ctx = check.context_of(self.reg, client, msg["ctx"], allow_lost=True)
        buf = self.reg.buffers.get(msg["buf"])
        return {"unmapped": self.iommu.unmap(ctx, buf)}

    def export_(self, client: ClientRec, msg: dict) -> dict:
        if "buf" in msg:
            return self._export_buffer(client, msg)
        if "fence" in msg:
            handle = check.check_fence(self.reg, client, msg["fence"])
            if self.reg.fence_recs[handle].client is not client:
                raise errors.NotPermitted(f"fence {handle:#x} is not this client's to export")
            perm = "rw" if msg.get("signal") else "r"  # "w": importers may signal it
            return {"token": self.iommu.export("fence", handle, perm, client)}
        raise errors.InvalidRequest("export names a buffer or a fence")

    def _export_buffer(self, client: ClientRec, msg: dict) -> dict:
        buf = self.iommu.resolve(client, msg["buf"], self.reg.buffers)
        rights = self.iommu.rights(client, buf)
        perm = "r" if msg.get("read_only") else rights
        if not covers(rights, perm):
            raise self.iommu.fault(errors.IommuFault(
                f"cannot export buffer {buf.handle:#x} {perm!r}: the client holds {rights!r}",
                detail={"buffer": buf.handle, "need": perm, "perm": rights}))
        if not buf.exportable:
            raise errors.NotPermitted(
                f"buffer {buf.handle:#x} shares its segment with its owner's other "
                "buffers, so it cannot be exported (an importer would map them too): "
                "allocate it with exportable=True (a segment of its own)",
                detail={"buffer": buf.handle})
        return {"token": self.iommu.export("buffer", buf.handle, perm, client)}

    def import_(self, client: ClientRec, msg: dict) -> dict:
        kind = msg.get("kind", "buffer")
        exp = self.iommu.lookup(msg["token"], kind)
        if kind == "fence":
            rec = self.reg.fence_recs.get(exp.handle)
            if rec is None:
                raise errors.StaleHandle("the exported fence was released")
            self.lifetimes.import_fence(client, rec)
            self.queues.fence_imported(client, exp.handle)
            if "w" in exp.perm and rec.client is not client:
                rec.signallers = rec.signallers | {client.id}
            return {"fence": exp.handle, "cid": self.reg.fences.info(exp.handle)["cid"],
                    "signal": rec.client is client or client.id in rec.signallers}
        buf = self.reg.buffers.get(exp.handle)
        sid = buf.block.segment
        held = sid in client.segments
        segs = hand_segment(self.reg, self.pool, client, sid,  # quota first
                            writable="w" in exp.perm)
        try:
            perm = self.iommu.add_buffer_import(client, buf, exp.perm)
        except BaseException:
            if segs and not held:
                client.segments.discard(sid)
            elif segs:  # it asked for a writable one: it holds the read-only one still
                client.read_only_segments.add(sid)
            raise
        return {**self.handoff.describe(buf), "perm": perm, "segs": segs}

    # -- the memory log -------------------------------------------------------------------

    def mem_events(self, client: ClientRec, msg: dict) -> dict:
        cids = msg.get("cids")
        wanted = None if cids is None else set(cids)
        mine = None if client.privileged else self._own_memory_keys(client)
        out = self.memlog.since(msg.get("since", 0), msg.get("limit", 4096), wanted, mine)
        if wanted is not None:
            # Commands of these requests not retired yet: their events are still to come.
            out["open"] = {c: self.handoff.open_cids.get(c, 0) for c in wanted}
        return out

    def _own_memory_keys(self, client: ClientRec) -> dict[str, set[Any]]:
        """What identifies a normal client's own memory events: its contexts, its buffers
        and imports, and its id (import events)."""
        return {"ctx": set(client.contexts), "client": {client.id},
                "buf": set(client.buffers) | set(self.iommu.imported_buffers(client))}

"""INVARIANT 1 lives here: the only code that frees, reclaims, purges or quarantines.

Recovery and the command engine decide *when* something may go (a command retired, a
device confirmed its stop, a client left); this module decides *how*, and refuses to let
memory go while anything may still touch it::

    client free ──▶ released ──(refs == 0, no importer)──▶ reclaim ──▶ purge ──▶ pool
                        │                                   │           │
                        └─ refs > 0: QUARANTINED ───────────┘           └─ a non-coherent
                           (a command a device may still run              device drops its
                           holds it; recovery retires it only             dirty lines first
                           after the device confirmed its stop)           (``purge``)

A buffer is referenced by its owner, by each importer, by each command that may still
touch it and by each user-mode queue it is bound to (``refs``); a fence likewise. The
block goes back to the pool only when all of those are gone. Fences: released by the
owner, dropped when no command and no importer holds them; the slot's generation makes a
stale handle harmless after that.

The counts are written on the fields they keep (``_records``: ``BufferRec.refs``,
``FenceRec.refs``); every reference is let go through ``_unref_buffer`` or
``_unref_fence``, which assert that it was held, and reclaim at zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ipc import errors

from ._records import BufferRec, ClientRec, FenceRec, Registry

if TYPE_CHECKING:
    from ._devices import Command
    from ._failures import Failures
    from ._iommu import Iommu
    from ._memory import Memory

# purge(device_name, [segment, offset], then): queue a cache purge on that device and call
# ``then`` once the device ran it (the supervisor's command engine provides it).
Purge = Callable[[str, list, Callable[[], None]], None]


class Lifetimes:
    def __init__(self, reg: Registry, pool: Memory, iommu: Iommu,
                 failures: Failures) -> None:
        self.reg = reg
        self.pool = pool
        self.iommu = iommu
        self.failures = failures
        self.purge: Purge | None = None  # see ``purge_with``

    def purge_with(self, purge: Purge) -> None:
        """A purge is a device command, so it comes from the command engine, which is
        built on this part: a cycle of the composition, closed once (``_compose``)."""
        assert self.purge is None, "one engine purges"
        self.purge = purge

    # -- fences -----------------------------------------------------------------------

    def new_fence(self, client: ClientRec | None, cid: int = 0) -> int:
        """A fence of ``client``'s; its handler checked the quota (``_quotas``) first."""
        handle = self.reg.fences.allocate(cid, client.id if client is not None else 0)
        self.reg.fence_recs[handle] = FenceRec(handle, client)
        if client is not None:
            client.fences.add(handle)
        return handle

    def new_fences(self, client: ClientRec, count: int) -> list[int]:
        """``count`` fences of ``client``'s (``new_fence`` each, in one call)."""
        out = self.reg.fences.allocate_many(count, client.id)
        recs = self.reg.fence_recs
        for handle in out:
            recs[handle] = FenceRec(handle, client)
        client.fences.update(out)
        return out

    def release_fences(self, client: ClientRec, handles: list[int]) -> None:
        """``client`` lets go of these fences: its own are released (``release_fence``),
        its imports dropped (``drop_fence_import``); a handle of neither is skipped."""
        recs, iommu = self.reg.fence_recs, self.iommu
        mine = client.fences
        dropped = []
        try:
            for handle in handles:
                rec = recs.get(handle)
                if rec is None:
                    continue
                if rec.client is not client:
                    self.drop_fence_import(client, handle)
                elif not rec.released:  # release_fence, inline: this runs per command
                    rec.released = True
                    mine.discard(handle)
                    if rec.refs == 0:  # drop_fence (its slot: with the others, below)
                        iommu.revoke("fence", handle)
                        del recs[handle]
                        dropped.append(handle)
        finally:
            self.reg.fences.release_many(dropped)

    def release_fence(self, handle: int) -> None:
        rec = self.reg.fence_recs.get(handle)
        if rec is None or rec.released:
            return
        rec.released = True
        if rec.client is not None:
            rec.client.fences.discard(handle)
        if rec.refs == 0:
            self.drop_fence(rec)

    def drop_fence(self, rec: FenceRec) -> None:
        self.iommu.revoke("fence", rec.handle)
        del self.reg.fence_recs[rec.handle]
        self.reg.fences.release(rec.handle)

    def hold_fence(self, rec: FenceRec) -> None:
        """A watch (a fence descriptor, a merge: ``_fencefds``) keeps ``rec``'s slot from
        recycling until it lets go (``let_go_fence``)."""
        rec.refs += 1

    def let_go_fence(self, rec: FenceRec) -> None:
        self._unref_fence(rec)

    def _unref_fence(self, rec: FenceRec) -> None:
        """A command or an importer lets go of ``rec``; dropped once nobody holds it."""
        assert rec.refs > 0, f"fence {rec.handle:#x} let go more often than held"
        rec.refs -= 1
        if rec.released and rec.refs == 0:
            self.drop_fence(rec)

    def _unref_buffer(self, buf: BufferRec) -> None:
        """A retired command lets go of ``buf``; reclaimed once nobody holds it."""
        assert buf.refs > 0, f"buffer {buf.handle:#x} let go more often than held"
        buf.refs -= 1
        if buf.released and buf.refs == 0:
            self.reclaim_buffer(buf)

    # -- a command's references ---------------------------------------------------------

    def take_refs(self, cmd: Command) -> None:
        """A committed command holds its buffers and fences until it retires."""
        recs = self.reg.fence_recs
        for h in cmd.signal:
            rec = recs[h]
            rec.bound = True
            rec.producer = cmd
            rec.refs += 1
        for h in cmd.wait:
            recs[h].refs += 1
        for b in cmd.ins:
            b.refs += 1
        for b in cmd.outs:
            b.refs += 1

    def hold_buffer(self, buf: BufferRec) -> None:
        """A queue binding holds ``buf`` (``_queue_bindings``): a device may touch it
        through any record of that queue until the binding is let go."""
        buf.refs += 1

    def let_go_buffer(self, buf: BufferRec) -> None:
        """A binding's hold ends: only once its device confirmed it will not touch the
        buffer (the barrier after the unbind, or the device's reaping)."""
        self._unref_buffer(buf)

    def drop_refs(self, cmd: Command) -> None:
        """A retired command lets go; what nobody else holds is reclaimed now."""
        if cmd.ins or cmd.outs:
            for b in cmd.ins + cmd.outs:
                self._unref_buffer(b)
        recs = self.reg.fence_recs
        for h in (cmd.wait + cmd.signal) if cmd.wait else cmd.signal:
            rec = recs.get(h)
            if rec is not None:
                self._unref_fence(rec)

    # -- buffers ------------------------------------------------------------------------

    def register(self, buf: BufferRec) -> BufferRec:
        buf.handle = self.reg.buffers.insert(buf)
        if not buf.internal:
            buf.client.buffers.add(buf.handle)
            buf.client.bytes += buf.nbytes + buf.byte_offset  # as _quotas checks it
        return buf

    def release_buffer(self, buf: BufferRec) -> bool:
        """The client let go; the memory goes back to the pool once no command holds it."""
        if buf.released:
            return False
        buf.released = True
        if buf.handle in buf.client.buffers:
            buf.client.buffers.discard(buf.handle)
            buf.client.bytes -= buf.nbytes + buf.byte_offset
            assert buf.client.bytes >= 0, "a client's bytes count only its own buffers"
        self.iommu.drop_client_mappings(buf.client, buf)
        if buf.refs == 0:
            self.reclaim_buffer(buf)
            return True
        return False

    def reclaim_buffer(self, buf: BufferRec) -> None:
        if buf.importers:
            return  # imported: the last importer's free reclaims it (``drop_import``)
        self.iommu.forget_buffer(buf)
        self.reg.buffers.remove(buf.handle)
        self._free_block_when_purged(buf)

    def maybe_reclaim(self, buf: BufferRec) -> None:
        if buf.released and buf.refs == 0 and not buf.importers:
            self.reclaim_buffer(buf)

    def _free_block_when_purged(self, buf: BufferRec) -> None:
        """Invariant 1 for caches: a non-coherent device may still hold this buffer's lines
        dirty, and evicting them later would write stale data over the block's next owner.
        Each such device first drops them (a purge command, in its queue order); only
        then does the block go back to the pool. A device that dies meanwhile restarts
        with an empty cache, which is as good."""
        devices = sorted(buf.dirty_on)
        buf.dirty_on = set()
        if not devices:
            self.pool.free(buf.block)
            return
        left = [len(devices)]

        def purged() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.pool.free(buf.block)

        assert self.purge is not None, "composed without a command engine"
        for name in devices:
            self.purge(name, [buf.block.segment, buf.block.offset + buf.byte_offset], purged)

    # -- imports ------------------------------------------------------------------------

    def import_fence(self, client: ClientRec, rec: FenceRec) -> None:
        """The importer's reference keeps the slot from recycling while it waits."""
        if rec.client is not client and client.id not in rec.importers:
            rec.importers = rec.importers | {client.id}
            rec.refs += 1
            self.iommu.fence_imports.setdefault(client.id, set()).add(rec.handle)

    def drop_import(self, client: ClientRec, handle: Any) -> dict | None:
        """``free`` by an importer: drop its reference; None if it holds no import."""
        try:
            buf = self.reg.buffers.get(handle)
        except errors.InvalidHandle:
            return None
        if not self.iommu.drop_buffer_import(client, buf):
            return None
        self.maybe_reclaim(buf)
        return {"reclaimed": False}

    def drop_fence_import(self, client: ClientRec, handle: int) -> bool:
        rec = self.reg.fence_recs.get(handle)
        if rec is None or client.id not in rec.importers:
            return False
        rec.importers = rec.importers - {client.id}
        self.iommu.fence_imports.get(client.id, set()).discard(handle)
        self._unref_fence(rec)
        return True

    # -- a client leaving -----------------------------------------------------------------

    def release_client(self, client: ClientRec) -> None:
        """A client is gone (its contexts already destroyed): its buffers, fences and
        imports are let go, each reclaimed as soon as nothing else holds it.

        Its user fences include those it released while importers still hold them: they
        left ``client.fences`` at release, yet nobody else can signal them now, so they
        fail (``Cancelled``, scope process) and their importers wake."""
        for buf in list(client.buffers):
            self.release_buffer(self.reg.buffers.get(buf))
        gone = errors.Cancelled(f"client {client.name!r} is gone", scope="process")
        recs = self.reg.fence_recs
        owned = set(client.fences) | {h for h, r in recs.items() if r.client is client}
        for handle in owned:
            rec = recs.get(handle)
            if rec is not None and not rec.bound:
                self.failures.fail(gone, [handle], noted=0)  # its leaving is no runtime failure
            self.release_fence(handle)
        self._drop_imports_of(client)

    def _drop_imports_of(self, client: ClientRec) -> None:
        """Every import it held is released, its fence exports revoked (its fences are
        recycled once unreferenced; a token must not outlive them)."""
        for e in list(self.iommu.exports.values()):
            if e.owner is client and e.kind == "fence":
                self.iommu.revoke("fence", e.handle)
        for handle in self.iommu.imported_buffers(client):
            try:
                buf = self.reg.buffers.get(handle)
            except errors.InvalidHandle:
                continue
            buf.importers.pop(client.id, None)
            self.maybe_reclaim(buf)
        for handle in self.iommu.imported_fences(client):
            rec = self.reg.fence_recs.get(handle)
            if rec is not None and client.id in rec.importers:
                rec.importers = rec.importers - {client.id}
                self._unref_fence(rec)

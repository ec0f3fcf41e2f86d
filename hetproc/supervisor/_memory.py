"""Buffer memory: one pool per tenant, a segment of its own per exportable buffer.

Every buffer segment is anonymous (``ipc.Segment.anonymous_segment``, a memfd): it never
has a name in ``/dev/shm``, so no process can open it by name; the supervisor hands its
descriptor (SCM_RIGHTS) to exactly the processes that may map it -- the connections of
the tenant whose memory it is (in the reply to ``alloc``), an importer of an exported
buffer (in the reply to ``import``), and a device (on its segment socket, before the
first command that uses it; ``_devices``). A descriptor maps a whole segment, so a
segment holds only memory every holder may reach::

    tenant pool      (per client process)  buddy blocks of that tenant's buffers only
    own segment     (an exportable buffer) exactly one buffer, page-rounded: an importer
                                           maps that buffer and nothing beside it (as a
                                           dma-buf is one buffer)
    internal pool    (key 0)               the runtime's copies; handed to devices only

Records and packets name a segment by its id (``sid``, a small int never reused), not by
a name. The supervisor holds a segment by its descriptor alone -- one descriptor, of the
platform's budget (``room``, ``_descriptors``) -- and maps it only to read it itself (a
queue's ring, ``mapping``). A segment's memory goes when its last holder closes or dies:
the supervisor drops its own descriptor (and mapping) when the segment is empty (an own
segment when its buffer is reclaimed; a pool when its tenant left and its last block came
back) and tells the devices to drop theirs (``on_drop``); a client unmaps an own segment
when it frees the buffer, and a pool when it closes. The platform budget (``memory_mib``)
counts every tenant's blocks together; the pages kept for reuse in tenants' pools stay
within it too (``free``).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Callable
from typing import Any

from ipc import Block, BlockPool, Segment, block_size, errors

INTERNAL = 0  # the tenant key of the runtime's own buffers


def sid_of(block: Block) -> int:
    """The id of ``block``'s segment. Every segment here is anonymous (an ``int`` key: a
    named one would be mapped by anyone who guessed its name); a name is no block of ours."""
    key = block.segment
    if not isinstance(key, int):
        raise ValueError(f"{block} is not from this memory")
    return key


class Memory:
    """The supervisor's buffer memory; see the module docstring."""

    def __init__(self, prefix: str, *, budget: int,
                 room: Callable[[int, str], None] = lambda n, what: None,
                 on_drop: Callable[[int], None] = lambda sid: None) -> None:
        """``room(n, what)``: raises unless the platform's descriptors have room for ``n``
        more (``_descriptors``). A segment costs the supervisor one descriptor (its
        memfd: it is mapped here only if the supervisor reads it, a queue's ring)."""
        self.prefix = prefix
        self.budget = budget
        self.room = room
        self.on_drop = on_drop
        self.segments: dict[int, Segment] = {}     # sid -> every live buffer segment
        self.pools: dict[Any, BlockPool] = {}       # tenant key -> its pool
        self._pool_of: dict[int, BlockPool] = {}    # sid -> the pool it belongs to
        self._orphans: list[BlockPool] = []         # tenants gone, blocks still held
        self.own: dict[int, int] = {}               # sid -> bytes of an own segment
        self._mapped = 0  # live segments mapped here too (``mapping`` +1, ``_drop`` -1)
        self._sids = itertools.count(1)
        self.created = 0
        self.dropped = 0
        self._zeroed_gone = 0

    # -- figures (the names BlockPool has: metrics read either) -------------------------

    def _all_pools(self) -> list[BlockPool]:
        return list(self.pools.values()) + self._orphans

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes for p in self._all_pools()) + sum(self.own.values())

    @property
    def live_blocks(self) -> int:
        return sum(p.live_blocks for p in self._all_pools()) + len(self.own)

    @property
    def descriptors(self) -> int:
        """What the live segments cost the supervisor: one each, two if mapped here
        (only through ``mapping``: a queue's ring)."""
        return len(self.segments) + self._mapped

    @property
    def resident_bytes(self) -> int:
        """Pages the kernel holds for every buffer segment, in use or kept free."""
        return sum(os.fstat(seg.fd).st_blocks * 512 for seg in self.segments.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def zeroed_bytes(self) -> int:
        return self._zeroed_gone + sum(p.zeroed_bytes for p in self._all_pools())

    def largest_free_block(self) -> int:
        return max((p.largest_free_block() for p in self._all_pools()), default=0)

    def metrics(self) -> dict[str, int]:
        return {"segments": len(self.segments), "reserved_bytes": self.reserved_bytes,
                "used_bytes": self.used_bytes, "live_blocks": self.live_blocks,
                "largest_free_bytes": self.largest_free_block(),
                "resident_bytes": self.resident_bytes,
                "zeroed_bytes": self.zeroed_bytes, "tenant_pools": len(self.pools),
                "orphan_pools": len(self._orphans), "own_segments": len(self.own),
                "segments_created": self.created, "segments_dropped": self.dropped,
                "segment_descriptors": self.descriptors}

    # -- allocate / free -----------------------------------------------------------------

    def allocate(self, tenant: Any, nbytes: int, *, exportable: bool = False) -> Block:
        """A zero-filled block for ``tenant``; MemoryError past the budget. ``exportable``:
        in a segment of its own, exactly the block's size (page-rounded)."""
        page = mmap.PAGESIZE
        need = -(-max(nbytes, 1) // page) * page if exportable else block_size(nbytes)
        used = self.used_bytes
        if used + need > self.budget:
            raise MemoryError(f"memory budget of {self.budget} bytes: {used} in use, "
                              f"{need} more asked")
        if exportable:
            seg = self._new_segment("b", need)
            block = Block(seg.key, 0, need)
            self.own[sid_of(block)] = need
            return block
        pool = self.pools.get(tenant)
        if pool is None:
            pool = self.pools[tenant] = BlockPool(
                self.prefix, limit=self.budget,
                make_segment=lambda index, size: self._new_segment("p", size))
        block = pool.allocate(nbytes)
        self._pool_of[sid_of(block)] = pool
        return block

    def free(self, block: Block) -> None:
        """The block comes back (scrubbed, in a pool); an own segment is dropped."""
        sid = sid_of(block)
        if sid in self.own:
            del self.own[sid]
            self._drop(sid)
            return
        pool = self._pool_of.get(sid)
        if pool is None:
            raise ValueError(f"{block} is not from this memory")
        # A freed block keeps its pages (scrubbed) for its tenant's next allocation, while
        # the platform's pages stay within its budget: past it, they go back to the
        # kernel. Pages in use are within the budget, and so are those kept: together at
        # most twice the budget, however many tenants come and go.
        pool.free(block, release=self.resident_bytes > self.budget)
        if pool.live_blocks == 0 and pool in self._orphans:
            self._orphans.remove(pool)
            self._drop_pool(pool)

    def tenant_gone(self, tenant: Any) -> None:
        """The tenant's last connection closed: its pool goes once its blocks are back
        (commands a device may still run hold some until they retire)."""
        pool = self.pools.pop(tenant, None)
        if pool is None:
            return
        if pool.live_blocks == 0:
            self._drop_pool(pool)
        else:
            self._orphans.append(pool)

    def mapping(self, sid: int) -> mmap.mmap:
        """The supervisor's own mapping of segment ``sid`` (made on first use: one more
        descriptor, within the platform's budget)."""
        seg = self.segments[sid]
        if not seg.mapped:
            self.room(1, "map a segment")
            try:
                seg.map = mmap.mmap(seg.fd, seg.size)
            except OSError as exc:
                raise errors.DescriptorsExhausted(f"cannot map segment {sid}: {exc}",
                                                  detail={"limit": "descriptors"}) from None
            self._mapped += 1
        return seg.map

    def pool_of(self, sid: int) -> BlockPool | None:
        return self._pool_of.get(sid)

    # -- segments -------------------------------------------------------------------------

    def _new_segment(self, kind: str, size: int) -> Segment:
        self.room(1, f"make a buffer segment of {size} bytes")
        sid = next(self._sids)
        try:
            seg = Segment.anonymous_segment(f"{self.prefix}{kind}{sid}", size, sid,
                                            mapped=False)
        except OSError as exc:  # out of descriptors or memory: this request fails alone
            raise MemoryError(f"cannot make a buffer segment: {exc}") from None
        self.segments[sid] = seg
        self.created += 1
        return seg

    def _drop_pool(self, pool: BlockPool) -> None:
        self._zeroed_gone += pool.zeroed_bytes
        for key in list(pool.segments):
            if not isinstance(key, int):  # (never: the pool makes its segments here)
                raise ValueError(f"pool segment {key!r} is not from this memory")
            self._pool_of.pop(key, None)
            self._drop(key)
        pool.segments.clear()
        pool.close(unlink=False)

    def _drop(self, sid: int) -> None:
        seg = self.segments.pop(sid, None)
        if seg is None:
            return
        self._mapped -= seg.mapped
        seg.close()
        self.dropped += 1
        self.on_drop(sid)

    def close(self) -> None:
        for sid in list(self.segments):
            self.segments.pop(sid).close()
        self.pools.clear()
        self._orphans.clear()
        self._pool_of.clear()
        self.own.clear()
        self._mapped = 0

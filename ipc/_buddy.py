"""A binary buddy allocator over an address range: pure bookkeeping, no memory.

Why buddies: a pool of fixed size classes never lets freed memory serve another size, so
after 16 x 64 MiB came and went a 1 KiB request could fail with nothing in use. Here a
freed block merges with its buddy (the other half of the block they were split from)
whenever that buddy is free too, so the free space is always held in the largest aligned
blocks it can form. The guarantee the tests check: whenever every byte of some aligned
block of size ``2**k * min_block`` is free, a request of that size succeeds.

The range need not be a power of two: it is cut greedily into power-of-two *chunks*
(largest first), so each chunk starts at a multiple of its own size and blocks never cross
a chunk. ``BlockPool`` backs each chunk with one shared-memory segment.

Among free blocks of the size needed, the lowest address is taken (a lazily cleaned
heap per size): low memory fills first, which keeps high memory in large blocks.
"""

from __future__ import annotations

import bisect
import heapq


class BuddyAllocator:
    """Blocks of ``min_block * 2**order`` bytes, each aligned to its own size."""

    def __init__(self, total: int, min_block: int = 4096) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise ValueError("min_block must be a power of two")
        self.min_block = min_block
        self.total = total - total % min_block
        self.chunks: list[tuple[int, int]] = []  # (base, size), largest first
        base, left = 0, self.total
        while left >= min_block:
            size = 1 << (left.bit_length() - 1)
            self.chunks.append((base, size))
            base, left = base + size, left - size
        self._bases = [b for b, _ in self.chunks]
        top = max((s for _, s in self.chunks), default=min_block)
        self.max_order = self.order_of(top)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._heap: list[list[int]] = [[] for _ in range(self.max_order + 1)]
        self._live: dict[int, int] = {}  # address -> order
        self.used_bytes = 0
        for b, s in self.chunks:
            self._push(self.order_of(s), b)

    # -- sizes ------------------------------------------------------------------------

    def order_of(self, nbytes: int) -> int:
        """The smallest order whose blocks hold ``nbytes`` (at least one minimum block)."""
        units = max(1, -(-nbytes // self.min_block))
        return (units - 1).bit_length()

    def size_of_order(self, order: int) -> int:
        return self.min_block << order

    def chunk_of(self, address: int) -> tuple[int, int]:
        """The (index, base) of the chunk holding ``address``."""
        i = bisect.bisect_right(self._bases, address) - 1
        return i, self._bases[i]

    # -- allocate / free --------------------------------------------------------------

    def allocate(self, nbytes: int) -> int:
        """The address of a free block holding ``nbytes``; MemoryError when none is."""
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        want = self.order_of(nbytes)
        if want > self.max_order:
            raise MemoryError(f"{nbytes} bytes exceed the largest block this budget can hold "
                              f"({self.size_of_order(self.max_order)} bytes)")
        order = next((o for o in range(want, self.max_order + 1) if self._free[o]), None)
        if order is None:
            raise MemoryError(
                f"no free block of {self.size_of_order(want)} bytes "
                f"({self.free_bytes} of {self.total} bytes free, largest free block "
                f"{self.largest_free()} bytes)")
        address = self._pop_lowest(order)
        while order > want:  # split: keep the low half, the high half becomes free
            order -= 1
            self._push(order, address + self.size_of_order(order))
        self._live[address] = want
        self.used_bytes += self.size_of_order(want)
        return address

    def free(self, address: int) -> int:
        """Give a live block back, merging it with free buddies; returns its size."""
        order = self._live.pop(address, None)
        if order is None:
            raise ValueError(f"address {address:#x} is not a live block (double free?)")
        size = self.size_of_order(order)
        self.used_bytes -= size
        index, chunk_base = self.chunk_of(address)
        chunk_order = self.order_of(self.chunks[index][1])
        while order < chunk_order:
            buddy = chunk_base + ((address - chunk_base) ^ self.size_of_order(order))
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)  # its heap entry goes stale, skipped later
            address = min(address, buddy)
            order += 1
        self._push(order, address)
        return size

    def size_of(self, address: int) -> int:
        return self.size_of_order(self._live[address])

    def live_size(self, address: int) -> int:
        """The size of the live block at ``address``, 0 when there is none."""
        order = self._live.get(address)
        return 0 if order is None else self.size_of_order(order)

    # -- what is free -----------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self.total - self.used_bytes

    @property
    def live_blocks(self) -> int:
        return len(self._live)

    def largest_free(self) -> int:
        """The largest block a request could get right now (0 when nothing is free)."""
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return self.size_of_order(order)
        return 0

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as (address, size), sorted: for checks and reports."""
        return sorted((a, self.size_of_order(o)) for o, s in enumerate(self._free) for a in s)

    def live(self) -> list[tuple[int, int]]:
        return sorted((a, self.size_of_order(o)) for a, o in self._live.items())

    # -- the free lists ---------------------------------------------------------------

    def _push(self, order: int, address: int) -> None:
        self._free[order].add(address)
        heap = self._heap[order]
        heapq.heappush(heap, address)
        if len(heap) > 2 * len(self._free[order]) + 64:  # too many stale entries: rebuild
            heap[:] = sorted(self._free[order])

    def _pop_lowest(self, order: int) -> int:
        free, heap = self._free[order], self._heap[order]
        while True:
            address = heapq.heappop(heap)
            if address in free:
                free.discard(address)
                return address

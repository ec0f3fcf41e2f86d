"""The buddy allocator: freed memory serves any size, blocks never overlap, and a block
changes owner only zeroed (issue "every client is untrusted", invariant 7)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetproc
from ipc import BlockPool, BuddyAllocator, entries_with_prefix, new_prefix
from tests.helpers import wait_for

MiB = 1 << 20


# -- the regression of the old size-class pool, in the pool and through a platform -------

def test_freed_memory_serves_another_size():
    """Old pool: the 64 MiB blocks stayed in their size class, so with 0 bytes in use the
    1 KiB request failed and so did 512 MiB."""
    prefix = new_prefix()
    pool = BlockPool(prefix, limit=1024 * MiB)
    try:
        blocks = [pool.allocate(64 * MiB) for _ in range(16)]
        with pytest.raises(MemoryError):
            pool.allocate(1024)  # the budget is really full
        for b in blocks:
            pool.free(b)
        assert pool.used_bytes == 0 and pool.live_blocks == 0
        small = pool.allocate(1024)
        big = pool.allocate(512 * MiB)
        assert big.capacity == 512 * MiB and big.offset % (512 * MiB) == 0
        assert small.capacity == 4096 and pool.free_bytes == 512 * MiB - 4096
        assert pool.largest_free_block() == 256 * MiB
        assert len(pool.segments) == 1, "one budget, one segment, made once"
    finally:
        pool.close(unlink=True)
    assert entries_with_prefix(prefix) == []


def test_a_client_can_reuse_a_whole_budget_in_another_size():
    # The owner may hold the whole 1 GiB here (by default one tenant holds at most 3/4).
    with hetproc.Platform(time_scale=1.0, limits={"client_mib": 1024}) as plat:
        client = plat.client
        bufs = [client.alloc(64 * MiB, "uint8") for _ in range(16)]
        for b in bufs:
            b.free()
        assert client.metrics()["pool"]["used_bytes"] == 0
        small = client.alloc(1024, "uint8")
        big = client.alloc(512 * MiB, "uint8")
        assert big.nbytes == 512 * MiB
        small.free()
        big.free()


def test_double_free_and_foreign_blocks_are_refused():
    pool = BlockPool(new_prefix(), limit=8 * MiB)
    try:
        b = pool.allocate(10_000)
        pool.free(b)
        with pytest.raises(ValueError):
            pool.free(b)
        with pytest.raises(ValueError):
            pool.free(type(b)("hp.nowhere.", 0, 4096))
        assert pool.used_bytes == 0
    finally:
        pool.close(unlink=True)


# -- zeroing between owners, across processes -------------------------------------------

_READER = """
import sys, numpy as np, hetproc
c = hetproc.connect(sys.argv[1], "next-owner")
out = []
for n in map(int, sys.argv[2:]):
    b = c.alloc(n, "uint8")
    a = b.array()
    out.append(f"{b.segment}:{b.offset}:{int(np.count_nonzero(a))}")
print(" ".join(out), flush=True)
c.close()
"""


@pytest.mark.parametrize("nbytes", [64 * 1024, 16 * MiB], ids=["small", "scanned-for-holes"])
def test_the_next_owner_never_reads_the_previous_owners_bytes(platform, client, nbytes):
    """Client A fills a block and frees it. Another process never gets that block (each
    process has a pool of its own) and reads zeros; another connection of the same process
    gets the very same block and must read zeros too (small blocks are memset whole, large
    ones where they hold pages: both paths)."""
    secret = client.alloc(nbytes, "uint8")
    secret.array()[:] = 0xA5
    where = f"{secret.segment}:{secret.offset}"
    secret.free()
    out = subprocess.run([sys.executable, "-c", _READER, platform.prefix, str(nbytes)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seg, _off, nonzero = out.stdout.split()[0].split(":")
    assert seg != str(secret.segment), "another process got a block of this process's segment"
    assert int(nonzero) == 0, f"{nonzero} bytes of someone else were readable"
    other = platform.connect("next-owner")
    try:
        b = other.alloc(nbytes, "uint8")
        assert f"{b.segment}:{b.offset}" == where, "the next connection got the same block"
        assert not b.array().any(), "the previous owner's bytes were readable"
    finally:
        other.close()


def test_the_scrub_writes_only_pages_that_were_touched():
    """A hole in the shared object already reads as zeros: scrubbing it would allocate
    16 MiB nobody used. Only the two touched pages (and the small block) are written."""
    pool = BlockPool(new_prefix(), limit=64 * MiB)
    try:
        big, small = pool.allocate(16 * MiB), pool.allocate(5000)
        seg = pool.segments[big.segment]
        seg.view(big.offset + 4096, (10,), "uint8")[:] = 7
        seg.view(big.offset + 8 * MiB, (10,), "uint8")[:] = 9
        seg.view(small.offset, (10,), "uint8")[:] = 3
        pool.free(big)
        assert pool.zeroed_bytes == 2 * 4096
        pool.free(small)
        assert pool.zeroed_bytes == 2 * 4096 + 8192
        again = pool.allocate(32 * MiB)
        assert not seg.view(again.offset, (32 * MiB,), "uint8").any()
    finally:
        pool.close(unlink=True)


def test_a_block_reused_in_another_size_is_zeroed_too(client):
    """Two freed neighbours merge; the merged block handed out is zero everywhere."""
    a, b = client.alloc(8192, "uint8"), client.alloc(8192, "uint8")
    a.array()[:] = 1
    b.array()[:] = 2
    a.free()
    b.free()
    both = client.alloc(16384, "uint8")
    assert both.segment == a.segment and both.offset == min(a.offset, b.offset)
    assert not both.array().any()
    both.free()


# -- properties of the bookkeeping over random traces -------------------------------------

UNIT = 16  # min_block in the model: small numbers, same logic


def _largest_aligned_free(alloc: BuddyAllocator) -> int:
    """From the live blocks alone: the largest aligned block inside one chunk whose every
    byte is free. The coalescing property says the allocator can hand it out."""
    live = alloc.live()
    best = 0
    for base, size in alloc.chunks:
        block = size
        while block >= alloc.min_block and block > best:
            for start in range(base, base + size, block):
                if all(a + s <= start or a >= start + block for a, s in live):
                    best = block
                    break
            block //= 2
    return best


def _check_invariants(alloc: BuddyAllocator) -> None:
    live = alloc.live()
    free = alloc.free_blocks()
    spans = sorted(live + free)
    for (a, s), (b, _) in zip(spans, spans[1:]):
        assert a + s <= b, "two blocks overlap"
    assert sum(s for _, s in spans) == alloc.total, "live and free blocks tile the range"
    for a, s in spans:
        i, base = alloc.chunk_of(a)
        assert (a - base) % s == 0 and a + s <= base + alloc.chunks[i][1], "aligned, in a chunk"
    assert alloc.used_bytes == sum(s for _, s in live)
    assert alloc.free_bytes == alloc.total - alloc.used_bytes
    free_set = set(free)
    for a, s in free:  # fully coalesced: no free block has a free buddy of its size
        i, base = alloc.chunk_of(a)
        if s < alloc.chunks[i][1]:
            assert (base + ((a - base) ^ s), s) not in free_set, "free buddies left unmerged"
    assert alloc.largest_free() == _largest_aligned_free(alloc)


trace_steps = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(0, 40 * UNIT)),
              st.tuples(st.just("free"), st.integers(0, 1 << 30))),
    max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(total=st.integers(0, 100 * UNIT), steps=trace_steps)
def test_random_alloc_free_traces_keep_every_invariant(total, steps):
    alloc = BuddyAllocator(total, UNIT)
    held: list[int] = []
    for kind, n in steps:
        if kind == "alloc":
            fits = _largest_aligned_free(alloc) >= alloc.size_of_order(alloc.order_of(n))
            try:
                address = alloc.allocate(n)
            except MemoryError:
                assert not fits, f"{n} bytes fit an aligned free region but were refused"
            else:
                assert fits
                assert alloc.size_of(address) >= max(n, 1)
                held.append(address)
        elif held:
            alloc.free(held.pop(n % len(held)))
        _check_invariants(alloc)
    for address in held:
        alloc.free(address)
    assert alloc.used_bytes == 0 and alloc.largest_free() == max(
        (s for _, s in alloc.chunks), default=0), "everything merges back"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(1, 3 * MiB)), max_size=40))
def test_real_blocks_never_overlap_and_always_arrive_zeroed(steps):
    """The same traces over real shared memory: every block handed out reads as zeros
    though earlier owners filled theirs, and live blocks never share a byte."""
    pool = BlockPool(new_prefix(), limit=8 * MiB)
    held: list = []
    try:
        for i, (alloc, n) in enumerate(steps):
            if alloc or not held:
                try:
                    block = pool.allocate(n)
                except MemoryError:
                    continue
                view = pool.segments[block.segment].view(block.offset, (block.capacity,), "uint8")
                assert not view.any(), "a previous owner's bytes are visible"
                view[:] = i % 255 + 1
                del view
                held.append(block)
            else:
                pool.free(held.pop(n % len(held)))
            spans = sorted((b.segment, b.offset, b.capacity) for b in held)
            for (s1, o1, c1), (s2, o2, _) in zip(spans, spans[1:]):
                assert s1 != s2 or o1 + c1 <= o2, "two live blocks overlap"
    finally:
        pool.close(unlink=True)


def test_a_live_address_cannot_be_freed_twice():
    alloc = BuddyAllocator(1 << 20)
    a = alloc.allocate(5000)
    assert alloc.size_of(a) == 8192
    alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free(a)
    with pytest.raises(MemoryError):
        alloc.allocate(2 << 20)


def test_chunks_cover_a_budget_that_is_not_a_power_of_two():
    alloc = BuddyAllocator(1536 * MiB + 5)
    assert alloc.chunks == [(0, 1024 * MiB), (1024 * MiB, 512 * MiB)]
    a = alloc.allocate(600 * MiB)
    b = alloc.allocate(300 * MiB)
    assert (a, b) == (0, 1024 * MiB), "each in a chunk; never across one"


def test_a_device_cache_never_serves_the_previous_owners_bytes(platform, client):
    """npu0's cache is not coherent: a line it filled while reading the first owner's
    buffer must not be hit by the next owner of the block, even one whose context skips
    the invalidate before reads (the classic driver bug a careless tenant may choose)."""
    from device_workers import read_checksum
    a = client.alloc(4096, "uint8")
    a.array()[:] = 7
    out_a = client.alloc(8, "uint8")
    client.context("npu0").submit("checksum", [a], [out_a]).wait(5)
    assert read_checksum(out_a.array()) == 7 * 4096, "npu0 read (and cached) the first owner's data"
    where = (a.segment, a.offset)
    live = client.metrics()["pool"]["live_blocks"]
    a.free()
    assert wait_for(lambda: client.metrics()["pool"]["live_blocks"] == live - 1)
    other = platform.connect("next-owner")
    try:
        b = other.alloc(4096, "uint8")
        assert (b.segment, b.offset) == where, "the same block, a new owner"
        out_b = other.alloc(8, "uint8")
        careless = other.context("npu0", cache_maintenance="clean")
        careless.submit("checksum", [b], [out_b]).wait(5)
        assert read_checksum(out_b.array()) == 0, "the device served a stale line of the last owner"
    finally:
        other.close()

"""Shared-buffer memory: allocator fragmentation, and what scrubbing a block costs.

``alloc_fragmentation``
    A seeded random alloc/free trace (sizes log-uniform from 1 KiB to 64 MiB, frees of a
    random live block, the budget kept about 60-90 % used) over a 1 GiB budget, replayed
    on the buddy allocator (``ipc.BuddyAllocator``, what ``BlockPool`` uses) and on a
    model of the pool it replaced (power-of-two size classes, 4 MiB arenas, freed blocks
    reusable only by their own class). At checkpoints along the trace: the largest block
    a request could get now divided by the free bytes (1.0 = no fragmentation). The
    product row is the buddy's median ratio, the baseline the old pool's; target: the
    buddy at least as good (ratio of ratios >= 1). Requests refused along the way are
    counted for both. Pure bookkeeping: no memory is touched.
``scrub_cost``
    What ``BlockPool.free`` pays to zero a block before its next owner (``pwrite`` of
    zeros over the pages that hold data), per MiB, for 64 KiB, 1 MiB and 16 MiB blocks
    written in full by another process -- against a plain memset of private, already
    mapped memory in this process (the raw floor; no target: the scrub writes through the
    page cache of a shared object, which cannot be as cheap). Extra rows: freeing a 64 MiB
    block nobody wrote (the hole scan skips it), and the next owner's first write over a
    scrubbed block vs over fresh pages of a new segment, target <= 1x (why the scrub keeps
    pages instead of punching them out).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import statistics
import time

import numpy as np

from ipc import BlockPool, BuddyAllocator, Segment, new_prefix

from ._registry import benchmark, make_row

KIB, MIB = 1 << 10, 1 << 20
BUDGET = 1 << 30


# -- fragmentation ------------------------------------------------------------------------

class SizeClassPool:
    """The pool ``BuddyAllocator`` replaced, as bookkeeping: power-of-two classes; small
    ones carved from 4 MiB arenas, large ones a segment each; a freed block returns to
    its own class only; segments count against the budget for good."""

    ARENA = 4 * MIB

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserved = 0
        self.used = 0
        self.free: dict[int, int] = {}  # class size -> free blocks

    @staticmethod
    def size_of(nbytes: int) -> int:
        return max(4 * KIB, 1 << (max(nbytes, 1) - 1).bit_length())

    def allocate(self, nbytes: int) -> int:
        size = self.size_of(nbytes)
        if not self.free.get(size):
            seg = max(size, self.ARENA)
            if self.reserved + seg > self.limit:
                raise MemoryError
            self.reserved += seg
            self.free[size] = self.free.get(size, 0) + seg // size
        self.free[size] -= 1
        self.used += size
        return size

    def release(self, size: int) -> None:
        self.free[size] += 1
        self.used -= size

    def largest_free(self) -> int:
        fresh = self.limit - self.reserved
        grow = 1 << (fresh.bit_length() - 1) if fresh >= 4 * KIB else 0
        if grow < self.ARENA and fresh < self.ARENA:
            grow = 0  # an arena could not be made: no small class can grow either
        reuse = max((s for s, n in self.free.items() if n), default=0)
        return max(grow, reuse)


def _trace(seed: int, steps: int) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    lo, hi = math.log2(KIB), math.log2(64 * MIB)
    return [("alloc", 2 ** rng.uniform(lo, hi)) if rng.random() < 0.55 else ("free", rng.random())
            for _ in range(steps)]


def _replay(trace, allocate, release, free_bytes, largest) -> dict:
    live: list = []
    ratios, refused = [], 0
    for i, (kind, x) in enumerate(trace):
        if kind == "alloc":
            if free_bytes() < 0.1 * BUDGET:  # keep 60-90 % in use: free one first
                release(live.pop(int(x * 1e6) % len(live)))
            try:
                live.append(allocate(int(x)))
            except MemoryError:
                refused += 1
        elif live and free_bytes() < 0.4 * BUDGET:
            release(live.pop(int(x * len(live))))
        if i % 50 == 49 and free_bytes():
            ratios.append(largest() / free_bytes())
    return {"ratios": ratios, "refused": refused, "live_end": len(live)}


def fragmentation(seed: int, steps: int) -> dict:
    trace = _trace(seed, steps)
    buddy = BuddyAllocator(BUDGET)
    b = _replay(trace, buddy.allocate, buddy.free, lambda: buddy.free_bytes, buddy.largest_free)
    old = SizeClassPool(BUDGET)
    o = _replay(trace, old.allocate, old.release, lambda: old.limit - old.used, old.largest_free)
    return {"buddy": b, "size_class": o}


@benchmark("alloc_fragmentation")
def bench_fragmentation(quick: bool) -> dict:
    steps = 2000 if quick else 20000
    runs = [fragmentation(seed, steps) for seed in (1, 2, 3)]
    b = [r for run in runs for r in run["buddy"]["ratios"]]
    o = [r for run in runs for r in run["size_class"]["ratios"]]
    b_med, o_med = statistics.median(b), statistics.median(o)
    refused_b = sum(run["buddy"]["refused"] for run in runs)
    refused_o = sum(run["size_class"]["refused"] for run in runs)
    rows = [
        make_row("largest block / free bytes, median (buddy vs size classes)", None,
                 value=round(b_med, 3), baseline=round(o_med, 3), unit="ratio",
                 ratio=round(b_med / o_med, 2) if o_med else None, target=">= 1x",
                 ok=b_med >= o_med),
        make_row("largest block / free bytes, p10 (buddy vs size classes)", None,
                 value=round(_q(b, 0.1), 3), baseline=round(_q(o, 0.1), 3), unit="ratio"),
        make_row("requests refused over the trace (buddy vs size classes)", None,
                 value=refused_b, baseline=refused_o, unit="requests"),
    ]
    return {"rows": rows, "steps": steps, "seeds": 3, "checkpoints": len(b)}


def _q(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- scrubbing ----------------------------------------------------------------------------

def _writer(name: str, offset: int, nbytes: int) -> None:
    """Another process writes the block in full, as its owner would have."""
    seg = Segment.attach(name)
    seg.view(offset, (nbytes,), "uint8")[:] = 0x5A
    seg.close()


def _write_elsewhere(seg: Segment, offset: int, nbytes: int) -> None:
    proc = mp.get_context("fork").Process(target=_writer, args=(seg.name, offset, nbytes))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
        proc.join(5)
        raise RuntimeError("the writer process did not finish")


def _per_mib(ns: float, nbytes: int) -> float:
    return ns / 1e3 / (nbytes / MIB)


@benchmark("scrub_cost")
def bench_scrub(quick: bool) -> dict:
    reps = 3 if quick else 10
    pool = BlockPool(new_prefix(), limit=256 * MIB)
    rows, detail = [], {}
    try:
        for nbytes in (64 * KIB, MIB, 16 * MIB):
            scrub, floor = [], []
            private = np.ones(nbytes, np.uint8)
            for _ in range(reps):
                block = pool.allocate(nbytes)
                seg = pool.segments[block.segment]
                _write_elsewhere(seg, block.offset, nbytes)
                t0 = time.perf_counter_ns()
                pool.free(block)
                scrub.append(time.perf_counter_ns() - t0)
                t0 = time.perf_counter_ns()
                private.fill(0)
                floor.append(time.perf_counter_ns() - t0)
                private.fill(1)
            s, f = statistics.median(scrub), statistics.median(floor)
            detail[nbytes] = {"scrub_ns": scrub, "memset_ns": floor}
            rows.append(make_row(f"scrub per MiB, {nbytes // KIB} KiB block written by its owner",
                                 _per_mib(s, nbytes), _per_mib(f, nbytes),
                                 per_block_us=round(s / 1e3, 1)))
        rows.append(_first_touch(pool, reps))
    finally:
        pool.close(unlink=True)
    rows.append(_untouched(reps))
    return {"rows": rows, "samples": detail}


def _untouched(reps: int) -> dict:
    """A block nobody wrote, in a fresh pool: the hole scan finds no data, writes nothing."""
    pool = BlockPool(new_prefix(), limit=128 * MIB)
    times = []
    try:
        for _ in range(reps):
            block = pool.allocate(64 * MIB)
            t0 = time.perf_counter_ns()
            pool.free(block)
            times.append(time.perf_counter_ns() - t0)
        assert pool.zeroed_bytes == 0, "a hole was written"
    finally:
        pool.close(unlink=True)
    return make_row("scrub per MiB, 64 MiB block never written (holes skipped)",
                    _per_mib(statistics.median(times), 64 * MIB),
                    per_block_us=round(statistics.median(times) / 1e3, 1))


def _first_touch(pool: BlockPool, reps: int) -> dict:
    """The next owner's first write over 16 MiB: scrubbed pages vs fresh zero pages."""
    nbytes = 16 * MIB
    reused, fresh = [], []
    for i in range(reps):
        block = pool.allocate(nbytes)
        seg = pool.segments[block.segment]
        _write_elsewhere(seg, block.offset, nbytes)
        pool.free(block)  # scrubbed: pages kept, zero
        block = pool.allocate(nbytes)
        view = seg.view(block.offset, (nbytes,), "uint8")
        t0 = time.perf_counter_ns()
        view[:] = 1
        reused.append(time.perf_counter_ns() - t0)
        del view
        pool.free(block)
        other = Segment.create(new_prefix() + f"fresh{i}", nbytes)
        try:
            view = other.view(0, (nbytes,), "uint8")
            t0 = time.perf_counter_ns()
            view[:] = 1
            fresh.append(time.perf_counter_ns() - t0)
            del view
        finally:
            other.close()
            other.unlink()
    return make_row("next owner's first write per MiB: scrubbed block vs fresh pages",
                    _per_mib(statistics.median(reused), nbytes),
                    _per_mib(statistics.median(fresh), nbytes), target="<= 1x")

"""Invariant 1 for caches: a block is reused only after every device dropped its lines."""

from __future__ import annotations

import time


def test_a_dirty_cache_line_of_a_freed_buffer_never_reaches_the_blocks_next_owner(platform):
    a, b = platform.client, platform.connect("B")
    try:
        npu = a.context("npu0")
        x = a.alloc(256)
        x.array()[:] = 5
        y = a.alloc(256, align=64)  # npu0 needs 128: the runtime copies via its own buffer
        npu.submit("relu", [x], [y]).wait(5)
        assert a.metrics()["handoff"]["copies"] >= 1
        time.sleep(0.05)
        z = b.alloc(256)
        z.array()[:] = 7
        for t in [a.alloc(96 * 1024) for _ in range(4)]:  # fill npu0's cache: evictions
            t.array()[:] = 1
            npu.submit("relu", [t], [t]).wait(5)
        assert (z.array() == 7).all(), "a stale line was written back over B's buffer"
    finally:
        b.close()

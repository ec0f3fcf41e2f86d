"""BufferPool (seed §17): a buffer comes back only when every release fence completed."""

from __future__ import annotations

import time

import pytest

import hetproc


def test_a_pool_buffer_is_never_handed_out_while_a_release_fence_is_pending(client):
    pool = hetproc.BufferPool(client, 2, (16,), "uint8")
    try:
        a, b = pool.acquire(), pool.acquire()
        assert a is not b
        with pytest.raises(hetproc.ResourceError):
            pool.acquire(timeout=0.01)  # nothing released: no fence could free one
        gate_a, gate_b1, gate_b2 = client.fence(), client.fence(), client.fence()
        pool.release(a, [gate_a])
        pool.release(b, [gate_b1, gate_b2])
        with pytest.raises(hetproc.FenceTimeout):
            pool.acquire(timeout=0.02)
        gate_b1.signal()
        with pytest.raises(hetproc.FenceTimeout):
            pool.acquire(timeout=0.02)  # b still waits for its second consumer
        assert pool.pending_fences(b) == [gate_b2]
        gate_a.signal(hetproc.DeviceTimeout)  # a failed consumer is done with it too
        assert pool.acquire(timeout=1.0) is a
        gate_b2.signal()
        assert pool.acquire(timeout=1.0) is b
        st = pool.statistics()
        assert (st.free, st.pending, st.in_use, st.acquired, st.recycled) == (0, 0, 2, 4, 2)
        with pytest.raises(hetproc.InvalidRequest):
            pool.release(client.alloc(16, "uint8"))
    finally:
        pool.close()


def test_a_pool_waits_for_the_device_that_still_reads_the_buffer(platform, client):
    app = platform.connect("app")
    try:
        pool = hetproc.BufferPool(client, 1, (64,), "uint8")
        buf = pool.acquire()
        shared = app.import_buffer(buf.export(read_only=True))
        done = app.context("npu0").submit("work", [shared], [], ms=80)
        release = client.import_fence(done.export())
        pool.release(buf, [release])
        again = pool.acquire(timeout=5.0)
        t_back = time.monotonic_ns()
        assert again is buf and done.done()
        assert client.fences.info(done.handle)["t_ns"] <= t_back
        assert pool.statistics().waited == 1
        pool.release(again)
        pool.close()
        shared.free()
    finally:
        app.close()

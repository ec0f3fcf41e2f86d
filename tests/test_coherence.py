"""Non-coherent caches: the stale read happens without maintenance and not with it.

npu0 is non-coherent on the default platform (it reads and writes through a private copy
in its own process); gpu0 and cpu0 are coherent. The emulated cache itself is tested
in-process at the end, against a plain shared-memory segment.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import hetproc
from device_workers._cache import DeviceMemory
from ipc import Segment, SegmentCache, errors


def _sorted(events, cid):
    return sorted((e for e in events if e["cid"] == cid), key=lambda e: (e["t0"], e["t1"]))


def test_a_missing_invalidate_reads_stale_data_and_the_maintenance_fixes_it(client):
    buggy = client.context("npu0", cache_maintenance="clean")  # never invalidates
    x, y1, y2, y3 = (client.alloc(256) for _ in range(4))
    x.array()[:] = 1.0
    buggy.submit("copy", [x], [y1]).wait(5)  # npu0 now holds x in its cache
    assert (y1.array() == 1.0).all()
    x.array()[:] = 2.0  # the CPU writes x behind the NPU's back
    buggy.submit("copy", [x], [y2]).wait(5)
    assert (y2.array() == 1.0).all(), "the stale read: npu0 used its cached copy of x"
    fixed = client.context("npu0")  # default: invalidate before reading, clean after
    f = fixed.submit("copy", [x], [y3])
    f.wait(5)
    assert (y3.array() == 2.0).all()
    steps = [e["kind"] for e in _sorted(client.memory_events(cids=[f.cid])["events"], f.cid)]
    assert steps == ["map", "invalidate", "exec", "clean", "unmap"]


def test_a_missing_clean_hides_the_write_from_the_next_device(client):
    x = client.alloc(256)
    x.array()[:] = np.linspace(-1, 1, 256, dtype=np.float32)
    gpu = client.context("gpu0")

    def npu_then_gpu(npu):
        y, z = client.alloc(256), client.alloc(256)
        f1 = npu.submit("relu", [x], [y])
        f2 = gpu.submit("copy", [y], [z], wait=[f1])
        f2.wait(5)
        return f1, f2, z.array().copy()

    _, _, stale = npu_then_gpu(client.context("npu0", cache_maintenance="invalidate"))
    assert (stale == 0).all(), "npu0's result never left its cache: the GPU read old memory"
    f1, f2, fresh = npu_then_gpu(client.context("npu0"))
    np.testing.assert_array_equal(fresh, np.maximum(x.array(), 0))
    ev = client.memory_events(cids=[f1.cid, f2.cid])["events"]
    clean = next(e for e in ev if e["kind"] == "clean" and e["cid"] == f1.cid)
    gpu_exec = next(e for e in ev if e["kind"] == "exec" and e["cid"] == f2.cid)
    assert clean["t1"] <= gpu_exec["t0"], "the write-back came before the consumer ran"


def test_without_any_maintenance_both_directions_go_stale(client):
    raw = client.context("npu0", cache_maintenance=False)
    x, y = client.alloc(256), client.alloc(256)
    x.array()[:] = 1.0
    raw.submit("copy", [x], [y]).wait(5)
    assert (y.array() == 0).all()
    with pytest.raises(hetproc.InvalidRequest):
        client.context("npu0", cache_maintenance="sometimes")


def test_maintenance_is_counted_with_its_cost_and_only_where_needed(client):
    x, y = client.alloc(1 << 16), client.alloc(1 << 16)
    before = client.metrics()["cache"]
    client.context("gpu0").submit("copy", [x], [y]).wait(5)  # coherent: nothing to do
    client.context("cpu0").submit("copy", [y], [x]).wait(5)
    client.ping()
    mid = client.metrics()["cache"]
    assert (mid["invalidates"], mid["cleans"]) == (before["invalidates"], before["cleans"])
    f = client.context("npu0").submit("copy", [x], [y])
    f.wait(5)
    client.memory_events(cids=[f.cid])  # until the supervisor read the record
    after = client.metrics()["cache"]
    assert after["invalidates"] == mid["invalidates"] + 1
    assert after["cleans"] == mid["cleans"] + 1
    assert after["invalidate_bytes"] - mid["invalidate_bytes"] == x.nbytes
    assert after["maintenance_us"] > mid["maintenance_us"]
    assert after["by_device"]["npu0"]["cleans"] >= 1 and "gpu0" not in after["by_device"]


# -- the emulated cache, in one process ------------------------------------------------------


@pytest.fixture
def segment():
    seg = Segment.create(f"hpt5.{os.getpid()}.cache", 1 << 16)
    cache = SegmentCache()
    cache.add(seg)
    try:
        yield seg, cache
    finally:
        cache.close()
        seg.unlink()


def _desc(seg, offset, shape, perm="rw", strides=None, dtype="uint8"):
    return [seg.name, offset, list(shape), dtype, strides, perm, 1]


def _cmd(ins=(), outs=(), inv=(), clean=()):
    return {"ins": list(ins), "outs": list(outs),
            "mem": {"inv": [[i, 0] for i in inv], "clean": [[j, 0] for j in clean]}}


def test_cache_reads_stay_stale_until_invalidated(segment):
    seg, segs = segment
    shared = seg.view(0, (64,), "uint8")
    shared[:] = 1
    mem = DeviceMemory(segs, coherent=False, cache_bytes=4096)
    (a,), _ = mem.acquire(_cmd(ins=[_desc(seg, 0, (64,))]), lambda: None)
    assert (a == 1).all()
    mem.release({}, lambda: None)
    mem.report()
    shared[:] = 2
    (a,), _ = mem.acquire(_cmd(ins=[_desc(seg, 0, (64,))]), lambda: None)
    assert (a == 1).all() and mem.stats["hits"] == 1
    mem.report()
    (a,), _ = mem.acquire(_cmd(ins=[_desc(seg, 0, (64,))], inv=[0]), lambda: None)
    assert (a == 2).all()
    assert [e[0] for e in mem.report()["ev"]] == ["invalidate"]


def test_cache_writes_reach_memory_on_clean_or_eviction_and_spare_the_padding(segment):
    seg, segs = segment
    pitch = seg.view(0, (4, 16), "uint8")
    pitch[:] = 9  # the padding bytes (columns 8..15) belong to someone else
    mem = DeviceMemory(segs, coherent=False, cache_bytes=128)
    desc = _desc(seg, 0, (4, 8), strides=[16, 1])
    _, (o,) = mem.acquire(_cmd(outs=[desc]), lambda: None)
    o[:] = 5
    mem.release({}, lambda: None)
    assert (pitch[:, :8] == 9).all(), "dirty in the cache, not in memory"
    mem.report()
    _, (o,) = mem.acquire(_cmd(outs=[desc], clean=[0]), lambda: None)
    mem.release(_cmd(outs=[desc], clean=[0]), lambda: None)
    assert (pitch[:, :8] == 5).all() and (pitch[:, 8:] == 9).all()
    mem.report()
    other = _desc(seg, 4096, (64,))
    _, (o2,) = mem.acquire(_cmd(outs=[other]), lambda: None)
    o2[:] = 7
    mem.release({}, lambda: None)
    mem.report()
    big = _desc(seg, 8192, (128,))  # evicts the dirty line, which is written back
    mem.acquire(_cmd(ins=[big]), lambda: None)
    assert (seg.view(4096, (64,), "uint8") == 7).all() and mem.stats["writebacks"] >= 2


def test_cache_refuses_an_access_the_descriptor_does_not_grant(segment):
    seg, segs = segment
    mem = DeviceMemory(segs, coherent=True, cache_bytes=0)
    with pytest.raises(errors.IommuFault, match="grants 'r'"):
        mem.acquire(_cmd(outs=[_desc(seg, 0, (8,), perm="r")]), lambda: None)
    with pytest.raises(errors.IommuFault):
        mem.acquire(_cmd(ins=[_desc(seg, 0, (8,))[:5]]), lambda: None)  # no mapping at all
    (a,), _ = mem.acquire(_cmd(ins=[_desc(seg, 0, (8,), perm="r")]), lambda: None)
    with pytest.raises(ValueError):
        a[0] = 1  # a read-only mapping is a read-only view

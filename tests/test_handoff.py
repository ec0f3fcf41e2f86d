"""Zero-copy preconditions (seed §5): shared when they hold, a visible copy when not.

npu0 takes dense NHWC int8/uint8/float32 at 128-byte alignment; gpu0 takes strides whose
row pitch is a multiple of 64, NHWC and NCHW. Every inserted copy must show in the
metrics, the DDR counters and the memory timeline, and must not change the result.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import hetproc
from device_workers._kernels import checksum_of, read_checksum
from tests.helpers import wait_for


def _timeline(client, *fences):
    ev = client.memory_events(cids=[f.cid for f in fences])["events"]
    return sorted(ev, key=lambda e: (e["t0"], e["t1"]))


def test_a_hand_off_that_meets_every_precondition_is_zero_copy(client):
    cpu, npu = client.context("cpu0"), client.context("npu0")
    x, out = client.alloc((1, 16, 16, 3), "uint8", layout="NHWC"), client.alloc(8, "uint8")
    f1 = cpu.submit("fill", [], [x], params={"value": 9})
    f2 = npu.submit("checksum", [x], [out], wait=[f1])
    f2.wait(5)
    assert read_checksum(out.array()) == 9 * x.nbytes
    ev = _timeline(client, f1, f2)
    assert not [e for e in ev if e["kind"] in ("copy", "reformat")]
    wrote = next(e for e in ev if e["kind"] == "exec" and e["cid"] == f1.cid)["ids"][0]
    read = next(e for e in ev if e["kind"] == "exec" and e["cid"] == f2.cid)["ids"][0]
    mine = x.identity()
    for seen in (wrote, read):  # the same physical buffer at producer and consumer
        assert (seen["segment"], seen["inode"], seen["offset"], seen["buf"]) == \
            (mine["segment"], mine["inode"], mine["offset"], mine["buf"])
    m = client.metrics()
    assert m["handoff"]["copies"] == m["handoff"]["reformats"] == 0


def test_a_padded_stride_the_npu_cannot_take_becomes_a_visible_copy(client):
    pitch = 64 * 3 + 64
    frame = client.alloc((1, 8, 64, 3), "uint8", strides=(8 * pitch, pitch, 3, 1))
    frame.array()[...] = (np.arange(8 * 64 * 3) % 251).reshape(1, 8, 64, 3)
    out_npu, out_gpu = client.alloc(8, "uint8"), client.alloc(8, "uint8")
    before = client.metrics()
    f_npu = client.context("npu0").submit("checksum", [frame], [out_npu])
    f_gpu = client.context("gpu0").submit("checksum", [frame], [out_gpu])  # pitch % 64 == 0
    f_npu.wait(5)
    f_gpu.wait(5)
    expected = checksum_of(frame.array())
    assert read_checksum(out_npu.array()) == read_checksum(out_gpu.array()) == expected
    ev = _timeline(client, f_npu, f_gpu)
    npu_steps = [e for e in ev if e["cid"] == f_npu.cid and e["kind"] in ("copy", "exec")]
    assert [e["kind"] for e in npu_steps] == ["copy", "exec"], "copy, then the kernel"
    assert npu_steps[0]["reasons"] == ["stride"] and npu_steps[0]["device"] == "npu0"
    assert npu_steps[0]["t1"] <= npu_steps[1]["t0"]
    assert not [e for e in ev if e["cid"] == f_gpu.cid and e["kind"] == "copy"]
    after = client.metrics()
    assert after["handoff"]["copies"] - before["handoff"]["copies"] == 1
    assert after["handoff"]["by_reason"]["stride"] == 1
    dense = 8 * 64 * 3
    assert after["ddr"]["copy_bytes"] - before["ddr"]["copy_bytes"] == frame.nbytes + dense
    assert wait_for(lambda: client.metrics()["handoff"]["internal_buffers"] == 0)


def test_a_layout_the_npu_does_not_read_is_reformatted_in_and_out(client):
    npu = client.context("npu0")
    x = client.alloc((1, 3, 4, 5), "float32", layout="NCHW")
    y = client.alloc((1, 3, 4, 5), "float32", layout="NCHW")
    x.array()[...] = np.random.default_rng(5).standard_normal((1, 3, 4, 5))
    f = npu.submit("relu", [x], [y])
    f.wait(5)
    np.testing.assert_array_equal(y.array(), np.maximum(x.array(), 0))
    steps = [e["kind"] for e in _timeline(client, f) if e["kind"] in ("reformat", "exec")]
    assert steps == ["reformat", "exec", "reformat"]
    gpu_f = client.context("gpu0").submit("relu", [x], [y])  # the GPU reads NCHW itself
    gpu_f.wait(5)
    assert not [e for e in _timeline(client, gpu_f) if e["kind"] == "reformat"]
    assert client.metrics()["handoff"]["by_reason"] == {"layout": 2}


def test_alignment_usage_and_dtype_are_preconditions_too(client):
    npu, gpu = client.context("npu0"), client.context("gpu0")
    odd = client.alloc(256, "uint8", align=64)  # npu0 wants 128
    assert odd.offset % 128 == 64
    odd.array()[:] = 3
    camera_only = client.alloc(256, "uint8", usage=["isp", "gpu"])
    camera_only.array()[:] = 4
    small = client.alloc(256, "int8")  # gpu0 reads no int8: widened to float32
    small.array()[:] = -5
    out, wide = client.alloc(8, "uint8"), client.alloc(256, "float32")
    npu.submit("checksum", [odd], [out]).wait(5)
    assert read_checksum(out.array()) == 3 * 256
    npu.submit("checksum", [camera_only], [out]).wait(5)
    assert read_checksum(out.array()) == 4 * 256
    gpu.submit("copy", [small], [wide]).wait(5)
    assert (wide.array() == -5.0).all()
    client.ping()
    assert wait_for(lambda: client.metrics()["handoff"]["by_reason"] ==
                    {"alignment": 1, "usage": 1, "dtype": 1})
    with pytest.raises(hetproc.DtypeError):  # a narrowing is never silent: refused
        npu.submit("relu", [client.alloc(4, "float64")], [client.alloc(4, "float64")])
    with pytest.raises(hetproc.DtypeError):  # nor is an output the device cannot write
        gpu.submit("copy", [wide], [small])


def test_a_refused_batch_takes_no_internal_buffers_or_fences(client):
    npu = client.context("npu0")
    strided = client.alloc((4, 8), "float32", strides=(64, 4))
    ok, bad = client.alloc((4, 8), "float32"), client.alloc((5, 5), "float32")
    before = client.metrics()
    with pytest.raises(hetproc.ShapeError):
        npu.submit_many([hetproc.command("relu", [strided], [ok]),
                         hetproc.command("add", [ok, bad], [ok])])
    after = client.metrics()
    assert after["registered_buffers"] == before["registered_buffers"]
    assert after["live_fences"] == before["live_fences"] and after["submitted"] == 0
    with pytest.raises(hetproc.ShapeError):
        npu.submit_nowait("add", [ok, bad], [ok]).wait(5)


def test_a_device_crash_mid_chain_fails_it_and_frees_the_internal_buffers(client):
    npu = client.context("npu0")
    strided = client.alloc((4, 8), "float32", strides=(64, 4))
    y = client.alloc((4, 8), "float32")
    blocks = client.metrics()["pool"]["live_blocks"]
    f = npu.submit("relu", [strided], [y], ms=2000)
    assert wait_for(lambda: client.metrics()["devices"]["npu0"]["state"] == "busy")
    os.kill(client.metrics()["devices"]["npu0"]["pid"], signal.SIGKILL)
    with pytest.raises(hetproc.DeviceFault):
        f.wait(5)
    assert wait_for(lambda: client.metrics()["pool"]["live_blocks"] == blocks)
    assert client.metrics()["handoff"]["internal_buffers"] == 0
    with pytest.raises(hetproc.ContextLost):
        npu.submit("relu", [strided], [y])  # the crash took the context with it
    assert client.context("npu0").submit("relu", [strided], [y]).wait(5) is None


def test_a_burst_of_commands_with_memory_reports_completes_without_a_device_reset(client):
    # Completion records are batched per ring slot; memory reports make them bigger, and a
    # batch that no longer fit its slot once killed the device (found by a 300-command burst).
    cpu = client.context("cpu0")
    a, b = client.alloc((1, 64, 64, 3)), client.alloc((1, 64, 64, 3))
    fences = [cpu.submit_nowait("scale", [a], [b], params={"factor": 2.0}, ms=0)
              for _ in range(300)]
    for f in fences:
        f.wait(10)
    dev = client.metrics()["devices"]["cpu0"]
    assert dev["restarts"] == 0 and dev["failed"] == 0


def test_completion_batches_are_split_to_fit_a_ring_slot():
    from device_workers import decode_completions
    from device_workers._outbox import payloads as _payloads
    base = {"epoch": 1, "code": 0, "msg": "", "t_start": 1, "t_end": 2}
    records = [{**base, "seq": i,
                "mem": {"ids": [["i", 1 << 62, 1, 2, 3]] * 8}} for i in range(40)]
    payloads = _payloads(records, 2000)
    assert len(payloads) > 1 and all(len(p) <= 2000 for p in payloads)
    assert [r["seq"] for p in payloads for r in decode_completions(p)] == list(range(40))
    big = ["i", 1 << 63, 1 << 63, 1 << 40, 1 << 63]  # segment ids are ints: 39 bytes each
    (alone,) = _payloads([{**base, "seq": 7, "mem": {"ids": [big] * 60}}], 2000)
    assert decode_completions(alone) == [{**base, "seq": 7}], "the outcome survives"

"""The platform across real processes: order, errors, handles, isolation, cleanup.

Tests that only submit and wait, each through a ``tenant`` of its own, share one platform
(``shared_platform``); those that kill, crash, stop or count a platform's whole state
start their own."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import psutil
import pytest

import hetproc
from ipc import cleanup_dead, entries_with_prefix
from tests.helpers import wait_for


def test_fences_order_a_chain_across_three_devices(tenant):
    cpu, npu, gpu = (tenant.context(d) for d in ("cpu0", "npu0", "gpu0"))
    x, a, b, y = (tenant.alloc((64, 64)) for _ in range(4))
    x.array()[:] = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) - 2000
    # Each stage holds longer than the previous hand-off, so a stage that ran without
    # waiting would read zeros and the result would be wrong.
    f1 = cpu.submit("scale", [x], [a], params={"factor": 2.0}, ms=20)
    f2 = npu.submit("relu", [a], [b], wait=[f1], ms=5)
    f3 = gpu.submit("scale", [b], [y], wait=[f2], params={"factor": 0.25}, ms=5)
    f3.wait(5)
    t = [tenant.fences.info(f.handle)["t_ns"] for f in (f1, f2, f3)]
    assert t[0] < t[1] < t[2], "signals happen in dependency order"
    np.testing.assert_allclose(y.array(), 0.25 * np.maximum(2 * x.array(), 0))


def test_user_fence_gates_a_device_and_many_waiters_wake(tenant):
    gate = tenant.fence()
    npu = tenant.context("npu0")
    out = tenant.alloc(16)
    done = npu.submit("fill", [], [out], wait=[gate], params={"value": 7.0}, ms=0) \
        if "fill" in tenant.info["spec"]["devices"][1]["ops"] else \
        npu.submit("work", [], [out], wait=[gate], ms=0)
    time.sleep(0.05)
    assert not done.done(), "the device must wait for the gate"
    gate.signal()
    done.wait(5)


def test_wait_timeout_leaves_the_command_running(tenant):
    f = tenant.context("dsp0").submit("work", ms=300)
    with pytest.raises(hetproc.FenceTimeout):
        f.wait(0.02)
    f.wait(5)  # it still completes


def test_error_propagates_to_dependants(tenant):
    gate = tenant.fence()
    npu, gpu = tenant.context("npu0"), tenant.context("gpu0")
    f2 = npu.submit("work", wait=[gate], ms=1)
    f3 = gpu.submit("work", wait=[f2], ms=1)
    gate.signal(hetproc.DeviceTimeout)
    with pytest.raises(hetproc.DependencyFailed) as e2:
        f2.wait(5)
    with pytest.raises(hetproc.DependencyFailed) as e3:
        f3.wait(5)
    assert e2.value.correlation_id == f2.cid and e3.value.correlation_id == f3.cid
    assert tenant.context("npu0").submit("work", ms=0).wait(5) is None, "devices live on"


def test_bad_requests_are_refused_and_nothing_runs(tenant):
    submitted = tenant.metrics()["submitted"]
    npu = tenant.context("npu0")
    a, b = tenant.alloc((4, 4)), tenant.alloc((5, 5))
    i64 = tenant.alloc((4, 4), "int64")
    with pytest.raises(hetproc.UnsupportedOp):
        npu.submit("resize", [a], [b])
    with pytest.raises(hetproc.ShapeError):
        npu.submit("add", [a, b], [a])
    with pytest.raises(hetproc.DtypeError):
        npu.submit("relu", [i64], [i64])
    with pytest.raises(hetproc.ShapeError):
        tenant.alloc((0, 4))
    with pytest.raises(hetproc.DtypeError):
        tenant.alloc((4,), "complex64")
    with pytest.raises(hetproc.InvalidRequest):
        tenant.context("tpu9")
    m = tenant.metrics()
    assert m["submitted"] == submitted and m["in_flight"] == 0


def test_a_refused_nowait_submit_fails_its_fence(tenant):
    a, b = tenant.alloc((4, 4)), tenant.alloc((5, 5))
    f = tenant.context("npu0").submit_nowait("add", [a, b], [a])
    with pytest.raises(hetproc.ShapeError):
        f.wait(5)


def test_stale_foreign_and_invalid_handles(platform, client):
    npu = client.context("npu0")
    buf = client.alloc(8)
    buf.free()
    with pytest.raises(hetproc.StaleHandle):
        npu.submit("relu", [buf], [buf])
    other = platform.connect("other")
    try:
        theirs = other.alloc(8)
        theirs.array()[:] = 3
        mine = client.alloc(8)
        with pytest.raises(hetproc.ForeignHandle):
            npu.submit("copy", [theirs], [mine])
        with pytest.raises(hetproc.ForeignHandle):
            npu.submit("copy", [mine], [theirs])
        assert (theirs.array() == 3).all(), "the owner's data is unchanged"
        their_fence = other.fence()
        with pytest.raises(hetproc.ForeignHandle):
            npu.submit("work", wait=[their_fence])
    finally:
        other.close()
    fake = hetproc.Fence(client, (7 << 32) | 5000)
    with pytest.raises(hetproc.InvalidHandle):
        npu.submit("work", wait=[fake])
    f = npu.submit("work", ms=0)
    f.wait(5)
    f.release()
    client.ping()  # flushes the release
    with pytest.raises(hetproc.StaleHandle):
        npu.submit("work", wait=[f])


def _raw_request(address, payload: bytes) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(address)
    s.sendall(struct.pack("<I", len(payload)) + payload)
    n = struct.unpack("<I", s.recv(4))[0]
    data = b""
    while len(data) < n:
        data += s.recv(n - len(data))
    s.close()
    return msgpack.unpackb(data)


@pytest.mark.parametrize("payload, expect", [
    (b"\xc1\xc1", "undecodable"),
    (msgpack.packb({"v": 1, "op": "hello", "id": 1}), "missing field"),
    (msgpack.packb({"v": 7, "op": "hello", "id": 1, "name": "x", "pid": 1}), "version"),
    (msgpack.packb({"v": 1, "op": "explode", "id": 1}), "unknown packet op"),
    (msgpack.packb({"v": 1, "op": "submit", "id": 1, "ctx": 1, "cmds": []}), "say hello first"),
])
def test_malformed_packets_get_an_error_and_the_supervisor_lives(platform, client, payload, expect):
    reply = _raw_request(platform.address, payload)
    assert reply["ok"] is False and expect in reply["error"]["message"]
    client.ping()


def test_a_corrupt_stream_drops_only_that_client(platform, client):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(platform.address)
    s.sendall(struct.pack("<I", 1 << 30))  # a frame length no packet may have
    assert s.recv(4), "it gets an error answer"
    s.close()
    assert client.context("cpu0").submit("work", ms=0).wait(5) is None


def test_malformed_command_in_a_device_ring_is_survived(platform, client):
    from ipc import Ring, Segment
    seg = Segment.attach(platform.prefix + "ring.gpu0")
    half = Ring.nbytes(256, 2048)
    ring = Ring(memoryview(seg.map)[:half], slots=256, slot_bytes=2048, create=False)
    ring.try_put(b"\x93not a command")
    ring.try_put(msgpack.packb({"v": 1, "op": "exec", "seq": "x"}))
    # No doorbell: the device sees them on its next wake-up, with the next real command.
    assert client.context("gpu0").submit("work", ms=0).wait(5) is None
    m = wait_for(lambda: (client.metrics()["last_error"] or {}).get("name") == "BadPacket")
    assert m
    assert client.metrics()["devices"]["gpu0"]["restarts"] == 0


def test_metrics_count_what_is_live(client):
    before = client.metrics()
    ctx = client.context("cpu0")
    bufs = [client.alloc(1024) for _ in range(3)]
    m = client.metrics()
    assert m["contexts"] == before["contexts"] + 1
    assert m["registered_buffers"] == before["registered_buffers"] + 3
    assert set(m["queue_depth"]) == {"cpu0", "npu0", "gpu0", "dsp0", "isp0"}
    for b in bufs:
        b.free()
    ctx.close()
    after = client.metrics()
    assert after["registered_buffers"] == before["registered_buffers"]
    assert after["contexts"] == before["contexts"]


def test_a_buffer_freed_while_in_use_is_reclaimed_only_after_the_command(client):
    ctx = client.context("npu0")
    a = client.alloc(1 << 16)
    f = ctx.submit("work", [a], [], ms=100)
    a.free()
    m = client.metrics()
    assert m["registered_buffers"] >= 1 and m["pool"]["live_blocks"] >= 1, \
        "still held by the command"
    f.wait(5)
    assert wait_for(lambda: client.metrics()["pool"]["live_blocks"] == 0)


def test_two_platforms_side_by_side():
    with hetproc.Platform() as p1, hetproc.Platform() as p2:
        assert p1.prefix != p2.prefix
        a1, a2 = p1.client.alloc(8), p2.client.alloc(8)
        a1.array()[:] = 1
        a2.array()[:] = 2
        p1.client.context("cpu0").submit("scale", [a1], [a1], params={"factor": 3.0}).wait(5)
        p2.client.context("cpu0").submit("scale", [a2], [a2], params={"factor": 5.0}).wait(5)
        assert (a1.array() == 3).all() and (a2.array() == 10).all()
        prefixes = (p1.prefix, p2.prefix)
    assert all(entries_with_prefix(p) == [] for p in prefixes)


def _platform_pids(plat):
    return [plat.pid] + [d["pid"] for d in plat.metrics()["devices"].values()]


def test_normal_stop_leaves_nothing(platform):
    pids = _platform_pids(platform)
    prefix = platform.prefix
    assert entries_with_prefix(prefix)
    platform.stop()
    assert entries_with_prefix(prefix) == []
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_supervisor_sigkill_then_cleanup_leaves_nothing():
    plat = hetproc.Platform().start()
    prefix, pids = plat.prefix, _platform_pids(plat)
    waiter = plat.client.fence()
    plat.kill_supervisor()
    with pytest.raises(hetproc.SupervisorLost):  # not FenceTimeout: it learns of the death
        waiter.wait(10)
    with pytest.raises(hetproc.PlatformError):
        plat.client.ping()
    assert wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                    for p in pids[1:])), "devices exit with their supervisor"
    assert entries_with_prefix(prefix), "objects remain until cleanup"
    out = subprocess.run([sys.executable, "-m", "hetproc", "cleanup", "--json"],
                         check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert entries_with_prefix(prefix) == []
    plat.client.close()
    plat.proc = None


def test_a_wait_begun_after_a_cleanup_took_the_dead_platform_is_supervisor_lost():
    """`hetproc cleanup` (here: a run beside this one) may remove a dead platform before
    one of its clients first waits on a fence: the semaphore it would open is gone. The
    wait says SupervisorLost, never the IPC library's own ExistentialError."""
    plat = hetproc.Platform().start()
    prefix = plat.prefix
    fence = plat.client.context("npu0").submit("work", ms=5000)  # never waited on yet
    plat.kill_supervisor()
    assert wait_for(lambda: prefix in cleanup_dead()["platforms"] or
                    not entries_with_prefix(prefix))
    assert entries_with_prefix(prefix) == []
    with pytest.raises(hetproc.SupervisorLost):
        fence.wait(10)
    plat.client.close()
    plat.proc = None


def test_cleanup_leaves_live_platforms_alone(platform):
    report = cleanup_dead()
    assert platform.prefix in report["live"]
    assert entries_with_prefix(platform.prefix)
    platform.client.ping()


DOOMED_CLIENT = """
import sys, time, hetproc
c = hetproc.connect(sys.argv[1], "doomed")
ctx = c.context("gpu0")
bufs = [c.alloc(4096) for _ in range(5)]
ctx.submit("work", bufs[:1], [], ms=50)
print("ready", flush=True)
time.sleep(60)
"""


def test_client_death_tears_down_its_contexts_and_buffers(platform, client):
    before = client.metrics()
    p = subprocess.Popen([sys.executable, "-c", DOOMED_CLIENT, platform.prefix],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert client.metrics()["registered_buffers"] == before["registered_buffers"] + 5
        p.kill()
        p.wait(5)
    finally:
        p.kill()
        p.wait(5)
    assert wait_for(lambda: client.metrics()["registered_buffers"] == before["registered_buffers"])
    m = client.metrics()
    assert m["contexts"] == before["contexts"] and m["clients"] == 1


def test_device_crash_fails_in_flight_work_and_the_device_comes_back(platform, client):
    npu = client.context("npu0")
    f = npu.submit("work", ms=2000)
    pid = client.metrics()["devices"]["npu0"]["pid"]
    wait_for(lambda: client.metrics()["devices"]["npu0"]["state"] == "busy")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(hetproc.DeviceCrashed) as exc:
        f.wait(5)
    assert exc.value.scope == "device" and exc.value.retryable
    assert wait_for(lambda: client.metrics()["devices"]["npu0"]["epoch"] == 2)
    assert client.metrics()["devices"]["npu0"]["pid"] != pid
    with pytest.raises(hetproc.ContextLost):
        npu.submit("work", ms=0)  # the context whose command was running is lost
    assert client.context("npu0").submit("work", ms=0).wait(5) is None


def test_status_lists_the_platform_with_its_pids(platform):
    out = subprocess.run([sys.executable, "-m", "hetproc", "status", "--json"],
                         check=False, capture_output=True, text=True, timeout=30)
    import json
    assert out.returncode == 0, out.stderr
    try:
        listed = json.loads(out.stdout)
    except ValueError:
        raise AssertionError(f"not JSON: {out.stdout[:300]!r} / {out.stderr[-500:]!r}") from None
    entries = {p["prefix"]: p for p in listed}
    me = entries[platform.prefix]
    assert me["supervisor_pid"] == platform.pid
    assert set(me["devices"]) == {"cpu0", "npu0", "gpu0", "dsp0", "isp0"}
    assert all(d["pid"] > 0 for d in me["devices"].values())


def test_a_higher_priority_request_overtakes_queued_lower_ones(tenant):
    """Only ~2 ms of modeled work sits in a device's in-order ring; the rest waits by
    priority, so the camera's request does not wait behind a third-party backlog."""
    background = tenant.context("npu0", priority=0, name="third-party")
    camera = tenant.context("npu0", priority=10, name="camera")
    # One batch, then the urgent one: two requests, so even a loaded host queues the
    # urgent one long before the backlog's third command could start.
    backlog = background.submit_many([hetproc.command("work", ms=50) for _ in range(5)])
    urgent = camera.submit("work", ms=1)
    for f in backlog + [urgent]:
        f.wait(5)
    done = {id(f): tenant.fences.info(f.handle)["t_ns"] for f in backlog + [urgent]}
    assert done[id(urgent)] < done[id(backlog[2])], "the urgent request waited its turn"
    order = sorted(backlog, key=lambda f: done[id(f)])
    assert order == backlog, "equal priorities keep their submission order"


@pytest.mark.parametrize("nowait", [False, True])
def test_one_command_dict_may_be_submitted_again_and_twice_in_a_batch(tenant, nowait):
    """A batch is built from the caller's dicts without changing them: the same dict
    submitted twice in a batch, and again later, gets its own fence and id each time."""
    ctx = tenant.context("cpu0")
    cmd = hetproc.command("work", ms=0.1)
    first = ctx.submit_many([cmd, cmd], nowait=nowait)
    again = ctx.submit_many([cmd], nowait=nowait)
    for f in first + again:
        f.wait(5)
    assert len({f.handle for f in first + again}) == 3
    assert len({f.cid for f in first + again}) == 3
    assert cmd == hetproc.command("work", ms=0.1)

"""Commands with buffers on user-mode queues (``Queue.submit``), across real processes.

A queue command means what ``Context.submit`` means: the same results, the same modeled
time (timing model, cache maintenance), and what the supervisor refuses the queue refuses
with the same error class (a differential test over random commands). A bound buffer is
reclaimed only after the device proved it let go (an unbind, then a barrier); a device
killed mid-command keeps its bound buffers quarantined until its reaping confirms the
stop. Fault rules and the command watchdog apply to queue commands: the late-writer
drill's corruption appears on a queue too when reclamation skips the barrier.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetproc
from hetproc import errors
from hetproc.drills import run_drill
from tests.helpers import wait_for

WAIT = 10.0
N = 1024  # float32 elements: 4 KiB buffers


def _fill(buf: hetproc.Buffer, values) -> None:
    buf.array()[...] = values


def test_a_queue_command_computes_what_a_submit_computes(platform):
    client = platform.client
    gpu = client.context("gpu0")
    x, y, z = (client.alloc((N,), "float32") for _ in range(3))
    _fill(x, np.linspace(-4, 4, N))
    with gpu.queue() as q:
        q.submit("scale", [x], [y], params={"factor": 3.0}).wait(WAIT)
        gpu.submit("scale", [x], [z], params={"factor": 3.0}).wait(WAIT)
        assert np.array_equal(y.array(), z.array()) and y.array()[-1] == 12.0
        a = q.submit("relu", [y], [z])
        b = q.submit("add", [z, x], [y], wait=[a])  # a dependency inside the queue
        b.wait(WAIT)
        expected = np.maximum(np.linspace(-4, 4, N) * 3, 0) + np.linspace(-4, 4, N)
        assert np.allclose(y.array(), expected)
        assert client.metrics()["queues"]["bindings"] == 3
    assert client.metrics()["queues"]["bindings"] == 0


def test_the_timing_model_and_cache_maintenance_are_the_supervisors(platform):
    """On the non-coherent NPU, mapped persistently: a relu without ``ms`` takes the same
    modeled time on both paths -- its invalidate, kernel (the timing table) and clean --
    measured as the gap between two back-to-back commands from one arrival."""
    client = platform.client
    npu = client.context("npu0")
    x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
    for b in (x, y):
        npu.map(b, "rw")
    at = time.monotonic_ns()
    s1, s2 = npu.submit_many([hetproc.command("relu", [x], [y])] * 2, at_ns=at)
    s2.wait(WAIT)
    with npu.queue() as q:
        at = time.monotonic_ns()
        q1, q2 = q.submit_many([hetproc.command("relu", [x], [y])] * 2, at_ns=at)
        q2.wait(WAIT)
    span = s2.signal_time() - s1.signal_time()
    spec = platform.spec.device("npu0")
    kernel = int((spec.timing.default_ms + spec.timing.per_mib_ms * 2 * 4 * N / (1 << 20)) * 1e6)
    assert q2.signal_time() - q1.signal_time() == span
    assert span > kernel  # the maintenance is in it: an invalidate and a clean


def test_cache_maintenance_off_reads_stale_data_on_a_queue_too(platform):
    """A context that cleans but never invalidates (the classic driver bug) reads its
    stale cached copy through a queue, as through a submit; with the maintenance, the new
    data: the maintenance is real on both paths, not a counter."""
    client = platform.client
    for maintenance, stale in (("both", False), ("clean", True)):
        for path in ("submit", "queue"):
            npu = client.context("npu0", cache_maintenance=maintenance)
            x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
            q = npu.queue() if path == "queue" else None
            submit = q.submit if q is not None else npu.submit
            _fill(x, 1.0)
            submit("copy", [x], [y]).wait(WAIT)
            _fill(x, 2.0)  # the CPU writes again; the NPU's cache still holds 1.0
            submit("copy", [x], [y]).wait(WAIT)
            assert (y.array()[0] == 1.0) == stale, (maintenance, path)
            if q is not None:
                q.close()
            x.free()
            y.free()
            npu.close()


def test_a_read_only_import_is_an_iommu_fault_as_an_output(platform):
    a, b = platform.client, platform.connect("tenant-b")
    try:
        src = a.alloc((N,), "float32", exportable=True)
        ro = b.import_buffer(src.export(read_only=True))
        out = b.alloc((N,), "float32")
        gpu = b.context("gpu0")
        with pytest.raises(errors.IommuFault):
            gpu.submit("copy", [out], [ro]).wait(WAIT)
        with gpu.queue() as q:
            assert q.bind(ro) == "r"
            with pytest.raises(errors.IommuFault):
                q.submit("copy", [out], [ro]).wait(WAIT)
            q.submit("copy", [ro], [out]).wait(WAIT)  # reading it is what it grants
            other = a.alloc((N,), "float32")
            with pytest.raises(errors.ForeignBuffer):
                q.submit("copy", [hetproc.Buffer(b, {**_desc(other)})], [out])
    finally:
        b.close()


def _desc(buf: hetproc.Buffer) -> dict:
    return {"buf": buf.handle, "segment": buf.segment, "offset": buf.offset,
            "nbytes": buf.nbytes, "shape": list(buf.shape), "dtype": buf.dtype.name}


# -- the differential test: random commands, one path against the other -------------------

_DEFECTS = ["none", "none", "kernel", "freed", "foreign", "read_only_out", "shape", "params_inf",
            "params_deep", "params_key", "ms_negative", "ms_inf", "dtype"]
_KERNELS = ["copy", "relu", "add", "scale", "fill", "work"]


def _command(kind: str, kernel: str, bufs: dict, ms: float | None) -> dict:
    x, y, z = bufs["x"], bufs["y"], bufs["z"]
    ins = {"copy": [x], "relu": [x], "add": [x, y], "scale": [x], "fill": [],
           "work": [x]}[kernel]
    outs = [z]
    params: dict | None = {"factor": 2.0} if kernel == "scale" else (
        {"value": 1.5} if kernel == "fill" else None)
    if kind == "kernel":
        kernel = "conv3d"
    elif kind == "freed":
        ins = [bufs["freed"]]
    elif kind == "foreign":
        ins = [bufs["foreign"]]
    elif kind == "read_only_out":
        outs = [bufs["ro"]]
    elif kind == "shape":
        outs = [bufs["small"]] if kernel != "work" else outs
    elif kind == "params_inf":
        params = {"factor": float("inf")}
    elif kind == "params_deep":
        params = {"a": [[[[[1]]]]]}
    elif kind == "params_key":
        params = {"a": {1: 2}}
    elif kind == "ms_negative":
        ms = -1.0
    elif kind == "ms_inf":
        ms = float("inf")
    elif kind == "dtype":
        outs = [bufs["f64"]]
    return {"kernel": kernel, "ins": ins, "outs": outs, "params": params, "ms": ms}


def _outcome(call) -> str:
    try:
        fence = call()
        fence.wait(WAIT)
    except errors.HetprocError as exc:
        return type(exc).__name__
    return "ok"


@pytest.fixture(scope="module")
def differential():
    with hetproc.Platform(time_scale=1.0) as plat:
        c = plat.client
        other = plat.connect("tenant-b")
        bufs = {k: c.alloc((N,), "float32") for k in ("x", "y", "z", "z2")}
        bufs["small"] = c.alloc((N // 2,), "float32")
        bufs["f64"] = c.alloc((N,), "float64")
        freed = c.alloc((N,), "float32")
        freed.free()
        bufs["freed"] = freed
        theirs = other.alloc((N,), "float32", exportable=True)
        bufs["ro"] = c.import_buffer(theirs.export(read_only=True))
        bufs["foreign"] = hetproc.Buffer(c, _desc(other.alloc((N,), "float32")))  # no import
        ctx = c.context("gpu0")
        q = ctx.queue()
        try:
            yield c, ctx, q, bufs
        finally:
            q.close()
            other.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(_DEFECTS), kernel=st.sampled_from(_KERNELS),
       ms=st.sampled_from([None, 0.0, 0.25]), seed=st.integers(0, 2**16))
def test_a_queue_refuses_what_the_supervisor_refuses_with_the_same_class(differential, kind,
                                                                         kernel, ms, seed):
    """Each random command, with at most one defect, through ``Context.submit`` and
    through ``Queue.submit`` on the same device: the same outcome -- the same error class,
    or success and the same output bytes."""
    _c, ctx, q, bufs = differential
    rng = np.random.default_rng(seed)
    _fill(bufs["x"], rng.standard_normal(N).astype(np.float32))
    _fill(bufs["y"], rng.standard_normal(N).astype(np.float32))
    cmd = _command(kind, kernel, bufs, ms)

    def via(submit, out):
        outs = [out if b is bufs["z"] else b for b in cmd["outs"]]
        return lambda: submit(cmd["kernel"], cmd["ins"], outs, params=cmd["params"],
                              ms=cmd["ms"])

    sup = _outcome(via(ctx.submit, bufs["z"]))
    queued = _outcome(via(q.submit, bufs["z2"]))
    assert queued == sup, (kind, kernel, ms)
    if sup == "ok" and bufs["z"] in cmd["outs"]:
        assert np.array_equal(bufs["z"].array(), bufs["z2"].array(), equal_nan=True)


# -- reclamation: invariant 1 ---------------------------------------------------------------


def _registered(client: hetproc.Client) -> tuple[int, int]:
    m = client.metrics()
    return m["registered_buffers"], m["quarantined_buffers"]


def test_a_freed_bound_buffer_is_reclaimed_only_after_the_barrier(platform):
    """The client frees a buffer its queue's running command writes: it stays quarantined
    (unbound: no new record may name it) until the command ends and the barrier behind
    it completes, then goes. (The device is held still for a moment while the buffer is
    freed, so that the command is certainly running then, however loaded the host.)"""
    client = platform.client
    gpu = client.context("gpu0")
    x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
    with gpu.queue() as q:
        q.bind(x)
        q.bind(y)
        running = q.submit("copy", [x], [y], ms=100.0)
        assert wait_for(lambda: client.metrics()["devices"]["gpu0"]["state"] == "busy")
        base = _registered(client)[0]
        pid = client.metrics()["devices"]["gpu0"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            y.free()
            time.sleep(0.03)
            assert _registered(client) == (base, 1)  # still held: the device may write it
        finally:
            os.kill(pid, signal.SIGCONT)
        running.wait(WAIT)
        assert wait_for(lambda: _registered(client) == (base - 1, 0))
        assert client.metrics()["queues"]["bindings_barriers"] >= 1
        with pytest.raises(errors.StaleHandle):
            q.submit("copy", [x], [y])


def test_a_device_killed_mid_command_keeps_its_bound_buffers_until_reaped(platform):
    """SIGSTOP the device during a queue command that writes a bound buffer, free the
    buffer: nothing the device could still touch is reclaimed while it is stopped; the
    watchdog resets it and only the reaping lets the buffer go."""
    client = platform.client
    gpu = client.context("gpu0")
    x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
    q = gpu.queue()
    f = q.submit("copy", [x], [y], ms=100.0)
    assert wait_for(lambda: client.metrics()["devices"]["gpu0"]["state"] == "busy")
    pid = client.metrics()["devices"]["gpu0"]["pid"]
    base = _registered(client)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        y.free()
        time.sleep(0.15)  # well past the command's modeled end
        assert _registered(client) == (base, 1)
        with pytest.raises((errors.DeviceTimeout, errors.DeviceCrashed)):
            f.wait(WAIT)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert wait_for(lambda: _registered(client) == (base - 1, 0), timeout=WAIT)
    assert client.metrics()["devices"]["gpu0"]["restarts"] == 1
    q.close()


def test_the_unbind_barrier_keeps_a_late_writer_off_the_next_owner():
    """The late-writer drill on a queue: its command keeps writing its bound output past
    its watchdog while the client frees it; the queue watchdog resets the device and only
    its reaping lets the buffer go: the next owner's canary is intact."""
    report = run_drill("queue-late-writer")
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert report["ok"], failed
    assert report["metrics"]["canary_bytes_corrupted"] == 0


def test_reclaiming_a_bound_buffer_without_the_barrier_corrupts_the_next_owner():
    """The rule broken on purpose (``unsafe_reclaim``: let go at the unbind, no barrier):
    the freed block goes straight to the next owner while the device still writes it."""
    report = run_drill("queue-late-writer", unsafe_reclaim=True)
    failed = {c["name"] for c in report["checks"] if not c["passed"]}
    assert failed == {"no corruption of the buffer's next owner (canary intact)"}
    assert report["metrics"]["canary_bytes_corrupted"] > 0
    assert report["metrics"]["next_owner_got_same_block"] is True


# -- faults and the watchdog ----------------------------------------------------------------


@pytest.mark.parametrize("kind, error", [("kernel_bug", errors.DeviceFault),
                                         ("crash", errors.DeviceCrashed)])
def test_a_fault_rule_hits_a_queue_command_as_a_submit(platform, kind, error):
    """``inject`` then the next command: the same drill whichever path it takes."""
    client = platform.client
    x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
    for path in ("submit", "queue"):
        ctx = client.context("gpu0")
        q = ctx.queue() if path == "queue" else None
        client.inject(kind, device="gpu0")
        submit = q.submit if q is not None else ctx.submit
        with pytest.raises(error):
            submit("copy", [x], [y]).wait(WAIT)
        if q is not None:
            q.close()
        client.clear_faults()
        deadline = time.monotonic() + WAIT
        while True:  # a crash resets the device: wait until it serves again
            try:
                client.context("gpu0").submit("work", ms=0.0).wait(WAIT)
                break
            except (errors.ContextLost, errors.CancelledByReset, errors.ResourceError):
                assert time.monotonic() < deadline
                time.sleep(0.01)


def test_a_hung_queue_command_times_out_on_its_own_watchdog(platform):
    client = platform.client
    client.inject("hang", device="npu0")
    with client.context("npu0").queue() as q:
        x = client.alloc((N,), "float32")
        t0 = time.monotonic()
        f = q.submit("relu", [x], [x], timeout_ms=30.0)
        after = q.submit_nowait(0.0)
        with pytest.raises(errors.DeviceTimeout, match="watchdog"):
            f.wait(WAIT)
        with pytest.raises(errors.CancelledByReset):
            after.wait(WAIT)
        assert time.monotonic() - t0 < 2.0
    m = client.metrics()["incidents"]
    assert m["watchdog_verdicts"].get("timed_out") == 1


# -- scribbles: the table and the records are read as hostile -------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(table=st.binary(min_size=0, max_size=2 * 192), slot=st.integers(-2, 4),
       gen=st.integers(0, 2**32 - 1), need=st.sampled_from(["r", "w"]),
       kernel=st.sampled_from(["copy", "relu", "add", "scale", "fill", "work"]))
def test_a_scribbled_binding_table_yields_only_the_supervisors_errors(table, slot, gen, need,
                                                                     kernel):
    """Whatever bytes a table holds, resolving an operand raises ``StaleHandle``,
    ``BadPacket`` or ``IommuFault`` -- never another exception -- and an operand that
    passes lies within its segment (the device's own descriptor check)."""
    from device_workers._cache import DeviceMemory
    from device_workers._queues import _operand
    from ipc import BindingTable, Segment, SegmentCache, table_bytes
    from ipc._queues import TABLE_HEADER
    raw = bytearray(table_bytes(4))
    raw[TABLE_HEADER:TABLE_HEADER + len(table)] = table
    tab = BindingTable(memoryview(raw), 4)
    seg = Segment.anonymous_segment("scribble", 1 << 16, 7)
    cache = SegmentCache()
    cache.add(seg)
    mem = DeviceMemory(cache, coherent=True, cache_bytes=0)
    try:
        b = _operand(tab, slot, gen, need, "input", 0)
        if kernel != "work":
            hetproc_validate(kernel, b)
        op = mem._operand(b.descriptor(), need, "input", 0)
        assert 0 <= op.offset and op.offset + op.span <= seg.size
    except (errors.StaleHandle, errors.BadPacket, errors.IommuFault, errors.ShapeError,
            errors.DtypeError, errors.InvalidRequest):
        pass
    finally:
        tab.release()
        seg.close()


def hetproc_validate(kernel: str, b) -> None:
    from device_workers import validate_kernel
    validate_kernel(kernel, [(b.shape, b.dtype)], [(b.shape, b.dtype)], {})


@pytest.fixture(scope="module")
def scribbled():
    with hetproc.Platform(time_scale=1.0) as plat:
        c = plat.client
        bound = c.alloc((N,), "float32")
        canary = c.alloc((N,), "float32")  # never bound: no record may reach it
        canary.array()[:] = 7.0
        q = c.context("gpu0").queue(slots=64)
        q.bind(bound)
        try:
            yield c, q, bound, canary
        finally:
            q.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(records=st.lists(st.tuples(
    st.integers(0, 15), st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3)), max_size=3),
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3)), max_size=3),
    st.binary(max_size=40), st.integers(0, 7)), min_size=1, max_size=6))
def test_scribbled_records_with_operands_reach_only_bound_buffers(scribbled, records):
    """Records naming random slots, generations, kernels, params and flags: each is run
    or refused, the device serves on, and a buffer never bound is never touched."""
    from ipc import encode_queue_record
    c, q, bound, canary = scribbled
    for kernel, ins, outs, params, flags in records:
        fence = hetproc.Fence(c, c._take_fences(1)[0], owned=True)
        fence._queue = q
        q._qseq += 1
        data = encode_queue_record(q._qseq, 1, fence.handle, time.monotonic_ns(), 0, [],
                                   kernel, ins=ins, outs=outs, params=params,
                                   flags=flags & 5)
        assert q._ring.put(data)
        q._doorbell.release()
        try:
            fence.wait(WAIT)
        except errors.HetprocError as exc:
            assert not isinstance(exc, errors.FenceTimeout)
    q.submit("copy", [bound], [bound]).wait(WAIT)  # the queue goes on
    assert (canary.array() == 7.0).all()


def test_a_rule_fires_once_whichever_path_meets_it_first(platform):
    """``inject`` (at=1, count=1): the queue command meets the fault; the submit after it
    does not, and the other way round (the device's firings count against the rule)."""
    client = platform.client
    x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
    ctx = client.context("gpu0")
    with ctx.queue() as q:
        client.inject("kernel_bug", device="gpu0")
        with pytest.raises(errors.DeviceFault):
            q.submit("copy", [x], [y]).wait(WAIT)
        ctx.submit("copy", [x], [y]).wait(WAIT)
        client.inject("kernel_bug", device="gpu0")
        with pytest.raises(errors.DeviceFault):
            ctx.submit("copy", [x], [y]).wait(WAIT)
        q.submit("copy", [x], [y]).wait(WAIT)
        fired = [f["kind"] for f in client.incidents()["faults"]]
        assert fired == ["kernel_bug", "kernel_bug"], fired


# -- a reset between a submit's look at the ring and its bind request ----------------------


def _lose_before(platform, q: hetproc.Queue, op: str, monkeypatch) -> None:
    """The client looked at the ring (open) and is about to send ``op``: the queue's device
    is SIGKILLed now, and ``op`` leaves only once the supervisor lost the queue."""
    client = platform.client
    conn = client.connection
    real = conn.request

    def request(name: str, **fields):
        if name == op:
            monkeypatch.setattr(conn, "request", real)
            os.kill(real("metrics")["metrics"]["devices"][q.ctx.device]["pid"], signal.SIGKILL)
            assert wait_for(lambda: q._ring.state != 0, timeout=WAIT)
        return real(name, **fields)

    monkeypatch.setattr(conn, "request", request)


@pytest.mark.parametrize("restart", [False, True], ids=["reset", "subsystem-restart"])
def test_a_queue_lost_as_its_submit_binds_raises_the_loss_not_invalid_handle(
        restart, monkeypatch):
    """Chaos seed 19: a device reset ended the queue after the submit saw it open and
    before its first bind reached the supervisor, which had forgotten the queue by then:
    the submit raised InvalidHandle ("queue 1 is not open on this connection"). It
    raises what a lost queue's submit raises (CancelledByReset; DeviceRestarted on a
    device that restarts as a subsystem), and an unbind after the loss is a no-op, as a
    close is."""
    spec = hetproc.load_platform(None)
    if restart:
        spec = dataclasses.replace(spec, recovery={**spec.recovery,
                                                   "subsystem_restart": ["npu0"]})
    lost = errors.DeviceRestarted if restart else errors.CancelledByReset
    with hetproc.Platform(spec=spec, time_scale=1.0) as platform:
        client = platform.client
        x, y = client.alloc((N,), "float32"), client.alloc((N,), "float32")
        q = client.context("npu0").queue()
        _lose_before(platform, q, "queue_bind", monkeypatch)
        with pytest.raises(lost):
            q.submit("copy", [x], [y])
        q.close()
        # an unbind racing the same loss: the supervisor let go of the binding with it
        ctx = client.context("gpu0")
        q = ctx.queue()
        q.bind(x)
        _lose_before(platform, q, "queue_unbind", monkeypatch)
        q.unbind(x)
        with pytest.raises(errors.CancelledByReset):
            q.submit_nowait(0.0)
        q.close()
        with pytest.raises(errors.InvalidHandle, match="closed"):
            q.submit_nowait(0.0)

"""Every client is untrusted: each attack of the issue, as an attacker would try it.

Each test drives a real platform (supervisor and device processes) the way a hostile or
broken tenant would, and asserts two things: the attacker gets a clear error from the one
hierarchy, and the platform (supervisor alive, other clients' work correct) carries on.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time

import msgpack
import psutil
import pytest

import hetproc
from hetproc.client import Fence

from .helpers import wait_for


def _alive(plat) -> bool:
    return plat.proc.poll() is None


def _raw_request(address: str, msg: dict, timeout: float = 5.0) -> dict:
    """Send one packet on a fresh connection, return the first reply (a hostile client
    needs no library)."""
    from ipc import Channel
    chan = Channel.connect(address, timeout)
    try:
        chan.send(msg)
        return msgpack.unpackb(chan.recv(timeout), raw=False, strict_map_key=False)
    finally:
        chan.close()


def _counts(client) -> tuple[int, int]:
    m = client.metrics()
    return m["submitted"], m["completed"]


# -- 1. validate before any state changes ---------------------------------------------------


@pytest.mark.parametrize("field,value", [("ms", 1e30), ("ms", float("nan")), ("ms", float("inf")),
                                         ("ms", -1.0), ("timeout_ms", 1e30),
                                         ("handoff_ms", 1e300)])
def test_out_of_range_duration_is_refused_before_anything_is_queued(shared_platform, tenant,
                                                                    field, value):
    c = tenant
    submitted, completed = _counts(c)
    ctx = c.context("npu0")
    first = ctx.submit("work", ms=20)  # a queued command the attack would jam behind
    cmd = {"kernel": "work", "ins": [], "outs": [], "wait": [], field: value}
    if field != "ms":
        cmd["ms"] = 1.0
    with pytest.raises(hetproc.InvalidRequest, match=field):
        ctx.submit_many([cmd])
    first.wait(5)
    assert _alive(shared_platform)
    ctx.submit("work", ms=1).wait(5)  # the device is not jammed
    assert wait_for(lambda: c.metrics()["completed"] == completed + 2)
    assert c.metrics()["submitted"] == submitted + 2


def test_a_batch_with_one_bad_command_queues_nothing(tenant):
    submitted, _ = _counts(tenant)
    ctx = tenant.context("npu0")
    good = {"kernel": "work", "ms": 1.0}
    with pytest.raises(hetproc.InvalidRequest):
        ctx.submit_many([dict(good), dict(good), {"kernel": "work", "ms": 1e30}])
    assert tenant.metrics()["submitted"] == submitted


def test_a_batch_is_checked_command_by_command_not_by_its_first(shared_platform, tenant):
    """What all commands of a submit share is looked up once, but each command's own
    fields are still checked: one bad command deep in a batch of 64 refuses it whole."""
    owner, other = tenant, shared_platform.connect("other")
    submitted, _ = _counts(owner)
    theirs = other.fence()
    ctx = owner.context("npu0")

    def batch(**bad):
        cmds = [{"kernel": "work", "ms": 0.0} for _ in range(64)]
        cmds[40].update(bad)
        return cmds

    with pytest.raises(hetproc.ForeignHandle):
        ctx.submit_many(batch(signal=theirs.handle))
    with pytest.raises(hetproc.UnsupportedOp):
        ctx.submit_many(batch(kernel="fill"))  # npu0 runs "work", not "fill"
    with pytest.raises(hetproc.InvalidRequest, match="deadline_ms"):
        ctx.submit_many(batch(deadline_ms=-1.0))
    with pytest.raises(hetproc.InvalidRequest):
        ctx.submit_many(batch(wait=[theirs.handle]))
    assert owner.metrics()["submitted"] == submitted
    for f in ctx.submit_many(batch(priority=3), nowait=True):
        f.wait(5)
    assert owner.metrics()["submitted"] == submitted + 64
    other.close()


@pytest.mark.parametrize("cmd,err", [
    ({"kernel": "work", "cid": -1}, hetproc.InvalidRequest),           # not encodable for a ring
    ({"kernel": "work", "params": {"a": [[[[[[[[[[1]]]]]]]]]]}}, hetproc.InvalidRequest),
    ({"kernel": "work", "params": {"k" * 70000: 1}}, hetproc.InvalidRequest),
    ({"kernel": "w" * 10000}, hetproc.InvalidRequest),
    ({"kernel": "work", "wait": list(range(100000))}, hetproc.InvalidRequest),
])
def test_malformed_commands_are_refused_whole(shared_platform, tenant, cmd, err):
    ctx = tenant.context("npu0")
    with pytest.raises(err):
        ctx.submit_many([cmd])
    assert _alive(shared_platform)
    ctx.submit("work", ms=1).wait(5)


def test_nowait_submit_of_an_unencodable_duration_fails_its_fence_not_the_supervisor(
        shared_platform, tenant):
    ctx = tenant.context("npu0")
    ctx.submit("work", ms=5)
    f = ctx.submit_nowait("work", ms=1e30)
    with pytest.raises(hetproc.InvalidRequest):
        f.wait(5)
    ctx.submit("work", ms=1).wait(5)
    assert _alive(shared_platform)


def test_requests_with_out_of_range_fields_are_refused(shared_platform, tenant):
    c = tenant
    for fields in ({"op": "fence_create", "count": 1 << 40}, {"op": "mem_events", "limit": -5},
                   {"op": "context_create", "device": "npu0", "name": "x" * 5000},
                   {"op": "context_create", "device": "npu0\n\x00"},
                   {"op": "alloc", "shape": [4] * 100, "dtype": "float32"},
                   {"op": "fence_release", "fences": list(range(100000))}):
        op = fields.pop("op")
        with pytest.raises(hetproc.InvalidRequest):
            c._request(op, **fields)
    assert _alive(shared_platform)
    c.ping()


# -- 2. the loop never dies from a client ---------------------------------------------------


def test_a_thousand_raw_connections_do_not_kill_the_supervisor(platform):
    """More connections than a 1024-descriptor supervisor could hold: the excess is refused
    with a clear error, a client connected before keeps working, and after the flood a new
    client is served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    sup = psutil.Process(platform.proc.pid)
    sup.rlimit(psutil.RLIMIT_NOFILE,
               (1024, sup.rlimit(psutil.RLIMIT_NOFILE)[1]))  # as on many hosts
    bystander = platform.connect("bystander")
    ctx = bystander.context("cpu0")
    socks, refused = [], 0
    try:
        for _ in range(1100):
            socks.append(_connect_raw(platform.address))
        ctx.submit("work", ms=1).wait(5)
        assert _alive(platform)
        for s in socks:  # the excess was told why, then closed
            s.setblocking(False)
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            if data and b"clients" in data:  # max_clients, or process_clients first
                refused += 1
        assert refused > 0
    finally:
        for s in socks:
            s.close()
    assert _alive(platform)
    with wait_for_client(platform) as late:
        late.context("npu0").submit("work", ms=1).wait(5)
    ctx.submit("work", ms=1).wait(5)


def _connect_raw(address: str) -> socket.socket:
    """A bare connection; the listen backlog may be full for a moment: retry then."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(address)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


class wait_for_client:
    """Connect once the platform has noticed the flood's connections closing."""

    def __init__(self, platform) -> None:
        self.platform = platform

    def __enter__(self):
        deadline = time.monotonic() + 10
        while True:
            try:
                self.c = self.platform.connect("late")
                return self.c
            except hetproc.ResourceError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __exit__(self, *exc):
        self.c.close()


def test_a_connection_that_never_says_hello_is_dropped():
    """Dropped after the platform's hello deadline (a short one here: the wait is real
    time), while the owner, which said hello at once, keeps its connection."""
    with hetproc.Platform(time_scale=1.0, limits={"hello_timeout_ms": 1000.0}) as plat:
        _dropped_without_hello(plat)
        plat.client.ping()


def _dropped_without_hello(platform) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(platform.address)
    try:
        data = s.recv(4096)  # the supervisor closes it after its hello deadline
        assert b"hello" in data
        assert s.recv(4096) == b""
    finally:
        s.close()


# -- 3. a client protocol that survives timeouts ---------------------------------------------


def test_a_timed_out_request_does_not_break_the_client_and_retry_runs_it_once(platform):
    c = hetproc.connect(platform.prefix, "patient")
    c._timeout = 0.3
    ctx = c.context("cpu0")
    pid = platform.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(hetproc.Timeout) as info:
            ctx.submit("work", ms=1)
    finally:
        os.kill(pid, signal.SIGCONT)
    exc = info.value
    assert isinstance(exc, hetproc.RequestTimeout)
    assert exc.detail["may_take_effect"] is True
    c._timeout = 10
    c.ping()  # the late reply to the submit is discarded, not taken for the ping's
    fences = exc.retry()  # same request id: answered from the first run, not run again
    fences["cmds"]
    wait_for(lambda: platform.client.metrics()["completed"] == 1, timeout=5)
    assert platform.client.metrics()["submitted"] == 1
    c.context("cpu0").submit("work", ms=1).wait(5)
    assert platform.client.metrics()["submitted"] == 2
    c.close()


def test_a_reused_request_id_is_not_run_twice(platform):
    c = platform.connect("dup")
    ctx = c.context("cpu0")
    msg = {"op": "submit", "id": 10_000, "ctx": ctx.handle, "cmds": [{"kernel": "work", "ms": 1.0}]}
    c._chan.send(msg)
    c._chan.send(msg)
    first = decode_reply(c._chan.recv(5))
    second = decode_reply(c._chan.recv(5))
    assert first == second
    wait_for(lambda: platform.client.metrics()["completed"] == 1)
    assert platform.client.metrics()["submitted"] == 1
    c._ids = iter(range(10_001, 20_000))
    c.close()


def decode_reply(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# -- 4. identity from the kernel ------------------------------------------------------------


def test_a_huge_client_name_is_refused_and_metrics_still_work(shared_platform, tenant):
    address = shared_platform.address
    reply = _raw_request(address, {"v": 1, "op": "hello", "id": 1, "name": "n" * 100_000,
                                   "pid": os.getpid()})
    assert not reply["ok"] and "name" in reply["error"]["message"]
    reply = _raw_request(address, {"v": 1, "op": "hello", "id": 1, "name": "evil\x1b[2J",
                                   "pid": os.getpid()})
    assert not reply["ok"]
    shared_platform.client.metrics()
    tenant.metrics()


def test_a_packet_pid_is_ignored(platform):
    from ipc import Channel
    chan = Channel.connect(platform.address, 5)
    try:
        chan.send({"op": "hello", "id": 1, "name": "liar", "pid": -1})
        assert decode_reply(chan.recv(5))["ok"]
        m = platform.client.metrics()  # broke every client's metrics: psutil.Process(-1)
        assert f"client liar ({os.getpid()})" in m["cpu_s"]
    finally:
        chan.close()


def test_one_hello_per_connection(platform):
    from ipc import Channel
    before = platform.client.metrics()["trace"]["free_client_rings"]
    chan = Channel.connect(platform.address, 5)
    try:
        chan.send({"op": "hello", "id": 1, "name": "a", "pid": 1})
        assert decode_reply(chan.recv(5))["ok"]
        for i in range(2, 20):
            chan.send({"op": "hello", "id": i, "name": "a", "pid": 1})
            reply = decode_reply(chan.recv(5))
            assert not reply["ok"] and "hello" in reply["error"]["message"]
        assert platform.client.metrics()["trace"]["free_client_rings"] >= before - 1
    finally:
        chan.close()
    wait_for(lambda: platform.client.metrics()["trace"]["free_client_rings"] == before)
    assert platform.client.metrics()["trace"]["free_client_rings"] == before


def test_the_fence_quota_is_per_process_not_per_connection(platform):
    a = platform.connect("a")
    with pytest.raises(hetproc.OutOfMemory, match="fences"):
        for _ in range(64):
            a._request("fence_create", count=1024)
    b = platform.connect("b")  # same process: no fresh quota
    with pytest.raises(hetproc.OutOfMemory, match="fences"):
        b._request("fence_create", count=1024)
    a.close()
    # Released with the connection that held them (once the supervisor read its EOF).
    assert wait_for(lambda: b.metrics()["quota"]["fences"] == 0)
    b._request("fence_create", count=16)
    b.close()


def test_a_second_connection_cannot_claim_ownership(platform):
    from ipc import Channel
    chan = Channel.connect(platform.address, 5)
    try:
        chan.send({"op": "hello", "id": 1, "name": "usurper", "pid": os.getpid(), "owner": True})
        assert decode_reply(chan.recv(5))["ok"]
        chan.send({"op": "shutdown", "id": 2})
        assert not decode_reply(chan.recv(5))["ok"]
    finally:
        chan.close()
    assert _alive(platform)


# -- 5. capabilities ---------------------------------------------------------------------


def test_an_imported_fence_may_be_waited_on_not_signalled(platform):
    owner, other = platform.client, platform.connect("other")
    user = owner.fence()
    mine = other.import_fence(user.export())
    ctx = other.context("cpu0")
    with pytest.raises(hetproc.InvalidRequest):
        ctx.submit_many([{"kernel": "work", "ms": 1.0, "signal": mine.handle}])
    with pytest.raises(hetproc.NotPermitted):
        mine.signal()
    assert not user.done()
    waiter = ctx.submit("work", ms=1, wait=[mine])  # waiting is granted
    user.signal()
    waiter.wait(5)
    other.close()


def test_a_fence_exported_with_the_signal_right_may_be_signalled(platform):
    owner, other = platform.client, platform.connect("other")
    user = owner.fence()
    mine = other.import_fence(user.export(signal=True))
    mine.signal()
    user.wait(5)
    other.close()


def test_a_foreign_fence_handle_cannot_be_signalled(platform):
    owner, other = platform.client, platform.connect("other")
    user = owner.fence()
    with pytest.raises((hetproc.NotPermitted, hetproc.ForeignHandle)):
        Fence(other, user.handle).signal()
    assert not user.done()
    user.signal()
    user.wait(1)
    other.close()


def test_a_normal_client_injects_into_its_own_work_only(platform):
    victim, attacker = platform.client, platform.connect("attacker")
    attacker.inject("crash", device="npu0", every=1, count=0)
    victim.context("npu0").submit("work", ms=1).wait(5)  # untouched
    with pytest.raises(hetproc.DeviceFault):
        attacker.context("npu0").submit("work", ms=1).wait(5)
    attacker.clear_faults()
    attacker.close()


_SNOOP = r"""
import json, sys
import hetproc
from hetproc.client import Fence
c = hetproc.connect(sys.argv[1], "snoop")
out = {"metrics": repr(c.metrics()), "events": c.memory_events()["events"]}
for name, call in (("fence_error", lambda: Fence(c, int(sys.argv[2])).error_detail()),
                   ("trace_info", lambda: c._request("trace_info")),
                   ("incidents", c.incidents)):
    try:
        call()
        out[name] = "allowed"
    except hetproc.InvalidRequest as exc:
        out[name] = exc.name
c.close()
print(json.dumps(out))
"""


def test_a_normal_client_does_not_see_other_tenants(platform):
    owner = platform.client
    ctx = owner.context("npu0", name="secret-model")
    buf = owner.alloc(1024)
    f = ctx.submit("relu", [buf], [buf])
    f.wait(5)
    proc = subprocess.run([sys.executable, "-c", _SNOOP, platform.prefix, str(f.handle)],
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    import json
    out = json.loads(proc.stdout)
    assert out["fence_error"] == "ForeignHandle"
    assert out["trace_info"] == out["incidents"] == "NotPermitted"
    assert out["events"] == []
    assert "secret-model" not in out["metrics"] and "client owner" not in out["metrics"]
    assert "client snoop" in out["metrics"]  # its own row it does see
    assert owner.memory_events()["events"]  # the owner sees the platform's timeline


def test_priority_is_bounded_by_role(platform):
    other = platform.connect("other")
    with pytest.raises(hetproc.NotPermitted, match="priority"):
        other.context("npu0", priority=other.max_priority + 1)
    with pytest.raises(hetproc.InvalidRequest, match="priority"):
        other.context("npu0", priority=1 << 40)
    other.context("npu0", priority=other.max_priority)
    other.close()


def test_a_role_token_grants_observation(platform):
    token = platform.client.grant_role()
    obs = hetproc.connect(platform.prefix, "observer", role=token)
    obs._request("trace_info")
    obs.close()


# -- 6. quotas and freed memory ----------------------------------------------------------


def test_per_client_byte_quota_names_the_limit():
    with hetproc.Platform(time_scale=1.0, limits={"client_mib": 4}) as plat:
        other = plat.connect("tenant")
        other.alloc(3 << 18)  # 3 MiB of float32
        with pytest.raises(hetproc.QuotaExceeded, match="client_mib"):
            other.alloc((1 << 18) + 1)  # one float32 past the 4 MiB
        other.alloc(1 << 18)  # exactly up to it
        other.close()


def test_per_client_context_quota():
    with hetproc.Platform(time_scale=1.0, limits={"client_contexts": 2}) as plat:
        c = plat.client
        c.context("cpu0"), c.context("cpu0")
        with pytest.raises(hetproc.QuotaExceeded, match="client_contexts"):
            c.context("cpu0")


def test_array_after_free_raises(platform):
    buf = platform.client.alloc(16)
    buf.free()
    with pytest.raises(hetproc.StaleHandle):
        buf.array()


def test_a_freed_block_is_not_reused_while_a_view_lives(platform):
    a, b = platform.client, platform.connect("b")
    buf = a.alloc(1024)
    view = buf.array()
    view[:] = 7
    buf.free()
    other = b.alloc(1024)
    assert (other.segment, other.offset) != (buf.segment, buf.offset)
    other.array()[:] = 1
    assert (view == 7).all()  # nobody else's writes land in a freed block we still see
    used = a.metrics()["pool"]["used_bytes"]
    del view
    a.ping()
    assert a.metrics()["pool"]["used_bytes"] < used
    b.close()


_DYING = r"""
import sys, runpy
from hetproc.supervisor import _server
def boom(self):
    raise RuntimeError("a bug that escaped the loop")
_server.Supervisor.tick = boom
sys.argv = ["hetproc.supervisor"] + sys.argv[1:]
runpy.run_module("hetproc.supervisor", run_name="__main__")
"""


def test_a_supervisor_that_dies_exits_non_zero_and_leaves_a_dump(tmp_path):
    """A bug no handler caught (here: the loop's timer raises) still tears the platform
    down; the process exits 1 and writes a dump saying why (was: exit status 0, no word)."""
    import json

    from hetproc._config import to_raw
    spec = hetproc.load_platform().with_trace(dump_dir=str(tmp_path))
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _DYING, "--spec",
                             json.dumps({"raw": to_raw(spec), "source": spec.source}),
                             "--ready-fd", str(write_fd)], pass_fds=(write_fd,),
                            stderr=subprocess.PIPE, text=True)
    os.close(write_fd)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        os.close(read_fd)
    assert proc.returncode == 1
    (dump,) = tmp_path.glob("hetproc-crash-*.txt")
    assert "a bug that escaped the loop" in dump.read_text()
    assert str(dump) in err
    prefix = dump.name.removeprefix("hetproc-crash-").removesuffix(".txt")
    from ipc import entries_with_prefix
    assert not entries_with_prefix(prefix + ".")  # torn down all the same


def test_peer_identity_comes_from_the_kernel(platform):
    """A client in another process is another tenant, whatever pid its hello claims."""
    script = ("import sys, hetproc; c = hetproc.connect(sys.argv[1], 'child'); "
              "print(c.metrics()['quota']['fences']); c.close()")
    held = platform.client.fence()  # the owner process holds a fence; the child holds none
    out = subprocess.run([sys.executable, "-c", script, platform.prefix], check=False,
                         capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert platform.client.metrics()["quota"]["fences"] >= 1
    held.release()


def test_a_request_its_schema_refuses_is_answered_under_its_own_id(platform):
    """Found by the stateful test: ``ping`` with a stray field was answered as id 0 (a
    notice), so the client waited for an answer that never came."""
    c = platform.connect("stray")
    with pytest.raises(hetproc.BadPacket, match="unknown field"):
        c._request("ping", ctx=0)
    c.ping()
    c.close()


_TWO_CONNECTIONS = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "x")
print("served")
try:
    hetproc.connect(sys.argv[1], "y")
except hetproc.ResourceError as exc:
    print(exc.name, "max_clients" if "max_clients" in str(exc) else str(exc))
c.close()
"""


def test_in_flight_and_client_quotas_name_their_limit():
    with hetproc.Platform(time_scale=1.0, limits={"client_inflight": 3, "max_clients": 3,
                                                  "process_clients": 2}) as plat:
        ctx = plat.client.context("cpu0")
        held = [ctx.submit("work", ms=200) for _ in range(3)]
        with pytest.raises(hetproc.QuotaExceeded, match="client_inflight"):
            ctx.submit("work", ms=1)
        second = plat.connect("second")
        with pytest.raises(hetproc.QuotaExceeded, match="process_clients"):
            plat.connect("third")  # the same process: its own cap comes first
        child = subprocess.run([sys.executable, "-c", _TWO_CONNECTIONS, plat.prefix],
                               check=False, capture_output=True, text=True, timeout=30)
        assert child.returncode == 0, child.stderr
        # Another process is served (the 3rd of 3); its 4th connection finds none left.
        assert child.stdout.split() == ["served", "OutOfMemory", "max_clients"]
        second.close()
        for f in held:
            f.wait(5)
        ctx.submit("work", ms=1).wait(5)


def test_the_owner_may_use_the_privileged_priority_range(platform):
    limits = hetproc.load_platform().limits
    assert platform.client.max_priority == limits.max_priority_privileged
    platform.client.context("npu0", priority=limits.max_priority_privileged)
    with pytest.raises(hetproc.NotPermitted):
        platform.client.context("npu0", priority=limits.max_priority_privileged + 1)


def test_a_freed_buffer_with_a_live_view_cannot_be_used_again(platform):
    c = platform.client
    buf = c.alloc(64)
    view = buf.array()
    buf.free()  # deferred: the view is alive
    ctx = c.context("cpu0")
    with pytest.raises(hetproc.StaleHandle):
        ctx.submit("relu", [buf], [buf])
    with pytest.raises(hetproc.StaleHandle):
        buf.export()
    del view


def test_connections_a_process_closed_do_not_count_against_its_reconnect():
    """A tenant at its connection quota closes its connections and reconnects at once. The
    supervisor may see the new connection before the closes (one batch of events, the
    accept first): it must let the hung-up ones go before it refuses anyone. Made certain
    here by stopping the supervisor while the reconnect queues and the closes happen."""
    with hetproc.Platform(time_scale=1.0, limits={"process_clients": 4}) as plat:
        flood = [plat.connect(f"flood{i}") for i in range(3)]  # with the owner's: 4
        sup = psutil.Process(plat.pid)
        sup.suspend()
        try:
            late = _connect_raw(plat.address)  # queued first: its accept comes first
            for c in flood:
                c.close()
        finally:
            sup.resume()
        try:
            reply = _hello_on(late)
        finally:
            late.close()
        assert "error" not in reply, reply
        plat.client.context("cpu0").submit("work", ms=1).wait(10)


def _hello_on(sock: socket.socket) -> dict:
    """Say hello on a bare connection; the supervisor's first answer."""
    from ipc import Channel
    chan = Channel(sock)
    chan.send({"op": "hello", "id": 1, "name": "late"})
    return msgpack.unpackb(chan.recv(10), raw=False, strict_map_key=False)

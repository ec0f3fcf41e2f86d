"""The client's seam: every object a client hands out goes through its ``Connection``.

``Context``, ``Buffer``, ``Fence``, ``Queue``, the platform handle and the trace ring hold
the client's ``Connection`` and use its documented calls; only ``_connection`` touches
the socket (one reader, one writer) and the connection's own state.
"""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest

import hetproc
from hetproc.client import Connection
from tests.helpers import wait_for

CLIENT_DIR = Path(hetproc.__file__).parent / "client"
_SOCKET_CALLS = {"recv", "recv_fds", "sendall", "send", "send_bytes", "take_fds"}


def _private_reaches(path: Path) -> list[str]:
    """``<something>.client._x`` or ``conn._x``-like reaches in one module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        holder = node.value
        name = holder.id if isinstance(holder, ast.Name) else (
            holder.attr if isinstance(holder, ast.Attribute) else "")
        if name in ("client", "conn", "_conn", "connection"):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_client_lends_nothing_private():
    """A regression guard for the nine members the client used to lend: outside the
    client and the connection, nobody reads ``client._x`` or ``connection._x``."""
    bad = [hit for path in sorted(CLIENT_DIR.glob("*.py"))
           if path.name not in ("_client.py", "_connection.py")
           for hit in _private_reaches(path)]
    assert not bad, "\n".join(bad)
    assert _private_reaches(CLIENT_DIR / "_client.py") == [], "the client asks its connection"


def test_only_the_connection_touches_the_socket():
    bad = []
    for path in sorted(CLIENT_DIR.glob("*.py")):
        if path.name == "_connection.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _SOCKET_CALLS:
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}")
    assert not bad, "\n".join(bad)


def test_every_object_of_a_client_holds_its_connection(client):
    ctx = client.context("npu0")
    buf = client.alloc(16)
    fence = ctx.submit_nowait("work", ms=0)
    with ctx.queue(slots=16) as q:
        objects = [ctx, buf, fence, q, q.submit_nowait(0.0)]
        assert isinstance(client.connection, Connection)
        assert all(o.client.connection is client.connection for o in objects)
        for f in objects[2::2]:
            f.wait(5)
    buf.free()
    client.close()
    with pytest.raises(hetproc.PlatformClosed):
        ctx.submit_nowait("work", ms=0)  # the shared connection is closed for all


def test_a_fence_kept_past_its_client_says_the_client_is_closed(platform):
    """Its words were a mapping of the closed fence table: reading one gave a released
    memoryview's ValueError instead of the error the hierarchy promises."""
    client = platform.connect("short-lived")
    done = client.context("npu0").submit("work", ms=0)
    done.wait(5)
    pending = client.context("npu0").submit_nowait("work", ms=10_000)
    client.close()
    for call in (done.done, done.signal_time, lambda: done.wait(1), lambda: pending.wait(1)):
        with pytest.raises(hetproc.PlatformClosed):
            call()


def test_a_crash_is_explained_from_the_inbox_without_a_request(platform, monkeypatch):
    """The failure record the supervisor sends ahead of the wake is read by the one
    reader and filed: explaining the failure sends nothing at all."""
    client = platform.client
    fence = client.context("npu0").submit("work", ms=5000)
    assert wait_for(lambda: client.metrics()["devices"]["npu0"]["state"] == "busy")
    sent: list[str] = []
    request, notify = Connection.request, Connection.notify
    monkeypatch.setattr(Connection, "request",
                        lambda self, op, **f: sent.append(op) or request(self, op, **f))
    monkeypatch.setattr(Connection, "notify",
                        lambda self, op, **f: sent.append(op) or notify(self, op, **f))
    os.kill(client.metrics()["devices"]["npu0"]["pid"], signal.SIGKILL)
    sent.clear()
    with pytest.raises(hetproc.DeviceCrashed) as info:
        fence.wait(5)
    assert sent == [], "the failure was explained without a request"
    assert info.value.evidence.get("incident") and "died" in str(info.value)
    assert client.failure_record(fence.handle)["message"] == info.value.message


def test_submit_many_and_its_nowait_variant_give_the_same_commands(client):
    """Two functions now, one contract: fences in order, each with a correlation id of
    its own, even for the same command dict submitted twice in one batch."""
    ctx = client.context("npu0")
    cmd = hetproc.command("work", ms=0)
    waited = ctx.submit_many([cmd, cmd])
    sent = ctx.submit_many_nowait([cmd, cmd])
    also_sent = ctx.submit_many([cmd], nowait=True)
    fences = waited + sent + also_sent
    for f in fences:
        f.wait(5)
    assert len({f.cid for f in fences}) == 5 and "cid" not in cmd
    assert all(f.done() and f.error() is None for f in fences)


def test_the_fence_pool_is_refilled_ahead_so_a_submitter_does_not_wait(platform):
    """Past the first fill, every batch of fences is asked for one way, ahead of need, and
    its reply read with the next request: no submit waits for a fence round trip (before:
    one blocking ``fence_create`` per 256 commands, 7-20 ms on a busy machine)."""
    c = platform.client
    conn = c.connection
    npu = c.context("npu0")
    blocking = []
    exchange = conn._exchange

    def counted(msg):
        if msg["op"] == "fence_create":
            blocking.append(msg["count"])
        return exchange(msg)

    conn._exchange = counted
    try:
        fences = [npu.submit_nowait("work", ms=0) for _ in range(900)]
        for f in fences:
            f.wait(10)
    finally:
        conn._exchange = exchange
    assert len(blocking) <= 1, blocking  # only the very first fill, if the pool was empty
    assert len({f.handle for f in fences}) == 900  # every command its own fence


def test_a_connection_asks_for_few_fences_first_and_more_only_when_it_ran_short():
    """Each fence slot the platform hands out costs a named semaphore for the platform's
    life: a client that takes a few fences makes a few dozen, not a full batch of 256;
    one that takes them steadily keeps the size the ask ahead keeps up with (a voice
    model's 125 commands made 240 semaphores, doubling on every ask); one that submits
    in bursts reaches the full batch in a few asks."""
    import hetproc
    from hetproc.client._connection import FENCE_BATCH, FIRST_FENCE_BATCH
    with hetproc.Platform(clock="virtual") as plat:
        conn = plat.client.connection
        asks = []
        send = conn._send

        def sent(msg, **kw):  # (every ask goes out here, waited for or not)
            if msg["op"] == "fence_create":
                asks.append(msg["count"])
            return send(msg, **kw)

        conn._send = sent
        npu = plat.client.context("npu0")
        npu.submit_nowait("work", ms=0).wait(5)
        assert asks == [FIRST_FENCE_BATCH, 2 * FIRST_FENCE_BATCH]  # (the second, ahead)
        assert plat.client.metrics()["fence_semaphores"] <= 64
        for _ in range(150):  # one at a time: the asks ahead keep up
            npu.submit_nowait("work", ms=0).wait(5)
        assert len(asks) > 5 and set(asks[1:]) == {2 * FIRST_FENCE_BATCH}
        assert plat.client.metrics()["fence_semaphores"] <= 128
        steady = len(asks)
        fences = [npu.submit_nowait("work", ms=0) for _ in range(700)]
        for f in fences:
            f.wait(10)
        grown = asks[steady:]
        assert grown == sorted(grown) and grown[-1] == FENCE_BATCH, asks


def test_a_failure_record_read_in_one_go_with_a_late_reply_is_found(tmp_path):
    """One read of the socket may bring several frames: a late reply (the fence batch
    asked for ahead) and, right behind it, the notice of a fence's failure. Looking only
    at whether the socket is readable, the notice stayed buffered and the waiter got the
    bare error; the frames already read are looked at too."""
    import socket

    from hetproc import _protocol
    from hetproc.errors import DeviceTimeout
    from ipc import encode, pack_frame
    address = str(tmp_path / "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    conn = Connection(address, timeout=5)
    peer, _ = listener.accept()
    try:
        fence = (1 << 32) | 7
        error = DeviceTimeout("npu0: the command ran past its watchdog").to_dict()
        peer.sendall(pack_frame(encode(_protocol.reply(99, {"fences": [1, 2]})))
                     + pack_frame(encode(_protocol.notice(error, fence=fence))))
        wait_for(lambda: conn.failure_record(fence) is not None, timeout=5)
        assert conn.failure_record(fence)["message"] == error["message"]
    finally:
        conn.channel.close()
        peer.close()
        listener.close()

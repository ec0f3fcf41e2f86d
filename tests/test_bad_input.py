"""Bad input from a client is refused before it can hurt anyone else (seed §20)."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

import hetproc
from tests.helpers import wait_for


def test_a_command_too_large_for_a_ring_slot_is_refused_and_nothing_wedges(client):
    npu = client.context("npu0")
    with pytest.raises(hetproc.BadPacket, match="too large"):
        npu.submit("work", params={"pad": "a" * 3000})
    assert npu.submit("work", ms=1).wait(5) is None  # the queue head is not blocked
    client.ping()


def test_a_malformed_fault_rule_is_refused_when_armed(client):
    with pytest.raises(hetproc.InvalidRequest, match="every"):
        client.inject("timeout", every="3")
    assert client.context("npu0").submit("work", ms=0).wait(5) is None


def test_a_client_that_never_reads_its_replies_does_not_stall_the_others(platform, client):
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    flood.connect(platform.address)
    hello = msgpack.packb({"v": 1, "op": "hello", "id": 1, "name": "flood", "pid": 1})
    ping = msgpack.packb({"v": 1, "op": "metrics", "id": 2})
    flood.sendall(struct.pack("<I", len(hello)) + hello)
    frame = struct.pack("<I", len(ping)) + ping
    flood.setblocking(False)
    try:
        for _ in range(5000):
            flood.send(frame)
    except BlockingIOError:
        pass
    # The others are still served, in bounded turns (not a measured latency: a behaviour).
    assert client.context("gpu0").submit("work", ms=1).wait(10) is None
    flood.close()
    client.ping()


def test_the_wait_ping_answers_nothing_and_needs_a_hello_first(platform, client):
    """The one-way ping of a virtual-clock wait is taken without decoding it: the same
    bytes from a connection that has not said hello are still refused, and after hello a
    flood of them is never answered (the next reply is the next request's)."""
    from ipc import encode, pack_frame
    ping = pack_frame(encode({"op": "ping", "id": 0}))
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(10)
    raw.connect(platform.address)
    try:
        raw.sendall(ping)

        def refused() -> bool:  # (once accepted and read: a turn or more later)
            last = platform.metrics()["last_error"]
            return last is not None and "say hello first" in last["message"]
        assert wait_for(refused, timeout=10)
        hello = msgpack.packb({"v": 1, "op": "hello", "id": 1, "name": "pinger", "pid": 1})
        raw.sendall(struct.pack("<I", len(hello)) + hello)
        ask = msgpack.packb({"v": 1, "op": "metrics", "id": 2})
        raw.sendall(ping * 500 + struct.pack("<I", len(ask)) + ask)
        replies = [_read_reply(raw), _read_reply(raw)]
        assert [r["id"] for r in replies] == [1, 2] and "error" not in replies[1]
    finally:
        raw.close()
    client.ping()


def _read_reply(sock: socket.socket) -> dict:
    head = _read_exactly(sock, 4)
    return msgpack.unpackb(_read_exactly(sock, struct.unpack("<I", head)[0]))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the supervisor closed the connection"
        data += chunk
    return data

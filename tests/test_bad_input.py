"""Bad input from a client is refused before it can hurt anyone else (seed §20)."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

import hetproc


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

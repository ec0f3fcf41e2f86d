"""What the host pays per command, cut without changing what is checked or sent.

The device remembers the command tails and kernel calls it found valid (their checks are
pure functions of what it remembers them by), never the ones it refused; the client
writes a frame in one non-blocking send when it fits, the rest within its deadline; a
device looks at its segment socket with a poll before reading it; a single-threaded
client publishes its waits without walking its threads.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from device_workers import _commands, _kernels, decode_command, encode_command
from device_workers._kernels import run_kernel
from hetproc.client import Connection
from hetproc.client._vclock import _Threads
from ipc import FrameReader, SegmentCache, errors
from ipc._fdpass import SegmentReceiver

DESC = [3, 0, [4, 4], "float32", None, "r", 0x11]
OUT = [3, 64, [4, 4], "float32", None, "w", 0x12]


def _record(**over) -> bytes:
    args = dict(seq=1, pidx=1, cid=1, kernel="scale", wait=[], signal=[0x40001],
                hold_ns=0, delay_ns=0, dep_timeout_ns=10**9, arrive_ns=0,
                params={"factor": 2.0}, ins=[DESC], outs=[OUT])
    args.update(over)
    return encode_command(**args)


# -- the device's command tails --------------------------------------------------------

def test_a_tail_that_passed_decodes_again_to_a_fresh_command():
    rec = _record()
    first = decode_command(rec)
    first["ins"][0][2].append(99)  # a caller that changes what it got
    first["params"]["factor"] = "x"
    second = decode_command(rec)
    assert second["ins"] == [DESC] and second["outs"] == [OUT]
    assert second["params"] == {"factor": 2.0}
    assert second["ins"] is not first["ins"] and second["params"] is not first["params"]


def test_a_refused_tail_is_refused_every_time_and_never_remembered():
    bad = _record(ins=[[3, 0, [4, 4], "float32", None, "rwx", 0x11]])  # no such permission
    for _ in range(3):
        with pytest.raises(errors.BadPacket):
            decode_command(bad)
    good = _record()
    decode_command(good)  # remembered
    # The same fields but one, after the good one passed: still checked, still refused.
    worse = _record(ins=[[3, 0, [4, 4], "float32", None, "r", -1]])
    with pytest.raises(errors.BadPacket):
        decode_command(worse)
    assert not any(b"rwx" in t for t in _commands._TAILS_PASSED.keys())


def test_the_remembered_tails_are_bounded():
    for i in range(_commands._TAILS_PASSED.limit + 10):
        decode_command(_record(params={"factor": float(i)}))
    assert len(_commands._TAILS_PASSED) <= _commands._TAILS_PASSED.limit


# -- the device's kernel checks --------------------------------------------------------

def _arrays(dtype="float32"):
    return [np.ones((4, 4), dtype)], [np.zeros((4, 4), dtype)]


def test_a_kernel_call_found_invalid_is_refused_every_time():
    ins, outs = _arrays()
    run_kernel("scale", ins, outs, {"factor": 1.0}, lambda: None)  # remembered as valid
    assert (outs[0] == 1.0).all()
    for bad in ({"factor": True}, {"factor": float("nan")}, {"factor": "2"},
                {"factor": 1.0, "extra": 1}):
        for _ in range(2):
            with pytest.raises(errors.InvalidRequest):
                run_kernel("scale", ins, outs, bad, lambda: None)
    ints, iouts = _arrays("int32")
    with pytest.raises(errors.DtypeError):  # the same shapes, another dtype
        run_kernel("scale", ints, iouts, {"factor": 1.0}, lambda: None)


def test_an_int_does_not_stand_for_a_bool_nor_a_float_for_an_int():
    out = [np.zeros(4, np.uint8)]
    run_kernel("fill", [], out, {"value": 1}, lambda: None)
    run_kernel("fill", [], out, {"value": True}, lambda: None)  # a bool is a valid fill
    with pytest.raises(errors.InvalidRequest):  # 1.5 does not fit an integer dtype
        run_kernel("fill", [], out, {"value": 1.5}, lambda: None)
    keys = {k for k in _kernels._CHECKED.passed.keys() if k[0] == "fill"}
    assert any((("value", int, 1),) == k[3] for k in keys)
    assert any((("value", bool, True),) == k[3] for k in keys)
    assert not any(k[3] and k[3][0][1] is float for k in keys)


def test_output_checks_run_on_every_call_whatever_was_remembered():
    ins, outs = _arrays()
    run_kernel("scale", ins, outs, {"factor": 3.0}, lambda: None)
    ro = outs[0].view()
    ro.flags.writeable = False
    with pytest.raises(errors.InvalidRequest, match="read-only"):
        run_kernel("scale", ins, [ro], {"factor": 3.0}, lambda: None)


# -- the supervisor's kernel checks ----------------------------------------------------

def test_a_kernel_call_that_passed_the_supervisor_is_not_walked_again(monkeypatch):
    calls = []
    real = _kernels._validate
    monkeypatch.setattr(_kernels, "_validate", lambda *a: calls.append(a) or real(*a))
    call = ("scale", [((4, 4), "float32")], [((4, 4), "float32")], {"factor": 2.5})
    for _ in range(3):
        _kernels.validate(*call)
    assert len(calls) == 1


def test_a_kernel_call_the_supervisor_refused_is_refused_every_time():
    good = [((4, 4), "float32")]
    _kernels.validate("scale", good, good, {"factor": 1.0})  # remembered
    for ins, params in (([((4, 4), "int32")], {"factor": 1.0}),  # another dtype
                        (good, {"factor": True}), (good, {"factor": float("nan")}),
                        (good, {"factor": 1.0, "extra": 1}),
                        ([((4, 4.0), "float32")], {"factor": 1.0})):  # 4.0 is no 4
        for _ in range(2):
            with pytest.raises((errors.InvalidRequest, errors.DtypeError,
                                errors.ShapeError)):
                _kernels.validate("scale", ins, good, params)
    assert all(k[3] == (("factor", float, 1.0),) or k[3][0][2] == 2.5
               for k in _kernels._VALIDATED.passed.keys() if k[0] == "scale")


# -- the client's writes ----------------------------------------------------------------

@pytest.fixture
def listener(tmp_path):
    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    try:
        yield path, srv
    finally:
        srv.close()


def test_a_frame_larger_than_the_socket_buffer_arrives_whole(listener):
    path, srv = listener
    conn = Connection(path, timeout=5.0)
    peer, _ = srv.accept()
    got: list[bytes] = []

    def read() -> None:
        reader = FrameReader()
        while not got:
            data = peer.recv(1 << 16)
            if not data:
                return
            got.extend(reader.feed(data))

    t = threading.Thread(target=read)
    t.start()
    blob = os.urandom(900_000)  # far more than a Unix socket buffers at once
    conn._write({"op": "x", "id": 0, "blob": blob})
    t.join(10)
    from ipc import unpack
    assert len(got) == 1 and unpack(got[0])["blob"] == blob
    peer.close()
    conn.channel.close()


def test_a_peer_that_never_reads_makes_a_write_time_out_not_hang(listener):
    path, srv = listener
    conn = Connection(path, timeout=0.3)
    peer, _ = srv.accept()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        for _ in range(64):  # fills the buffer, then the deadline must end the write
            conn._write({"op": "x", "id": 0, "blob": b"\0" * (1 << 18)})
    assert time.monotonic() - t0 < 5.0
    peer.close()
    conn.channel.close()


# -- the device's segment socket ----------------------------------------------------------

def test_an_empty_segment_socket_reads_nothing_and_a_closed_one_is_seen():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cache = SegmentCache()
    rx = SegmentReceiver(b, cache)
    try:
        assert rx.drain() == 0 and not rx.closed
        a.send(b"\0" * 3)  # garbage still gets read (and counted), not skipped
        assert rx.drain() == 0 and rx.garbage == 1
        a.close()
        assert rx.drain() == 0 and rx.closed, "a hang-up must be read even with no data"
    finally:
        rx.close()
        cache.close()


# -- the client's waiter slot -------------------------------------------------------------

class _Conn:
    def __init__(self) -> None:
        from ipc import clock
        self.words = memoryview(bytearray(clock.segment_bytes(0, 1))).cast("Q")
        self.waiter = clock.Waiter(self.words, 0)


def _slot(conn: _Conn) -> tuple[int, int]:
    from ipc import clock
    first = clock.segment_bytes(0, 0) // 8  # the header's words: slot 0 comes next
    return conn.words[first + clock.WAKE], conn.words[first + clock.FENCE]


def test_one_thread_publishes_its_wait_and_its_run():
    threads, conn = _Threads(), _Conn()
    threads.known(conn)
    threads.wait(conn, 500, 0x77)
    assert _slot(conn) == (500, 0x77)
    threads.run()
    assert _slot(conn)[0] == 0
    threads.wait(conn, 900)  # a sleep: no fence
    assert _slot(conn) == (900, 0)


@contextlib.contextmanager
def _another_thread_running(threads: _Threads, conn: _Conn) -> Iterator[None]:
    """A second thread known on ``conn``, running until the block ends (then it ends)."""
    started, stop = threading.Event(), threading.Event()

    def other() -> None:
        threads.known(conn)  # known, and running
        started.set()
        stop.wait(5)

    t = threading.Thread(target=other)
    t.start()
    started.wait(5)
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def test_a_second_thread_running_keeps_the_process_running():
    threads, conn = _Threads(), _Conn()
    threads.known(conn)
    with _another_thread_running(threads, conn):
        threads.wait(conn, 500, 0x77)
        assert _slot(conn)[0] == 0, "another known thread runs: the process is not blocked"
    threads.look()  # the other ended: the waiter alone is left, blocked
    assert _slot(conn) == (500, 0x77)


def test_one_thread_on_several_connections_shows_blocked_only_where_it_waits():
    """A single-threaded client holding three connections (a scenario's tenants): its
    wait says blocked in that connection's slot alone, and every slot says running once
    it runs again -- a slot left blocked would let the clock jump while it runs."""
    threads, conns = _Threads(), [_Conn(), _Conn(), _Conn()]
    for conn in conns:
        threads.known(conn)
    for k in (2, 0, 1, 1, 2):
        threads.wait(conns[k], 500 + k, 0x70 + k)
        assert _slot(conns[k]) == (500 + k, 0x70 + k), k
        assert [_slot(c)[0] for i, c in enumerate(conns) if i != k] == [0, 0], k
        threads.run()
        assert [_slot(c)[0] for c in conns] == [0, 0, 0], k


def test_the_slot_a_second_thread_left_blocked_is_cleared_once_one_thread_is_left():
    """A wait published while another known thread lived (every slot walked), then that
    thread ended: the single thread's next publishes still clear what was shown."""
    threads, a, b = _Threads(), _Conn(), _Conn()
    threads.known(a)
    with _another_thread_running(threads, b):
        threads.wait(a, 500, 0x77)
        assert _slot(a)[0] == 0 and _slot(b)[0] == 0, "the other runs: nothing blocked"
    threads.look()  # the other ended: the waiter alone is left, blocked on ``a``
    assert _slot(a) == (500, 0x77) and _slot(b)[0] == 0
    threads.run()
    assert _slot(a)[0] == 0 and _slot(b)[0] == 0
    threads.wait(b, 600, 0x78)
    assert _slot(b) == (600, 0x78) and _slot(a)[0] == 0

"""The ipc core across real processes: fences, rings, packets, pools, names."""

from __future__ import annotations

import multiprocessing as mp
import time

import msgpack
import pytest

from ipc import (
    BlockPool,
    FenceTable,
    Ring,
    Segment,
    cleanup_prefix,
    decode,
    encode,
    entries_with_prefix,
    errors,
    new_prefix,
)
from ipc._fences import FAILED, PENDING

CTX = mp.get_context("fork")


@pytest.fixture
def table():
    prefix = new_prefix()
    seg = Segment.create(prefix + "fences", FenceTable.segment_bytes(256))
    ft = FenceTable(prefix, seg, create=True)
    yield ft
    ft.close(unlink=True)
    seg.close()
    seg.unlink()
    cleanup_prefix(prefix)
    assert entries_with_prefix(prefix) == []


def _waiter(prefix, seg_name, handle, timeout, out):
    ft = FenceTable(prefix, Segment.attach(seg_name), create=False)
    try:
        out.put(("ok", ft.wait(handle, timeout), time.monotonic_ns()))
    except errors.HetprocError as exc:
        out.put((exc.name, exc.code, time.monotonic_ns()))


def _spawn_waiters(ft, handle, n, timeout=5.0):
    out = CTX.Queue()
    procs = [CTX.Process(target=_waiter, args=(ft.prefix, ft.segment.name, handle, timeout, out))
             for _ in range(n)]
    for p in procs:
        p.start()
    return procs, out


def _collect(procs, out, n):
    results = [out.get(timeout=10) for _ in range(n)]
    for p in procs:
        p.join(5)
        assert p.exitcode == 0
    return results


def test_many_waiters_in_other_processes_all_wake(table):
    h = table.allocate()
    procs, out = _spawn_waiters(table, h, 6)
    time.sleep(0.1)  # let them block on the semaphore
    t_signal = time.monotonic_ns()
    assert table.signal(h)
    results = _collect(procs, out, 6)
    assert [r[:2] for r in results] == [("ok", 0)] * 6
    assert all(r[2] >= t_signal for r in results)


def test_error_signal_wakes_every_waiter_with_the_code(table):
    h = table.allocate()
    procs, out = _spawn_waiters(table, h, 4)
    time.sleep(0.1)
    table.signal(h, errors.DeviceTimeout.code)
    assert [r[:2] for r in _collect(procs, out, 4)] == [("ok", errors.DeviceTimeout.code)] * 4
    assert table.poll(h) == (FAILED, errors.DeviceTimeout.code)


def test_wait_times_out_and_the_fence_stays_pending(table):
    h = table.allocate()
    procs, out = _spawn_waiters(table, h, 2, timeout=0.05)
    assert [r[0] for r in _collect(procs, out, 2)] == ["FenceTimeout"] * 2
    assert table.poll(h) == (PENDING, 0)


def test_first_outcome_is_final(table):
    h = table.allocate()
    assert table.signal(h, errors.Cancelled.code)
    assert not table.signal(h, 0)  # a late success never overrides the failure
    assert table.poll(h) == (FAILED, errors.Cancelled.code)


def test_bulk_allocation_gives_fresh_pending_fences_all_or_none(table):
    old = table.allocate(cid=7)
    table.signal(old)
    table.release(old)
    got = table.allocate_many(200)
    assert len(set(got)) == 200 and old not in got
    assert all(table.poll(h) == (PENDING, 0) for h in got)
    assert all(table.info(h)["cid"] == 0 and table.info(h)["t_ns"] == 0 for h in got)
    assert not table.signal(old), "the recycled slot's old handle stays stale"
    live = table.live_count()
    with pytest.raises(errors.OutOfMemory):
        table.allocate_many(100)  # 56 slots left: none is taken
    assert table.live_count() == live
    assert len(table.allocate_many(56)) == 56
    table.signal(got[0])
    table.release_many(got[:100] + [old, got[0]])  # a stale handle, a repeat: skipped
    assert table.live_count() == 156
    assert not table.signal(got[1]), "a released fence's handle goes stale"
    again = table.allocate_many(100)
    assert not set(again) & set(got) and all(table.poll(h) == (PENDING, 0) for h in again)


def test_late_signal_on_recycled_slot_touches_nothing(table):
    old = table.allocate()
    table.release(old)
    new = table.allocate()
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF, "the slot is reused"
    assert not table.signal(old), "a stale handle must not signal the new fence"
    assert table.poll(new) == (PENDING, 0)
    with pytest.raises(errors.StaleHandle):
        table.wait(old, 0.01)
    with pytest.raises(errors.InvalidHandle):
        table.poll(12345 << 32 | 999999)


def test_recycled_slot_starts_without_leftover_tokens(table):
    h = table.allocate()
    table.signal(h)
    table.wait(h, 1.0)  # leaves the passed-on token in the semaphore
    table.release(h)
    h2 = table.allocate()
    with pytest.raises(errors.FenceTimeout):
        table.wait(h2, 0.05)


def test_fence_semaphores_come_from_a_pool(table):
    handles = [table.allocate() for _ in range(10)]
    for h in handles:
        table.release(h)
    created = len(table._sems)
    for _ in range(50):
        table.release(table.allocate())
    assert len(table._sems) == created, "steady-state fences must not sem_open"


def test_ring_wraps_and_reports_full():
    buf = memoryview(bytearray(Ring.nbytes(4, 64)))
    ring = Ring(buf, slots=4, slot_bytes=64, create=True)
    for round_ in range(5):
        for i in range(4):
            assert ring.try_put(f"{round_}:{i}".encode())
        assert not ring.try_put(b"x"), "full ring refuses, never overwrites"
        assert [ring.get() for _ in range(4)] == [f"{round_}:{i}".encode() for i in range(4)]
        assert ring.get() is None


def test_ring_rejects_oversize_and_survives_corrupt_length():
    buf = memoryview(bytearray(Ring.nbytes(4, 64)))
    ring = Ring(buf, slots=4, slot_bytes=64, create=True)
    with pytest.raises(errors.BadPacket):
        ring.try_put(b"x" * 61)
    ring.try_put(b"good")
    buf[128:132] = (10_000).to_bytes(4, "little")  # a corrupt length in the slot
    ring.try_put(b"next")
    with pytest.raises(errors.BadPacket):
        ring.get()
    assert ring.get() == b"next", "the reader skips the bad slot and goes on"


def _ring_consumer(name, n, out):
    seg = Segment.attach(name)
    ring = Ring(memoryview(seg.map), slots=64, slot_bytes=64, create=False)
    got, deadline = [], time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        data = ring.get()
        if data is not None:
            got.append(int(data))
    out.put(got)


def test_ring_carries_every_message_in_order_across_processes():
    prefix = new_prefix()
    seg = Segment.create(prefix + "ring", Ring.nbytes(64, 64))
    try:
        ring = Ring(memoryview(seg.map), slots=64, slot_bytes=64, create=True)
        out = CTX.Queue()
        p = CTX.Process(target=_ring_consumer, args=(seg.name, 5000, out))
        p.start()
        i = 0
        while i < 5000:
            if ring.try_put(str(i).encode()):
                i += 1
        assert out.get(timeout=15) == list(range(5000))
        p.join(5)
    finally:
        seg.unlink()


SCHEMAS = {"exec": {"seq": int, "name?": str}}


@pytest.mark.parametrize("data, why", [
    (b"\xc1garbage", "undecodable"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (msgpack.packb({"v": 99, "op": "exec", "seq": 1}), "version"),
    (msgpack.packb({"v": 1, "op": "nope"}), "unknown packet op"),
    (msgpack.packb({"v": 1, "op": "exec"}), "missing field"),
    (msgpack.packb({"v": 1, "op": "exec", "seq": "1"}), "must be int"),
    (msgpack.packb({"v": 1, "op": "exec", "seq": True}), "got bool"),
    (msgpack.packb({"v": 1, "op": "exec", "seq": 1, "name": 5}), "must be str"),
])
def test_malformed_packets_get_a_clear_error(data, why):
    with pytest.raises(errors.BadPacket, match=why):
        decode(data, SCHEMAS)


def test_packet_round_trip():
    assert decode(encode({"op": "exec", "seq": 3}), SCHEMAS)["seq"] == 3


def test_pool_reuses_memory_without_new_segments():
    prefix = new_prefix()
    pool = BlockPool(prefix, limit=64 << 20)
    try:
        blocks = [pool.allocate(100_000) for _ in range(8)]
        assert all(b.offset % 4096 == 0 for b in blocks)
        segs = len(pool.segments)
        for _ in range(20):
            for b in blocks:
                pool.free(b)
            blocks = [pool.allocate(100_000) for _ in range(8)]
        assert len(pool.segments) == segs, "steady-state allocation must not create segments"
        with pytest.raises(MemoryError):
            pool.allocate(128 << 20)
    finally:
        pool.close(unlink=True)
    assert entries_with_prefix(prefix) == []


def test_segment_views_are_bounds_checked():
    prefix = new_prefix()
    seg = Segment.create(prefix + "s", 4096)
    try:
        v = seg.view(0, (16, 16), "float32")
        v[:] = 1.5
        assert Segment.attach(seg.name).view(0, (16, 16), "float32").sum() == 384
        with pytest.raises(ValueError):
            seg.view(4000, (100,), "float32")
        with pytest.raises(ValueError):
            seg.view(0, (4, 4), "float32", strides=(-16, 4))
    finally:
        seg.unlink()


def test_a_fence_wait_in_a_thread_outlasts_signals_and_keeps_its_deadline(platform):
    """A runtime's waiter thread is hit by signals (an interval timer, SIGCHLD...): its
    fence wait neither ends early with the signal's EINTR nor outlives its deadline, and it
    returns once another process signals the fence. (In the main thread the signal's own
    handler decides: Ctrl-C ends the wait there.)"""
    import json
    import signal
    import subprocess
    import sys
    import threading

    import hetproc

    fence = platform.client.fence()
    token = fence.export(signal=True)
    outcome: list = []
    signalled = threading.Event()

    def waiter() -> None:
        try:
            with pytest.raises(hetproc.FenceTimeout):
                fence.wait(0.3)
            signalled.wait(60)
            outcome.append(fence.wait(10))
        except BaseException as exc:  # the test reports what escaped
            outcome.append(exc)

    old = signal.signal(signal.SIGALRM, lambda *_: None)
    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        kicks = 0
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline:  # aimed at the waiter: its sem_timedwait sees EINTR
            signal.pthread_kill(thread.ident, signal.SIGALRM)
            kicks += 1
            time.sleep(0.002)
        code = ("import json, sys, hetproc; c = hetproc.connect(json.loads(sys.argv[1]));"
                "c.import_fence(int(sys.argv[2])).signal(); c.close()")
        subprocess.run([sys.executable, "-c", code, json.dumps(platform.address), str(token)],
                       check=True, timeout=60)
        signalled.set()
        thread.join(30)
    finally:
        signalled.set()
        signal.signal(signal.SIGALRM, old)
    assert kicks > 10 and not thread.is_alive()
    assert outcome == [None] or outcome == [0], outcome


class _Stop(Exception):
    pass


def _wait_in_main(table, handle: int, how: str) -> int:
    """The fence's code, waited for in the main thread by ``FenceTable.wait`` or by the
    virtual clock's sleeps (``wait_once`` until it completes)."""
    from ipc import wait_fence_once
    if how == "wait":
        return table.wait(handle, 30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code = wait_fence_once(table, handle, 1.0)
        if code is not None:
            return code
    raise AssertionError("never completed")


@pytest.mark.parametrize("libc", [True, False], ids=["libc", "signal-module"])
@pytest.mark.parametrize("how", ["wait", "wait_once"])
def test_a_signal_handled_in_the_main_thread_neither_ends_its_fence_wait_nor_is_lost(
        table, how, libc, monkeypatch):
    """A program's own signals reach the main thread while it waits on a fence (a SIGCHLD
    handler, a profiler's timer): a handler that returns leaves the wait asleep until the
    fence completes, one that raises ends it with its own exception, and the fence's token
    is still there for the next wait. (posix_ipc turned both into SignalError: the wait
    failed on a harmless signal, and a test runner's timeout lost its message.)"""
    import signal
    import threading

    from ipc import _fences
    if not libc:
        monkeypatch.setattr(_fences._SIGNALS, "_mask", None)
    main = threading.main_thread().ident
    handled: list[int] = []
    raising = [False]

    def handler(signum, frame):
        handled.append(signum)
        if raising[0]:
            raise _Stop

    kickers: list[threading.Thread] = []

    def kick(times: int, then_signal: int | None) -> threading.Thread:
        def run() -> None:
            for _ in range(times):
                time.sleep(0.003)
                signal.pthread_kill(main, signal.SIGALRM)  # aimed at the sleeping thread
            if then_signal is not None:
                time.sleep(0.02)
                table.signal(then_signal)
        thread = threading.Thread(target=run)
        thread.start()
        kickers.append(thread)
        return thread

    old = signal.signal(signal.SIGALRM, handler)
    try:
        h = table.allocate()
        kicker = kick(40, h)
        assert _wait_in_main(table, h, how) == 0
        kicker.join(30)
        assert len(handled) >= 1  # every handler ran (kicks may merge while held)

        h2 = table.allocate()
        raising[0] = True
        kicker = kick(1, None)
        with pytest.raises(_Stop):
            _wait_in_main(table, h2, how)
        kicker.join(30)
        raising[0] = False
        assert table.poll(h2)[0] == PENDING
        table.signal(h2)
        assert _wait_in_main(table, h2, how) == 0
    finally:
        for thread in kickers:  # none may kick once the runner's own handler is back
            thread.join(30)
        signal.signal(signal.SIGALRM, old)


def test_a_nudge_ends_one_sleep_of_a_pending_fence_and_never_completes_it(table):
    """The virtual clock's wake-up of a waiter asleep on a fence (``nudge``): its one
    sleep (``wait_once``) ends with the fence still pending; a completed or stale fence
    is left alone, and a token of a completed fence is passed on to the next waiter."""
    from ipc import nudge_fence, wait_fence_once
    h = table.allocate()
    slot = h & 0xFFFFFFFF
    nudge_fence(table, h)
    assert table._sem(slot).value == 1
    assert wait_fence_once(table, h, 30.0) is None  # the token, not the 30 s
    assert table._sem(slot).value == 0 and table.poll(h) == (PENDING, 0)
    assert wait_fence_once(table, h, 0.0) is None  # no token left: the slice ends
    table.signal(h, errors.Cancelled.code)
    nudge_fence(table, h)  # completed: no token
    assert wait_fence_once(table, h, 0.0) == errors.Cancelled.code
    assert table._sem(slot).value == 1, "the signal's token passed on"
    table.release(h)
    nudge_fence(table, h)  # stale: nothing
    with pytest.raises(errors.StaleHandle):
        wait_fence_once(table, h, 0.0)


def test_a_slot_map_finds_what_get_returns_and_nothing_once_removed():
    """``find`` (the quota's count over a tenant's own contexts) answers the live object
    of a handle, as ``get`` does, and None where ``get`` raises: a removed handle, and
    the old handle of a recycled slot."""
    from ipc._slotmap import SlotMap

    m: SlotMap[str] = SlotMap("thing")
    a = m.insert("a")
    assert m.find(a) == m.get(a) == "a"
    m.remove(a)
    b = m.insert("b")  # the same slot, a new generation
    assert b & 0xFFFFFFFF == a & 0xFFFFFFFF and b != a
    assert m.find(a) is None and m.find(b) == "b"
    with pytest.raises(errors.StaleHandle):
        m.get(a)
    assert m.find((5 << 32) | 7) is None  # a slot never made


def test_a_ring_s_words_say_what_its_depth_says():
    """The supervisor polls its completion rings by their head and tail words (no call
    per ring per loop turn): they must agree with ``depth`` through puts, gets and a
    reset."""
    buf = bytearray(Ring.nbytes(4, 64))
    ring = Ring(memoryview(buf), slots=4, slot_bytes=64, create=True)

    def pending() -> bool:
        words = ring.words
        return words[0] != words[Ring.TAIL]

    assert not pending() and ring.depth() == 0
    for n in range(1, 4):
        ring.try_put(b"x")
        assert pending() and ring.depth() == n
    ring.get()
    assert pending() and ring.depth() == 2
    ring.reset()
    assert not pending() and ring.depth() == 0


def test_a_waiter_asleep_on_a_completed_fence_is_about_to_run(table):
    """Who blocks last wakes the supervisor, once every other waiter is blocked; one
    asleep on a fence that completed is about to run (it says so itself when it blocks
    again), so a device that signalled its consumer's input and then blocked no longer
    wakes the supervisor to find the consumer running. A stale handle counts as done:
    its waiter wakes to find out."""
    from ipc import clock
    seg = Segment.create(table.prefix + "clock", clock.segment_bytes(3, 0))
    try:
        vclock = clock.VirtualClock(seg, create=True)
        _, consumer, idle = (vclock.waiter(i) for i in range(3))  # 0: the producer
        fence = table.allocate()
        consumer.block(clock.NO_WAKE, fence)
        idle.block(clock.NO_WAKE)
        assert table.pending(fence)
        assert vclock.all_blocked(range(3), but=0, pending=table.pending)
        table.signal(fence)  # the producer signals the consumer's input, then blocks
        assert not table.pending(fence)
        assert not vclock.all_blocked(range(3), but=0, pending=table.pending)
        assert vclock.all_blocked(range(3), but=0)  # (its slot alone still says blocked)
        table.release(fence)
        assert not table.pending(fence)  # stale
        vclock.close()
    finally:
        seg.close()
        seg.unlink()

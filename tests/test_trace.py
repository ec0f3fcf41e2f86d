"""The ring trace across real processes, and its Perfetto (Chrome Trace Event JSON) export.

No test asserts a wall-clock duration: timing figures are printed, never checked.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import defaultdict
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetproc.trace import flow_chains, validate
from hetproc.trace._perfetto import tid_for, to_chrome_trace, write_chrome_trace
from ipc._trace import (
    BEGIN,
    END,
    INSTANT,
    RECORD_DTYPE,
    Stage,
    TraceRing,
    freeze,
    merge,
)

FORK = mp.get_context("fork")
WAIT_S = 30.0  # generous deadline for a hand-off between processes: never a timing check

T_CLIENT, T_SCHED, T_NPU = 1, 2, 3
TRACKS = {T_CLIENT: "camera client", T_SCHED: "scheduler", T_NPU: "npu0"}


@pytest.fixture
def segment():
    """Make shared-memory segments; unlink them whatever happens, close after the rings."""
    made: list[SharedMemory] = []
    rings: list[TraceRing] = []

    def make(size: int) -> tuple[SharedMemory, list[TraceRing]]:
        shm = SharedMemory(create=True, size=size)
        made.append(shm)
        return shm, rings

    try:
        yield make
    finally:
        for ring in rings:
            ring.close()
        for shm in made:
            shm.unlink()
            shm.close()


# -- one request through three processes -------------------------------------------------


def _attach_writer(buf: memoryview, k: int, cap: int) -> TraceRing:
    n = TraceRing.nbytes(cap)
    # A non-zero pid claims the ring: records carry this (forked) process's pid.
    return TraceRing(buf[k * n:(k + 1) * n], create=False, pid=os.getpid())


def _client(buf, cap, cid, to_sched, to_client):
    ring = _attach_writer(buf, 0, cap)
    ring.begin(Stage.SUBMIT, cid, T_CLIENT)
    ring.begin(Stage.IMPORT, cid, T_CLIENT, a0=4096)
    ring.end(Stage.IMPORT, cid, T_CLIENT)
    ring.begin(Stage.MAP, cid, T_CLIENT)
    ring.end(Stage.MAP, cid, T_CLIENT)
    ring.instant(Stage.COPY, 99, T_CLIENT)  # another request's record in between
    ring.end(Stage.SUBMIT, cid, T_CLIENT)
    to_sched.set()
    if not to_client.wait(WAIT_S):
        raise SystemExit(2)
    ring.begin(Stage.WAKE, cid, T_CLIENT)
    ring.end(Stage.WAKE, cid, T_CLIENT)
    ring.begin(Stage.CALLBACK, cid, T_CLIENT)
    ring.end(Stage.CALLBACK, cid, T_CLIENT)


def _supervisor(buf, cap, cid, to_sched, to_device):
    ring = _attach_writer(buf, 1, cap)
    ring.counter(Stage.QUEUE_DEPTH, 0, T_SCHED)
    if not to_sched.wait(WAIT_S):
        raise SystemExit(2)
    ring.begin(Stage.ENQUEUE, cid, T_SCHED)
    ring.end(Stage.ENQUEUE, cid, T_SCHED)
    ring.counter(Stage.QUEUE_DEPTH, 1, T_SCHED)
    to_device.set()


def _device(buf, cap, cid, to_device, to_client):
    ring = _attach_writer(buf, 2, cap)
    ring.begin(Stage.EXEC, 98, T_NPU)
    ring.end(Stage.EXEC, 98, T_NPU)
    if not to_device.wait(WAIT_S):
        raise SystemExit(2)
    ring.begin(Stage.QUEUED, cid, T_NPU)
    ring.end(Stage.QUEUED, cid, T_NPU)
    ring.begin(Stage.EXEC, cid, T_NPU)
    ring.end(Stage.EXEC, cid, T_NPU, a0=1)
    ring.instant(Stage.SIGNAL, cid, T_NPU)
    to_client.set()


def _run_three_processes(buf, cap, cid):
    to_sched, to_device, to_client = FORK.Event(), FORK.Event(), FORK.Event()
    procs = [
        FORK.Process(target=_client, args=(buf, cap, cid, to_sched, to_client)),
        FORK.Process(target=_supervisor, args=(buf, cap, cid, to_sched, to_device)),
        FORK.Process(target=_device, args=(buf, cap, cid, to_device, to_client)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(WAIT_S * 2)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    return [p.pid for p in procs]


def test_one_request_is_traced_in_order_across_three_processes(segment):
    cap, cid = 256, 7
    n = TraceRing.nbytes(cap)
    shm, rings = segment(3 * n)
    # The supervisor lays out the rings; each process then claims its own.
    for k in range(3):
        rings.append(TraceRing(shm.buf[k * n:(k + 1) * n], create=True, capacity=cap))
    client, sup, dev = _run_three_processes(shm.buf, cap, cid)

    assert [r.pid for r in rings] == [client, sup, dev]
    merged = merge(*(r.snapshot() for r in rings))
    assert np.all(np.diff(merged["t_ns"].astype(np.int64)) >= 0)
    mine = merged[merged["cid"] == cid]
    got = [(Stage(s).name, int(ph), int(pid)) for s, ph, pid in
           zip(mine["stage"], mine["phase"], mine["pid"])]
    want = [
        ("SUBMIT", BEGIN, client), ("IMPORT", BEGIN, client), ("IMPORT", END, client),
        ("MAP", BEGIN, client), ("MAP", END, client), ("SUBMIT", END, client),
        ("ENQUEUE", BEGIN, sup), ("ENQUEUE", END, sup),
        ("QUEUED", BEGIN, dev), ("QUEUED", END, dev),
        ("EXEC", BEGIN, dev), ("EXEC", END, dev), ("SIGNAL", INSTANT, dev),
        ("WAKE", BEGIN, client), ("WAKE", END, client),
        ("CALLBACK", BEGIN, client), ("CALLBACK", END, client),
    ]
    assert got == want
    assert mine[(mine["stage"] == Stage.IMPORT) & (mine["phase"] == BEGIN)]["a0"][0] == 4096

    # The same evidence exported: one flow chain links the request's stages across pids,
    # in stage order, ending at the client (IMPORT and MAP are parts of SUBMIT: no step).
    trace = to_chrome_trace(merged, track_names=TRACKS,
                            process_names={client: "camera", sup: "supervisor", dev: "npu0"})
    chain = [e for e in trace["traceEvents"] if e["ph"] in "stf" and e.get("id") == cid]
    # SUBMIT (client) ENQUEUE (supervisor) QUEUED EXEC (device) WAKE CALLBACK (client)
    assert [e["ph"] for e in chain] == ["s"] + ["t"] * 4 + ["f"]
    assert [e["pid"] for e in chain] == [client, sup, dev, dev, client, client]
    assert validate(trace) == []


# -- wrapping, freezing, concurrent readers ----------------------------------------------


def test_wrapped_ring_keeps_the_last_capacity_records_and_a_frozen_window_its_old_ones():
    cap = 64
    buf = bytearray(TraceRing.nbytes(cap))
    with TraceRing(buf, create=True, capacity=cap) as ring:
        for i in range(cap // 2):
            ring.emit(Stage.EXEC, INSTANT, cid=i, a0=i, t_ns=1_000 + i)
        frozen = freeze(ring, t_from_ns=1_000, t_to_ns=1_010)  # e.g. around an error
        assert frozen["a0"].tolist() == list(range(11))

        total = cap // 2 + 10 * cap
        for i in range(cap // 2, total):
            ring.emit(Stage.EXEC, INSTANT, cid=i, a0=i, t_ns=1_000 + i)
        assert ring.written == total

        snap = ring.snapshot()
        assert snap["a0"].tolist() == list(range(total - cap, total))
        assert snap["t_ns"].tolist() == [1_000 + i for i in range(total - cap, total)]
        assert len(ring.window(1_000, 1_010)) == 0  # the ring forgot ...
        assert frozen["a0"].tolist() == list(range(11))  # ... the frozen copy did not
        assert frozen.base is None or not isinstance(frozen.base, memoryview)


def test_a_pair_writes_what_two_emits_and_a_counter_write_also_across_the_ring_end():
    cap = 8
    for start in range(cap):  # every first slot: the last ones wrap
        for counted in (False, True):
            one = TraceRing(bytearray(TraceRing.nbytes(cap)), create=True, capacity=cap, pid=42)
            two = TraceRing(bytearray(TraceRing.nbytes(cap)), create=True, capacity=cap, pid=42)
            for i in range(start):
                one.counter(Stage.INFLIGHT, i, 1, t_ns=500 + i)
                two.counter(Stage.INFLIGHT, i, 1, t_ns=500 + i)
            one.emit(Stage.HOST_EXEC, INSTANT, 7, 5, 10, -1, 7, t_ns=1_000)
            one.emit(Stage.EXEC, END, 7, 5, 3, 4, 9, t_ns=2_000)
            extra = ()
            if counted:  # the counter sample after them, at the first record's time
                one.counter(Stage.MODEL_LAGS, 11, 5, t_ns=1_000)
                extra = (Stage.MODEL_LAGS, 11)
            two.pair(7, 5, Stage.HOST_EXEC, INSTANT, 1_000, 10, -1, 7, Stage.EXEC, END, 2_000,
                     3, 4, 9, *extra)
            assert two.written == one.written
            assert one.snapshot().tobytes() == two.snapshot().tobytes()
    two.enabled = False
    two.pair(0, 0, Stage.EXEC, INSTANT, 1, 0, 0, 0, Stage.EXEC, INSTANT, 2)
    two.pair(0, 0, Stage.EXEC, INSTANT, 1, 0, 0, 0, Stage.EXEC, INSTANT, 2, 0, 0, 0, 9, 1)
    assert two.written == one.written


def _hammer(buf, cap, started, n):
    ring = TraceRing(buf[:TraceRing.nbytes(cap)], create=False, pid=os.getpid())
    started.set()
    for i in range(n):
        # Every field derives from i, so a record mixing two writes is detectable.
        ring.emit(Stage.COPY, INSTANT, cid=i + 1, track=i & 0xFFFF, a0=i, a1=3 * i,
                  a2=-i, t_ns=10_000 + i)


def _assert_intact(snap):
    a0 = snap["a0"].astype(np.int64)
    assert np.all(np.diff(a0) == 1), "records must be consecutive"
    assert np.array_equal(snap["a1"], 3 * a0)
    assert np.array_equal(snap["a2"], -a0)
    assert np.array_equal(snap["t_ns"].astype(np.int64), 10_000 + a0)
    assert np.array_equal(snap["cid"].astype(np.int64), a0 + 1)
    assert np.array_equal(snap["track"].astype(np.int64), a0 & 0xFFFF)


def test_snapshot_while_another_process_writes_never_returns_a_torn_record(segment):
    cap, n = 128, 200_000
    shm, rings = segment(TraceRing.nbytes(cap))
    rings.append(TraceRing(shm.buf[:TraceRing.nbytes(cap)], create=True, capacity=cap))
    reader = rings[0]
    started = FORK.Event()
    p = FORK.Process(target=_hammer, args=(shm.buf, cap, started, n))
    p.start()
    try:
        assert started.wait(WAIT_S)
        snaps = 0
        while p.is_alive():
            snap = reader.snapshot()
            assert len(snap) <= cap
            _assert_intact(snap)
            snaps += 1
        p.join(WAIT_S)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == 0
    print(f"\n{snaps} snapshots taken while the writer ran")
    last = reader.snapshot()
    assert last["a0"].tolist() == list(range(n - cap, n))


def test_disabled_ring_writes_nothing_and_a_closed_one_ignores_late_emits():
    buf = bytearray(TraceRing.nbytes(8))
    ring = TraceRing(buf, create=True, capacity=8)
    ring.enabled = False
    emit = ring.begin  # a hot caller may cache the bound writer
    emit(Stage.EXEC, 1)
    ring.counter(Stage.INFLIGHT, 3)
    assert ring.written == 0
    ring.enabled = True
    emit(Stage.EXEC, 1)
    assert ring.written == 1
    ring.close()
    ring.emit(Stage.EXEC, END, 1)  # no error: tracing must not break a shutdown path


def test_attach_checks_the_header():
    buf = bytearray(TraceRing.nbytes(16))
    with pytest.raises(ValueError):
        TraceRing(buf, create=False)  # all zeros: no magic
    with pytest.raises(ValueError):
        TraceRing(buf, create=True, capacity=12)  # not a power of two
    TraceRing(buf, create=True, capacity=16, pid=4242).close()
    with pytest.raises(ValueError):
        TraceRing(buf, create=False, capacity=32)
    with TraceRing(buf, create=False) as reader:
        assert reader.pid == 4242 and reader.capacity == 16


def test_stage_numbers_are_unique_and_fit_a_byte():
    values = [s.value for s in Stage]
    assert len(values) == len(set(values))
    assert all(0 < v < 256 for v in values)
    assert Stage.SUBMIT < Stage.QUEUED < Stage.EXEC < Stage.SIGNAL < Stage.CALLBACK


# -- export --------------------------------------------------------------------------------

T0 = 5_000_000_000


def _scenario_records():
    """Three pids with exact times (ns after T0): a request (cid 7) and a second (cid 8)."""
    buf = {pid: bytearray(TraceRing.nbytes(64)) for pid in (101, 102, 103)}
    r = {pid: TraceRing(b, create=True, capacity=64, pid=pid) for pid, b in buf.items()}
    cam, sup, npu = r[101], r[102], r[103]
    npu.end(Stage.COPY, 9, T_NPU, t_ns=T0 + 100_000)  # its BEGIN was lost: dropped
    cam.begin(Stage.SUBMIT, 7, T_CLIENT, t_ns=T0)
    cam.end(Stage.SUBMIT, 7, T_CLIENT, t_ns=T0 + 250_000)
    sup.begin(Stage.ENQUEUE, 7, T_SCHED, t_ns=T0 + 300_000)
    sup.end(Stage.ENQUEUE, 7, T_SCHED, t_ns=T0 + 320_000)
    sup.counter(Stage.QUEUE_DEPTH, 1, T_SCHED, t_ns=T0 + 320_000)
    npu.begin(Stage.QUEUED, 7, T_NPU, t_ns=T0 + 320_000)
    npu.begin(Stage.QUEUED, 8, T_NPU, t_ns=T0 + 400_000)  # overlaps cid 7's, not nested
    npu.end(Stage.QUEUED, 7, T_NPU, t_ns=T0 + 1_500_000)
    npu.begin(Stage.EXEC, 7, T_NPU, a0=3, t_ns=T0 + 1_500_000)
    sup.counter(Stage.QUEUE_DEPTH, 0, T_SCHED, t_ns=T0 + 1_500_000)
    npu.end(Stage.EXEC, 7, T_NPU, a0=1, t_ns=T0 + 3_500_000)
    npu.instant(Stage.SIGNAL, 7, T_NPU, t_ns=T0 + 3_500_000)
    npu.end(Stage.QUEUED, 8, T_NPU, t_ns=T0 + 3_600_000)
    npu.begin(Stage.EXEC, 8, T_NPU, t_ns=T0 + 3_600_000)  # never ends: unfinished
    cam.begin(Stage.WAKE, 7, T_CLIENT, t_ns=T0 + 3_600_000)
    cam.end(Stage.WAKE, 7, T_CLIENT, t_ns=T0 + 3_610_000)
    cam.begin(Stage.CALLBACK, 7, T_CLIENT, t_ns=T0 + 3_610_000)
    cam.end(Stage.CALLBACK, 7, T_CLIENT, t_ns=T0 + 3_700_000)
    recs = freeze(*r.values())
    for ring in r.values():
        ring.close()
    return recs


PROCS = {101: "camera app", 102: "supervisor", 103: "npu0 worker"}


def _by_ph(events, ph):
    return [e for e in events if e["ph"] == ph]


def _assert_rows_nest(slices):
    """Slices on one (pid, tid) row must nest: what a thread row in the viewer requires."""
    rows = defaultdict(list)
    for e in slices:
        rows[(e["pid"], e["tid"])].append((e["ts"], -e["dur"], e["ts"] + e["dur"]))
    for row in rows.values():
        ends: list[float] = []
        for ts, _, te in sorted(row):
            while ends and ends[-1] <= ts:
                ends.pop()
            assert not ends or te <= ends[-1], "overlapping slices share a row"
            ends.append(te)


def test_chrome_trace_export(tmp_path):
    recs = _scenario_records()
    trace = to_chrome_trace(recs, track_names=TRACKS, process_names=PROCS)
    back = json.loads(json.dumps(trace))
    assert back == trace
    assert back["displayTimeUnit"] == "ms"
    events = back["traceEvents"]

    # metadata names every process and every row, overflow rows included
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == PROCS
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["name"] == "thread_name"}
    assert rows[(101, tid_for(T_CLIENT))] == "camera client"
    assert rows[(102, tid_for(T_SCHED))] == "scheduler"
    assert rows[(103, tid_for(T_NPU))] == "npu0"
    assert rows[(103, tid_for(T_NPU, 1))] == "npu0 #1"

    # complete slices with exact durations (us)
    xs = _by_ph(events, "X")
    dur = {(e["name"], e["args"]["cid"]): e["dur"] for e in xs}
    assert dur[("SUBMIT", 7)] == 250.0
    assert dur[("ENQUEUE", 7)] == 20.0
    assert dur[("QUEUED", 7)] == 1180.0
    assert dur[("EXEC", 7)] == 2000.0
    assert dur[("QUEUED", 8)] == 3200.0
    assert dur[("CALLBACK", 7)] == 90.0
    exec7 = next(e for e in xs if e["name"] == "EXEC" and e["args"]["cid"] == 7)
    assert exec7["ts"] == 1500.0 and exec7["args"]["a0"] == 3 and exec7["args"]["end_a0"] == 1
    exec8 = next(e for e in xs if e["name"] == "EXEC" and e["args"]["cid"] == 8)
    assert exec8["args"]["unfinished"] is True
    assert exec8["ts"] + exec8["dur"] == 3700.0  # runs to the end of the trace
    assert not any(e["name"] == "COPY" for e in xs)  # END without BEGIN
    assert back["otherData"]["dropped_ends"] == 1
    assert back["otherData"]["origin_monotonic_ns"] == T0
    queued8 = next(e for e in xs if e["name"] == "QUEUED" and e["args"]["cid"] == 8)
    assert queued8["tid"] == tid_for(T_NPU, 1)
    _assert_rows_nest(xs)

    # instants and counters
    (signal,) = _by_ph(events, "i")
    assert (signal["name"], signal["s"], signal["ts"], signal["args"]["cid"]) == (
        "SIGNAL", "t", 3500.0, 7)
    counters = _by_ph(events, "C")
    assert {c["name"] for c in counters} == {"QUEUE_DEPTH scheduler"}
    assert [c["args"]["value"] for c in counters] == [1, 0]

    # one flow chain per cid: one start, one finish, each bound to a slice of that cid
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e)
    assert set(flows) == {7, 8}
    starts = {(e["pid"], e["tid"], e["ts"], e["args"]["cid"]) for e in xs}
    for cid, chain in flows.items():
        phs = [e["ph"] for e in chain]
        assert phs.count("s") == 1 and phs.count("f") == 1
        assert phs[0] == "s" and phs[-1] == "f" and chain[-1]["bp"] == "e"
        assert [e["ts"] for e in chain] == sorted(e["ts"] for e in chain)
        assert len({(e["cat"], e["name"]) for e in chain}) == 1
        for e in chain:
            assert (e["pid"], e["tid"], e["ts"], cid) in starts
    assert len(flows[7]) == 6  # SUBMIT ENQUEUE QUEUED EXEC WAKE CALLBACK
    assert {e["pid"] for e in flows[7]} == {101, 102, 103}

    # every event is sorted by time after the metadata
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)

    path = write_chrome_trace(tmp_path / "trace.json", trace)
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == back


def _records(*slices: tuple[int, int, int, int, int, int]) -> np.ndarray:
    """Slices (pid, track, stage, cid, begin us, end us after T0), as the rings hold them."""
    rings: dict[int, TraceRing] = {}
    for pid, track, stage, cid, b, e in slices:
        ring = rings.get(pid)
        if ring is None:
            ring = rings[pid] = TraceRing(bytearray(TraceRing.nbytes(64)), create=True,
                                          capacity=64, pid=pid)
        ring.complete(stage, cid, track, T0 + b * 1000, T0 + e * 1000)
    recs = freeze(*rings.values())
    for ring in rings.values():
        ring.close()
    return recs


def test_a_marker_never_cuts_across_another_requests_slice_on_its_row():
    """Found by the chaos mix: a QUEUED slice is entered where its SUBMIT ended (a
    ``queued`` part nested in it), and another request queued meanwhile must not sit
    across that part on the same row, or the row would not nest."""
    recs = _records((101, T_CLIENT, Stage.SUBMIT, 7, 0, 30),
                    (102, T_SCHED, Stage.QUEUED, 7, 10, 100),
                    (101, T_CLIENT, Stage.SUBMIT, 8, 31, 33),
                    (102, T_SCHED, Stage.QUEUED, 8, 20, 50),
                    (103, T_NPU, Stage.EXEC, 8, 50, 90),
                    (103, T_NPU, Stage.EXEC, 7, 100, 110))
    doc = to_chrome_trace(recs, track_names=TRACKS, process_names=PROCS)
    assert validate(doc) == []
    chains = flow_chains(doc)
    assert [name for name, _ in chains[7]] == ["SUBMIT", "queued", "EXEC"]


def test_a_modeled_exec_before_the_take_leaves_queued_even_by_a_narrow_part():
    """Found by the chaos mix: EXEC sits at its modeled start, which may lie before the
    host took the command; the arrow leaves QUEUED where EXEC starts however narrow that
    part is (here 1.999 us: a 2 us floor once left it pointing back)."""
    recs = _records((101, T_CLIENT, Stage.SUBMIT, 7, 0, 47),
                    (102, T_SCHED, Stage.QUEUED, 7, 6, 414))
    recs = np.concatenate([recs, _records((103, T_NPU, Stage.EXEC, 7, 0, 44))])
    recs["t_ns"][-2:] += np.array([48_999, 48_999], np.uint64)  # EXEC 48.999 .. 92.999 us
    doc = to_chrome_trace(recs, track_names=TRACKS, process_names=PROCS)
    assert validate(doc) == []
    assert [name for name, _ in flow_chains(doc)[7]] == ["SUBMIT", "queued", "EXEC"]


def test_export_of_nothing_is_a_valid_empty_trace():
    trace = to_chrome_trace(np.empty(0, RECORD_DTYPE), track_names={}, process_names={})
    assert json.loads(json.dumps(trace))["traceEvents"] == []


def test_emit_cost_is_reported_not_asserted():
    from bench._trace_bench import emit_cost_ns

    cost = emit_cost_ns(n=20_000)
    print(f"\ntrace emit: enabled {cost['enabled']:.0f} ns/record, "
          f"disabled {cost['disabled']:.0f} ns, empty call {cost['empty_call']:.0f} ns")
    assert set(cost) == {"enabled", "disabled", "empty_call"}


def test_a_staircase_deeper_than_the_scanned_lanes_keeps_every_slice_and_reuses_rows():
    """Slices that overlap without nesting (a deep queue, or what a tenant writes into
    its own ring) each need a row; past the first ``SCANNED_LANES`` a slice takes the
    lowest empty row instead of scanning them all. Two staircases one after the other:
    every slice exported, rows nest, the second reuses the first's rows (as many rows as
    slices ever open at once), and the trace reads as Perfetto would read it."""
    from hetproc.trace._perfetto import SCANNED_LANES
    depth = 3 * SCANNED_LANES
    buf = bytearray(TraceRing.nbytes(1024))
    ring = TraceRing(buf, create=True, capacity=1024, pid=103)
    for wave in range(2):
        t = T0 + wave * 10_000_000
        for i in range(depth):
            ring.begin(Stage.QUEUED, 100 * (wave + 1) + i, T_NPU, t_ns=t + i * 1000)
        for i in range(depth):
            ring.end(Stage.QUEUED, 100 * (wave + 1) + i, T_NPU, t_ns=t + 1_000_000 + i * 1000)
    trace = to_chrome_trace(freeze(ring), track_names=TRACKS, process_names=PROCS)
    ring.close()
    xs = _by_ph(trace["traceEvents"], "X")
    assert len(xs) == 2 * depth
    _assert_rows_nest(xs)
    assert len({e["tid"] for e in xs}) == depth
    assert validate(trace) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 600)), min_size=40, max_size=120))
def test_any_overlap_of_slices_on_one_track_exports_whole_and_nested(spans):
    """Random QUEUED slices on one device row, each starting 0-20 us after the one before
    and lasting 1-600 us: however they overlap -- many rows, emptied and taken again past
    the scanned lanes -- every slice is exported, every row nests, the trace validates."""
    buf = bytearray(TraceRing.nbytes(256))
    ring = TraceRing(buf, create=True, capacity=256, pid=103)
    events = []
    start = 0
    for k, (gap, length) in enumerate(spans):
        start += gap
        events.append((T0 + start * 1000, 1, k))
        events.append((T0 + (start + length) * 1000, 0, k))
    for t, is_begin, k in sorted(events):  # (an end before a begin at one instant)
        (ring.begin if is_begin else ring.end)(Stage.QUEUED, 1 + k, T_NPU, t_ns=t)
    trace = to_chrome_trace(freeze(ring), track_names=TRACKS, process_names=PROCS)
    ring.close()
    xs = _by_ph(trace["traceEvents"], "X")
    assert sorted(e["args"]["cid"] for e in xs) == [1 + k for k in range(len(spans))]
    _assert_rows_nest(xs)
    assert validate(trace) == []


def test_past_the_scanned_lanes_a_slice_takes_a_lane_only_once_it_is_empty(monkeypatch):
    """Two lanes scanned. C and D outlive A and B, so they take lanes 2 and 3; G and H
    take A's and B's lanes as those end, and hold them past 12 us. Then F (the longer,
    placed first) and E start at 12 us, when C has ended and D has not: F takes C's
    lane; E gets a new one rather than overlap D (nor nests in F: a lane past the
    scanned ones is only taken empty)."""
    from hetproc.trace import _perfetto
    monkeypatch.setattr(_perfetto, "SCANNED_LANES", 2)
    buf = bytearray(TraceRing.nbytes(64))
    ring = TraceRing(buf, create=True, capacity=64, pid=103)
    us = 1000
    spans = {"A": (0, 10), "B": (1, 11), "C": (2, 12), "D": (3, 13), "G": (10, 30),
             "H": (11, 31), "F": (12, 40), "E": (12, 35)}
    cids = {name: 1 + k for k, name in enumerate(spans)}
    events = sorted([(T0 + b * us, 1, n) for n, (b, _) in spans.items()]
                    + [(T0 + e * us, 0, n) for n, (_, e) in spans.items()])
    for t, is_begin, name in events:  # (at one instant: the ends first)
        (ring.begin if is_begin else ring.end)(Stage.QUEUED, cids[name], T_NPU, t_ns=t)
    trace = to_chrome_trace(freeze(ring), track_names=TRACKS, process_names=PROCS)
    ring.close()
    xs = _by_ph(trace["traceEvents"], "X")
    lane = {name: next(e["tid"] for e in xs if e["args"]["cid"] == cid)
            for name, cid in cids.items()}
    assert (lane["G"], lane["H"], lane["F"]) == (lane["A"], lane["B"], lane["C"])
    assert len(set(lane.values())) == 5  # E's lane is its own
    _assert_rows_nest(xs)

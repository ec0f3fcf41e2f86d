"""A virtual-clock run's trace is laid out in modeled time (issue item 3, invariant 8).

Every process stamps its records with the platform's clock, so on the virtual clock the
client's SUBMIT and WAKE, the supervisor's QUEUED and the device's EXEC share the modeled
timeline to the ns, and so do the bounds of a window frozen around an error. Modeled time
has ties (a submit, an empty queue and a kernel of no length are one instant), which the
export must still draw as arrows Perfetto binds to the right request: the first tests
run it across real processes, the last ones pin the tie rules on records made by hand.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import hetproc
from hetproc import trace
from hetproc.trace import flow_chains, validate
from hetproc.trace._export import frozen_to_chrome
from hetproc.trace._perfetto import to_chrome_trace
from ipc import Stage
from ipc._trace import TraceRing, freeze

from .helpers import wait_for

MS = 1_000_000


def _at(doc: dict, ev: dict) -> tuple[int, int]:
    """An event's (start, end) in ns on the records' own clock."""
    t0 = doc["otherData"]["origin_monotonic_ns"]
    start = t0 + round(ev["ts"] * 1000)
    return start, start + round(ev.get("dur", 0) * 1000)


def _slices_of(doc: dict, cid: int) -> dict[str, tuple[int, int]]:
    return {e["name"]: _at(doc, e) for e in doc["traceEvents"]
            if e.get("ph") == "X" and (e.get("args") or {}).get("cid") == cid
            and "marks" not in e["args"]}


def test_every_process_draws_a_request_on_the_modeled_timeline_to_the_ns():
    with hetproc.Platform(clock="virtual") as plat:
        c = plat.client
        npu = c.context("npu0")
        x, y = c.alloc(64, "float32"), c.alloc(64, "float32")
        hetproc.sleep(7)
        t_submit = plat.now()
        fence = npu.submit("relu", [x], [y], ms=2)
        fence.wait(5)
        instant = npu.submit_nowait("work", ms=0)  # takes no modeled time at all
        instant.wait(5)
        signalled = fence.signal_time()
        doc = trace.chrome_trace(c)
        t_end = plat.now()
    assert validate(doc) == [] and doc["otherData"]["clock"] == "virtual"
    # One timeline: nothing lies on the host's clock, far from the modeled one.
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "M":
            assert _at(doc, ev)[1] <= t_end + 1, ev
    at = _slices_of(doc, fence.cid)
    assert at["SUBMIT"][0] == at["QUEUED"][0] == at["EXEC"][0] == t_submit
    assert at["EXEC"][1] == at["WAKE"][1] == signalled  # woken at the modeled signal
    assert at["EXEC"][1] - at["EXEC"][0] >= 2 * MS
    assert at["EXEC"][0] <= at["MAP"][0] and at["MAP"][1] <= at["EXEC"][1]
    assert [row.split(" #")[0] for _, row in flow_chains(doc)[fence.cid]] == [
        "client owner", "npu0 queue", "npu0", "client owner"]
    # A request of no modeled length: each hop one instant, drawn 1 ns wide, in order.
    at = _slices_of(doc, instant.cid)
    assert {at[s] for s in ("SUBMIT", "QUEUED", "EXEC", "WAKE")} == {
        (signalled, signalled + 1)}
    assert [name for name, _ in flow_chains(doc)[instant.cid]] == [
        "SUBMIT", "QUEUED", "EXEC", "WAKE"]


def test_a_window_frozen_on_the_virtual_clock_is_bounded_in_modeled_time():
    with hetproc.Platform(clock="virtual") as plat:
        c = plat.client
        npu = c.context("npu0")
        hetproc.sleep(5)
        t_submit = plat.now()
        upstream = c.fence()
        done = npu.submit_nowait("work", wait=[upstream], ms=0)
        hetproc.sleep(3)
        t_error = plat.now()
        upstream.signal(hetproc.DeviceFault)
        try:
            done.wait(5)
        except hetproc.DependencyFailed:
            pass
        hetproc.sleep(50)
        (window,) = wait_for(plat.frozen_windows)
    assert window["t_error_ns"] == t_error and window["cids"] == [done.cid]
    assert window["t_from_ns"] < t_submit and window["t_to_ns"] >= t_error
    mine = window["records"][window["records"]["cid"] == done.cid]
    stamps = mine["t_ns"].tolist()
    assert min(stamps) == t_submit and max(stamps) == t_error
    assert {Stage.SUBMIT, Stage.QUEUED, Stage.ACQUIRE_WAIT, Stage.WAKE} <= {
        Stage(int(s)) for s in mine["stage"]}
    doc = frozen_to_chrome(window)
    assert validate(doc) == [] and doc["otherData"]["clock"] == "virtual"
    assert _slices_of(doc, done.cid)["ACQUIRE_WAIT"] == (t_submit, t_error)


# -- the tie rules, on records made by hand ------------------------------------------

T = 2_000_000_000
CLIENT, SUP, DEV = 11, 12, 13
TRACKS = {1: "client", 2: "npu0 queue", 3: "npu0"}


def _one_instant_records(requests: list[tuple[int, int, int]]) -> np.ndarray:
    """Requests (cid, modeled start, modeled end) submitted together at ``T`` by one
    client, queued at ``T`` and run in turn; the client waits for each in order from T."""
    rings = {pid: TraceRing(bytearray(TraceRing.nbytes(256)), create=True, capacity=256,
                            pid=pid) for pid in (CLIENT, SUP, DEV)}
    client, sup, dev = rings[CLIENT], rings[SUP], rings[DEV]
    for cid, _, _ in requests:
        client.complete(Stage.SUBMIT, cid, 1, T, T)
        sup.begin(Stage.QUEUED, cid, 2, t_ns=T)
    woke = T
    for cid, m0, m1 in requests:
        sup.end(Stage.QUEUED, cid, 2, t_ns=m0)
        dev.complete(Stage.EXEC, cid, 3, m0, m1)
        client.complete(Stage.WAKE, cid, 1, woke, m1)
        woke = m1
    records = freeze(*rings.values())
    for ring in rings.values():
        ring.close()
    return records


def test_requests_queued_at_one_instant_each_bind_their_own_queue_slice():
    reqs = [(7, T, T + 5 * MS), (8, T + 5 * MS, T + 8 * MS), (9, T + 8 * MS, T + 9 * MS)]
    doc = to_chrome_trace(_one_instant_records(reqs), track_names=TRACKS,
                          process_names={CLIENT: "client", SUP: "supervisor", DEV: "npu0"})
    assert validate(doc) == []  # e.g. no step binds to another request's QUEUED
    chains = flow_chains(doc)
    for cid, _, _ in reqs:
        assert [name for name, _ in chains[cid]][:2] == ["SUBMIT", "QUEUED"], chains[cid]
    # Three QUEUED slices began at T: one lane each, since a step binds the innermost.
    queue_rows = {row for cid, _, _ in reqs for name, row in chains[cid] if name == "QUEUED"}
    assert queue_rows == {"npu0 queue", "npu0 queue #1", "npu0 queue #2"}


def test_a_request_of_no_length_keeps_its_hops_in_causal_order():
    reqs = [(7, T, T), (8, T, T + 3 * MS)]  # 7 takes no time: every hop at T
    doc = to_chrome_trace(_one_instant_records(reqs), track_names=TRACKS,
                          process_names={CLIENT: "client", SUP: "supervisor", DEV: "npu0"})
    assert validate(doc) == []
    chains = flow_chains(doc)
    assert [name for name, _ in chains[7]] == ["SUBMIT", "QUEUED", "EXEC", "WAKE"]
    assert [name for name, _ in chains[8]] == ["SUBMIT", "QUEUED", "EXEC", "WOKE"]
    widened = [e for e in doc["traceEvents"] if (e.get("args") or {}).get("no_time")]
    assert {e["dur"] for e in widened} == {0.001}  # 1 ns, and said so


# -- the fuzz: any schedule on a coarse grid, so that instants tie often ----------------

_REQUEST = st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 2))


def _grid_records(requests: list[tuple[int, int, int]]) -> tuple[np.ndarray, list[int]]:
    """One client submits requests (device, submit step, length in steps of 1 ms) in
    order, each device runs its own in order, then the client waits for each in turn."""
    rings = {pid: TraceRing(bytearray(TraceRing.nbytes(256)), create=True, capacity=256,
                            pid=pid) for pid in (CLIENT, SUP, DEV, DEV + 1)}
    free = {0: T, 1: T}
    submitted, ends, cids = T, [], []
    for k, (device, step, length) in enumerate(requests):
        cid, submitted = 100 + k, max(submitted, T + step * MS)
        m0 = max(submitted, free[device])
        free[device] = m1 = m0 + length * MS
        rings[CLIENT].complete(Stage.SUBMIT, cid, 1, submitted, submitted)
        rings[SUP].complete(Stage.QUEUED, cid, 2 + 2 * device, submitted, m0)
        rings[DEV + device].complete(Stage.EXEC, cid, 3 + 2 * device, m0, m1)
        ends.append(m1)
        cids.append(cid)
    woke = submitted
    for cid, m1 in zip(cids, ends):
        rings[CLIENT].complete(Stage.WAKE, cid, 1, woke, max(woke, m1))
        woke = max(woke, m1)
    records = freeze(*rings.values())
    for ring in rings.values():
        ring.close()
    return records, cids


@settings(max_examples=300, deadline=None)
@given(st.lists(_REQUEST, min_size=1, max_size=8))
def test_fuzz_any_schedule_of_ties_reads_as_meant(requests):
    records, cids = _grid_records(requests)
    doc = to_chrome_trace(records, track_names={1: "client", 2: "npu0 queue", 3: "npu0",
                                                4: "gpu0 queue", 5: "gpu0"},
                          process_names={CLIENT: "client", SUP: "supervisor",
                                         DEV: "npu0", DEV + 1: "gpu0"})
    assert validate(doc) == []  # every step binds its own request, every arrow forward
    chains = flow_chains(doc)
    for cid in cids:
        names = [name for name, _ in chains[cid]]
        assert names[0] == "SUBMIT" and names[-1] in ("WAKE", "WOKE"), names
        assert "EXEC" in names, names  # the device's hop is never lost

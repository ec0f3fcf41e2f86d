"""Synchronisation hazards (seed §4, §5, invariant 9): a command that touches a buffer
another unfinished command uses, unordered, is refused (``SyncHazard``), counted and
traced; the same program with the fence is served. The three programs are the issue's:
npu0 writes for 30 modeled ms while gpu0 reads without waiting (read after write), cpu0
overwrites what npu0 still reads (write after read), npu0 and gpu0 both write one buffer
(write after write)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import hetproc
from device_workers._kernels import checksum_of, read_checksum
from ipc import Stage


def _platform(mode: str = "error", **kw) -> hetproc.Platform:
    return hetproc.Platform(spec=dataclasses.replace(hetproc.load_platform(), hazards=mode),
                            time_scale=1.0, **kw)


@pytest.fixture(scope="module")
def plat():
    with _platform() as p:
        yield p


def _bufs(c, n=3):
    return [c.alloc(256) for _ in range(n)]


# Each program's first command waits on a gate the test opens once the second one was
# submitted, so that it is still unfinished then however slow the host is; then it runs
# for 30 modeled ms.


def _read_after_write(c, gate, fenced: bool):
    npu, gpu = c.context("npu0"), c.context("gpu0")
    src, buf = _bufs(c, 2)
    out = c.alloc(8, "uint8")
    writer = npu.submit("relu", [src], [buf], wait=[gate], ms=30)
    return writer, buf, lambda: gpu.submit("checksum", [buf], [out],
                                           wait=[writer] if fenced else [])


def _write_after_read(c, gate, fenced: bool):
    npu, cpu = c.context("npu0"), c.context("cpu0")
    buf, dst = _bufs(c, 2)
    reader = npu.submit("relu", [buf], [dst], wait=[gate], ms=30)
    return reader, buf, lambda: cpu.submit("fill", [], [buf], params={"value": 2.0},
                                           wait=[reader] if fenced else [])


def _write_after_write(c, gate, fenced: bool):
    npu, gpu = c.context("npu0"), c.context("gpu0")
    src, buf = _bufs(c, 2)
    first = npu.submit("relu", [src], [buf], wait=[gate], ms=30)
    return first, buf, lambda: gpu.submit("fill", [], [buf], params={"value": 3.0},
                                          wait=[first] if fenced else [])


PROGRAMS = [("read-after-write", _read_after_write), ("write-after-read", _write_after_read),
            ("write-after-write", _write_after_write)]


@pytest.mark.parametrize("kind, program", PROGRAMS)
def test_an_unordered_access_is_refused_naming_the_buffer_the_command_and_the_fence(
        plat, kind, program):
    c = plat.client
    before = c.metrics()["hazards"]["found"][kind]
    gate = c.fence()
    other, buf, second = program(c, gate, fenced=False)
    with pytest.raises(hetproc.SyncHazard) as got:
        second()
    gate.signal()
    exc = got.value
    assert exc.scope == "request" and not exc.retryable and exc.buffers_trusted
    assert exc.detail["hazard"] == kind and kind in str(exc)
    assert exc.detail["buffer"] == buf.handle
    assert exc.detail["other_cid"] == other.cid
    assert exc.detail["missing_fence"] == other.handle
    assert exc.correlation_id and exc.correlation_id != other.cid
    other.wait(5)  # the first command is unharmed
    assert c.metrics()["hazards"]["found"][kind] == before + 1
    event = [e for e in c.incidents()["events"] if e["event"] == "hazard"][-1]
    assert (event["hazard"], event["other_cid"], event["buffer"]) == (kind, other.cid, buf.handle)
    assert exc.evidence.get("trace_window")  # a window frozen around it
    records, _, _ = plat.trace_records()
    mine = (records["stage"] == int(Stage.HAZARD)) & (records["cid"] == exc.correlation_id)
    marks = records[mine]
    assert len(marks) == 1 and int(marks["a2"][0]) == buf.handle


@pytest.mark.parametrize("kind, program", PROGRAMS)
def test_the_same_program_with_the_fence_is_served(plat, kind, program):
    c = plat.client
    before = c.metrics()["hazards"]
    gate = c.fence()
    _, _, second = program(c, gate, fenced=True)
    done = second()
    gate.signal()
    done.wait(5)
    after = c.metrics()["hazards"]
    assert after["found"] == before["found"] and after["checked"] >= before["checked"] + 2


def test_order_on_one_context_or_through_a_chain_of_fences_is_enough(plat):
    c = plat.client
    npu, cpu, gpu = c.context("npu0"), c.context("cpu0"), c.context("gpu0")
    src, buf = _bufs(c, 2)
    out = c.alloc(8, "uint8")
    before = c.metrics()["hazards"]["found"]
    npu.submit("relu", [src], [buf], ms=10)
    npu.submit("checksum", [buf], [out]).wait(5)           # in order on one context
    w = npu.submit("relu", [src], [buf], ms=20)
    hop = cpu.submit("work", wait=[w], ms=1)                # the reader waits on this one
    gpu.submit("checksum", [buf], [out], wait=[hop]).wait(5)
    other, gate = c.context("npu0"), c.fence()
    w = npu.submit("relu", [src], [buf], wait=[gate], ms=20)
    with pytest.raises(hetproc.SyncHazard):                 # another context: no order
        other.submit("checksum", [buf], [out])
    gate.signal()
    w.wait(5)
    assert c.metrics()["hazards"]["found"]["read-after-write"] == before["read-after-write"] + 1


def test_a_command_more_urgent_than_its_contexts_earlier_one_is_not_ordered_by_it(plat):
    c = plat.client
    npu = c.context("npu0", priority=0)
    src, buf = _bufs(c, 2)
    out = c.alloc(8, "uint8")
    gate = c.fence()
    w = npu.submit("relu", [src], [buf], wait=[gate], ms=20)
    with pytest.raises(hetproc.SyncHazard) as got:  # priority 5 may run first
        npu.submit("checksum", [buf], [out], priority=5)
    assert got.value.detail["other_cid"] == w.cid
    after = npu.submit("checksum", [buf], [out], priority=0)  # no more urgent: in order
    gate.signal()
    after.wait(5)


def test_a_batch_is_checked_in_its_own_order(plat):
    c = plat.client
    npu, gpu = c.context("npu0"), c.context("gpu0")
    src, buf = _bufs(c, 2)
    out = c.alloc(8, "uint8")
    fences = npu.submit_many([hetproc.command("relu", [src], [buf], ms=5),
                              hetproc.command("checksum", [buf], [out])])
    fences[-1].wait(5)
    gate = c.fence()
    w = gpu.submit("fill", [], [buf], params={"value": 1.0}, wait=[gate], ms=20)
    with pytest.raises(hetproc.SyncHazard) as got:  # its second command reads what w writes
        npu.submit_many([hetproc.command("checksum", [src], [out]),
                         hetproc.command("checksum", [buf], [out])])
    assert got.value.detail["other_cid"] == w.cid
    gate.signal()
    w.wait(5)
    x = c.alloc(256)
    with pytest.raises(hetproc.SyncHazard) as got:  # two commands of a batch, unordered
        npu.submit_many([hetproc.command("relu", [src], [x], ms=5),
                         hetproc.command("checksum", [x], [out], priority=5)])
    assert got.value.detail["hazard"] == "read-after-write"


@pytest.mark.parametrize("mode", ["warn", "off"])
def test_warn_serves_and_records_off_serves_silently(mode):
    with _platform(mode) as p:
        c = p.client
        gate = c.fence()
        other, _, second = _read_after_write(c, gate, fenced=False)
        done = second()
        gate.signal()
        done.wait(5)
        h = c.metrics()["hazards"]
        events = [e for e in c.incidents()["events"] if e["event"] == "hazard"]
        records, _, _ = p.trace_records()
        marks = records[records["stage"] == int(Stage.HAZARD)]
        if mode == "warn":
            assert h["found"]["read-after-write"] == 1 and h["refused"] == 0
            assert events and events[0]["other_cid"] == other.cid
            assert len(marks) == 1
        else:
            assert h["checked"] == 0 and sum(h["found"].values()) == 0
            assert not events and not len(marks)


def test_without_the_check_the_reader_sees_half_written_data():
    """What the check prevents: gpu0 writes a buffer in two steps (fill 1.0, then doubled
    once a gate opens); cpu0 reads it between them without waiting. Checked, the read is
    refused naming the second step; unchecked, it is served and sees the first step only:
    neither the data before nor the result the program meant."""
    shape = (64,)
    expected = checksum_of(np.full(shape, 2.0, np.float32))
    seen = {}
    for mode in ("error", "off"):
        with _platform(mode) as p:
            c = p.client
            gpu, cpu, gate = c.context("gpu0"), c.context("cpu0"), c.fence()
            buf, out = c.alloc(shape, "float32"), c.alloc(8, "uint8")
            gpu.submit("fill", [], [buf], params={"value": 1.0}, ms=5).wait(5)
            done = gpu.submit("scale", [buf], [buf], params={"factor": 2.0}, wait=[gate], ms=5)
            try:
                cpu.submit("checksum", [buf], [out]).wait(5)
                seen[mode] = read_checksum(out.array())
            except hetproc.SyncHazard as exc:
                seen[mode] = exc.detail["other_cid"] == done.cid
            gate.signal()
            done.wait(5)
            assert np.all(buf.array() == 2.0)  # what the program meant the reader to see
    assert seen["error"] is True  # refused, naming the last writer
    assert seen["off"] != expected and seen["off"] == checksum_of(np.full(shape, 1.0, np.float32))


def test_the_conformance_cases_fail_when_the_check_is_off(tmp_path):
    """The three cases guard the check: on a platform whose file says hazards = "off",
    every one of them fails at its refusal (the other checks still hold)."""
    from importlib import resources

    from hetproc.drills import run_conformance
    text = resources.files("hetproc.platforms").joinpath("default.toml").read_text()
    assert '\nhazards = "error"' in text
    soc = tmp_path / "no-hazards.toml"
    soc.write_text(text.replace('\nhazards = "error"', '\nhazards = "off"', 1))
    result = run_conformance(only="hetproc/hazard-*", platform_file=str(soc))
    rows = {r["name"]: r for r in result["rows"]}
    assert len(rows) == 3 and not result["ok"]
    for kind in ("read-after-write", "write-after-read", "write-after-write"):
        row = rows[f"hetproc/hazard-{kind}"]
        assert row["failed_checks"] == [f"the unordered {kind} was refused with SyncHazard"], row


@pytest.mark.parametrize("policy", ["fifo", "priority", "edf", "fair", "mixed"])
def test_a_policys_in_order_promise_is_kept_by_its_picks_and_preemptions(policy):
    """What the check counts on, as pure logic: whenever a policy says ``later`` (same
    context, submitted after ``first``) runs in order, ``later`` never preempts ``first``
    and, with both queued and any other work beside them, is never picked first."""
    from types import SimpleNamespace

    from hetproc import SchedSpec
    from hetproc.supervisor._scheduler import make_scheduler
    rng = random.Random(policy)
    ctx = SimpleNamespace(client=SimpleNamespace(id=1), weight=1.0)
    other = SimpleNamespace(client=SimpleNamespace(id=2), weight=1.0)
    promised = 0
    for trial in range(300):
        s = make_scheduler(SchedSpec(policy=policy, realtime_priority=10))

        def cmd(seq, c=ctx):
            return SimpleNamespace(seq=seq, ctx=c, priority=rng.choice([0, 1, 5, 10, 12]),
                                   deadline_ns=rng.choice([0, 10, 20]), hold_ns=rng.choice([1, 5]),
                                   t_arrive=rng.choice([0, 0, 3]))
        first, later = cmd(2), cmd(5)
        if not s.in_order(first, later):
            continue
        promised += 1
        assert not s.preempts(later, first), (first, later)
        for c in [cmd(1, other), first, cmd(3, other), later, cmd(7, other)]:
            s.add(c)
        picked = []
        while (c := s.pick(None)) is not None:
            picked.append(c.seq)
            s.account(c, c.hold_ns)
        assert picked.index(2) < picked.index(5), (trial, picked)
    assert promised > 30

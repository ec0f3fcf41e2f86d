"""The supervisor's one ordered failure path (``hetproc.supervisor._failures``), across
real processes: the error is noted (its frozen window named), the fence's record
written, the record told to the owner and importers, and only then the fence signalled;
and recovery reclaims only after the device's confirmed stop.

The ordering test makes telling slow on purpose (each notice takes 50 ms to reach the
socket): a path that signalled before it told would wake the waiters to empty sockets.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path

import msgpack
import pytest

from hetproc._config import load_platform
from hetproc.supervisor._evidence import Evidence
from hetproc.supervisor._failures import Failures, kind_of
from hetproc.supervisor._records import ClientRec, FenceRec, Registry
from hetproc.supervisor._recovery import Incident, Policy, Recovery
from ipc import PENDING, FenceTable, FrameReader, Segment, encode, errors, new_prefix, pack_frame

FORK = mp.get_context("fork")
SLOW_TELL_S = 0.05


def _waiter(prefix: str, seg_name: str, handle: int, sock: socket.socket, out) -> None:
    """A client process blocked on the fence: at its wake, what its socket already holds."""
    table = FenceTable(prefix, Segment.attach(seg_name), create=False)
    word = table.wait(handle, 10.0)
    woke = time.monotonic_ns()
    sock.setblocking(False)
    frames = []
    try:
        frames = FrameReader().feed(sock.recv(1 << 16))
    except BlockingIOError:
        pass
    notices = [msgpack.unpackb(f, raw=False) for f in frames]
    out.put((woke, word, notices))
    table.close()


@pytest.fixture
def parts():
    """The failure path over real tables: a fence table and a trace bank in shared memory."""
    prefix = new_prefix()
    spec = load_platform()
    segments: list[Segment] = []

    def new_segment(suffix: str, size: int) -> Segment:
        segments.append(Segment.create(prefix + suffix, size))
        return segments[-1]

    fences = FenceTable(prefix, new_segment("fences", FenceTable.segment_bytes(64)), create=True)
    reg = Registry(spec, fences, {}, [], None)
    evidence = Evidence(reg, prefix, new_segment)
    yield reg, evidence, prefix
    evidence.close()
    fences.close(unlink=True)
    for seg in segments:
        seg.close()
        seg.unlink()
    assert not [p for p in Path("/dev/shm").glob(prefix.lstrip("/") + "*")]


def test_a_failure_is_noted_recorded_told_and_only_then_signalled(parts):
    reg, evidence, prefix = parts
    steps: list[tuple] = []
    names = ("owner", "importer", "bystander")
    pairs = {name: socket.socketpair() for name in names}
    clients = {name: ClientRec(id=i + 1, name=name, pid=0, owner=False, conn=pairs[name][0])
               for i, name in enumerate(names)}
    reg.clients = {c.conn: c for c in clients.values()}
    handle = reg.fences.allocate(7, clients["owner"].id)
    rec = reg.fence_recs[handle] = FenceRec(handle, clients["owner"],
                                            importers=frozenset({clients["importer"].id}))

    def slow_tell(client: ClientRec, msg: dict) -> None:
        # What the readers could see at this moment, then a slow socket.
        steps.append(("tell", client.name, reg.fences.poll(handle)[0] == PENDING,
                      rec.error is not None, (evidence.last_error or {}).get("trace_window")))
        time.sleep(SLOW_TELL_S)
        client.conn.sendall(pack_frame(encode(msg)))
        steps.append(("told", client.name, time.monotonic_ns()))

    failures = Failures(reg, evidence.note_error, slow_tell)
    out = FORK.Queue()
    procs = [FORK.Process(target=_waiter, args=(prefix, reg.fences.segment.name, handle,
                                                pairs[name][1], out)) for name in names]
    for p in procs:
        p.start()
    time.sleep(0.2)  # every waiter blocks on the fence's semaphore
    exc = errors.CancelledByReset("cancelled by the reset of npu0", correlation_id=7)
    record, completed = failures.fail(exc, [handle])
    woken = [out.get(timeout=10) for _ in names]
    for p in procs:
        p.join(5)
        assert p.exitcode == 0
    for a, b in pairs.values():
        a.close()
        b.close()

    window = record["detail"]["trace_window"]
    assert window and completed == 1
    assert "trace_window" not in exc.detail, "the exception itself is left as it was"
    assert evidence.last_error["trace_window"] == window
    # 1 noted and 2 recorded before 3 anyone is told, 4 signalled after the last notice.
    assert [s[:2] for s in steps] == [("tell", "owner"), ("told", "owner"),
                                      ("tell", "importer"), ("told", "importer")]
    assert all(s[2:] == (True, True, window) for s in steps if s[0] == "tell")
    last_told = max(s[2] for s in steps if s[0] == "told")
    assert all(woke > last_told for woke, _, _ in woken)
    assert {word for _, word, _ in woken} == {exc.wire}
    # Every reader of the record holds it at its wake; nobody else gets it.
    held = sorted(len(notices) for _, _, notices in woken)
    assert held == [0, 1, 1]
    for _, _, notices in woken:
        for notice in notices:
            assert notice["fence"] == handle and notice["error"] == record == rec.error


def test_a_device_signalled_failure_gets_its_record_after_and_is_never_overwritten(parts):
    """The device woke the waiters itself: the record follows (no second signal); and a
    failure never overwrites a fence that completed already."""
    reg, evidence, _ = parts
    told: list[int] = []
    failures = Failures(reg, evidence.note_error, lambda client, msg: told.append(msg["fence"]))
    owner = ClientRec(id=1, name="owner", pid=0, owner=False, conn=None)
    reg.clients = {"conn": owner}
    done, failed = reg.fences.allocate(1, 1), reg.fences.allocate(2, 1)
    for h in (done, failed):
        reg.fence_recs[h] = FenceRec(h, owner)
    reg.fences.signal(done, 0)
    reg.fences.signal(failed, errors.WrongOutput("bad").wire)  # the device signalled it

    _, completed = failures.fail(errors.DeviceTimeout("late"), [done])
    assert completed == 0 and reg.fence_recs[done].error is None and told == []
    record, completed = failures.fail(errors.WrongOutput("bad"), [failed], signalled=True)
    assert completed == 0 and reg.fence_recs[failed].error == record and told == [failed]


def test_what_an_error_kind_does_on_the_path_is_one_entry():
    """A runtime failure freezes a window; a caller's mistake, a consequence or a
    client's own cancel does not."""
    assert kind_of(errors.DeviceCrashed("x")).freezes(errors.DeviceCrashed("x"))
    assert kind_of(errors.IommuFault("x")).freezes(errors.IommuFault("x"))
    for quiet in (errors.InvalidRequest("x"), errors.ContextLost("x"),
                  errors.PlatformClosed("x"), errors.Cancelled("x")):
        assert not kind_of(quiet).freezes(quiet), quiet
    by_reset = errors.CancelledByReset("x")
    assert kind_of(by_reset).freezes(by_reset)


def test_reclaim_before_the_confirmed_stop_is_refused_unless_asked_for():
    """Step 6 of recovery is named and guarded: only the debug policy ``unsafe_reclaim``
    (the late-writer drill) may reclaim before the device confirmed its stop."""
    inc = Incident(1, "timeout", "npu0", None, time.monotonic_ns())
    recovery = Recovery(Policy(), _NoQuarantine(), commands=None, evidence=None, spawn=None)
    with pytest.raises(AssertionError, match="confirmed its stop"):
        recovery.reclaim(inc, [])
    inc.confirmed = True
    recovery.reclaim(inc, [])
    unsafe = Recovery(Policy(unsafe_reclaim=True), _NoQuarantine(), commands=None,
                      evidence=None, spawn=None)
    unsafe.reclaim(Incident(2, "timeout", "npu0", None, time.monotonic_ns()), [])
    assert [s["step"] for s in inc.steps] == ["reclaim"]


class _NoQuarantine:
    def quarantine_count(self) -> int:
        return 0


def test_no_fence_fails_outside_the_failure_path():
    """Only the failure path writes a fence's error word or its record."""
    import re

    import hetproc.supervisor
    root = Path(hetproc.supervisor.__file__).parent
    sources = {p.name: p.read_text() for p in root.glob("*.py")}
    assert "_failures.py" in sources and len(sources) > 20
    for name, text in sources.items():
        if name == "_failures.py":
            continue
        assert not re.search(r"\.wire\b", text), f"{name} signals an error word itself"
        assert not re.search(r"(?<!inc)\.error\s*=(?!=)", text), f"{name} writes a record itself"

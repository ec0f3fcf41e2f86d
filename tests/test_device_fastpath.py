"""A command that only holds modeled time takes the device's fast path
(``DeviceWorker.execute_hold``). Run a device loop in this process over real shared
memory, fences and trace ring, once as it is and once with that path sent to the general
one (``execute_general``): the state table, the fences, the completion records and the
trace records must come out the same, all but the host's own timestamps."""

from __future__ import annotations

import os
import secrets
import time

import posix_ipc
import pytest

from device_workers import DeviceBoot, decode_completions, encode_command
from device_workers._state import STATE_DTYPE, DeviceState, StateSlot, state_table
from device_workers._worker import DeviceWorker
from ipc import FenceTable, Ring, Segment, TraceBank

SLOTS, SLOT_BYTES, TRACE_CAP = 64, 2048, 1024
S = StateSlot


class _Device:
    """One device loop in this process, on its own named objects (all unlinked at close)."""

    def __init__(self) -> None:
        self.prefix = f"/hpfast{secrets.token_hex(4)}_"
        self.segs: list[Segment] = []
        fseg = self._seg("fences", FenceTable.segment_bytes(256))
        self.fences = FenceTable(self.prefix, fseg, create=True)
        sseg = self._seg("state", STATE_DTYPE.itemsize)
        state_table(sseg.map, 1)[:] = 0
        rseg = self._seg("ring", 2 * Ring.nbytes(SLOTS, SLOT_BYTES))
        half = Ring.nbytes(SLOTS, SLOT_BYTES)
        mem = memoryview(rseg.map)
        self.commands = Ring(mem[:half], slots=SLOTS, slot_bytes=SLOT_BYTES, create=True)
        self.completions = Ring(mem[half:], slots=SLOTS, slot_bytes=SLOT_BYTES, create=True)
        tseg = self._seg("trace", TraceBank.nbytes(2, TRACE_CAP))
        self.bank = TraceBank(tseg.map, create=True, rings=2, capacity=TRACE_CAP, enabled=True)
        self.bell = posix_ipc.Semaphore(self.prefix + "bell", posix_ipc.O_CREX)
        self.efd = os.eventfd(0, os.EFD_NONBLOCK)
        self.worker = DeviceWorker(DeviceBoot(
            name="npu0", index=0, prefix=self.prefix, epoch=1, fence_segment=fseg.name,
            state_segment=sseg.name, device_count=1, ring_segment=rseg.name,
            ring_slots=SLOTS, ring_slot_bytes=SLOT_BYTES, doorbell=self.bell.name,
            completion_fd=self.efd, parent_pid=os.getppid(), trace_segment=tseg.name,
            first_pidx=1))
        self.slot = StateSlot(sseg.map, 0)

    def _seg(self, name: str, size: int) -> Segment:
        seg = Segment.create(self.prefix + name, size)
        self.segs.append(seg)
        return seg

    def close(self) -> None:
        self.worker.tr.close()
        self.slot.release()
        self.worker.slot.release()
        self.fences.close(unlink=True)
        self.worker.fences.close()
        self.bell.unlink()
        self.bell.close()
        self.worker.doorbell.close()
        os.close(self.efd)
        for seg in self.segs:
            seg.unlink()
        assert not [n for n in os.listdir("/dev/shm") if self.prefix.strip("/") in n]


def _run(general: bool, monkeypatch) -> dict:
    """The same commands through one fresh device; what a reader can see afterwards."""
    with monkeypatch.context() as m:
        if general:
            m.setattr(DeviceWorker, "execute_hold", DeviceWorker.execute_general)
        dev = _Device()
        try:
            w = dev.worker
            # Every command starts from the previous modeled end, well in the past: each
            # one ends late (a lag, a MODEL_LAGS sample), whichever path runs it.
            w.model_end = time.monotonic_ns() - 10 * 10**9
            handles = [dev.fences.allocate(cid=i + 1) for i in range(7)]
            kw = dict(wait=[], hold_ns=0, delay_ns=0, dep_timeout_ns=10**9, arrive_ns=1)
            cmds = [
                ({"signal": [handles[0]]}, {}),
                ({"signal": [handles[1], handles[2]], "hold_ns": 1_000_000}, {}),
                ({"signal": [handles[3]]}, {"spd": 0.5, "pre": True}),
                ({"signal": [handles[4]], "delay_ns": 3_000_000}, {}),  # hand-off
                ({"signal": [handles[5]]}, {"params": {"ms": 0}}),
                ({"signal": [handles[6]]}, {}),  # cancelled before it starts
            ]
            for i, (args, opts) in enumerate(cmds, start=1):
                if i == len(cmds):
                    w.drain()  # the others ran; now a cancel for the last one
                    dev.slot.u64[S.CANCEL_PIDX] = i
                dev.commands.try_put(encode_command(
                    i, i, 100 + i, "work", **{**kw, **args}, **opts))
            w.drain()
            deadline = time.monotonic() + 5
            while w.delayed and time.monotonic() < deadline:  # the hand-off signal
                time.sleep(0.001)
                w.fire_due_signals()
            assert not w.delayed
            records = []
            while (data := dev.completions.get()) is not None:
                records += decode_completions(data)
            trace = w.tr.ring.snapshot()
            u64, u32 = dev.slot.u64, dev.slot.u32
            return {
                "state": (u32[S.STATE], u64[S.CURRENT_SEQ], u64[S.CURRENT_PIDX],
                          u64[S.DONE], u64[S.ACK_PIDX], u64[S.PROGRESS]),
                "fences": [dev.fences.poll(h) for h in handles],
                "fence_t": [dev.fences.producer(h)[2] for h in handles],
                "records": records,
                "trace": [(int(r["stage"]), int(r["phase"]), int(r["cid"]), int(r["track"]))
                          for r in trace],
                "exec_a0": [int(r["a0"]) for r in trace if r["phase"] == 2],
                "counters": w.tr.c.tolist(),
            }
        finally:
            dev.close()


_HOST_TIMES = ("t_start", "t_end", "t_take", "t_signal", "lag")


def _shape(out: dict) -> dict:
    """What must not depend on the path: everything but the host's own times."""
    recs = [{k: (v if k not in _HOST_TIMES else "t") for k, v in r.items()}
            for r in out["records"]]
    # Modeled times: each command's span, and where its fences were stamped.
    spans = [(r["m1"] - r["m0"]) if "m0" in r else None for r in out["records"]]
    ends = {r["seq"]: r.get("m1") for r in out["records"]}
    for r in recs:
        r.pop("m0", None)
        r.pop("m1", None)
    return {"state": out["state"], "fences": out["fences"], "records": recs,
            "counters": out["counters"][:7],  # all but the lags' ns (host time)
            "spans": spans, "trace": out["trace"], "exec_a0": out["exec_a0"],
            "stamped": [t - ends[seq] if ends.get(seq) else None
                        for seq, t in zip((1, 2, 2, 3, 4, 5, 6), out["fence_t"])]}


def test_the_hold_only_fast_path_leaves_what_the_general_path_leaves(monkeypatch):
    fast, general = _run(False, monkeypatch), _run(True, monkeypatch)
    assert _shape(fast) == _shape(general)
    # ... and what it leaves is right: five ran and signalled (one after its hand-off
    # delay), the sixth was cancelled before it started and left its fence pending.
    assert fast["state"][:2] == (DeviceState.IDLE, 0) and fast["state"][3] == 6
    assert [s for s, _ in fast["fences"]] == [1] * 6 + [0]
    assert [r["seq"] for r in fast["records"]] == [1, 2, 3, 5, 6, 4]
    assert fast["records"][4]["code"] != 0 and fast["records"][4].get("unsignalled")
    assert _shape(fast)["spans"][:3] == [0, 1_000_000, 0]
    assert _shape(fast)["stamped"][4] == 3_000_000  # the hand-off, past the modeled end
    assert all("lag" in r for r in fast["records"] if "m0" in r)


@pytest.fixture(autouse=True)
def _no_leftover_objects():
    yield
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(("hpfast", "sem.hpfast"))]

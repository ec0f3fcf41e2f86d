"""The watchdog notices a device that owes work and does not move (issue "every client is
untrusted", item 8): across real processes, by tampering with the shared state table and
the command ring the way any same-user process can. Not a hang of a running command
(SIGSTOP while busy is the command watchdog's case): here the device sits idle, awake,
with commands pushed to it that it will never take."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import hetproc
from device_workers import StateSlot
from ipc import Ring, Segment

from .helpers import wait_for

S = StateSlot


def _slot(platform, device: str) -> tuple[Segment, StateSlot]:
    """The device's slot of the shared state table, found by the pid it published."""
    pid = platform.client.metrics()["devices"][device]["pid"]
    seg = Segment.attach(platform.prefix + "state")
    for index in range(len(seg.map) // 128):
        slot = StateSlot(seg.map, index)
        if slot.u32[S.PID] == pid:
            return seg, slot
        slot.release()
    seg.close()
    raise AssertionError(f"no state slot for {device}")


def _command_ring(platform, device: str) -> tuple[Segment, Ring]:
    seg = Segment.attach(platform.prefix + f"ring.{device}")
    half = Ring.nbytes(256, 2048)
    return seg, Ring(memoryview(seg.map)[:half], slots=256, slot_bytes=2048, create=False)


def _holds(ring: Ring, count: int) -> bool:
    return ring.depth() == count


def _stalls(client, device: str) -> list[dict]:
    return [i for i in client.incidents()["history"] if i["kind"] == "stall"
            and i["device"] == device]


def _device(client, device: str) -> dict:
    return client.metrics()["devices"][device]


def test_a_device_parked_by_a_tampered_state_table_is_reset_and_serves_again(platform, client):
    """``park`` is the supervisor's field; nobody asked for it. The device idles with a
    command pushed: the watchdog resets it, the command fails naming the stall, the
    restart is counted, and the next command runs."""
    dsp = client.context("dsp0")
    assert dsp.submit("work", ms=0).wait(5) is None
    before = _device(client, "dsp0")
    seg, slot = _slot(platform, "dsp0")
    try:
        slot.u32[S.PARK] = 1
        fence = dsp.submit("work", ms=1)
        with pytest.raises(hetproc.CancelledByReset, match="made no progress"):
            fence.wait(10)
    finally:
        slot.release()
        seg.close()
    assert wait_for(lambda: _stalls(client, "dsp0"), 5), "the incident is recorded"
    inc = _stalls(client, "dsp0")[0]
    assert inc["guilty"] is None and inc["killed"] and inc["confirmed_stop"] == "reaped"
    steps = [s["step"] for s in inc["steps"]]
    assert steps.index("mark") < steps.index("isolate") < steps.index("confirm") \
        < steps.index("restart")
    assert inc["steps"][0]["park"] == 1, "the mark step says what it saw"
    after = _device(client, "dsp0")
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]
    assert dsp.submit("work", ms=1).wait(5) is None, "the restarted device serves"
    assert client.incidents()["verdicts"].get("stalled") == 1


def test_a_ring_read_index_moved_past_pushed_commands_is_noticed_and_they_replay():
    """The device's read index is set to the write index with two commands unread: the
    device sees an empty ring and idles. With ``replay_innocent`` both commands run
    again on the fresh ring and succeed; another device is never touched."""
    spec = hetproc.load_platform().with_time_scale(1.0)
    spec = dataclasses.replace(spec, recovery={**spec.recovery, "replay_innocent": True})
    with hetproc.Platform(spec=spec) as plat:
        client = plat.client
        gpu, npu = client.context("gpu0"), client.context("npu0")
        assert gpu.submit("work", ms=0).wait(5) is None
        npu_pid = _device(client, "npu0")["pid"]
        seg, slot = _slot(plat, "gpu0")
        rseg, ring = _command_ring(plat, "gpu0")
        try:
            slot.u32[S.PARK] = 1  # hold the device still while the index is moved
            fences = [gpu.submit_nowait("work", ms=1) for _ in range(2)]
            assert wait_for(functools.partial(_holds, ring, 2), 5), "both pushed, none taken"
            ring._idx[1] = ring.head  # the read index jumps over them
            slot.u32[S.PARK] = 0
            assert [f.wait(10) for f in fences] == [None, None], "replayed and run"
        finally:
            del ring  # its views go before its segment closes
            slot.release()
            rseg.close()
            seg.close()
        # The replayed commands finish before the incident does: it stays active until
        # its probes (one per device in use) have answered, and only then is history.
        assert wait_for(lambda: _stalls(client, "gpu0"), 5), "the incident is recorded"
        inc = _stalls(client, "gpu0")[0]
        assert len(inc["innocent"]) == 2 and inc["steps"][0]["pushed"] == 2
        assert _device(client, "gpu0")["restarts"] == 1
        assert _device(client, "npu0")["pid"] == npu_pid, "no other device was reset"
        assert npu.submit("work", ms=0).wait(5) is None


def test_waiting_on_an_input_or_a_handoff_delay_is_not_a_stall(platform, client):
    """Owed work that legitimately does not finish for longer than the quiet bound: a
    command waiting for its input fence, and one whose signal waits for its hand-off
    delay (it already ran). Neither is a stall; both complete."""
    isp = client.context("isp0")
    gate = client.fence()
    waiting = isp.submit("work", ms=0, wait=[gate])
    delayed = client.context("cpu0").submit("work", ms=0, handoff_ms=700)
    assert not wait_for(lambda: waiting.done(), 0.7), "still waiting on its input"
    gate.signal()
    assert waiting.wait(5) is None and delayed.wait(5) is None
    verdicts = client.incidents()["verdicts"]
    assert verdicts.get("stalled", 0) == 0 and not client.incidents()["history"]
    assert all(d["restarts"] == 0 for d in client.metrics()["devices"].values())


# -- the excuse for a loaded host, as pure logic (the clock and the CPU reading faked) -----

class _Slot:
    def __init__(self) -> None:
        self.u32 = [0] * 32
        self.u64 = [0] * 16


class _Reg:
    def __init__(self, dev) -> None:
        self.devices = {dev.name: dev}
        self.slots = [_Slot()]
        self.spec = dataclasses.make_dataclass("Spec", [("watchdog_ms", float)])(200.0)
        self.events: list = []

    def scaled_ns(self, ms: float) -> int:
        return int(ms * 1e6)

    def engine(self, dev):  # the hang check at the watchdog, as the built-in platform's
        return dataclasses.make_dataclass("Engine", [("heartbeat_interval_ms", float)])(
            self.spec.watchdog_ms)

    def note_event(self, kind: str, **detail) -> None:
        self.events.append(detail)


def _recovery_over_one_idle_device(monkeypatch, cpu_readings):
    from types import SimpleNamespace

    from device_workers import DeviceState
    from hetproc.supervisor._recovery import Policy, Recovery
    dev = SimpleNamespace(name="npu0", index=0, pid=123, paused=False, epoch=1,
                          commands=SimpleNamespace(tail=5),
                          pushed={9: SimpleNamespace(pidx=6, delay_ns=0)})
    reg = _Reg(dev)
    reg.slots[0].u32[S.STATE] = DeviceState.IDLE
    reg.slots[0].u64[S.CURRENT_PIDX] = 5
    rec = Recovery(Policy(), reg, commands=None, evidence=None, spawn=lambda d: None)
    readings = iter(cpu_readings)
    monkeypatch.setattr(rec.device_cpu, "read", lambda d: next(readings))
    stalls: list = []
    monkeypatch.setattr(rec, "start_stall", lambda d, quiet_ms: stalls.append(quiet_ms))
    return rec, dev, stalls


def test_a_runnable_device_short_of_cpu_is_excused_then_a_sleeping_one_is_stalled(monkeypatch):
    ms = 1_000_000
    rec, dev, stalls = _recovery_over_one_idle_device(monkeypatch, [
        (True, 0),            # first sight: quiet from here
        (True, 5 * ms),       # past the bound, runnable, 5 ms of CPU: the host's fault
        (False, 6 * ms)])     # asleep with work owed: stalled
    rec.watch(dev, 0)
    rec.watch(dev, 100 * ms)
    assert not stalls, "inside the bound: nothing yet (no CPU read needed)"
    rec.watch(dev, 300 * ms)
    assert not stalls and rec.verdicts["idle_host_lag"] == 1
    rec.watch(dev, 400 * ms)
    assert stalls == [400.0] and rec.verdicts["stalled"] == 1


def test_a_device_spinning_without_taking_its_work_is_not_excused(monkeypatch):
    ms = 1_000_000
    rec, dev, stalls = _recovery_over_one_idle_device(monkeypatch, [(True, 0), (True, 300 * ms)])
    rec.watch(dev, 0)
    rec.watch(dev, 300 * ms)
    assert stalls == [300.0], "it had the CPU for the whole bound and took nothing"


def test_any_sign_of_moving_restarts_the_quiet_clock(monkeypatch):
    ms = 1_000_000
    rec, dev, stalls = _recovery_over_one_idle_device(monkeypatch, [(False, 0)] * 4)
    rec.watch(dev, 0)
    rec.reg.slots[0].u64[S.PROGRESS] += 1
    rec.watch(dev, 200 * ms)  # moved: quiet again from here
    rec.watch(dev, 400 * ms)
    assert not stalls
    rec.watch(dev, 460 * ms)
    assert stalls == [260.0]

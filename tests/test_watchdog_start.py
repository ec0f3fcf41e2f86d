"""The watchdog's first look at a command reads several fields of the device's state slot
while the device keeps running; it must never pair one command's start stamp with another.

Pure logic, with a slot whose values change *between* two reads exactly as a device that
finishes one command and takes the next would; the same mechanism across real processes
is ``test_recovery.test_watchdog_times_out_only_from_device_start``.
"""

from __future__ import annotations

from types import SimpleNamespace

from device_workers import DeviceState
from device_workers import StateSlot as S
from hetproc.supervisor._recovery import Policy, Recovery

MS = 1_000_000


class _Field:
    def __init__(self, values: dict[int, int], on_read=None) -> None:
        self.values, self.on_read = values, on_read

    def __getitem__(self, i: int) -> int:
        value = self.values[i]
        if self.on_read is not None:
            self.on_read(i)
        return value


def _cmd(seq: int, pidx: int, t_submit: int) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, pidx=pidx, cid=seq, t_submit=t_submit,
                           timeout_ns=40 * MS, watch_deadline=0, watch_progress=0, rearms=0,
                           watch_cpu=-1, lagged=False)


def test_a_stale_busy_state_does_not_start_the_next_commands_watchdog_at_the_last_start():
    """Command 2 (submitted before command 1 started) waits on its input fence. The
    watchdog reads BUSY -- command 1's last instant -- then the device finishes command 1
    and takes command 2 (WAITING); the slot now names command 2 but still holds command
    1's start stamp. Timing command 2 from it would count its fence wait as execution."""
    first, second = _cmd(1, 11, t_submit=100 * MS), _cmd(2, 12, t_submit=101 * MS)
    u64 = {S.CURRENT_SEQ: 1, S.CURRENT_PIDX: 11, S.STARTED: 105 * MS, S.PROGRESS: 7,
           S.HEARTBEAT: 0}
    u32 = {S.STATE: DeviceState.BUSY}

    def device_moves_on(i: int) -> None:  # right after the watchdog read the state
        if i == S.STATE and u64[S.CURRENT_SEQ] == 1:
            u32[S.STATE] = DeviceState.WAITING
            u64[S.CURRENT_SEQ], u64[S.CURRENT_PIDX] = 2, 12

    slot = SimpleNamespace(u32=_Field(u32, device_moves_on), u64=_Field(u64))
    dev = SimpleNamespace(name="cpu0", index=0, pid=0, pushed={1: first, 2: second})
    reg = SimpleNamespace(slots=[slot], devices={"cpu0": dev})
    rec = Recovery(Policy(), reg, commands=None, evidence=None, spawn=None)
    rec.watch(dev, now=106 * MS)
    assert second.watch_deadline == 0, "armed from the previous command's start"
    assert first.watch_deadline == 0  # command 1 is gone: nothing to arm either

    # command 2 starts on the device after its fence: the watchdog times it from there
    u64[S.STARTED], u32[S.STATE] = 900 * MS, DeviceState.BUSY
    rec.watch(dev, now=901 * MS)
    assert second.watch_deadline == 940 * MS

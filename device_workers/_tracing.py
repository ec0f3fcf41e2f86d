"""What one emulated processor writes into the evidence chain (seed §22).

The device owns ring ``device_slot(index)`` of the platform's trace bank and writes, per
command, on its own track::

    ACQUIRE_WAIT  begin .. end   waiting on the input fences; the END says which fence
                                 came last (a0), whose request signalled it (a1 = cid)
                                 and which device or client did (a2 = signaller id)
    EXEC          one END        running (kernel + modeled time), written whole when it
                                 ends: a0 = error code (+ SIGNALLED_AT_END), a1 = take
                                 time, a2 = start time (see ``done``)
      MAP         begin .. end   mapping the command's buffers (nested in EXEC);
                                 END a0 = bytes touched, a1 = buffers, a2 = segments imported
    SIGNAL        instant        the fence signal: the emulated interrupt; a0 = error code.
                                 Written only for a delayed (hand-off) signal or a command
                                 that never ran; otherwise the EXEC record carries it.
    HOST_EXEC     instant        beside an EXEC drawn at its modeled times: the host's own
                                 start (a0), lag past the modeled end (a1), modeled end (a2)
    PREEMPT       instant        the running command (cid) suspended for pidx a0; a1 = the
                                 modeled switch cost

A no-op command costs the device two records, HOST_EXEC and EXEC's END, written by one
call (``TraceRing.pair``), and a third, the MODEL_LAGS sample, when it ran late: a call is
~0.3 us of Python, and the trace must stay cheap enough to leave on. It writes
the counters BUFFER_MAPS, DDR_BYTES (cumulative) and POWER_STATE (1 active, 0 low
power), and it counts maps, imports, bytes, fence waits and power switches in its counter
block so the metrics stay exact when tracing is off. The time a command was taken off the
ring (``t_take``) rides in the command's records (ACQUIRE_WAIT's BEGIN a2, EXEC's a1): it
ends the QUEUED slice the supervisor opened, which the export draws on the supervisor's
queue track (``hetproc.trace._export.expand``); it also goes back in the completion record.

Every record is stamped by the platform's clock (``ipc.clock.now_ns``): the host's
monotonic clock, or on the virtual clock the modeled now, where HOST_EXEC's "host" times
are the clock's readings too (the host's own time is not on that timeline).

Ring slots and track numbers are fixed here because both the device and the supervisor
(``hetproc``) must agree on them and ``hetproc`` depends on this package, not the reverse.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ipc import COUNTERS, END, INSTANT, Stage, TraceBank, clock

SLOT_SUPERVISOR = 0
TRACK_SUPERVISOR = 0
# An idle device drops to low power after this long without work; the next command wakes
# it (a power-state switch). Real SoCs use a few ms of hysteresis so that back-to-back work
# does not bounce the rails; this is not scaled, like the other fixed OS costs.
POWER_DOWN_NS = 2_000_000

_ACQ, _EXEC = int(Stage.ACQUIRE_WAIT), int(Stage.EXEC)
_MAP, _SIGNAL = int(Stage.MAP), int(Stage.SIGNAL)
_C_MAPS, _C_IMPORTS, _C_DDR = COUNTERS["maps"], COUNTERS["imports"], COUNTERS["ddr_bytes"]
_C_POWER, _C_WAITS = COUNTERS["power_switches"], COUNTERS["fence_waits"]
_C_WAIT_NS = COUNTERS["fence_wait_ns"]
_C_LAGS, _C_LAG_NS = COUNTERS["model_lags"], COUNTERS["model_lag_ns"]
_HOST, _PREEMPT = int(Stage.HOST_EXEC), int(Stage.PREEMPT)
# Counter stages as plain ints: an enum member costs a lookup and an ``__index__`` per write.
_POWER_STATE, _BUFFER_MAPS, _DDR_BYTES = (int(Stage.POWER_STATE), int(Stage.BUFFER_MAPS),
                                          int(Stage.DDR_BYTES))
_MODEL_LAGS, _FREQUENCY, _TEMPERATURE = (int(Stage.MODEL_LAGS), int(Stage.FREQUENCY),
                                         int(Stage.TEMPERATURE))


def device_slot(index: int) -> int:
    """The trace ring a device writes (slot 0 is the supervisor's)."""
    return 1 + index


def device_track(index: int) -> int:
    """The track of a device's execution lane."""
    return 1 + index


QUEUE_TRACK_BASE = 256
SIGNALLED_AT_END = 1 << 32  # in an EXEC record's a0: its fences were signalled at its end


def queue_track(index: int) -> int:
    """The track of a device's queue, drawn by the supervisor."""
    return QUEUE_TRACK_BASE + index


class DeviceTrace:
    """The device's writer: a ring, a counter block, and what is open for the current
    command, so that a command failing half-way still closes every slice it opened."""

    def __init__(self, bank: TraceBank, index: int, fences: Any, cache: Any, *,
                 private: bool = False) -> None:
        self.bank = bank
        # The platform's clock (the modeled one on a virtual clock): every record of this
        # ring shares the timeline of the EXEC slices, which are drawn at modeled times.
        self.now = clock.now_ns
        self.ring = bank.writer(device_slot(index), now=self.now)
        self.c = bank.counters(device_slot(index))
        self.track = device_track(index)
        self.fences = fences
        self.cache = cache
        self._imports_counted = 0  # of ``cache.imports``, added to the counter so far
        self._private = private
        self.t_take = 0  # when the current command came off the ring: only ``take`` sets it
        # The slices the current command has open: each begin sets its flag, its end
        # clears it, and ``done`` closes whatever a failure left open; a preemption saves
        # and restores them whole (``save``, ``restore``).
        self._open_wait = self._open_exec = self._open_map = False
        self._t_wait = self._t_exec = 0
        self._active = False  # the power state drawn last: only ``_power`` changes it
        # When the ring ran dry (0: busy): ``idle`` sets it; ``take`` and a power switch
        # clear it.
        self._idle_since = 0
        self.ring.counter(_POWER_STATE, 0, self.track)

    @classmethod
    def attach(cls, boot: Any, cache: Any, fences: Any) -> DeviceTrace:
        """Attach the platform's bank, or a private disabled one when there is none (a
        device started without tracing still counts, for its own metrics)."""
        if boot.trace_segment:
            seg = cache.get(boot.trace_segment)
            return cls(TraceBank(seg.map, create=False), boot.index, fences, cache)
        bank = TraceBank(bytearray(TraceBank.nbytes(boot.index + 2, 2)), create=True,
                         rings=boot.index + 2, capacity=2, enabled=False)
        return cls(bank, boot.index, fences, cache, private=True)

    # -- power state ------------------------------------------------------------------

    def idle(self) -> None:
        """The command ring is empty. Record when idling began; drop to low power (dated
        when it really happened) once the hysteresis has passed."""
        if not self._active:
            return
        now = self.now()
        if not self._idle_since:
            self._idle_since = now
        elif now - self._idle_since >= POWER_DOWN_NS:
            self._power(0, self._idle_since + POWER_DOWN_NS)

    def _power(self, state: int, t_ns: int) -> None:
        self._active = bool(state)
        self._idle_since = 0
        self.c[_C_POWER] += 1
        self.ring.counter(_POWER_STATE, state, self.track, t_ns=t_ns)

    # -- one command ------------------------------------------------------------------

    def queued(self, cid: int, t_queued: int, t_take: int, index: int) -> None:
        """A command read from a user-mode queue: no supervisor opened its QUEUED slice,
        so the device draws it whole, from the record's arrival to the take."""
        self.ring.complete(Stage.QUEUED, cid, queue_track(index), min(t_queued, t_take), t_take)

    def take(self, t_ns: int) -> None:
        """A command came off the ring at ``t_ns`` (the end of its QUEUED time)."""
        self.t_take = t_ns
        if self._idle_since and t_ns - self._idle_since >= POWER_DOWN_NS:
            self._power(0, self._idle_since + POWER_DOWN_NS)
        if not self._active:
            self._power(1, t_ns)
        self._idle_since = 0

    def wait_begin(self, cid: int, n: int) -> None:
        self._open_wait = True
        self._t_wait = self.now()
        self.ring.begin(_ACQ, cid, self.track, n, 0, self.t_take, self._t_wait)

    def wait_end(self, cid: int, handles: list[int]) -> None:
        """Close ACQUIRE_WAIT naming the fence that signalled last: the one really waited for."""
        self._open_wait = False
        last = (0, 0, 0, 0)  # t, handle, producer cid, signaller
        for h in handles:
            pcid, who, t = self.fences.producer(h)
            if t >= last[0]:
                last = (t, h, pcid, who)
        now = self.now()
        self.c[_C_WAITS] += 1
        self.c[_C_WAIT_NS] += now - self._t_wait
        self.ring.end(_ACQ, cid, self.track, last[1], last[2], last[3], t_ns=now)

    def exec_begin(self, cid: int, t_ns: int) -> None:
        """The command starts running. Nothing is written yet: the whole EXEC slice goes
        out as one record when it ends (see ``done``); while it runs, the state table's
        ``current_cid`` and ``started_ns`` say so, and that is what a window frozen
        around a hang or a crash draws its open EXEC from."""
        self._open_exec = True
        self._t_exec = t_ns

    def map_buffers(self, memory: Any, cmd: dict[str, Any], between: Any,
                    views: bool, **modeled: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``memory.acquire`` (IOMMU check, maps, cache maintenance, numpy views), traced as
        a MAP slice: END a0 = bytes viewed, a1 = buffers mapped, a2 = segments imported.
        ``modeled``: the modeled start and hold function, passed on to ``acquire``."""
        n = len(cmd["ins"]) + len(cmd["outs"])
        if not n:
            return memory.acquire(cmd, between, views=views, **modeled)
        cid, ring, c = cmd["cid"], self.ring, self.c
        self._open_map = True
        before = self.cache.imports
        ring.begin(_MAP, cid, self.track)
        ins, outs = memory.acquire(cmd, between, views=views, **modeled)
        # (not the change of ``len(cache)``: a fetch during the map reads drops too, and
        # a negative count failed the command with a DeviceFault, ValueError in 'Q')
        imported = self.cache.imports - before
        nbytes = 0
        for a in ins:  # (a loop, not ``sum`` over generators: once per command)
            nbytes += a.nbytes
        for a in outs:
            nbytes += a.nbytes
        c[_C_MAPS] += n
        total = self.cache.imports  # (those read while idle too: counted here)
        c[_C_IMPORTS] += total - self._imports_counted
        self._imports_counted = total
        c[_C_DDR] += nbytes
        self._open_map = False
        ring.end(_MAP, cid, self.track, nbytes, n, imported)
        ring.counter(_BUFFER_MAPS, c[_C_MAPS], self.track)
        ring.counter(_DDR_BYTES, c[_C_DDR], self.track)
        return ins, outs

    def done(self, cmd: dict[str, Any], code: int, signal_now: bool,
             modeled: tuple[int, int, int] | None = None) -> None:
        """The command finished (or failed at any point): close what it left open.

        The EXEC slice is one END record: a0 = error code (| ``SIGNALLED_AT_END`` when its
        fences are signalled right after this, with no hand-off delay: the record stands
        for the SIGNAL too), a1 = when the command was taken off the ring (the end of its
        QUEUED time), a2 = when it started. The export turns it back into BEGIN, END and
        SIGNAL. A command that never started gets its own SIGNAL instant.

        ``modeled`` = (modeled start, modeled end, lag ns) of a command that ran: the EXEC
        slice is then drawn at its modeled times (invariant 8), and a HOST_EXEC instant at
        the host's own end carries the host's start (a0), the lag (a1: how far past the
        modeled end the host finished, 0 when absorbed) and the modeled end (a2). A lag
        also bumps the ``model_lags`` counter and its trace counter.
        """
        cid, ring = cmd["cid"], self.ring
        if self._open_map:
            self._open_map = False
            ring.end(_MAP, cid, self.track, 0, 0, 0)
        if self._open_exec:
            self._open_exec = False
            flags = code | (SIGNALLED_AT_END if signal_now else 0)
            if modeled is None:
                ring.end(_EXEC, cid, self.track, flags, self.t_take, self._t_exec)
            else:
                m0, m1, lag = modeled
                ring.instant(_HOST, cid, self.track, self._t_exec, lag, m1)
                ring.end(_EXEC, cid, self.track, flags, self.t_take, m0, t_ns=m1)
                if lag:
                    self.c[_C_LAGS] += 1
                    self.c[_C_LAG_NS] += lag
                    ring.counter(_MODEL_LAGS, self.c[_C_LAGS], self.track)
        elif signal_now:
            ring.instant(_SIGNAL, cid, self.track, code)
        if self._open_wait:
            self.wait_end(cid, cmd.get("wait") or [])

    def ran(self, cid: int, signal_now: bool, m0: int, m1: int, lag: int) -> None:
        """``done`` for a command that ran to its end with only EXEC open (no input wait,
        no map: ``execute_hold``): the same records, HOST_EXEC then EXEC's END."""
        if self._open_map or self._open_wait or not self._open_exec:
            self.done({"cid": cid}, 0, signal_now, (m0, m1, lag))
            return
        self._open_exec = False
        flags = SIGNALLED_AT_END if signal_now else 0
        if not lag:
            self.ring.pair(cid, self.track, _HOST, INSTANT, self.now(), self._t_exec,
                           0, m1, _EXEC, END, m1, flags, self.t_take, m0)
            return
        c = self.c
        c[_C_LAGS] += 1
        c[_C_LAG_NS] += lag
        self.ring.pair(cid, self.track, _HOST, INSTANT, self.now(), self._t_exec, lag,
                       m1, _EXEC, END, m1, flags, self.t_take, m0, _MODEL_LAGS, c[_C_LAGS])

    def power(self, speed: float, thermal: Any, temperature_only: bool = False) -> None:
        """Counters: the speed a command runs at (per mille of the top frequency) and,
        with a thermal model, the temperature (milli-degrees)."""
        if not temperature_only:
            self.ring.counter(_FREQUENCY, int(round(speed * 1000)), self.track)
        if thermal is not None:
            self.ring.counter(_TEMPERATURE, int(thermal.temp * 1000), self.track)

    def preempted(self, victim_cid: int, target_pidx: int, switch_ns: int) -> None:
        """The running command is suspended at a chunk boundary for a more urgent one."""
        self.ring.instant(_PREEMPT, victim_cid, self.track, target_pidx, switch_ns, 0)

    def save(self) -> tuple:
        """What is open for the current command, kept across a preemption. Nothing is
        open then for the urgent command: one that fails before it starts gets its own
        SIGNAL instant, not the END of the suspended command's EXEC under its id."""
        state = (self.t_take, self._open_wait, self._open_exec, self._open_map, self._t_wait,
                 self._t_exec)
        self._open_wait = self._open_exec = self._open_map = False
        self._t_wait = self._t_exec = 0
        return state

    def restore(self, state: tuple) -> None:
        (self.t_take, self._open_wait, self._open_exec, self._open_map, self._t_wait,
         self._t_exec) = state

    def signalled(self, cid: int, code: int) -> None:
        """A delayed (hand-off) signal is being posted now."""
        self.ring.instant(_SIGNAL, cid, self.track, code)

    def close(self) -> None:
        self.bank.close()

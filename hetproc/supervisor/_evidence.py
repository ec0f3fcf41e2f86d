"""The supervisor's side of the evidence chain (seed §22): trace rings, frozen windows.

::

      one shared segment <prefix>trace (a TraceBank), one ring + counter block per writer:
      ┌─────────────┬──────────────┬─────┬──────────────┬─────────────┬─────┐
      │ 0 supervisor│ 1 device 0   │ ... │ D device D-1 │ D+1 client  │ ... │
      └──────▲──────┴──────▲───────┴─────┴──────────────┴──────▲──────┴─────┘
             │ QUEUED (and │ ACQUIRE_WAIT, EXEC, MAP,          │ SUBMIT, WAKE,
             │ ENQUEUE),   │ SIGNAL, power state               │ CALLBACK
             │ queue depth,│ (device_workers._tracing)         │ (hetproc.client._trace_ring)
             │ in flight   │
             │
      error ─┴─▶ freeze_window(reason, cid): when the "after" part of the window has
                 passed (tick), copy [t_error - before, t_error + after] out of every
                 ring into an owned array, keep it (bounded), optionally dump it as JSON.

Every record carries the request's correlation id (``cid``), made by the client and
carried in the command packet and the fence slot, so one request's stages line up across
the client, supervisor and device processes on the one CLOCK_MONOTONIC timeline.

``Evidence`` is one part of the supervisor: the loop and the command engine call a
handful of hooks where a request passes through (``hello``, ``submitted``, ``failed``,
``note_error``...), recovery calls ``freeze_window``; the ``trace_*`` requests and the
extra metrics come from here, so the evidence logic stays out of the loop. It also keeps
the platform's ``last_error``: every error the supervisor notes goes through it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

from device_workers import (
    QUEUE_TRACK_BASE,
    SLOT_SUPERVISOR,
    TRACK_SUPERVISOR,
    DeviceState,
    device_slot,
    device_track,
    queue_track,
)
from ipc import Stage, TraceBank, clock, errors

from ._failures import kind_of, record_of

if TYPE_CHECKING:
    from ._devices import Command, DeviceHandle
    from ._records import ClientRec, Registry

_QUEUED, _ERROR = int(Stage.QUEUED), int(Stage.ERROR)
_DEPTH, _INFLIGHT = int(Stage.QUEUE_DEPTH), int(Stage.INFLIGHT)
_MAX_NAMES = 4096          # process names remembered for export (oldest clients dropped)
_FREEZES_PER_S = 10        # an error storm must not turn the supervisor into a copier
_PAGE_RECORDS = 16000      # records per trace_frozen reply: 768 KB, under MAX_PACKET
_SAMPLE_NS = 1_000_000     # counter samples at most every 1 ms (see _sample)
CLIENT_TRACK_BASE = 1024


def client_track(client_id: int) -> int:
    """The track of a client's lane (u16: client ids wrap after ~64k clients)."""
    return CLIENT_TRACK_BASE + client_id % (0xFFFF - CLIENT_TRACK_BASE)


def freezes_on(exc: errors.HetprocError) -> bool:
    """Errors worth a frozen window: a runtime failure, not a caller's mistake nor the
    consequence of an earlier failure (each kind's entry: ``_failures.KINDS``)."""
    return kind_of(exc).freezes(exc)


class Evidence:
    """Trace bank, per-request hooks, frozen windows, the last error, and their metrics."""

    def __init__(self, reg: Registry, prefix: str, new_segment: Callable[[str, int], Any]) -> None:
        self.reg = reg
        self.spec = reg.spec
        self.prefix = prefix
        self.last_error: dict[str, Any] | None = None
        t = self.spec.trace
        rings = 1 + len(self.spec.devices) + t.client_slots
        seg = new_segment("trace", TraceBank.nbytes(rings, t.capacity))
        self.trace_segment = seg
        self.trace_bank = TraceBank(seg.map, create=True, rings=rings, capacity=t.capacity,
                                    enabled=t.enabled)
        # Looked up at each stamp: the virtual clock is installed after this is built.
        self.trace_ring = self.trace_bank.writer(SLOT_SUPERVISOR, now=lambda: clock.now_ns())
        self._trace_free = deque(range(1 + len(self.spec.devices), rings))
        self._trace_slot_of: dict[Any, int] = {}
        self._trace_departed = dict.fromkeys(("maps", "imports", "fence_waits", "fence_wait_ns"), 0)
        self.trace_names: dict[int, str] = {os.getpid(): "hetproc supervisor"}
        self.trace_tracks: dict[int, str] = {TRACK_SUPERVISOR: "supervisor"}
        for i, d in enumerate(self.spec.devices):
            self.trace_tracks[device_track(i)] = d.name
            self.trace_tracks[queue_track(i)] = f"{d.name} queue"
        self.frozen: deque[dict[str, Any]] = deque(maxlen=t.keep)
        self._pending_freeze: dict[str, Any] | None = None
        self._freeze_ids = itertools.count(1)
        self._freeze_times: deque[int] = deque(maxlen=_FREEZES_PER_S)
        self._freezes_suppressed = 0
        self._sampled = 0                    # when counters were last written
        self._dev_at = {dev.index: dev for dev in reg.devices.values()}
        self._shown: dict[int, int] = {}     # device index (-1: in-flight) -> value written
        scale = max(self.spec.time_scale, 0.05)
        # Scaled like the modeled durations, floored by what the OS itself costs (a wake-up
        # on a loaded 2-core box takes up to a few ms whatever the time scale).
        self._before_ns = int(max(t.before_ms * scale, 5.0) * 1e6)
        self._after_ns = int(max(t.after_ms * scale, 2.0) * 1e6)
        self._lookback_ns = 20 * self._before_ns

    def boot_args(self) -> dict[str, str]:
        """What a device needs to find its ring (merged into its boot arguments)."""
        return {"trace_segment": self.trace_segment.name}

    def device_spawned(self, dev: DeviceHandle) -> None:
        self.trace_names[dev.pid] = f"{dev.name} (device, epoch {dev.epoch})"

    def close(self) -> None:
        if self.spec.trace.dump_dir:
            self.flush()  # a window still collecting its aftermath reaches its file
        self.trace_bank.close()

    # -- clients ----------------------------------------------------------------------

    def hello(self, client: ClientRec) -> dict[str, Any]:
        """Hand a ring to a new client (least recently used first, so the previous
        occupant's records stay readable as long as possible)."""
        slot = self._trace_free.popleft() if self._trace_free else -1
        track = client_track(client.id)
        if slot >= 0:
            self._trace_slot_of[client] = slot
            self.trace_bank.reset_counters(slot)
        self._remember_name(client.pid, client.name)
        self.trace_tracks[track] = f"client {client.name}"
        return {"trace": {"segment": self.trace_segment.name, "slot": slot, "track": track,
                          "enabled": self.trace_bank.enabled}}

    def _remember_name(self, pid: int, name: str) -> None:
        names = self.trace_names
        old = names.pop(pid, None)
        if old and old.startswith("client ") and name not in old[7:].split(", "):
            names[pid] = f"{old}, {name}"  # several clients in one process share its row
        else:
            names[pid] = f"client {name}"
        while len(names) > _MAX_NAMES:
            names.pop(next(iter(names)))

    def client_gone(self, client: ClientRec) -> None:
        slot = self._trace_slot_of.pop(client, None)
        if slot is None:
            return
        counts = self.trace_bank.counter_values(slot)
        for key in self._trace_departed:
            self._trace_departed[key] += counts[key]
        self._trace_free.append(slot)

    # -- a request passing through -----------------------------------------------------

    def submitted(self, dev: DeviceHandle, cmds: list[Command], t0_ns: int) -> None:
        """After a submit queued ``cmds``: one QUEUED slice per command, open until
        the device takes the command off its ring.

        The supervisor is the platform's busiest process, so this is the only record it
        writes per command: the BEGIN is stamped when the message arrived (``t0_ns``) and
        carries in a2 how long validation and queueing took (the export turns that into
        an ENQUEUE slice); the END is the device's take time, which the device writes into
        its own first record of the command (a2), and the export draws the END from it.
        Only a command failed before a device took it gets an END from here.
        """
        qt = QUEUE_TRACK_BASE + dev.index
        now = clock.now_ns()
        begin, enq = self.trace_ring.begin, now - t0_ns
        for cmd in cmds:
            begin(_QUEUED, cmd.cid, qt, cmd.seq, cmd.priority, enq, t0_ns)
            cmd.trace_track = qt
        if now - self._sampled >= _SAMPLE_NS:
            self._sample(now)

    def failed(self, cmd: Command, exc: errors.HetprocError) -> None:
        """A command failed without a completion (cancelled, device died): close QUEUED
        (if the device had taken it, its own record says when; explain takes the earlier)."""
        qt = cmd.trace_track
        if qt < 0:
            return
        cmd.trace_track = -1
        self.trace_ring.end(_QUEUED, cmd.cid, qt, exc.code, 0, 0, clock.now_ns())

    def _sample(self, now: int) -> None:
        """Write the queue-depth counters that changed, and the in-flight total (commands
        submitted and not yet completed: queued here or pushed to a device).

        Paced to one round per ``_SAMPLE_NS``, from submits and from the loop's tick, not
        per command: at 20k commands/s a sample per command would cost the busiest process
        more than the slices themselves, and a counter track needs no finer grain.
        """
        self._sampled = now
        counter, shown, total = self.trace_ring.counter, self._shown, 0
        for index, dev in self._dev_at.items():
            depth = dev.queue_depth()
            total += depth
            if shown.get(index, 0) != depth:
                shown[index] = depth
                counter(_DEPTH, depth, QUEUE_TRACK_BASE + index, 0, now)
        if shown.get(-1, 0) != total:
            shown[-1] = total
            counter(_INFLIGHT, total, TRACK_SUPERVISOR, 0, now)

    def note_error(self, exc: errors.HetprocError) -> int:
        """Every error the supervisor notes: it becomes the last error, and the ones that
        matter freeze a window, whose id the last error then names and which is returned
        (0: none) for the error's record to name (``_failures.record_of``)."""
        last = self.last_error = {**record_of(exc, 0), "t": time.time()}
        if not freezes_on(exc):
            return 0
        wid = self.freeze_window(f"{exc.name}: {exc.message}", exc.correlation_id,
                                 code=exc.code)
        if wid:
            # (The window's copy of the last error shares this detail: it names itself.)
            last["detail"]["trace_window"] = last["trace_window"] = wid
        return wid

    # -- frozen windows ---------------------------------------------------------------

    def freeze_window(self, reason: str, cid: int = 0, *, code: int = 0) -> int:
        """Keep the trace around now: [now - before, now + after] from every ring.

        Returns the window's id at once; the copy is taken by ``tick`` once the
        "after" part has passed (so it holds what happened next, e.g. the recovery).
        Errors while a window is still open join it; an error storm is rate-limited and
        counted as ``freezes_suppressed``. Safe to call from any supervisor code path.
        """
        # Two clocks: the window's bounds are on the records' timeline (the modeled one on
        # a virtual clock), while when to copy it and the storm limit are host matters.
        now, host = clock.now_ns(), time.monotonic_ns()
        self.trace_ring.instant(_ERROR, cid, TRACK_SUPERVISOR, code, t_ns=now)
        entry = {"t_ns": now, "reason": reason, "cid": cid, "code": code}
        p = self._pending_freeze
        if p is not None:
            p["errors"].append(entry)
            if cid:
                p["cids"].add(cid)
            known = {r[2] for r in p["running"]}
            p["running"] += [r for r in self.running_execs() if r[2] not in known]
            # Extend to cover this error's aftermath, but never indefinitely.
            p["t_due"] = max(p["t_due"], min(host + self._after_ns,
                                             p["t_error_host"] + self._before_ns))
            p["t_to"] = max(p["t_to"], min(now + self._after_ns,
                                           p["t_error_ns"] + self._before_ns))
            return p["id"]
        times = self._freeze_times
        if len(times) == _FREEZES_PER_S and host - times[0] < 1_000_000_000:
            self._freezes_suppressed += 1
            if self.frozen:
                self.frozen[-1]["suppressed"] += 1
                return self.frozen[-1]["id"]
            return 0
        self._freeze_times.append(host)
        wid = next(self._freeze_ids)
        self._pending_freeze = {
            "id": wid, "reason": reason, "cid": cid, "cids": {cid} if cid else set(),
            "t_error_ns": now, "t_to": now + self._after_ns, "t_error_host": host,
            "t_due": host + self._after_ns, "errors": [entry],
            "last_error": dict(self.last_error) if self.last_error else None, "suppressed": 0,
            # What ran at the error (a hung command has no EXEC record yet: it is written
            # when a command ends), read now: a restarted device overwrites its state slot.
            "running": self.running_execs(),
        }
        return wid

    def tick(self) -> None:
        """Called every loop turn: finish counter tracks whose last sample was skipped;
        take the copy of a window whose "after" part has passed."""
        now = clock.now_ns()
        if now - self._sampled >= _SAMPLE_NS:
            self._sample(now)
        p = self._pending_freeze
        if p is not None and time.monotonic_ns() >= p["t_due"]:
            self._complete_freeze()

    def _complete_freeze(self) -> None:
        p, self._pending_freeze = self._pending_freeze, None
        assert p is not None
        t_to = max(p["t_to"], clock.now_ns())
        t_from = p["t_error_ns"] - self._before_ns
        if self.frozen:  # windows never overlap: the previous one already holds that part
            t_from = max(t_from, self.frozen[-1]["t_to_ns"] + 1)
        records = self.trace_bank.snapshot(t_from_ns=max(0, t_from - self._lookback_ns),
                                           t_to_ns=t_to)
        # Reach back to the start of each failed request (its submit may predate "before"),
        # within the lookback bound.
        cids = np.fromiter(p["cids"], np.uint64, len(p["cids"]))
        if len(cids) and len(records):
            mine = records["t_ns"][np.isin(records["cid"], cids)]
            if len(mine):
                t_from = min(t_from, int(mine.min()))
        records = records[records["t_ns"] >= t_from]
        window = {
            "id": p["id"], "reason": p["reason"], "cid": p["cid"], "cids": sorted(p["cids"]),
            "t_error_ns": p["t_error_ns"], "t_from_ns": t_from, "t_to_ns": t_to,
            "clock": self.spec.clock,  # the clock of every time above and of the records
            "errors": p["errors"], "last_error": p["last_error"], "suppressed": p["suppressed"],
            "records": records, "names": dict(self.trace_names),
            "tracks": dict(self.trace_tracks), "running": p["running"], "file": None,
        }
        self.frozen.append(window)
        dump_dir = self.spec.trace.dump_dir
        if dump_dir:
            window["file"] = _dump_window(window, dump_dir, self.prefix)

    def running_execs(self) -> list[list[int]]:
        """``[pid, track, cid, started_ns]`` of each command executing now, from the state
        table (its EXEC record is written when it ends)."""
        out = []
        for dev in self.reg.devices.values():
            st = self.reg.state[dev.index]
            busy = int(st["state"]) == DeviceState.BUSY
            if busy and int(st["current_seq"]) and int(st["started_ns"]):
                out.append([int(st["pid"]), device_track(dev.index), int(st["current_cid"]),
                            int(st["started_ns"])])
        return out

    def flush(self) -> None:
        """Take a pending window now (before answering about windows, or at shutdown)."""
        if self._pending_freeze is not None:
            self._complete_freeze()

    # -- requests ---------------------------------------------------------------------

    def info(self) -> dict:
        """Where the rings are and what their pids and tracks are called: a reader maps the
        segment and snapshots the rings itself (data never travels on the control channel)."""
        return {"segment": self.trace_segment.name, "rings": self.trace_bank.rings,
                "capacity": self.trace_bank.capacity, "enabled": self.trace_bank.enabled,
                "names": [[pid, name] for pid, name in self.trace_names.items()],
                "tracks": [[t, name] for t, name in self.trace_tracks.items()],
                "running": self.running_execs()}

    def frozen_page(self, wid: int | None, offset: int = 0, flush: bool = False) -> dict:
        """Without ``wid``: every kept window's summary. With it: one window, its
        records paged from ``offset`` (raw RECORD_DTYPE bytes)."""
        if flush:
            self.flush()
        if wid is None:
            return {"windows": [_summary(w) for w in self.frozen],
                    "pending": self._pending_freeze is not None,
                    "suppressed": self._freezes_suppressed}
        for w in self.frozen:
            if w["id"] == wid:
                off = int(offset)
                recs = w["records"][off:off + _PAGE_RECORDS]
                return {"window": {**_summary(w), "names": [[p, n] for p, n in w["names"].items()],
                                   "tracks": [[t, n] for t, n in w["tracks"].items()],
                                   "errors": w["errors"], "last_error": w["last_error"],
                                   "running": w["running"]},
                        "records": recs.tobytes(), "offset": off, "total": len(w["records"])}
        kept = [w["id"] for w in self.frozen]
        raise errors.InvalidRequest(f"no frozen window {wid} (kept: {kept})")

    # -- metrics ----------------------------------------------------------------------

    def add_metrics(self, m: dict[str, Any]) -> dict[str, Any]:
        """Add the §9/§15 figures the trace counters and the OS know: fence waits, buffer
        views (what devices and clients mapped as arrays; the IOMMU's own ``buffer_maps``
        come from ``hetproc.supervisor._handoff``), power-state switches, CPU per process,
        trace health."""
        bank = self.trace_bank
        maps = imports = 0
        dev_waits = dev_wait_ns = switches = 0
        cpu: dict[str, float | None] = {"supervisor": _cpu_s(os.getpid())}
        for dev in self.reg.devices.values():
            v = bank.counter_values(device_slot(dev.index))
            maps += v["maps"]
            imports += v["imports"]
            dev_waits += v["fence_waits"]
            dev_wait_ns += v["fence_wait_ns"]
            switches += v["power_switches"]
            m["devices"][dev.name].update(
                mapped_operands=v["maps"], segment_imports=v["imports"],
                bytes_touched=v["ddr_bytes"], power_switches=v["power_switches"],
                acquire_waits=v["fence_waits"], acquire_wait_ms=v["fence_wait_ns"] / 1e6,
                model_lags=v["model_lags"], model_lag_ms=v["model_lag_ns"] / 1e6)
            cpu[dev.name] = _cpu_s(dev.pid) if dev.pid else None
        departed = self._trace_departed
        c_waits, c_wait_ns = departed["fence_waits"], departed["fence_wait_ns"]
        c_maps = self._trace_departed["maps"]
        imports += self._trace_departed["imports"]
        for slot in self._trace_slot_of.values():
            v = bank.counter_values(slot)
            c_maps += v["maps"]
            imports += v["imports"]
            c_waits += v["fence_waits"]
            c_wait_ns += v["fence_wait_ns"]
        for client in self.reg.live_clients():
            if client.pid:
                cpu[f"client {client.name} ({client.pid})"] = _cpu_s(client.pid)
        m.update(
            buffer_views={"device_operands": maps, "client_arrays": c_maps,
                          "segment_imports": imports},
            power_switches=switches,
            fence_wait={"client_waits": c_waits, "client_wait_ms": c_wait_ns / 1e6,
                        "client_wait_ms_mean": c_wait_ns / 1e6 / c_waits if c_waits else None,
                        "device_waits": dev_waits, "device_wait_ms": dev_wait_ns / 1e6,
                        "device_wait_ms_mean":
                            dev_wait_ns / 1e6 / dev_waits if dev_waits else None},
            cpu_s=cpu,
            trace={"enabled": bank.enabled, "capacity": bank.capacity, "rings": bank.rings,
                   "free_client_rings": len(self._trace_free),
                   "records_written": sum(bank.written(k) for k in range(bank.rings)),
                   "frozen_windows": len(self.frozen),
                   "freezes_suppressed": self._freezes_suppressed,
                   "last_window": self.frozen[-1]["id"] if self.frozen else None},
        )
        return m


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (None if it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
        return round(t.user + t.system, 4)
    except (psutil.Error, OSError):
        return None


def _summary(w: dict[str, Any]) -> dict[str, Any]:
    return {"id": w["id"], "reason": w["reason"], "cid": w["cid"], "cids": w["cids"],
            "t_error_ns": w["t_error_ns"], "t_from_ns": w["t_from_ns"], "t_to_ns": w["t_to_ns"],
            "clock": w["clock"], "records": len(w["records"]), "errors": len(w["errors"]),
            "suppressed": w["suppressed"], "file": w["file"]}


def _dump_window(window: dict[str, Any], dump_dir: str, prefix: str) -> str | None:
    """Write one frozen window as Chrome Trace JSON; a failure to write loses the file,
    never the window (it stays in memory) nor the supervisor."""
    from ..trace import frozen_to_chrome, write_chrome_trace
    try:
        os.makedirs(dump_dir, exist_ok=True)
        path = os.path.join(dump_dir, f"frozen-{prefix.strip('.')}-{window['id']}.json")
        return write_chrome_trace(path, frozen_to_chrome(window))
    except OSError:
        return None

"""What a device tells the world when a command completes: its fences, then its record.

::

    finish ──▶ signal(fences) ──▶ put(record) ─┬─ an error, a lost signal ─▶ flush, eventfd
                                              ├─ OUTBOX_MAX records ─────▶ flush
                                              └─ nothing queued behind ──▶ flush
               hold(record) ──▶ delayed (a heap by due time) ──▶ fire_due: signal, put
    flush ──▶ completion ring, in batches that fit a slot ──▶ eventfd (when asked for news)

Successes are batched while more commands wait (one ring slot and at most one eventfd
write per batch, not per command); errors go out at once. A record whose fences are
signalled after the hand-off delay waits in ``delayed`` until its signal is due: the
supervisor learns a command finished only once its consumers could. A signal of a
watched fence (a descriptor or a merge waits on it: ``ipc._fencefd``) wakes the
supervisor at once, whatever the batch: only it completes what watches the fence.
"""

from __future__ import annotations

import heapq
import os
import time
from collections import deque
from typing import Any

from ipc import FenceTable, Ring, clock, errors

from ._boot import DeviceBoot
from ._commands import (
    BATCH_HEAD,
    MAX_BATCH,
    completion_batch,
    encode_completion,
    encode_ran,
    ran_tail,
)
from ._state import StateSlot
from ._tracing import DeviceTrace

_EMPTY = b""
OUTBOX_MAX = 16  # completion records per message: ~100 bytes each, ring slots hold 2 KiB
_FULL_RING_SLEEP_S = 0.0005


class Outbox:
    """The completion records of one device on their way to its supervisor."""

    def __init__(self, boot: DeviceBoot, completions: Ring, commands: Ring, backlog: deque,
                 u32: memoryview, fences: FenceTable, trace: DeviceTrace) -> None:
        self.epoch = boot.epoch
        self.completion_fd = boot.completion_fd
        self.parent_pid = boot.parent_pid
        self.signaller = boot.index + 1  # who signalled, as the fence slots record it
        self.completions = completions
        self.commands = commands  # with ``backlog``: what still waits to run
        self.backlog = backlog
        self.pending: list = []  # the marked commands read, not run (``Preemption.pending``)
        self.u32 = u32
        self.fences = fences
        self.trace = trace
        # Encoded records not yet in the ring: ``put`` and ``ran`` append, ``flush`` empties.
        self.records: list[bytes] = []
        # (due ns, seq, fences, record) of commands whose signal waits for the hand-off
        # delay: ``hold`` pushes, ``fire_due`` pops once due.
        self.delayed: list[tuple[int, int, list[int], dict[str, Any]]] = []
        # Grows whenever something leaves the device (a fence signalled, records in the
        # ring): a lease on the virtual clock ends there (``_vclock``). (A poke that only
        # says "look, I block" tells nothing.)
        self.told = 0

    def signal(self, handles: list[int], word: int, t_model: int = 0) -> None:
        """Signal (``word`` 0) or fail the fences, stamped with the modeled time."""
        signal, signaller = self.fences.signal, self.signaller
        self.told += 1
        for handle in handles:
            signal(handle, word, signaller, t_model)
        if self.fences.poked:
            self.poke()

    def poke(self) -> None:
        """A watched fence was signalled: wake the supervisor, which completes what
        watches it (the records need not be in the ring: it reads the fence table)."""
        self.fences.poked = False
        try:
            os.eventfd_write(self.completion_fd, 1)
        except OSError:
            pass

    def post(self, record: dict[str, Any]) -> None:
        """Queue a completion record; an error or a lost signal goes out at once."""
        self.put(encoded(record, self.completions.max_payload),
                 urgent=bool(record["code"] or record.get("unsignalled")))

    def ran(self, cmd: dict[str, Any], t_start: int, t_end: int, t_take: int, m0: int,
            m1: int, lag: int, speed: float, thermal: Any, lazy: bool,
            mem: dict[str, Any] | None = None) -> None:
        """Signal the fences of a command that ran to its end (modeled m0..m1), then queue
        its record, packed as it goes (``encode_ran``: the bytes ``encode_completion``
        makes of that record's map, ``post``'s). ``mem``: its memory report (None: no
        memory work). ``lazy``: see ``put``."""
        signal, signaller = self.fences.signal, self.signaller
        self.told += 1
        for handle in cmd["signal"]:
            signal(handle, 0, signaller, m1)
        if self.fences.poked:
            self.poke()
        tail = _EMPTY if mem is None else ran_tail(mem, self.completions.max_payload)
        if thermal is None:
            data = encode_ran(cmd["seq"], self.epoch, t_start, t_end, t_take,
                              clock.now_ns(), cmd["cid"], m0, m1, lag, speed, tail=tail)
        else:
            data = encode_ran(cmd["seq"], self.epoch, t_start, t_end, t_take,
                              clock.now_ns(), cmd["cid"], m0, m1, lag, speed,
                              round(thermal.temp, 3), thermal.throttled, tail)
        records = self.records
        records.append(data)  # ``put``, one call less on the most common record
        if len(records) >= OUTBOX_MAX or not (lazy or self._queued()):
            self.flush()

    def record(self, cmd: dict[str, Any], exc: errors.HetprocError | None, t_start: int,
               t_end: int, t_take: int, mem: dict[str, Any] | None,
               modeled: tuple[int, int, int] | None, speed: float,
               thermal: Any) -> dict[str, Any]:
        """The completion record of a command as a map (``ran`` packs the common one
        directly): its outcome, host times, memory report, modeled times and speed."""
        record = {"seq": cmd["seq"], "epoch": self.epoch,
                  "code": exc.code if exc is not None else 0,
                  "msg": str(exc) if exc is not None else "", "t_start": t_start,
                  "t_end": t_end, "mem": mem, "t_take": t_take, "cid": cmd["cid"]}
        if modeled is not None:
            record["m0"], record["m1"], record["lag"] = modeled
            record["spd"] = speed
            if thermal is not None:
                record["temp"], record["thr"] = round(thermal.temp, 3), thermal.throttled
        if exc is not None and exc.detail.get("remote_traceback"):
            record["tb"] = exc.detail["remote_traceback"]
        return record

    def complete(self, seq: int, t_start: int, code: int, msg: str) -> None:
        """A record that is news of its own: an error, a refused or lost command."""
        self.post({"seq": seq, "epoch": self.epoch, "code": code, "msg": msg,
                   "t_start": t_start, "t_end": clock.now_ns()})

    def put(self, data: bytes, urgent: bool = False, lazy: bool = False) -> None:
        """Queue an encoded record: flushed when urgent, when the batch is full, or when
        nothing waits to run behind it -- unless ``lazy``: then the loop flushes it when
        it finds the ring dry (one look per wake-up instead of one per record)."""
        records = self.records
        records.append(data)
        if urgent or len(records) >= OUTBOX_MAX or not (lazy or self._queued()):
            self.flush(wake=urgent)

    def hold(self, due: int, seq: int, handles: list[int], record: dict[str, Any]) -> None:
        """Keep a record until its fences' hand-off signal is due (``fire_due``)."""
        heapq.heappush(self.delayed, (due, seq, handles, record))

    def fire_due(self) -> None:
        """Signal the held fences that are due, then post their records."""
        now = clock.now_ns()
        delayed = self.delayed
        while delayed and delayed[0][0] <= now:
            due, _, handles, record = heapq.heappop(delayed)
            self.trace.signalled(record["cid"], 0)
            self.signal(handles, 0, due)  # the modeled end plus the hand-off
            record["t_signal"] = clock.now_ns()
            self.post(record)

    def _queued(self) -> int:
        return self.commands.depth() or len(self.backlog) or len(self.pending)

    def flush_if_dry(self) -> None:
        """Flush what is left when nothing waits to run."""
        if self.records and not self._queued():
            self.flush()

    def flush(self, wake: bool = False) -> None:
        """Put the batched records in the completion ring. The supervisor is woken only
        for news it must act on now (an error, a lost signal) or when it asked for news
        (it has commands waiting for ring space, or a recovery running); otherwise it
        collects them on its next turn, instead of competing for a CPU with the client
        this very completion just woke."""
        if not self.records:
            return
        batch, self.records = self.records, []
        self.told += 1
        for payload in batches(batch, self.completions.max_payload):
            # The supervisor drains completions as fast as we post them; a full ring means
            # it is stalled, and it owns the recovery of that. Wait briefly, re-check the parent.
            while not self.completions.try_put(payload):
                if os.getppid() != self.parent_pid:
                    return
                time.sleep(_FULL_RING_SLEEP_S)
        if not (wake or self.u32[StateSlot.WANT_NEWS]):
            return
        try:
            os.eventfd_write(self.completion_fd, 1)
        except OSError:
            pass


def encoded(record: dict[str, Any], limit: int) -> bytes:
    """A completion record, encoded to fit a ring slot alone: records vary in size (a
    memory report), and a record too big for its slot must never cost the completion
    itself -- its evidence goes, not its outcome."""
    data = encode_completion(record)
    if len(data) + BATCH_HEAD.size > limit:
        data = encode_completion({k: v for k, v in record.items() if k not in ("mem", "tb")})
    return data


def batches(records: list[bytes], limit: int) -> list[bytes]:
    """Encoded records in ring-slot batches of at most ``limit`` bytes, in order."""
    out: list[bytes] = []
    part: list[bytes] = []
    size = BATCH_HEAD.size
    for rec in records:
        if part and (size + len(rec) > limit or len(part) >= MAX_BATCH):
            out.append(completion_batch(part))
            part, size = [], BATCH_HEAD.size
        part.append(rec)
        size += len(rec)
    if part:
        out.append(completion_batch(part))
    return out


def payloads(records: list[dict[str, Any]], limit: int) -> list[bytes]:
    """Completion records in batches that each fit one ring slot (what ``post`` and
    ``flush`` make of them)."""
    return batches([encoded(r, limit) for r in records], limit)

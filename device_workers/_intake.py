"""The supervisor's command ring as a device reads it: in ring order, trusting nothing.

Every record is decoded and checked whole before anything changes (``_commands``). A
command that fails its checks but names itself (its ``seq``, next in ring order) is
refused with an unsignalled ``BadPacket`` completion, so the supervisor fails just that
command; a record that names nothing, or an old one read again, is reported and skipped;
the loop goes on. When real commands were lost -- ring indices out of range, or a gap in
the ring positions the supervisor numbers 1, 2, 3... -- the device posts a ``BadPacket``
record saying why and exits with ``RING_CORRUPT_EXIT_STATUS``: the supervisor's crash
recovery fails what was in flight and starts it again on a fresh ring.

Control records (``stop``, a queue attached or detached) take effect here, in ring order
with the commands around them.
"""

from __future__ import annotations

from typing import Any

from ipc import clock, errors

from ._commands import best_effort_ids, decode_command
from ._outbox import Outbox
from ._queues import DeviceQueues

RING_CORRUPT_EXIT_STATUS = 71  # the device quit so that the supervisor resets it


class Intake:
    """The checks between a device's command ring and its loop."""

    def __init__(self, name: str, epoch: int, first_pidx: int, outbox: Outbox,
                 queues: DeviceQueues) -> None:
        self.name = name
        self.epoch = epoch
        self.first_pidx = first_pidx  # the ring position of the first command (0: unknown)
        self.outbox = outbox
        self.queues = queues
        # The last ring position taken: only ``decode`` and ``refuse`` raise it, by one.
        self.last_pidx = first_pidx - 1 if first_pidx else 0
        # Set once, by a ``stop`` record or a corrupt ring: the device reads no more.
        self.stopped = False
        self.exit_status = 0  # RING_CORRUPT_EXIT_STATUS once the ring was found corrupt

    def decode(self, data: bytes) -> dict[str, Any] | None:
        """The command in ``data``, checked whole and in ring order; None for a control
        record (done), a refused or replayed record (answered) or a lost one (the ring is
        corrupt: we stop so that the supervisor resets us)."""
        try:
            cmd = decode_command(data)
        except errors.BadPacket as exc:
            self.refuse(data, exc)
            return None
        op = cmd["op"]
        if op != "exec":
            if op == "stop":
                self.stopped = True
            elif op == "qattach":
                self.queues.attach(cmd)
            elif op == "qgrant":
                self.queues.grant(cmd["qid"], cmd["fence"])
            elif op == "qfaults":
                self.queues.set_faults(cmd["qid"], cmd["rules"])
            elif op == "qdetach":
                self.queues.detach(cmd["qid"])
            return None
        pidx = cmd["pidx"]
        if pidx <= self.last_pidx:  # an old slot read again: its command already ran
            self.outbox.complete(0, 0, errors.BadPacket.code,
                                 f"{self.name}: replayed command record (ring position "
                                 f"{pidx}, {self.last_pidx} taken) ignored")
            return None
        if pidx != self.last_pidx + 1 and (self.last_pidx or self.first_pidx):
            self.corrupt(cmd["seq"], f"ring position {pidx} follows {self.last_pidx}: "
                         f"{pidx - self.last_pidx - 1} command(s) lost")
            return None
        # Checked in ring order as read, whatever order a preemption then runs them in.
        self.last_pidx = pidx
        return cmd

    def refuse(self, data: bytes, exc: errors.BadPacket) -> None:
        """A record failed its checks. If it names its seq and is next in ring order, only
        that command is refused: the supervisor fails its fences (we do not trust its
        handles enough to signal them). A record that names nothing is reported and
        skipped; had it overwritten a real command, the gap in ring positions shows at
        the next command and the device resets then."""
        seq, pidx = best_effort_ids(data)
        if seq and pidx == self.last_pidx + 1:
            self.last_pidx = pidx
            self.outbox.post({"seq": seq, "epoch": self.epoch, "code": exc.code,
                              "msg": f"command refused by {self.name}: {exc}"[:1000],
                              "t_start": 0, "t_end": clock.now_ns(), "unsignalled": True})
            return
        self.outbox.complete(0, 0, exc.code,
                             f"{self.name}: unreadable command record ignored: {exc}"[:1000])

    def corrupt(self, seq: int, why: str) -> None:
        """Say why, then stop: the supervisor reaps us (a confirmed stop), fails what was
        in flight with a clear error and restarts us on a fresh ring."""
        self.outbox.complete(seq, 0, errors.BadPacket.code,
                             f"{self.name}: command ring corrupt, device resets: {why}"[:1000])
        self.outbox.flush(wake=True)
        self.stopped = True
        self.exit_status = RING_CORRUPT_EXIT_STATUS

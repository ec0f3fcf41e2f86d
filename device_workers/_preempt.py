"""Preemption (seed §7, §11): urgent commands first, at the running command's next chunk.

The supervisor pushes a more urgent command out of order, marked ``pre``, and names it in
the state table's ``preempt_pidx``. At its next chunk boundary the running command is
suspended (a modeled switch cost to save, another to restore), every marked command in
the ring runs, the others wait in a local backlog in ring order, and the suspended
command resumes, its modeled end pushed back by the time it was off the device. Between
commands the marked ones simply run first.

::

    running ──chunk boundary──▶ suspend: Suspended pushed ──▶ marked commands run, each
       ▲                                                      in its own frame
       └──────────── resume: Suspended popped, its frame's shift grows ◀──┘

The suspended commands form a stack, innermost last. Today it is at most one deep: a
command runs preemptible only while the stack is empty (``allowed``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from ipc import errors

from ._frame import Frame
from ._state import DeviceState
from ._state import StateSlot as S

_FAR = 1 << 62  # "no host time yet": ``point`` unclamped


@dataclass(frozen=True, slots=True)
class Suspended:
    """A command taken off the device at a chunk boundary: what resuming it puts back
    (the rest of it is its frame, which waits on the suspended call's own stack)."""

    frame: Frame
    at: int           # the modeled time it was suspended at
    speed: float      # the speed it ran at
    progress: int     # the progress word: the urgent work's progress is not its own
    memory: tuple     # ``DeviceMemory.save()``
    trace: tuple      # ``DeviceTrace.save()``
    seq: int          # its state-table words, as they were
    cid: int
    pidx: int
    started: int


class Host(Protocol):
    """What preemption reads and changes of the device running it."""

    model_end: int
    speed: float
    frame: Frame
    frames: list[Frame]
    u32: Any
    u64: Any
    memory: Any
    tr: Any
    outbox: Any
    commands: Any
    intake: Any  # ``_intake.Intake``: ring order, control records, a corrupt ring

    def execute(self, cmd: dict[str, Any]) -> None: ...
    def check_cancel(self) -> None: ...


class Preemption:
    """The marked commands of one device: when they run and what they set aside."""

    def __init__(self, host: Host, *, enabled: bool, switch_ns: int, chunk_ns: int) -> None:
        self.host = host
        self.enabled = enabled     # the device model preempts at all
        self.switch_ns = switch_ns  # modeled cost of one context switch (save or restore)
        self.chunk_ns = chunk_ns
        # The last marked command run (its ring position): only raised, by ``run_marked``
        # and ``preempt``; the supervisor's ``preempt_pidx`` past it asks for more.
        self.seen = 0
        # The suspended commands, innermost last: ``preempt`` pushes and pops.
        self.stack: list[Suspended] = []
        # Unmarked commands a preemption read past, in ring order: ``take_marked``
        # appends, the loop runs them once the suspended command is done.
        self.backlog: deque = deque()

    def allowed(self) -> bool:
        """A command starting now may be preempted (never one run under a suspended one)."""
        return self.enabled and not self.stack

    def run_marked(self) -> None:
        """Between commands: run the marked ones in the ring before anything else."""
        self.seen = max(self.seen, int(self.host.u64[S.PREEMPT_PIDX]))
        for cmd in self.take_marked():
            self.host.execute(cmd)
            self.seen = max(self.seen, cmd["pidx"])

    def take_marked(self) -> list[dict[str, Any]]:
        """Empty the ring: the commands marked to preempt, in ring order; the others go
        to the backlog, which runs, in order, once the suspended command is done."""
        intake, get = self.host.intake, self.host.commands.get
        marked: list[dict[str, Any]] = []
        while not intake.stopped:
            try:
                data = get()
            except errors.BadPacket as exc:
                intake.corrupt(0, str(exc))
                break
            if data is None:
                break
            cmd = intake.decode(data)
            if cmd is not None:
                (marked if cmd.get("pre") else self.backlog).append(cmd)
        return marked

    def due(self) -> bool:
        """The marked command has arrived in the model by the running command's next chunk
        boundary, and the host has reached that boundary: the switch happens there, at
        the modeled instant the policy would make it, never earlier (a command dated
        ahead is marked before it arrives) and never between two boundaries."""
        at = self.point(self.host.frame, int(self.host.u64[S.PREEMPT_AT]), _FAR)
        return time.monotonic_ns() >= at

    def preempt(self) -> None:
        """Suspend the running command at this chunk boundary; run every marked command
        in the ring; set the others aside in ring order; resume. The switches cost
        ``switch_ns`` each in modeled time, and the suspended command's modeled end moves
        back by its whole time off the device."""
        host = self.host
        target = int(host.u64[S.PREEMPT_PIDX])
        self.seen = max(self.seen, target)
        marked = self.take_marked()
        if not marked:
            return
        now = time.monotonic_ns()
        # Never before the device's last modeled end (an earlier preemption's work).
        at = max(self.point(host.frame, marked[0].get("arrive_ns", 0), now), host.model_end)
        self.stack.append(self.suspend(at, target))
        try:
            while marked and not host.intake.stopped:
                cmd = marked.pop(0)
                host.execute(cmd)
                self.seen = max(self.seen, cmd["pidx"])
                if not marked:
                    marked = self.take_marked()  # marked while the first ones ran
        finally:
            saved = self.stack.pop()
        self.resume(saved)

    def point(self, frame: Frame, arrival: int, now: int) -> int:
        """The modeled chunk boundary of the running command at or after ``arrival``:
        where the model switches, whatever the host's wake-up added (never past now)."""
        origin, chunk = frame.m_origin + frame.shift, self.chunk_ns
        if arrival <= origin:
            return min(origin, now)
        return min(origin + -(-(arrival - origin) // chunk) * chunk, now)

    def suspend(self, at: int, target: int) -> Suspended:
        """Save the running command at modeled time ``at`` for marked command ``target``."""
        host, u64, switch = self.host, self.host.u64, self.switch_ns
        saved = Suspended(host.frame, at, host.speed, int(u64[S.PROGRESS]),
                          host.memory.save(), host.tr.save(), int(u64[S.CURRENT_SEQ]),
                          int(u64[S.CURRENT_CID]), int(u64[S.CURRENT_PIDX]),
                          int(u64[S.STARTED]))
        host.tr.preempted(saved.cid, target, switch)
        u64[S.PREEMPTIONS] += 1
        u64[S.SWITCH_NS] += 2 * switch
        host.model_end = at + switch  # saved: the urgent work starts after the save
        if len(host.frames) <= len(self.stack) + 1:  # a frame for the urgent commands
            host.frames.append(Frame())
        return saved

    def resume(self, saved: Suspended) -> None:
        """Put the suspended command back on the device, its time off it added to its
        frame's shift; a cancel that came meanwhile stops it before any more work."""
        host, u64 = self.host, self.host.u64
        resumed = host.model_end + self.switch_ns  # restored
        frame = host.frame = saved.frame
        frame.shift += resumed - saved.at
        host.speed = saved.speed
        # The urgent work's progress was its own: the watchdog must not take it for the
        # suspended command's (a hung command stays hung however much ran under it).
        u64[S.PROGRESS] = saved.progress
        host.memory.restore(saved.memory)
        host.tr.restore(saved.trace)
        u64[S.CURRENT_SEQ], u64[S.CURRENT_CID] = saved.seq, saved.cid
        u64[S.CURRENT_PIDX], u64[S.STARTED] = saved.pidx, saved.started
        host.u32[S.STATE] = DeviceState.BUSY
        host.outbox.flush()
        host.check_cancel()

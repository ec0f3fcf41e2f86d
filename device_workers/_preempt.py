"""Preemption (seed §7, §11): urgent commands first, at a chunk boundary, to any depth.

The supervisor pushes a command more urgent than the one running out of order, marked
``pre``, with its urgency ``urg`` (lower is more urgent: the policy's order, from
``Scheduler.urgency``), and raises the state table's ``preempt_pidx``. The device reads
the ring then: marked commands become ``pending``, the others wait in a local backlog in
ring order. At the running command's first chunk boundary at or after a pending command's
modeled arrival, if that command is more urgent, the running one is suspended (a modeled
switch cost to save, another to restore) and the most urgent pending command that has
arrived runs in a frame of its own, itself preemptible. When it ends, the next one is
the most urgent pending command more urgent than the suspended one; when none is, the
suspended command resumes, its modeled end pushed back by its whole time off the device.
Between commands, pending commands that have arrived run first, most urgent first.

::

    running ──chunk boundary──▶ suspend: Suspended pushed ──▶ pending commands run, each
       ▲                         (any depth: a pending          in its own frame, most
       │                          command preempts these too)   urgent first
       └──────────── resume: Suspended popped, its frame's shift grows ◀──┘

The suspended commands form a stack, innermost last: each is resumed when nothing pending
is more urgent than it, which is the order the reference simulator resumes them in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from ipc import clock, errors

from ._commands import LEAST_URGENT
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
        # Marked commands read from the ring, not run yet (any order: ``choice`` picks).
        self.pending: list[dict[str, Any]] = []

    def allowed(self) -> bool:
        """A command starting now may be preempted (at any depth)."""
        return self.enabled

    def collect(self) -> None:
        """If the supervisor marked more, read the ring: marked commands join ``pending``,
        the others the backlog, in ring order."""
        target = int(self.host.u64[S.PREEMPT_PIDX])
        if target > self.seen:
            self.seen = target
            self.pending.extend(self.take_marked())

    def choice(self, by: int, than: int, than_pidx: int = 0) -> dict[str, Any] | None:
        """The most urgent pending command arrived by modeled time ``by`` and before
        ``(than, than_pidx)`` in (urgency, ring position) order, or None: strictly more
        urgent with ``than_pidx`` 0; as urgent and earlier in the ring also counts."""
        best, key = None, (than, than_pidx)
        for c in self.pending:
            k = (c.get("urg", LEAST_URGENT), c["pidx"])
            if c["arrive_ns"] <= by and k < key:
                best, key = c, k
        return best

    def arrived(self) -> bool:
        """A pending command has arrived: it is ready, so a queue's record waits for it
        (a queue runs when nothing the supervisor scheduled is ready)."""
        now = clock.now_ns()
        return any(c["arrive_ns"] <= now for c in self.pending)

    def alone(self) -> dict[str, Any] | None:
        """With nothing else queued, the pending command to run next: the most urgent of
        those arrived by the time the first of them arrives (or the device is free)."""
        if not self.pending:
            return None
        first = min(c["arrive_ns"] for c in self.pending)
        return self.choice(max(self.host.model_end, first), LEAST_URGENT + 1)

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

    def due(self) -> int | None:
        """The chunk boundary of the running command at which a pending command more urgent
        than it takes over, once the host has reached it (None: not now). The switch is
        at the modeled instant the policy makes it: never before the command's arrival,
        never between two boundaries, whatever the host's wake-ups."""
        at = self.next_point()
        return at if at is not None and clock.now_ns() >= at else None

    def next_point(self) -> int | None:
        """The chunk boundary of the running command at which a pending command more
        urgent than it takes over, reached or not (None: none does, or it ends first)."""
        frame = self.host.frame
        if not frame.preemptible:
            return None
        self.collect()
        if not self.pending:
            return None
        mine = frame.cmd.get("urg", LEAST_URGENT)
        points = [self.point(frame, c["arrive_ns"], _FAR) for c in self.pending
                  if c.get("urg", LEAST_URGENT) < mine]
        if not points:
            return None
        at = min(points)
        if at >= frame.holds_to + frame.shift:
            return None  # it ends first: the next command is chosen then
        return at

    def run_next(self, cmd: dict[str, Any]) -> None:
        """Run ``cmd``, the next in ring order, unless a marked command more urgent has
        arrived by the time it would start: that one runs first, and ``cmd`` waits at the
        head of the backlog (the policy's choice at that instant, as the model makes it)."""
        first = self.before(cmd) if self.pending else None
        if first is not None:
            self.backlog.appendleft(cmd)
            self.pending.remove(first)
            cmd = first
        self.host.execute(cmd)

    def before(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        """A pending command to run before ``cmd``, the next in ring order: one more
        urgent that has arrived by the time ``cmd`` would start."""
        self.collect()
        if not self.pending:
            return None
        start = max(self.host.model_end, cmd.get("arrive_ns", 0))
        return self.choice(start, cmd.get("urg", LEAST_URGENT), cmd["pidx"])

    def preempt(self, at: int) -> None:
        """Suspend the running command at boundary ``at``; run the pending commands more
        urgent than it, most urgent first (each preemptible in turn); resume it. The
        switches cost ``switch_ns`` each in modeled time, and the suspended command's
        modeled end moves back by its whole time off the device."""
        host = self.host
        at = max(at, host.model_end)  # never before an earlier preemption's work
        mine = host.frame.cmd.get("urg", LEAST_URGENT)
        cmd = self.choice(at, mine)
        if cmd is None:
            return
        self.stack.append(self.suspend(at, cmd["pidx"]))
        try:
            while cmd is not None and not host.intake.stopped:
                self.pending.remove(cmd)
                host.execute(cmd)
                self.collect()
                cmd = self.choice(host.model_end, mine)
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

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

Timeslicing (``timeslice_ms``, i915's ``timeslice_duration_ms``): a command that has run
a timeslice since it began or resumed, while a command of equal urgency and another
context that has arrived waits (a *peer*: marked, or read from the ring), is switched
out at its next chunk boundary and the peer runs: round robin between contexts. A stack
cannot take a turn back from a command above it, so a timesliced command is *parked*
instead of suspended: it must only hold modeled time (``Frame.parkable``: no buffers,
kernel or fences in flight), its execution unwinds (``Parked``) with its frame saved,
and it waits in ``pending`` behind every command of its urgency that joined the queue
before it was parked, until it is picked and taken up where it was (``unpark``). The
switch costs what a preemption's does. On such a device every command names its context
(``ctx``), and a command waits while an earlier one of its context is unfinished
(``blocked``): a context runs in order. A command with buffers runs its turn to its end
(the reference simulator knows no such command).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from ipc import PENDING, clock, errors

from ._commands import LEAST_URGENT
from ._frame import Frame
from ._state import DeviceState
from ._state import StateSlot as S

_FAR = 1 << 62  # "no host time yet": ``point`` unclamped
_PREEMPT_PIDX = S.PREEMPT_PIDX


class Parked(Exception):
    """The running command was parked by its timeslice (``Preemption.park``): its
    execution ends here, unfinished; ``DeviceWorker.execute`` lets it go."""


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
    fences: Any  # ``ipc.FenceTable``: which command a pending input fence waits for

    def execute(self, cmd: dict[str, Any]) -> None: ...
    def check_cancel(self) -> None: ...


class Preemption:
    """The marked commands of one device: when they run and what they set aside."""

    def __init__(self, host: Host, *, enabled: bool, switch_ns: int, chunk_ns: int,
                 slice_ns: int = 0) -> None:
        self.host = host
        self.enabled = enabled     # the device model preempts at all
        self.switch_ns = switch_ns  # modeled cost of one context switch (save or restore)
        self.chunk_ns = chunk_ns
        self.slice_ns = slice_ns if enabled else 0  # the timeslice (0: run to completion)
        self.parks = 0  # commands parked so far: only ``park`` counts (their turn order)
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
        target = self.host.u64[_PREEMPT_PIDX]  # (looked at on every hold's wake)
        if target > self.seen:
            self.seen = int(target)
            self.pending.extend(self.take_marked())

    def order(self, c: dict[str, Any]) -> tuple[int, int, int, int]:
        """Which command goes first: the most urgent; at one urgency, in ring order, or,
        on a device that timeslices, in the order they joined the queue (their arrival;
        a parked one when it was parked, after one that arrived then): round robin."""
        urg, rr = c.get("urg", LEAST_URGENT), c.get("rr")
        if not self.slice_ns:
            return (urg, 0, c["pidx"], 0)
        return (urg, c["arrive_ns"], 0, c["pidx"]) if rr is None else (urg, c["at"], 1, rr)

    def choice(self, by: int, than: int, plain: dict[str, Any] | None = None
               ) -> dict[str, Any] | None:
        """The first pending command (``order``) arrived by modeled time ``by`` that goes
        before urgency ``than``, or None: strictly more urgent; with ``plain``, an unmarked
        command of urgency ``than``, one as urgent that ``order`` puts before it counts
        too. One that waits for its context (``blocked``) never counts."""
        best, key = None, None
        limit = self.order(plain) if plain is not None else None
        for c in self.pending:
            urg = c.get("urg", LEAST_URGENT)
            if c["arrive_ns"] > by or urg > than:
                continue
            k = self.order(c)
            if urg == than and (limit is None or not k < limit):
                continue
            if self.slice_ns and self.blocked(c):
                continue
            if key is None or k < key:
                if self.behind_its_producer(c, plain):
                    continue
                best, key = c, k
        return best

    def _owed(self, c: dict[str, Any]) -> set[int]:
        """The fences ``c`` waits on that are still pending."""
        wait = c.get("wait")
        if not wait:
            return set()
        outcome = self.host.fences.outcome
        return {h for h in wait if outcome(h)[0] == PENDING}

    def behind_its_producer(self, c: dict[str, Any], plain: dict[str, Any] | None) -> bool:
        """``c`` waits on a fence that a command of this device signals which cannot run
        before it: the one running or suspended, one in the backlog, or ``plain`` (the
        next in ring order). Run first, ``c`` would hold the device waiting for work
        queued behind it until its dependency deadline failed it (a priority inversion
        and a deadlock the client never wrote: the supervisor sends a producer in before
        its consumer, ``DeviceHandle._producer_first``, and the device keeps that)."""
        owed = self._owed(c)
        if not owed:
            return False
        others = [*self.backlog, *(s.frame.cmd for s in self.stack)]
        if plain is not None:
            others.append(plain)
        if self.host.u32[S.STATE] == DeviceState.BUSY:  # (else the frame is a finished one's)
            others.append(self.host.frame.cmd)
        return _signals_one(others, owed) is not None

    def producer_first(self, c: dict[str, Any]) -> dict[str, Any]:
        """``c``, or the pending command it waits on that must run before it (followed
        on while that one waits on another)."""
        for _ in range(64):
            producer = _signals_one(self.pending, self._owed(c)) if self.pending else None
            if producer is None:
                break
            c = producer
        return c

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
        chosen = self.choice(max(self.host.model_end, first), LEAST_URGENT + 1)
        return self.producer_first(chosen) if chosen is not None else None

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
        slicing = self.slice_ns and frame.parkable
        # Its turn may be over: who waits? On the virtual clock the peers are looked for
        # at once, so that the wake this returns includes the end of the timeslice (the
        # clock would jump past it otherwise); the boundary found is the same.
        if slicing and (clock.virtual is not None
                        or clock.now_ns() >= frame.since + self.slice_ns):
            self.pending.extend(self.take_marked())
        if not self.pending and not (slicing and self.backlog):
            return None
        mine = frame.cmd.get("urg", LEAST_URGENT)
        points = [self.point(frame, c["arrive_ns"], _FAR) for c in self.pending
                  if c.get("urg", LEAST_URGENT) < mine
                  and not (self.slice_ns and self.blocked(c))]
        if slicing:  # a peer waits: the boundary where the timeslice is over
            peers = [c["arrive_ns"] for c in self.peers(frame, mine)]
            if peers:
                points.append(self.point(frame, max(min(peers), frame.since + self.slice_ns),
                                         _FAR))
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
        if self.slice_ns and self.blocked(cmd):
            self.pending.append(cmd)  # it runs once the earlier one of its context ended
            return
        first = self.before(cmd) if self.pending else None
        first = self.producer_first(first or cmd) if self.pending else first
        if first is not None and first is not cmd:
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
        return self.choice(start, cmd.get("urg", LEAST_URGENT), cmd)

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
            self.maybe_park(at, mine)
            return
        self.stack.append(self.suspend(at, cmd["pidx"]))
        try:
            while cmd is not None and not host.intake.stopped:
                cmd = self.producer_first(cmd)  # (the urgent one's input, inheriting)
                self.pending.remove(cmd)
                host.execute(cmd)
                self.collect()
                cmd = self.choice(host.model_end, mine)
        finally:
            saved = self.stack.pop()
        self.resume(saved)

    def blocked(self, c: dict[str, Any]) -> bool:
        """``c`` waits for its context: an earlier command of it (a lower ring position:
        a context's commands are pushed in order) is running, suspended, parked or read
        and not run yet (a context runs in order; only contexts take turns)."""
        ctx = c.get("ctx")
        if ctx is None:
            return False
        pidx = c["pidx"]

        def earlier(o: dict[str, Any]) -> bool:
            return o.get("ctx") == ctx and o.get("pidx", pidx) < pidx

        return (earlier(self.host.frame.cmd) or any(earlier(s.frame.cmd) for s in self.stack)
                or any(earlier(o) for o in self.pending) or any(earlier(o) for o in self.backlog))

    def peers(self, frame: Frame, mine: int) -> list[dict[str, Any]]:
        """The commands read from the ring that would take a turn from ``frame``'s: as
        urgent, of another context, not waiting for their own context."""
        ctx = frame.cmd.get("ctx")
        return [c for c in (*self.pending, *self.backlog)
                if c.get("urg", LEAST_URGENT) == mine and c.get("ctx") != ctx
                and not self.blocked(c)]

    def maybe_park(self, at: int, mine: int) -> None:
        """At boundary ``at``: if the running command's timeslice is over and a peer has
        arrived, park it (raises ``Parked``)."""
        frame = self.host.frame
        if not (self.slice_ns and frame.parkable and at - frame.since >= self.slice_ns):
            return
        waiting = [c for c in self.peers(frame, mine) if c["arrive_ns"] <= at]
        if waiting:
            self.park(at, min(waiting, key=self.order)["pidx"])

    def park(self, at: int, target: int) -> None:
        """Take the running command off the device at boundary ``at`` for ``target``,
        as a preemption's save does, and put it in ``pending`` behind the commands of
        its urgency there; its execution unwinds (``Parked``)."""
        host = self.host
        saved = self.suspend(at, target)
        host.frames[len(self.stack)] = Frame()  # its own stays with it, off the device
        cmd = saved.frame.cmd
        cmd["parked"], cmd["rr"], cmd["at"] = saved, self.parks, at
        self.parks += 1
        self.pending.append(cmd)
        raise Parked

    def unpark(self, cmd: dict[str, Any]) -> Frame:
        """Put a parked command back on the device (a restore, as a resume's), in its own
        frame at the current depth; the caller checks for a cancel and takes up its hold
        where it was."""
        saved = cmd.pop("parked")
        del cmd["rr"], cmd["at"]
        self.host.frames[len(self.stack)] = saved.frame
        self.restore(saved)
        return saved.frame

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

    def restore(self, saved: Suspended) -> None:
        """Put the suspended command back on the device, its time off it added to its
        frame's shift."""
        host, u64 = self.host, self.host.u64
        resumed = host.model_end + self.switch_ns  # restored
        frame = host.frame = saved.frame
        frame.shift += resumed - saved.at
        frame.since = resumed
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

    def resume(self, saved: Suspended) -> None:
        """``restore``, then a cancel that came meanwhile stops it before any more work."""
        self.restore(saved)
        self.host.check_cancel()


def _signals_one(cmds: Any, fences: set[int]) -> dict[str, Any] | None:
    """The first of ``cmds`` that signals one of ``fences`` (None: none, or no fence)."""
    if not fences:
        return None
    return next((c for c in cmds if fences.intersection(c.get("signal") or ())), None)

"""INVARIANT 9 lives here: zero-copy is never unsynchronised (seed §4, §5, §12).

Sharing one physical buffer removes the copy, not the ordering. Per buffer the supervisor
keeps the last writer not yet retired and the unfinished readers since that write
(``BufferRec.hz_writer``, ``hz_readers``: only this module changes them). Each submitted
command N is checked against them before anything of its batch is committed::

    N reads  b, its writer W unfinished     read-after-write     unless W -> N
    N writes b, a reader R unfinished       write-after-read     unless R -> N
    N writes b, its writer W unfinished     write-after-write    unless W -> N

``T -> N`` (T is ordered before N) holds when one of these does, cheapest first:

1. N waits on T's fence (the one T's client got back);
2. T and N are on one context and device, and its scheduler promises that T runs first
   (``Scheduler.in_order``: the same priority under "priority", no earlier deadline under
   "edf"...; the device keeps the promise: a preemptor never overtakes its own context);
3. T's fence completed already (signalled, or failed: a failed T writes no more);
4. walking up from N: through the producer of each fence a command waits on
   (``FenceRec.producer``) and the unfinished commands before it on its own context
   (queued or in its device's ring; for N, also earlier in its batch), T is reached, or
   a command after T on T's context (2.). The walk does not go past a completed fence
   or command (everything before it finished).

Zero false positives first: where the supervisor cannot know what a fence follows -- a
fence a client signals by hand, or a user-mode queue's (its records never pass here) --
N is taken as ordered, and so is a walk that visits more than ``MAX_WALK`` commands (it
is counted as ``unverified``). A hazard is reported against the first other command found.

``hazards`` in the platform file: "error" (the default) refuses the submit with
``SyncHazard`` (scope request, not retryable; nothing of the batch runs); "warn" serves
it; both count it (``metrics()["hazards"]``), note an event (``incidents()["events"]``)
and write a ``HAZARD`` instant into the trace (a1: the kind, a2: the buffer); the error
also freezes a trace window. "off" does not look. Host access (``Buffer.array()``) and
the operands of user-mode queue records never pass through the supervisor: not checked.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from device_workers import TRACK_SUPERVISOR
from ipc import PENDING, Stage, errors

from ._devices import Command, CommandState

if TYPE_CHECKING:
    from ._evidence import Evidence
    from ._records import BufferRec, Registry

RAW, WAR, WAW = "read-after-write", "write-after-read", "write-after-write"
KINDS = (RAW, WAR, WAW)
MAX_WALK = 256  # commands one ordering question may visit before it is taken as ordered
_DONE = CommandState.DONE
_HAZARD = int(Stage.HAZARD)

# What a batch's earlier commands did to a buffer, before any of them is committed:
# [writer, readers added, whether the buffer's own readers were replaced by a write].
# Absent: nothing yet, the buffer's own record holds.
_View = dict  # BufferRec -> list


class Hazards:
    """The check (``check``), the record after commit (``record``) and the figures."""

    def __init__(self, reg: Registry, evidence: Evidence, mode: str) -> None:
        assert mode in ("error", "warn", "off"), mode
        self.reg = reg
        self.evidence = evidence
        self.mode = mode
        self.on = mode != "off"
        self.checked = 0      # commands with operands checked
        self.unverified = 0   # ordering questions given up past MAX_WALK (taken as ordered)
        self.found: Counter[str] = Counter()  # hazards by kind
        self.refused = 0      # submits refused for one (mode "error")
        self._batch: list[Command] = []  # the batch being checked, and where (``check``)
        self._at = 0

    # -- at submit ----------------------------------------------------------------------

    def check(self, cmds: list[Command]) -> dict[int, tuple] | None:
        """Check a validated batch (``_validation.build_commands``), in its order; raise
        ``SyncHazard`` for the first hazard when the mode is "error", else report each.
        Returns each command's operands by index (the hand-off replaces them with its
        internal buffers before ``record``), or None when no command has any."""
        ops = None
        for i, cmd in enumerate(cmds):
            if cmd.ins or cmd.outs:
                if ops is None:
                    ops = {}
                ops[i] = (tuple(cmd.ins), tuple(cmd.outs))
        if ops is None:
            return None
        view: _View | None = {} if len(ops) > 1 else None
        self._batch = cmds
        try:
            for i, (reads, writes) in ops.items():
                cmd = cmds[i]
                self._at = i  # (the walk's view of the batch: its commands before this one)
                self.checked += 1
                hit = self._first_hazard(cmd, reads, writes, view)
                if hit is not None:
                    self._report(cmd, *hit)
                if view is not None:
                    _note(view, cmd, reads, writes)
        finally:
            self._batch = []  # (holds no command past its submit)
        return ops

    def record(self, chains: list[list[Command]], ops: dict[int, tuple]) -> None:
        """The committed batch becomes each buffer's writer or reader: a chain's last part
        (its fence is the one the client got back, signalled when the whole chain ran)."""
        for i, (reads, writes) in ops.items():
            last = chains[i][-1]
            last.hazard = (reads, writes)
            for b in writes:
                b.hz_writer, b.hz_readers = last, None  # later ones order after it or clash
            for b in reads:
                if b.hz_writer is last:
                    continue  # read and written in place: the writer covers it
                readers = b.hz_readers
                if readers is None:
                    b.hz_readers = {last: None}
                else:
                    readers[last] = None

    # -- ordering ---------------------------------------------------------------------------

    def _first_hazard(self, n: Command, reads: tuple, writes: tuple,
                      view: _View | None) -> tuple[str, BufferRec, Command] | None:
        ordered = self.ordered
        for b in reads:
            w = b.hz_writer if view is None else _writer(b, view)
            if w is not None and not ordered(w, n):
                return RAW, b, w
        for b in writes:
            w = b.hz_writer if view is None else _writer(b, view)
            if w is not None and not ordered(w, n):
                return (RAW if b in reads else WAW), b, w
            for r in (b.hz_readers or () if view is None else _readers(b, view)):
                if not ordered(r, n):
                    return WAR, b, r
        return None

    def ordered(self, t: Command, n: Command) -> bool:
        """Whether ``t`` (submitted earlier, not retired) ends before ``n`` starts."""
        if t.ctx is n.ctx and t.device is n.device and t.device.sched.in_order(t, n):
            return True  # (the commonest case first: one context's own sequence)
        if t.state is _DONE:
            return True
        sig = t.signal
        if sig and sig[0] in n.wait:
            return True
        if not sig:
            return False  # in n's own batch, with no fence its client chose: none to wait on
        if self.reg.fences.poll(sig[0])[0] != PENDING:
            return True
        if self._upstream(t, n):
            return True
        # The walk stops at a fence that completed since t's was polled above; if t is
        # upstream of it, t's fence completed first: a second look tells.
        return self.reg.fences.poll(sig[0])[0] != PENDING

    def _upstream(self, t: Command, n: Command) -> bool:
        """Whether ``t`` runs before something ``n`` runs after: walking up from ``n``
        through the producers of the fences each command waits on and the unfinished
        commands before it on its own context, never past a completed fence or command."""
        recs, poll = self.reg.fence_recs, self.reg.fences.poll
        in_order = t.device.sched.in_order
        stack, seen = [n], {n}
        while stack:
            c = stack.pop()
            if (c is not n and c.ctx is t.ctx and c.device is t.device and 0 < t.seq < c.seq
                    and in_order(t, c)):
                return True
            for h in c.wait:
                rec = recs.get(h)
                if rec is None or poll(h)[0] != PENDING:
                    continue  # completed: so did everything it followed
                p = rec.producer
                if p is None or p is t:
                    return True  # t, or a fence a client or a queue signals: it may follow t
                if p not in seen and p.state is not _DONE:
                    seen.add(p)
                    stack.append(p)
            for e in self._context_before(c, n):
                if e is t:
                    return True
                if e not in seen:
                    seen.add(e)
                    stack.append(e)
            if len(seen) > MAX_WALK:
                self.unverified += 1
                return True
        return False

    def _context_before(self, c: Command, n: Command) -> list[Command]:
        """The unfinished commands that run before ``c`` on its context: still queued or
        in its device's ring, and, for the command being checked, earlier in its batch."""
        out = []
        if c is n:
            in_order = n.device.sched.in_order
            out = [e for e in self._batch[:self._at] if in_order(e, n)]
        if c.ctx.inflight > (0 if c is n else 1):
            dev = c.device
            in_order = dev.sched.in_order
            for group in (dev.sched.waiting.values(), dev.pushed.values()):
                out += [e for e in group if e.ctx is c.ctx and e is not c
                        and (c is n or e.seq < c.seq) and in_order(e, c)]
        return out

    # -- reports ----------------------------------------------------------------------------

    def _report(self, n: Command, kind: str, b: BufferRec, t: Command) -> None:
        fence = t.signal[0] if t.signal else 0
        self.found[kind] += 1
        detail = {"hazard": kind, "buffer": b.handle, "other_cid": t.cid,
                  "missing_fence": fence, "device": n.device.name,
                  "other_device": t.device.name}
        self.reg.note_event("hazard", mode=self.mode, cid=n.cid, **detail)
        self.evidence.trace_ring.instant(_HAZARD, n.cid, TRACK_SUPERVISOR, t.cid & (1 << 63) - 1,
                                         KINDS.index(kind) + 1, b.handle)
        if self.mode != "error":
            return
        self.refused += 1
        what = {RAW: ("reads", "writes"), WAR: ("writes", "reads"),
                WAW: ("writes", "writes")}[kind]
        wait = f"wait on its fence {fence:#x}" if fence else "order them"
        raise errors.SyncHazard(
            f"{kind}: a {n.kernel} command on {n.device.name} {what[0]} buffer "
            f"{b.handle:#x} while command {t.cid:#x} ({t.kernel} on {t.device.name}) still "
            f"{what[1]} it, unordered: {wait}", correlation_id=n.cid, detail=detail)

    def metrics(self) -> dict[str, Any]:
        return {"mode": self.mode, "checked": self.checked,
                "found": {k: self.found[k] for k in KINDS}, "refused": self.refused,
                "unverified": self.unverified}


def forget(cmd: Command) -> None:
    """``cmd`` retired: it is no buffer's writer or reader any more (``Commands.retire``)."""
    reads, writes = cmd.hazard
    cmd.hazard = None
    for b in writes:
        if b.hz_writer is cmd:
            b.hz_writer = None
    for b in reads:
        readers = b.hz_readers
        if readers:
            readers.pop(cmd, None)


def _writer(b: BufferRec, view: _View | None) -> Command | None:
    if view is not None:
        seen = view.get(b)
        if seen is not None:
            return seen[0]
    return b.hz_writer


def _readers(b: BufferRec, view: _View | None) -> Any:
    if view is not None:
        seen = view.get(b)
        if seen is not None:
            return seen[1] if seen[2] else [*(b.hz_readers or ()), *seen[1]]
    return b.hz_readers or ()


def _note(view: _View, cmd: Command, reads: tuple, writes: tuple) -> None:
    """A batch's earlier command, as its later ones must see it (``record``'s rules)."""
    for b in writes:
        view[b] = [cmd, [], True]
    for b in reads:
        if b not in writes:
            seen = view.get(b)
            if seen is None:
                view[b] = [b.hz_writer, [cmd], False]
            else:
                seen[1].append(cmd)

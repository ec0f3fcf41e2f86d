"""Which waiting command a device runs next (seed §7, §11): one interface, five policies.

Every device has one scheduler, chosen in the platform file (``[device.scheduler]``):

    fifo       in order of submission
    priority   highest priority first; within one level, clients share fairly
    edf        earliest deadline first (a request's ``deadline_ms``, else its context's
               ``period_ms``); commands without a deadline after, in order
    fair       weighted fair share across clients (start-time fair queueing: each client
               has a virtual time, its service divided by its weight; the least served runs)
    mixed      the seed's policy: real-time work (camera) strictly first, by deadline;
               always-on work a guaranteed minimum share; third-party long jobs share
               what is left fairly, and any of the others preempts them

The interface (``Scheduler``): ``add`` a command, ``pick`` the next one (it leaves the
queue), ``account`` for what ran (modeled ns, charged to its client), ``preempts`` (would
this arrival preempt that running command), plus removal and iteration for recovery. The
device's ring is in order, so ``DeviceHandle.pump`` moves only a short window of picked
work into it; everything else waits here, where a later, more urgent arrival still wins.

Decisions are made in modeled time. ``peek(t)`` and ``pick(t)`` choose among the commands
that have arrived by ``t`` (their ``t_arrive``), the instant the device is next free in the
model, whatever the host's clock says: a command dated ahead waits here, unseen by the
policy, until a decision at or after its arrival (``release``), and ``next_arrival`` says
when that is. This is what makes a workload submitted ahead of time schedule the same on
a loaded machine as on a quiet one (``hetproc._refsched`` is the specification).

Fair sharing inside a level is what keeps one client's backlog from starving another's:
a client that joins gets the current virtual time, not credit for the time it was idle.
Pure logic over plain attributes of a command (``seq``, ``priority``, ``deadline_ns``,
``hold_ns``, ``ctx.client.id``, ``ctx.weight``), so it is tested by exact order on scripted
arrivals without any process.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Iterator
from typing import Any

from .._config import SchedSpec

NO_DEADLINE = (1 << 63) - 1
_DEADLINE_BITS = (1 << 61) - 1  # a deadline in ``Mixed.urgency`` (73 years of ns)
_PRIORITY_CEILING = 1 << 20  # above any priority: ``Priority.urgency`` stays positive
_DECAY = 0.9  # per accounted command, for the mixed policy's recent shares


def max_priority(client: Any) -> int:
    """The highest priority ``client`` may ask for. One place, so that client identity
    (roles granted by the platform's owner) can bound it later; today every client may use
    the whole documented range."""
    return MAX_PRIORITY


MAX_PRIORITY = 99  # the supervisor's own probes run at 100, above any client


def weight_of(ctx: Any) -> float:
    """A context's share under fair queueing: its ``weight`` (a plain object may have
    none), at least 1e-3 -- ``max(1e-3, float(weight or 1.0))`` without the calls."""
    w = getattr(ctx, "weight", 1.0) or 1.0
    if type(w) is not float:
        w = float(w)
    return w if w > 1e-3 else 1e-3  # (NaN, too, becomes 1e-3, as max would make it)


class Scheduler:
    """The interface; each policy below is a small subclass."""

    name = "base"
    preemptive = False  # ``preempts`` can be True: the policy ranks commands by urgency

    def __init__(self, spec: SchedSpec) -> None:
        self.spec = spec
        self.waiting: dict[int, Any] = {}  # seq -> command, every one queued here
        # Commands not released to the policy yet, as (arrival, seq): a heap, so the next
        # arrival is at its top. ``released_ns`` only grows: a command arriving at or
        # before it goes straight to the policy.
        self.arrivals: list[tuple[int, int]] = []
        self.released_ns = 0
        self.ready = 0  # how many of ``waiting`` the policy holds

    # -- the interface -------------------------------------------------------------------

    def add(self, cmd: Any) -> None:
        self.waiting[cmd.seq] = cmd
        t = getattr(cmd, "t_arrive", 0)
        if t > self.released_ns:
            heapq.heappush(self.arrivals, (t, cmd.seq))
        else:
            self.ready += 1
            self._add(cmd)

    def release(self, until_ns: int | None) -> None:
        """Hand the policy every command that has arrived by ``until_ns`` (None: all)."""
        if until_ns is None:
            until_ns = NO_DEADLINE
        if until_ns > self.released_ns:
            self.released_ns = until_ns
        arrivals, waiting = self.arrivals, self.waiting
        while arrivals and arrivals[0][0] <= until_ns:
            cmd = waiting[heapq.heappop(arrivals)[1]]
            self.ready += 1
            self._add(cmd)

    def next_arrival(self) -> int | None:
        """When the earliest command the policy does not see yet arrives (None: none)."""
        return self.arrivals[0][0] if self.arrivals else None

    def pick(self, now_ns: int | None = None) -> Any | None:
        """The next command to run at modeled time ``now_ns`` among those arrived by then,
        removed from the queue; None when none has. ``None``: every command has arrived
        (pure logic, as the policy tests use it)."""
        self.release(now_ns)
        if not self.ready:
            return None
        cmd = self._pick(now_ns or 0)
        del self.waiting[cmd.seq]
        self.ready -= 1
        return cmd

    def peek(self, now_ns: int | None = None) -> Any | None:
        """What ``pick`` would return, without removing it."""
        self.release(now_ns)
        if not self.ready:
            return None
        return self._peek(now_ns or 0)

    def account(self, cmd: Any, ran_ns: int) -> None:
        """Charge ``ran_ns`` of device time to ``cmd``'s client (fairness, shares)."""

    def preempts(self, new: Any, running: Any) -> bool:
        """Whether ``new`` is urgent enough to preempt ``running`` at a chunk boundary."""
        return False

    def in_order(self, first: Any, later: Any) -> bool:
        """Whether ``later``, submitted after ``first`` on the same context, can never run
        before it: never picked first, never preempting it (the hazard check counts on
        it, ``_hazards``). Commands reach the policy in (arrival, submission) order, so a
        later one dated earlier may come first; then each policy answers for its own
        rules (``_keeps_order``)."""
        return (getattr(later, "t_arrive", 0) >= getattr(first, "t_arrive", 0)
                and self._keeps_order(first, later))

    def _keeps_order(self, first: Any, later: Any) -> bool:
        return False  # no promise

    def urgency(self, cmd: Any) -> int:
        """``preempts`` as one number per command, for the device to compare (lower
        preempts higher: ``preempts(a, b)`` exactly when ``urgency(a) < urgency(b)``)."""
        return 0

    def remove_if(self, doomed: Callable[[Any], bool]) -> list[Any]:
        """Take out every waiting command ``doomed`` says, returned in arrival order."""
        out = [c for c in self.waiting.values() if doomed(c)]
        if out:
            for c in out:
                del self.waiting[c.seq]
            self.arrivals = [a for a in self.arrivals if a[1] in self.waiting]
            heapq.heapify(self.arrivals)
            self._rebuild()
        return out

    def clear(self) -> list[Any]:
        return self.remove_if(lambda c: True)

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.waiting.values()))

    # -- what a policy implements ----------------------------------------------------------

    def _add(self, cmd: Any) -> None:
        raise NotImplementedError

    def _pick(self, now_ns: int) -> Any:
        raise NotImplementedError

    def _peek(self, now_ns: int) -> Any:
        raise NotImplementedError

    def _rebuild(self) -> None:
        """Rebuild the policy's structures from the released commands after a removal."""
        pending = {seq for _, seq in self.arrivals}
        cmds = [c for seq, c in self.waiting.items() if seq not in pending]
        self._reset()
        self.ready = len(cmds)
        for c in cmds:
            self._add(c)

    def _reset(self) -> None:
        raise NotImplementedError


class Fifo(Scheduler):
    """In order of arrival (of release to the policy: submission order at one arrival)."""

    name = "fifo"

    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.queue: collections.deque = collections.deque()

    def _reset(self) -> None:
        self.queue.clear()

    def _add(self, cmd: Any) -> None:
        self.queue.append(cmd)

    def _peek(self, now_ns: int) -> Any:
        return self.queue[0]

    def _pick(self, now_ns: int) -> Any:
        return self.queue.popleft()

    def _keeps_order(self, first: Any, later: Any) -> bool:
        return True


class FairQueue:
    """Start-time fair queueing across clients: per-client FIFO queues and virtual times.

    A client's virtual time grows by ``ns / weight`` for what it ran; the backlogged client
    with the least virtual time goes next (ties: the earliest command). A client that was
    idle rejoins at the current virtual time, so idling earns no burst later."""

    def __init__(self) -> None:
        self.queues: dict[int, collections.deque] = {}
        self.vtime: dict[int, float] = {}
        self.clock = 0.0  # the virtual time of the last pick

    def add(self, cmd: Any) -> None:
        key = cmd.ctx.client.id  # one fair share per client
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = collections.deque()
            self.vtime[key] = max(self.vtime.get(key, 0.0), self.clock)
        q.append(cmd)

    def __bool__(self) -> bool:
        return bool(self.queues)

    def peek(self) -> Any:
        queues = self.queues
        if len(queues) == 1:  # one backlogged client: its oldest command, no comparison
            for q in queues.values():
                return q[0]
        key = min(queues, key=lambda k: (self.vtime[k], queues[k][0].seq))
        return queues[key][0]

    def pop(self) -> Any:
        """``peek``'s command, out of its queue."""
        queues = self.queues
        if len(queues) == 1:
            key, q = next(iter(queues.items()))
        else:
            key = min(queues, key=lambda k: (self.vtime[k], queues[k][0].seq))
            q = queues[key]
        cmd = q.popleft()
        if not q:
            del queues[key]
        v = self.vtime[key]
        if v > self.clock:  # self.clock = max(self.clock, v)
            self.clock = v
        return cmd

    def charge(self, cmd: Any, ns: int) -> None:
        key = cmd.ctx.client.id
        self.vtime[key] = self.vtime.get(key, self.clock) + ns / weight_of(cmd.ctx)

    def clear(self) -> None:
        self.queues.clear()


class Fair(Scheduler):
    name = "fair"

    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.fq = FairQueue()

    def _reset(self) -> None:
        self.fq.clear()

    def _add(self, cmd: Any) -> None:
        self.fq.add(cmd)

    def _peek(self, now_ns: int) -> Any:
        return self.fq.peek()

    def _pick(self, now_ns: int) -> Any:
        return self.fq.pop()

    def account(self, cmd: Any, ran_ns: int) -> None:
        self.fq.charge(cmd, ran_ns)

    def _keeps_order(self, first: Any, later: Any) -> bool:
        return True  # one client's commands leave its queue in order


class Priority(Scheduler):
    """Highest priority first; clients of one level share it fairly (``FairQueue``)."""

    name = "priority"
    preemptive = True

    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.levels: dict[int, FairQueue] = {}
        # max(levels): the highest level with work; meaningless while ``levels`` is empty
        # (nothing reads it then: every reader runs only while a command waits).
        self.top = 0
        self.shared = FairQueue()  # virtual times carried across levels: one per client

    def _reset(self) -> None:
        self.levels.clear()
        self.top = 0

    def _add(self, cmd: Any) -> None:
        p = cmd.priority
        fq = self.levels.get(p)
        if fq is None:
            fq = self.levels[p] = FairQueue()
            fq.vtime = self.shared.vtime  # one virtual time per client, whatever the level
            if len(self.levels) == 1 or p > self.top:  # the first level, or a higher one
                self.top = p
        fq.clock = self.shared.clock
        fq.add(cmd)

    def _peek(self, now_ns: int) -> Any:
        return self.levels[self.top].peek()

    def _pick(self, now_ns: int) -> Any:
        levels, level = self.levels, self.top
        fq = levels[level]
        cmd = fq.pop()
        shared = self.shared
        if fq.clock > shared.clock:  # max(shared.clock, fq.clock)
            shared.clock = fq.clock
        if not fq.queues:  # (its __bool__, without the call)
            del levels[level]
            self.top = max(levels) if levels else 0
        return cmd

    # ``add``, ``peek`` and ``account`` without a layer each: this is the platform's
    # default policy, asked these for every command (the same steps as ``Scheduler``'s
    # with ``_add`` and ``_peek`` above, and ``FairQueue.charge``).

    def add(self, cmd: Any) -> None:
        self.waiting[cmd.seq] = cmd
        t = getattr(cmd, "t_arrive", 0)
        if t > self.released_ns:
            heapq.heappush(self.arrivals, (t, cmd.seq))
            return
        self.ready += 1
        p = cmd.priority
        fq = self.levels.get(p)
        if fq is None:
            fq = self.levels[p] = FairQueue()
            fq.vtime = self.shared.vtime
            if len(self.levels) == 1 or p > self.top:  # the first level, or a higher one
                self.top = p
        fq.clock = self.shared.clock
        fq.add(cmd)

    def peek(self, now_ns: int | None = None) -> Any | None:
        if self.arrivals:
            self.release(now_ns)
        if not self.ready:
            return None
        return self.levels[self.top].peek()

    def account(self, cmd: Any, ran_ns: int) -> None:
        shared = self.shared
        key = cmd.ctx.client.id
        shared.vtime[key] = shared.vtime.get(key, shared.clock) + ran_ns / weight_of(cmd.ctx)

    def preempts(self, new: Any, running: Any) -> bool:
        return new.priority > running.priority

    def _keeps_order(self, first: Any, later: Any) -> bool:
        return later.priority <= first.priority  # one level: its client's queue, in order

    def urgency(self, cmd: Any) -> int:
        return _PRIORITY_CEILING - cmd.priority


class Edf(Scheduler):
    name = "edf"
    preemptive = True

    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.heap: list[tuple[int, int]] = []

    def _reset(self) -> None:
        self.heap = []

    def _add(self, cmd: Any) -> None:
        heapq.heappush(self.heap, (cmd.deadline_ns or NO_DEADLINE, cmd.seq))

    def _peek(self, now_ns: int) -> Any:
        return self.waiting[self.heap[0][1]]

    def _pick(self, now_ns: int) -> Any:
        return self.waiting[heapq.heappop(self.heap)[1]]

    def preempts(self, new: Any, running: Any) -> bool:
        return (new.deadline_ns or NO_DEADLINE) < (running.deadline_ns or NO_DEADLINE)

    def _keeps_order(self, first: Any, later: Any) -> bool:
        return (later.deadline_ns or NO_DEADLINE) >= (first.deadline_ns or NO_DEADLINE)

    def urgency(self, cmd: Any) -> int:
        return cmd.deadline_ns or NO_DEADLINE


REALTIME, ALWAYS_ON, THIRD_PARTY = 2, 1, 0


class Mixed(Scheduler):
    """Real-time strictly first (EDF), except that always-on work below its minimum share
    goes first when the most urgent real-time command can still meet its deadline after
    it; always-on before third-party; third-party shares fairly across its clients and is
    preempted by either class (``preempts``)."""

    name = "mixed"
    preemptive = True

    def __init__(self, spec: SchedSpec) -> None:
        super().__init__(spec)
        self.rt = Edf(spec)
        self.ao = Fair(spec)
        self.tp = Fair(spec)
        for part in (self.rt, self.ao, self.tp):
            part.released_ns = NO_DEADLINE  # this policy releases: its parts hold no arrival
        self.served = [0.0, 0.0, 0.0]  # recent device time per class, decayed

    def klass(self, cmd: Any) -> int:
        if cmd.priority >= self.spec.realtime_priority:
            return REALTIME
        return ALWAYS_ON if cmd.priority >= 1 else THIRD_PARTY

    def _part(self, cmd: Any) -> Scheduler:
        return (self.tp, self.ao, self.rt)[self.klass(cmd)]

    def _reset(self) -> None:
        for part in (self.rt, self.ao, self.tp):
            part.waiting.clear()
            part.ready = 0
            part._reset()

    def _add(self, cmd: Any) -> None:
        self._part(cmd).add(cmd)

    def _choose(self, now_ns: int) -> Scheduler:
        rt, ao = self.rt.peek(now_ns), self.ao.peek(now_ns)
        if rt is not None and ao is not None:
            total = sum(self.served)
            starved = total > 0 and self.served[ALWAYS_ON] < self.spec.min_share * total
            slack = (rt.deadline_ns or NO_DEADLINE) - now_ns - rt.hold_ns
            if starved and slack >= ao.hold_ns:
                return self.ao
            return self.rt
        if rt is not None:
            return self.rt
        return self.ao if ao is not None else self.tp

    def _peek(self, now_ns: int) -> Any:
        return self._choose(now_ns).peek(now_ns)

    def _pick(self, now_ns: int) -> Any:
        return self._choose(now_ns).pick(now_ns)

    def account(self, cmd: Any, ran_ns: int) -> None:
        k = self.klass(cmd)
        self.served = [s * _DECAY for s in self.served]
        self.served[k] += ran_ns
        self._part(cmd).account(cmd, ran_ns)

    def preempts(self, new: Any, running: Any) -> bool:
        kn, kr = self.klass(new), self.klass(running)
        if kn != kr:
            return kn > kr
        return kn == REALTIME and self.rt.preempts(new, running)

    def _keeps_order(self, first: Any, later: Any) -> bool:
        kf, kl = self.klass(first), self.klass(later)
        if kl == kf:
            return kl != REALTIME or self.rt._keeps_order(first, later)
        # A lower class waits for a higher one, except always-on work below its share,
        # which may go before real-time work (``_choose``).
        return kl < kf and not (kl == ALWAYS_ON and kf == REALTIME)

    def urgency(self, cmd: Any) -> int:
        """The class in the top bits (real-time lowest), then, for real-time work only,
        the deadline: two commands of one other class never preempt each other."""
        k = self.klass(cmd)
        deadline = min(cmd.deadline_ns or NO_DEADLINE, _DEADLINE_BITS) if k == REALTIME else 0
        return ((REALTIME - k) << 61) | deadline


POLICY_CLASSES: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (Fifo, Priority, Edf, Fair, Mixed)}


# -- a context's order, as the device keeps it (``DeviceHandle``) ----------------------------


def first_of_context(sched: Scheduler, cmd: Any) -> Any:
    """The oldest command still queued in ``sched`` that must run before ``cmd`` in its
    context's order (``Scheduler.in_order``), else ``cmd``: a producer pulled forward
    (``DeviceHandle._producer_first``) never overtakes its own context."""
    in_order = sched.in_order
    for c in sched.waiting.values():  # (in arrival order)
        if c is cmd:
            return cmd
        if c.ctx is cmd.ctx and c.seq < cmd.seq and in_order(c, cmd):
            return c
    return cmd


def context_ahead(sched: Scheduler, head: Any) -> bool:
    """Whether a command of ``head``'s context that must run before it is still queued in
    ``sched`` (a command dated ahead may be marked to preempt before the policy sees it,
    ``DeviceHandle._mark_ahead``). One already in the device's ring needs no check: the
    device runs marked commands by (urgency, ring position), and a later command that
    keeps its context's order (``in_order``) is never more urgent, and is later in the
    ring."""
    in_order, ctx, seq = sched.in_order, head.ctx, head.seq
    return any(c.ctx is ctx and c.seq < seq and in_order(c, head)
               for c in sched.waiting.values())


def make_scheduler(spec: SchedSpec) -> Scheduler:
    return POLICY_CLASSES[spec.policy](spec)

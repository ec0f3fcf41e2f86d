"""The five policies, with the semantics of ``hetproc.supervisor._scheduler`` (the package
docstring states them), over the simulation's per-job ``Run`` records."""

from __future__ import annotations

import heapq

from .._config import POLICIES
from ._model import NO_DEADLINE, DevicePolicy, Job

_DECAY = 0.9  # the mixed policy's recent shares, per first start (as the product's)


class Run:
    """A job's state during the simulation."""

    __slots__ = ("job", "index", "order", "ready_ns", "done_ns", "start_ns", "end_ns",
                 "segments", "preempted", "suspended", "deps_left", "dependents", "awaits",
                 "follows")

    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.index = index
        self.order: tuple = (job.arrival_ns, index)  # every tie: arrival, then submission
        self.ready_ns = -1
        self.done_ns = 0           # work done so far
        self.start_ns = -1
        self.end_ns = -1
        self.segments: list[list[int]] = []
        self.preempted: list[list[int]] = []
        self.suspended = False
        self.deps_left = len(job.after)
        self.dependents: list[Run] = []
        self.awaits: list[Run] = []
        # On a device that timeslices: the previous job of its context, which it waits
        # for (a context runs in order; only contexts take turns). No hand-off.
        self.follows: Run | None = None

    @property
    def left_ns(self) -> int:
        return self.job.duration_ns - self.done_ns

    @property
    def deadline(self) -> int:
        return self.job.deadline_ns or NO_DEADLINE


class _Book:
    """Start-time fair queueing's shared state: a virtual time per client and the clock
    (the virtual time of the last pick)."""

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.clock = 0.0

    def charge(self, run: Run) -> None:
        key = run.job.client
        self.vtime[key] = self.vtime.get(key, self.clock) + run.job.duration_ns / _weight(run)


class _FairQueue:
    """Per-client queues in arrival order; the least-served backlogged client first."""

    def __init__(self, book: _Book) -> None:
        self.book = book
        self.queues: dict[str, list[tuple[tuple[int, int], Run]]] = {}

    def __len__(self) -> int:
        return len(self.queues)

    def add(self, run: Run) -> None:
        key = run.job.client
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = []
            book = self.book
            book.vtime[key] = max(book.vtime.get(key, 0.0), book.clock)
        heapq.heappush(q, (run.order, run))

    def _best(self) -> str:
        vt = self.book.vtime
        return min(self.queues, key=lambda k: (vt[k], self.queues[k][0][0]))

    def peek(self) -> Run:
        return self.queues[self._best()][0][1]

    def runs(self) -> list[Run]:
        return [r for q in self.queues.values() for _, r in q]

    def pop(self) -> Run:
        key = self._best()
        q = self.queues[key]
        run = heapq.heappop(q)[1]
        if not q:
            del self.queues[key]
        book = self.book
        book.clock = max(book.clock, book.vtime[key])
        return run


def _weight(run: Run) -> float:
    w = float(run.job.weight or 1.0)
    return w if w > 1e-3 else 1e-3


class _Policy:
    preemptive = False

    def __init__(self, dp: DevicePolicy) -> None:
        self.dp = dp

    def __len__(self) -> int:
        raise NotImplementedError

    def add(self, run: Run) -> None:
        raise NotImplementedError

    def peek(self, now: int) -> Run:
        raise NotImplementedError

    def pick(self, now: int) -> Run:
        raise NotImplementedError

    def charge(self, run: Run) -> None:
        """Its first start: what it will run is charged once (fair shares)."""

    def preempts(self, new: Run, running: Run) -> bool:
        return False

    def runs(self) -> list[Run]:
        """Every job waiting here (any order)."""
        raise NotImplementedError


class _Fifo(_Policy):
    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.heap: list[tuple[tuple[int, ...], Run]] = []  # (sort key, run)

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, run: Run) -> None:
        heapq.heappush(self.heap, (run.order, run))

    def peek(self, now: int) -> Run:
        return self.heap[0][1]

    def pick(self, now: int) -> Run:
        return heapq.heappop(self.heap)[1]

    def runs(self) -> list[Run]:
        return [r for _, r in self.heap]


class _Edf(_Fifo):
    preemptive = True

    def add(self, run: Run) -> None:
        heapq.heappush(self.heap, ((run.deadline, *run.order), run))

    def preempts(self, new: Run, running: Run) -> bool:
        return new.deadline < running.deadline


class _Fair(_Policy):
    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.fq = _FairQueue(_Book())
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, run: Run) -> None:
        self.n += 1
        self.fq.add(run)

    def peek(self, now: int) -> Run:
        return self.fq.peek()

    def pick(self, now: int) -> Run:
        self.n -= 1
        return self.fq.pop()

    def charge(self, run: Run) -> None:
        self.fq.book.charge(run)

    def runs(self) -> list[Run]:
        return self.fq.runs()


class _Priority(_Policy):
    preemptive = True

    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.book = _Book()  # one virtual time per client, whatever the level
        self.levels: dict[int, _FairQueue] = {}
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, run: Run) -> None:
        self.n += 1
        fq = self.levels.get(run.job.priority)
        if fq is None:
            fq = self.levels[run.job.priority] = _FairQueue(self.book)
        fq.add(run)

    def peek(self, now: int) -> Run:
        return self.levels[max(self.levels)].peek()

    def pick(self, now: int) -> Run:
        top = max(self.levels)
        fq = self.levels[top]
        run = fq.pop()
        if not len(fq):
            del self.levels[top]
        self.n -= 1
        return run

    def charge(self, run: Run) -> None:
        self.book.charge(run)

    def runs(self) -> list[Run]:
        return [r for fq in self.levels.values() for r in fq.runs()]

    def preempts(self, new: Run, running: Run) -> bool:
        return new.job.priority > running.job.priority


_TP, _AO, _RT = 0, 1, 2


class _Mixed(_Policy):
    preemptive = True

    def __init__(self, dp: DevicePolicy) -> None:
        super().__init__(dp)
        self.parts = (_Fair(dp), _Fair(dp), _Edf(dp))  # by class: third-party, always-on, RT
        self.served = [0.0, 0.0, 0.0]

    def klass(self, run: Run) -> int:
        p = run.job.priority
        return _RT if p >= self.dp.realtime_priority else _AO if p >= 1 else _TP

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def add(self, run: Run) -> None:
        self.parts[self.klass(run)].add(run)

    def _choose(self, now: int) -> _Policy:
        tp, ao, rt = self.parts
        if len(rt) and len(ao):
            total = sum(self.served)
            starved = total > 0 and self.served[_AO] < self.dp.min_share * total
            head, other = rt.peek(now), ao.peek(now)
            if starved and head.deadline - now - head.left_ns >= other.left_ns:
                return ao
            return rt
        if len(rt):
            return rt
        return ao if len(ao) else tp

    def peek(self, now: int) -> Run:
        return self._choose(now).peek(now)

    def pick(self, now: int) -> Run:
        return self._choose(now).pick(now)

    def charge(self, run: Run) -> None:
        k = self.klass(run)
        self.served = [s * _DECAY for s in self.served]
        self.served[k] += run.job.duration_ns
        self.parts[k].charge(run)

    def runs(self) -> list[Run]:
        return [r for part in self.parts for r in part.runs()]

    def preempts(self, new: Run, running: Run) -> bool:
        kn, kr = self.klass(new), self.klass(running)
        if kn != kr:
            return kn > kr
        return kn == _RT and new.deadline < running.deadline


MODELS: dict[str, type[_Policy]] = {
    "fifo": _Fifo, "priority": _Priority, "edf": _Edf, "fair": _Fair, "mixed": _Mixed}
assert tuple(sorted(MODELS)) == tuple(sorted(POLICIES)), "a policy without a model"

"""An N-stage pipeline across devices (seed §3, §10): K buffer sets in rotation, a bounded
queue in front, a policy for when a stage falls behind, and a per-frame deadline.

::

    source (every interval) ─▶ [queue ≤ max_queue] ─▶ set k: stage 0 ─fence▶ stage 1 ─▶ ... ─▶ done
                                   │ full:                (device A)        (device B)        │
                                   │  backpressure: the source waits       set k back ◀──────┘
                                   │  drop_oldest / drop_newest: a frame is dropped, counted

Frame ``i`` arrives at ``t_first + i * interval`` (its modeled arrival, however late the
host gets round to it). It goes to a free buffer set at once, or waits in the queue. A set
carries a frame through every stage, each stage reading buffer ``s`` of the set and
writing buffer ``s + 1``, ordered only by fences; the first stage also waits on the fence
that last freed the set, so the model sees that a frame cannot start before its buffers
are free. Latency is the last stage's modeled end minus the arrival, so host wake-ups do
not count: what the report says is what the modeled SoC would do.

Decisions follow the model, not the host: before an arrival is placed, every frame that
could have ended by then (its arrival plus its stages' modeled time) is waited for and,
if it did end by then, retired, so a host running late drops no more frames than the
modeled SoC would. Backpressure stalls the source: a frame that found the queue full
arrives only when a set frees up, and its latency still counts from when it should have
arrived (the report counts it as delayed). Drops are counted by policy. The report has
throughput, latency p50/p99, drops, delays, deadline misses and the queue depth over time.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc import errors

from . import _now

if TYPE_CHECKING:
    from ._buffer import Buffer
    from ._client import Client
    from ._context import Context
    from ._fence import Fence

POLICIES = ("backpressure", "drop_oldest", "drop_newest")


@dataclass
class PipelineStage:
    """One stage: a kernel on a context's device. ``ms`` is its modeled duration, or a
    function of the frame index (a spike); ``handoff_ms`` delays its signal (seed §10)."""

    context: Context
    kernel: str = "work"
    ms: float | Callable[[int], float] | None = None
    params: dict | None = None
    handoff_ms: float = 0.0
    name: str = ""

    def duration(self, frame: int) -> float | None:
        """The stage's modeled milliseconds for ``frame`` (``ms`` may be a function of it)."""
        return self.ms(frame) if callable(self.ms) else self.ms


@dataclass
class PipelineReport:
    frames: int
    completed: int
    dropped: int
    delayed: int
    deadline_misses: int
    latency_ms: np.ndarray
    throughput_fps: float
    period_ms: float
    queue_depth: list[tuple[float, int]]   # (modeled ms since the first arrival, frames waiting)
    stage_depth: list[tuple[float, list[int]]]  # per stage: frames at or waiting for it
    dropped_frames: list[int] = field(default_factory=list)
    failed: int = 0

    def summary(self) -> dict[str, Any]:
        """The report's counts and latency percentiles as plain data."""
        lat = self.latency_ms
        return {"frames": self.frames, "completed": self.completed, "dropped": self.dropped,
                "delayed": self.delayed, "deadline_misses": self.deadline_misses,
                "failed": self.failed,
                "latency_p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
                "latency_p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
                "latency_max_ms": float(lat.max()) if lat.size else None,
                "throughput_fps": self.throughput_fps, "period_ms": self.period_ms,
                "max_queue_depth": max((d for _, d in self.queue_depth), default=0)}


@dataclass
class _Frame:
    index: int
    arrival: int          # modeled arrival (ns)
    delayed: bool = False
    slot: int = -1
    fences: list = field(default_factory=list)
    min_ns: int = 0       # its stages' modeled time: it cannot end before arrival + this


_LATER = object()


class Pipeline:
    """See the module docstring. ``fill(i, array)`` writes frame ``i`` into the first
    buffer of its set (default: leave it as it is)."""

    def __init__(self, client: Client, stages: Sequence[PipelineStage], *,
                 shape: Sequence[int] = (1, 16, 16, 3), dtype: str = "float32",
                 buffers: int = 3, max_queue: int = 2, policy: str = "backpressure",
                 deadline_ms: float | None = None,
                 fill: Callable[[int, np.ndarray], None] | None = None) -> None:
        if not stages:
            raise errors.InvalidRequest("a pipeline needs at least one stage")
        if policy not in POLICIES:
            raise errors.InvalidRequest(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if buffers < 1 or max_queue < 0:
            raise errors.InvalidRequest("buffers must be >= 1 and max_queue >= 0")
        self.client = client
        self.now = client.connection.clock.now_ns  # the platform's clock (maybe virtual)
        self.stages = list(stages)
        self.policy = policy
        self.max_queue = max_queue
        self.deadline_ns = round(deadline_ms * 1e6) if deadline_ms else 0
        self.fill = fill
        n = len(self.stages)
        self.sets: list[list[Buffer]] = [
            [client.alloc(shape, dtype) for _ in range(n + 1)] for _ in range(buffers)]
        for bufs in self.sets:  # mapped once, as a runtime does (no map per frame)
            for s, st in enumerate(self.stages):
                st.context.map(bufs[s], "r")
                st.context.map(bufs[s + 1], "w")
        self._freed_by: list[Fence | None] = [None] * buffers
        self._scale = float(client.info.get("time_scale", 1.0))

    # -- running ----------------------------------------------------------------------

    def run(self, frames: int, *, interval_ms: float | None = None,
            timeout_s: float = 30.0) -> PipelineReport:
        """Feed ``frames`` frames, one every ``interval_ms`` (None: as fast as the
        buffers allow, i.e. always backpressure), and collect them all."""
        run = _Run(self, frames, round(interval_ms * 1e6) if interval_ms else 0, timeout_s)
        while run.nxt < frames or run.queue or run.flight:
            run.check_deadline()
            run.start_queued()
            t_arrive = run.arrival_time()
            if run.nxt < frames and (not run.interval or self.now() >= t_arrive):
                run.admit(t_arrive)
            else:
                run.idle(t_arrive)
        return run.report()

    def _submit(self, fr: _Frame, slot: int, flight: collections.deque) -> None:
        """Queue frame ``fr``'s stages on buffer set ``slot``, chained by fences."""
        bufs = self.sets[slot]
        fr.slot = slot
        if self.fill is not None:
            self.fill(fr.index, bufs[0].array())
        prev = self._freed_by[slot]
        wait = [prev] if prev is not None else []
        at = min(fr.arrival, self.now())
        fr.min_ns = int(sum((st.duration(fr.index) or 0.0) + st.handoff_ms
                            for st in self.stages) * self._scale * 1e6)
        for s, st in enumerate(self.stages):
            f = st.context.submit_nowait(st.kernel, [bufs[s]], [bufs[s + 1]], wait=wait,
                                         params=st.params, ms=st.duration(fr.index),
                                         handoff_ms=st.handoff_ms, at_ns=at)
            fr.fences.append(f)
            wait = [f]
        flight.append(fr)

    def _stage_depths(self, flight: collections.deque, queue: collections.deque) -> list[int]:
        """Frames at, or waiting for, each stage (the queue counts for the first)."""
        depth = [0] * len(self.stages)
        depth[0] += len(queue)
        for fr in flight:
            for s, f in enumerate(fr.fences):
                if not f.done():
                    depth[s] += 1
                    break
        return depth

    def close(self) -> None:
        """Release the pipeline's fences and free its buffers."""
        for f in self._freed_by:
            if f is not None:
                f.release()
        self._freed_by = [None] * len(self.sets)
        for bufs in self.sets:
            for b in bufs:
                b.free()


class _Run:
    """The state of one ``Pipeline.run``: free sets, the queue, frames in flight and what
    the report counts. Kept apart from ``Pipeline`` because a pipeline can run again;
    each run starts from empty counters."""

    def __init__(self, pipe: Pipeline, frames: int, interval: int, timeout_s: float) -> None:
        self.pipe = pipe
        self.frames = frames
        self.interval = interval
        self.timeout_s = timeout_s
        self.free = collections.deque(range(len(pipe.sets)))
        self.queue: collections.deque[_Frame] = collections.deque()
        self.flight: collections.deque[_Frame] = collections.deque()
        self.lat: list[float] = []
        self.dropped: list[int] = []
        self.samples: list[tuple[float, int]] = []
        self.stage_samples: list[tuple[float, list[int]]] = []
        self.delayed = self.misses = self.failed = 0
        self.ends: list[int] = []
        self.deadline = time.monotonic() + timeout_s
        self.t_first = pipe.now() + 2_000_000
        self.nxt = 0

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise errors.FenceTimeout(f"pipeline did not finish within {self.timeout_s} s")

    def arrival_time(self) -> int:
        """The next frame's modeled arrival (0 without an interval: it comes when taken)."""
        return self.t_first + self.nxt * self.interval if self.interval else 0

    def start_queued(self) -> None:
        while self.queue and self.free:
            self.pipe._submit(self.queue.popleft(), self.free.popleft(), self.flight)

    def sample(self, t: int) -> None:
        at_ms = (t - self.t_first) / 1e6
        self.samples.append((at_ms, len(self.queue) + len(self.flight)))
        self.stage_samples.append((at_ms, self.pipe._stage_depths(self.flight, self.queue)))

    # -- arrivals ---------------------------------------------------------------------

    def admit(self, t_arrive: int) -> None:
        """Frame ``nxt`` arrives: start it, queue it, drop a frame or stall the source."""
        if self.interval:
            self.retire_ended_by(t_arrive)
        fr = _Frame(self.nxt, t_arrive or self.pipe.now())
        self.nxt += 1
        policy = self.pipe.policy
        if self.free and not self.queue:
            self.pipe._submit(fr, self.free.popleft(), self.flight)
        elif len(self.queue) < self.pipe.max_queue:
            self.queue.append(fr)
        elif policy == "drop_oldest" and self.queue:
            self.dropped.append(self.queue.popleft().index)
            self.queue.append(fr)
        elif policy != "backpressure":  # drop_newest (or nothing older queued)
            self.dropped.append(fr.index)
        else:
            self.stall_source(fr)
        self.sample(fr.arrival)

    def retire_ended_by(self, t_arrive: int) -> None:
        """Decide on the model's state at the arrival, whatever the host's lag: every
        frame that may end by then is waited for (in order), and retired if it did; the
        frames it frees go first (they came first)."""
        while self.flight and self.flight[0].arrival + self.flight[0].min_ns <= t_arrive:
            self.check_deadline()
            if self.finish_oldest(0.05, before=t_arrive) is _LATER:
                break
        self.start_queued()

    def stall_source(self, fr: _Frame) -> None:
        """Backpressure: the source waits for a set to come free; with an interval the
        frame keeps its modeled arrival and counts as delayed."""
        if not self.interval:
            fr.arrival = 0  # as fast as possible: it arrives when accepted
        fr.delayed = bool(self.interval)
        self.delayed += fr.delayed
        while not self.free:
            self.finish_oldest(1.0)
        if not fr.arrival:
            fr.arrival = self.pipe.now()
        self.queue.append(fr)

    def idle(self, t_arrive: int) -> None:
        """No arrival is due: retire a frame in flight, or sleep until the next arrival."""
        more = bool(self.interval) and self.nxt < self.frames
        if self.flight:
            wait_s = max(0.0, (t_arrive - self.pipe.now()) / 1e9) if more else 0.05
            done = self.finish_oldest(min(wait_s, 0.05), before=t_arrive if more else None)
            if done is _LATER:
                _sleep_until(self.pipe, t_arrive)  # it ends after the next arrival: it comes first
        elif more:
            _sleep_until(self.pipe, t_arrive)

    # -- completions ------------------------------------------------------------------

    def finish_oldest(self, timeout: float, before: int | None = None) -> object:
        """Retire the oldest frame once its last fence is done: True; False if not
        done within ``timeout``; ``_LATER`` if it ends (modeled) after ``before``."""
        fr = self.flight[0]
        last = fr.fences[-1]
        ok = True
        try:
            last.wait(timeout)
        except errors.FenceTimeout:
            return False
        except errors.HetprocError:
            self.failed += 1
            ok = False
        else:
            end = last.signal_time()
            if before is not None and end > before:
                return _LATER  # in the model it still runs at ``before``
            self.count_end(fr, end)
        self.flight.popleft()
        self.free_set(fr, last, ok)
        return True

    def count_end(self, fr: _Frame, end: int) -> None:
        self.ends.append(end)
        self.lat.append((end - fr.arrival) / 1e6)
        deadline_ns = self.pipe.deadline_ns
        if deadline_ns and end - fr.arrival > deadline_ns:
            self.misses += 1

    def free_set(self, fr: _Frame, last: Fence, ok: bool) -> None:
        """Give frame ``fr``'s buffer set back; ``last`` (its final fence) is what the
        next frame on the set waits on."""
        freed_by = self.pipe._freed_by
        for f in fr.fences[:-1]:
            f.release()
        old = freed_by[fr.slot]
        if old is not None:
            old.release()
        self.free.append(fr.slot)
        self.sample(max(fr.arrival, last.signal_time() or fr.arrival))
        # A failed frame frees its set all the same, but its fence is not what the
        # next frame there waits on: that frame would fail with it (DependencyFailed),
        # and so would every later one on this set.
        freed_by[fr.slot] = last if ok else None
        if not ok:
            last.release()

    def report(self) -> PipelineReport:
        ends = self.ends
        span = (max(ends) - min(ends)) / 1e6 if len(ends) > 1 else 0.0
        period = float(np.median(np.diff(sorted(ends)))) / 1e6 if len(ends) > 1 else 0.0
        return PipelineReport(
            frames=self.frames, completed=len(self.lat), dropped=len(self.dropped),
            delayed=self.delayed, deadline_misses=self.misses, latency_ms=np.array(self.lat),
            failed=self.failed, throughput_fps=(len(ends) - 1) / span * 1e3 if span else 0.0,
            period_ms=period, queue_depth=self.samples, stage_depth=self.stage_samples,
            dropped_frames=self.dropped)


def _sleep_until(pipe: Pipeline, t_ns: int) -> None:
    delay = (t_ns - pipe.now()) / 1e9
    if delay > 0:  # on the platform's clock: a wait in modeled time on the virtual one
        _now.sleep(min(delay, 0.05) * 1000, pipe.client)

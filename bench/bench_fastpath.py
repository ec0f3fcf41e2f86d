"""The fast submission path: CPU per command in every process, rates and latencies, each
beside a floor measured in the same run, and where one no-op command's time goes.

``fastpath`` (``python -m bench --only fastpath [--strict]``)
    * CPU per no-op command, batches of 64 (``submit_many(nowait=True)``, 4 batches in
      flight): the supervisor's and the device's CPU time from ``/proc/<pid>/task/*/
      schedstat`` (ns), the client's from ``time.process_time_ns``, divided by the
      commands run. Targets: supervisor <= 15 us, device <= 10 us, client <= 5 us.
    * Batched no-op throughput (batches of 64 and of 512) next to the raw shm ring with
      a doorbell in alternating rounds; target >= 60,000 cmd/s and >= 0.2x the ring.
    * A stream of single ``submit_nowait`` calls (fences retired 256 behind); target
      >= 20,000 cmd/s.
    * ``submit_nowait`` + wait p50 cross CPU vs the raw semaphore round trip (<= 3x) and
      submit -> device start p50 vs the raw one-way wake plus the validation time (<= 2x);
      the validation time is what the checks of one command cost in one process: the
      supervisor's decode and whole-request check of a one-command submit plus the
      device's decode of its record.
    * The profile of one no-op command per process: two more platforms with
      ``HETPROC_PROFILE`` set (``ipc.profiled``), a short and a long batched run after
      the same warm-up; the difference of their profiles, function by function, divided
      by the extra commands (start-up and one-time growth cancel out), gives the
      functions with the most own time per command in the supervisor and the device
      (the client is profiled in-process over the long run). Wall time, with the calls
      that block or hand the CPU to the process they wake (semaphores, sockets, select,
      sleep) left out of the rows and the total. Profiling slows everything 2-4x: read
      the shares.
"""

from __future__ import annotations

import glob
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import hetproc
from hetproc import _protocol
from hetproc._config import load_platform
from hetproc.supervisor._validation import check_request
from ipc import decode, encode

from . import _baselines, _raw
from ._registry import benchmark, make_row
from .bench_core import (
    DeviceStates,
    _p,
    _pin,
    _pinned,
    _platform,
    _wait,
    batched_throughput,
    placements,
    submit_latency,
)

_DEVICE = "npu0"
CPU_TARGETS_US = {"supervisor": 15.0, "device": 10.0, "client": 5.0}
TPUT_TARGET = 60_000.0
TPUT_RING_RATIO = 0.2
STREAM_TARGET = 20_000.0
_SIZES = {  # (quick, full)
    "cpu_batches": (20, 120), "tput_batches": (10, 60), "tput_rounds": (2, 3),
    "stream_n": (2000, 10000), "lat_rounds": (2, 4), "lat_n": (80, 300),
    "prof_batches": (20, 80),
}


def _size(key: str, quick: bool) -> int:
    return _SIZES[key][0 if quick else 1]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid``, in ns (schedstat: not the 10 ms tick)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


class _QueuePath:
    """A ``hetproc.Queue`` behind the same calls the bench makes of a context, so every
    figure is measured the same way on both paths."""

    def __init__(self, queue: hetproc.Queue) -> None:
        self.queue = queue
        self.client = queue.client
        self.device = queue.ctx.device

    def submit_nowait(self, kernel: str, ms: float = 0.0) -> hetproc.Fence:
        return self.queue.submit_nowait(ms)

    def submit(self, kernel: str, ms: float = 0.0) -> hetproc.Fence:
        return self.queue.submit_nowait(ms)

    def submit_many(self, cmds: list, nowait: bool = True) -> list:
        return self.queue.submit_many([c.get("ms", 0.0) for c in cmds])


def cpu_per_command(ctx: Any, sup_pid: int, dev_pid: int, batches: int,
                    batch: int = 64, depth: int = 4) -> dict[str, float]:
    """us of CPU per command in each process over a batched no-op run."""
    s0, d0, c0 = cpu_ns(sup_pid), cpu_ns(dev_pid), time.process_time_ns()
    res = batched_throughput(ctx, batches, batch, depth)
    ctx.client.ping()  # the releases and the supervisor's last collection are in
    s1, d1, c1 = cpu_ns(sup_pid), cpu_ns(dev_pid), time.process_time_ns()
    n = res["n"]
    return {"supervisor": (s1 - s0) / n / 1e3, "device": (d1 - d0) / n / 1e3,
            "client": (c1 - c0) / n / 1e3, "cmds_per_s": res["cmds_per_s"]}


def submit_stream(ctx: Any, n: int, behind: int = 256) -> float:
    """cmd/s of single ``submit_nowait`` calls, fences waited and released ``behind``."""
    pending = []
    t0 = time.monotonic_ns()
    for _ in range(n):
        pending.append(ctx.submit_nowait("work", ms=0))
        if len(pending) > behind:
            f = pending.pop(0)
            _wait(f, None, "stream fence", timeout=60.0)
            f.release()
    for f in pending:
        _wait(f, None, "stream fence", timeout=60.0)
        f.release()
    return n / ((time.monotonic_ns() - t0) / 1e9)


def validation_us(n: int = 2000) -> float:
    """What the checks of one no-op command cost: the supervisor's decode and check of a
    one-command submit, plus the device's decode of a command record."""
    from device_workers import decode_command, encode_command
    limits = load_platform().limits
    cmd = {"kernel": "work", "ins": [], "outs": [], "wait": [], "ms": 0.0,
           "cid": (1 << 40) | (1 << 39) | 7, "signal": 1 << 32 | 3}
    frame = encode({"op": "submit", "id": 9, "ctx": 1 << 32, "cmds": [cmd], "t_ns": 1})
    record = encode_command(7, 7, cmd["cid"], "work", [], [cmd["signal"]], 0, 0, 10**9, 1)

    def once() -> None:
        msg = decode(frame, _protocol.REQUESTS)
        check_request(msg, limits)
        decode_command(record)

    return best_us(once, n)


def best_us(once: Any, n: int) -> float:
    """us per call of ``once``, the best of five rounds of ``n`` calls."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            once()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best / 1e3


def queue_checks_us(n: int = 2000) -> float:
    """What the checks of one queue command cost the device: decoding the record and the
    owner, pending and bound checks (``device_workers._queues``)."""
    from ipc import FenceTable, Segment
    from ipc import decode_queue_record as decode_record
    from ipc import encode_queue_record as encode_record
    seg = Segment.anonymous_segment("bench-fences", FenceTable.segment_bytes(64), 1)
    fences = FenceTable("bench-none-", seg, create=False)
    try:
        record = encode_record(1, 7, 1 << 32 | 3, time.monotonic_ns(), 0)

        def once() -> None:
            rec = decode_record(record)
            _ = fences.pending_owner(rec.signal) == 7 and rec.hold_ns <= 10**9 and rec.qseq == 1

        return best_us(once, n)
    finally:
        fences.close()
        seg.close()


_BLOCKING = ("acquire", "release", "recv", "send", "select", "poll", "sleep", "eventfd")


def _blocking(func: str) -> bool:
    return func.startswith(("<method", "<built-in")) and any(b in func for b in _BLOCKING)


def _top(stats: pstats.Stats, n_cmds: int, k: int = 10,
         minus: pstats.Stats | None = None) -> tuple[float, list]:
    """Own us per command of all non-blocking calls, and (function, own us per command,
    cumulative us per command), most own time first. ``minus``: a shorter run's profile
    of the same process, subtracted function by function (``n_cmds``: the difference)."""
    less = minus.stats if minus is not None else {}
    rows = []
    for key, (_cc, _nc, tt, ct, _callers) in stats.stats.items():
        file, line, func = key
        if _blocking(func):
            continue
        if key in less:
            tt, ct = tt - less[key][2], ct - less[key][3]
        where = f"{os.path.basename(file)}:{line}({func})" if line else func
        rows.append((where, tt * 1e6 / n_cmds, ct * 1e6 / n_cmds))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:k]


def _profiled_run(where: str, batches: int, batch: int, client: bool,
                  queue: bool) -> pstats.Stats | None:
    """One platform under ``HETPROC_PROFILE`` (files in ``where``): a warm-up deeper than
    the run (the fence table makes its semaphores as fences are first needed and keeps
    them: its growth must be over before the run), then ``batches`` at depth 4, through
    a queue or the supervisor's path; the client's own profile of those batches when
    ``client``."""
    import cProfile
    old = os.environ.get("HETPROC_PROFILE")
    os.environ["HETPROC_PROFILE"] = where
    prof = None
    try:
        with _platform() as (plat, _states):
            ctx = plat.client.context(_DEVICE)
            q = ctx.queue(slots=4096) if queue else None
            path = _QueuePath(q) if q is not None else ctx
            batched_throughput(path, _PROF_WARM, batch, 8)
            if client:
                prof = cProfile.Profile()
                prof.enable()
            batched_throughput(path, batches, batch, 4)
            if prof is not None:
                prof.disable()
            plat.client.ping()
            if q is not None:
                q.close()
    finally:
        if old is None:
            os.environ.pop("HETPROC_PROFILE", None)
        else:
            os.environ["HETPROC_PROFILE"] = old
    return pstats.Stats(prof) if prof is not None else None


_PROF_WARM = 24  # batches of warm-up (at depth 8) before a profiled run


def profile_rows(batches: int, batch: int = 64, queue: bool = True) -> tuple[list[dict], dict]:
    """The top functions per process, own time per command. The supervisor's and the
    device's profiles cover their whole loop (start-up, the first connection, the fence
    pool's growth: none of it per command), so they come from two platforms, a short run
    and a long one (``batches``): their difference, function by function, is what the
    extra commands cost. The client's is its own profile of the long run."""
    rows, detail = [], {}
    short = max(1, batches // 4)
    found: dict[str, dict[str, pstats.Stats]] = {}
    with tempfile.TemporaryDirectory(prefix="hetproc-prof-") as where:
        for run, n in (("short", short), ("long", batches)):
            sub = os.path.join(where, run)
            os.mkdir(sub)
            client = _profiled_run(sub, n, batch, client=run == "long", queue=queue)
            if client is not None:
                found.setdefault("client", {})["long"] = client
            for path in glob.glob(os.path.join(sub, "*.prof")):
                role = os.path.basename(path).rsplit("-", 1)[0]
                if role == "supervisor" or role == f"device-{_DEVICE}":
                    found.setdefault(role, {})[run] = pstats.Stats(path)
    for role, runs in found.items():
        if role == "client":
            total, top = _top(runs["long"], batches * batch)
        elif "short" in runs and "long" in runs:
            total, top = _top(runs["long"], (batches - short) * batch, minus=runs["short"])
        else:
            continue
        detail[role] = {"total_us_per_cmd": total, "top": top}
        label = "queue" if queue else "supervisor path"
        rows.append(make_row(f"profile, {label}, {role}: own time / cmd, blocking calls "
                             f"out (profiled)", total))
        for fn, own, cum in top[:8]:
            rows.append(make_row(f"  {fn[:60]} (cum {cum:.1f} us)", own))
    return rows, detail


def _throughputs(path: Any, quick: bool, ring: list[float]) -> dict[int, list[float]]:
    """Batched no-op rates (64 and 512), alternating with the raw ring's in one run."""
    tput: dict[int, list[float]] = {64: [], 512: []}
    for r in range(_size("tput_rounds", quick)):
        for which in (("raw", "prod") if r % 2 == 0 else ("prod", "raw")):
            if which == "raw":
                ring.append(_raw.ring_throughput(_baselines.size("ring_n", quick))["msgs_per_s"])
            else:
                for b in tput:
                    nb = _size("tput_batches", quick) * 64 // b + 2
                    tput[b].append(batched_throughput(path, nb, b, 4)["cmds_per_s"])
    return tput


def _latencies(path: Any, states: DeviceStates, quick: bool, here: set, other: set,
               others: tuple[int, ...]) -> dict[str, list]:
    """submit_nowait + wait and submit -> device start, pinned across CPUs, alternating
    with the raw semaphore ping-pong."""
    acc: dict[str, list] = {"total": [], "to_start": [], "raw_rtt": [], "raw_one": []}
    everywhere = os.sched_getaffinity(0)
    submit_latency(path, states, 100, sync=False)
    for r in range(_size("lat_rounds", quick)):
        for pid in others:
            _pin(pid, other)
        with _pinned(here, other):
            for which in (("raw", "prod") if r % 2 == 0 else ("prod", "raw")):
                if which == "raw":
                    raw = _raw.sem_pingpong(_size("lat_n", quick))
                    acc["raw_rtt"].append(raw["rtt_ns"])
                    acc["raw_one"].append(raw["one_way_ns"])
                else:
                    res = submit_latency(path, states, _size("lat_n", quick), sync=False)
                    acc["total"].append(res["total"])
                    acc["to_start"].append(res["to_start"])
    for pid in others:
        _pin(pid, everywhere)
    return acc


def _path_rows(label: str, path: Any, states: DeviceStates, quick: bool, sup_pid: int,
               dev_pid: int, cross: str, where: dict, checks_us: float,
               targets: bool) -> tuple[list[dict], dict]:
    """Every figure of one submission path; ``targets``: judge them (the fast path)."""
    rows, detail = [], {}

    def judged(ok: bool) -> bool | None:
        return ok if targets else None

    cpu = [cpu_per_command(path, sup_pid, dev_pid, _size("cpu_batches", quick))
           for _ in range(3)]
    detail["cpu_rounds"] = cpu
    for proc, limit in CPU_TARGETS_US.items():
        v = statistics.median(r[proc] for r in cpu)
        rows.append(make_row(f"{label}: CPU per no-op cmd, batches of 64: {proc}", v,
                             target=f"<= {limit:g} us" if targets else None,
                             ok=judged(v <= limit)))
    ring: list[float] = []
    tput = _throughputs(path, quick, ring)
    ring_rate = statistics.median(ring)
    for b, rates in tput.items():
        rate = statistics.median(rates)
        ok = rate >= TPUT_TARGET and rate >= TPUT_RING_RATIO * ring_rate
        target = f">= {TPUT_TARGET / 1000:.0f}k/s, >= {TPUT_RING_RATIO}x ring"
        rows.append(dict(make_row(f"{label}: no-op throughput, batches of {b}", None,
                                  target=target if targets else None, ok=judged(ok)),
                         value=rate, baseline=ring_rate, ratio=rate / ring_rate, unit="/s"))
    detail["throughput"] = {"prod": tput, "ring": ring}
    stream = [submit_stream(path, _size("stream_n", quick)) for _ in range(2)]
    rate = statistics.median(stream)
    rows.append(dict(make_row(f"{label}: single submit_nowait stream", None,
                              target=f">= {STREAM_TARGET / 1000:.0f}k/s" if targets else None,
                              ok=judged(rate >= STREAM_TARGET)), value=rate, unit="/s"))
    detail["stream"] = stream
    here, other = where[cross]
    acc = _latencies(path, states, quick, here, other, (sup_pid, dev_pid))
    rtt, raw_rtt = _p(acc["total"], "p50_us"), _p(acc["raw_rtt"], "p50_us")
    rows.append(make_row(f"{label}: submit_nowait+wait p50, {cross}", rtt, raw_rtt,
                         target="<= 3x" if targets else None))
    start, raw_one = _p(acc["to_start"], "p50_us"), _p(acc["raw_one"], "p50_us")
    rows.append(make_row(f"{label}: submit -> device start p50, {cross} (floor: one-way "
                         f"{raw_one:.1f} + checks {checks_us:.1f} us)", start,
                         raw_one + checks_us, target="<= 2x" if targets else None))
    return rows, detail


@benchmark("fastpath")
def bench_fastpath(quick: bool) -> dict:
    """Both submission paths, each in full: the queue (``Context.queue``: the fast path,
    judged against the targets) and the supervisor's (``Context.submit_nowait``:
    every figure beside it, for comparison)."""
    rows, detail = [], {}
    where = placements()
    cross = "cross CPU" if "cross CPU" in where else next(iter(where))
    with _platform() as (plat, states):
        c = plat.client
        ctx = c.context(_DEVICE)
        batched_throughput(ctx, 2, 64, 2)  # warm-up: fence pool, slots, rings
        # Read after the warm-up: a device writes its pid into the state table as its
        # loop starts, which may be just after the platform said it is up.
        sup_pid, dev_pid = c.supervisor_pid, states.pid(_DEVICE)
        if dev_pid <= 0 or not os.path.exists(f"/proc/{dev_pid}"):
            raise RuntimeError(f"no live pid for {_DEVICE} in the state table ({dev_pid})")
        with ctx.queue(slots=4096) as queue:
            qpath = _QueuePath(queue)
            batched_throughput(qpath, 2, 64, 2)
            qrows, detail["queue"] = _path_rows(
                "queue", qpath, states, quick, sup_pid, dev_pid, cross, where,
                queue_checks_us(300 if quick else 2000), targets=True)
        srows, detail["supervisor_path"] = _path_rows(
            "supervisor path", ctx, states, quick, sup_pid, dev_pid, cross, where,
            validation_us(300 if quick else 2000), targets=False)
        rows += qrows + srows
        c.ping()

    for queue in (True, False):
        prof_rows, detail["profile_queue" if queue else "profile"] = profile_rows(
            _size("prof_batches", quick), queue=queue)
        rows.extend(prof_rows)
    return {"rows": rows, **detail}

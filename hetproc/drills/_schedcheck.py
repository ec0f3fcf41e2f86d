"""A task set on a real platform against the reference simulator, job by job.

``compare(platform, taskset)`` submits every job of the task set to the running platform
ahead of time, each dated with its modeled arrival (``at_ns``: the scheduler holds it
until then, so the host's pace does not enter the schedule), waits for all of them,
reads each job's modeled start (the device's EXEC record, at its modeled times) and end
(its fence's modeled signal stamp, less its hand-off), and simulates the same set with
``hetproc.simulate_schedule`` under the platform's own scheduler settings (policy, chunk,
switch cost, timeslice, dispatch latency, time scale 1). The
result has one row per job and a summary: misses on both sides, the largest start and
end errors, how many jobs differ. Times in the rows are ns after the task set's origin.

The simulator is the specification (see ``hetproc._refsched``); a difference is the
product's, unless the host lagged (the platform's ``model_lags`` count is in the summary).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ipc import END, Stage

from .. import _refsched, errors
from ..client import Fence, Platform, command

MS = 1_000_000
LEAD_NS = 300 * MS       # the origin, this far after the contexts are warm...
LEAD_PER_JOB_NS = MS // 2  # ...plus this per job: every submit is in before it
WAIT_MARGIN_S = 10.0     # real seconds past the set's modeled length to wait for its fences


@dataclass
class Comparison:
    """``rows``: one per job (submission order); ``summary``: the figures of the run."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def differing(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r["same"]]


def compare(platform: Platform, taskset: Iterable[Any], policy: str | None = None, *,
            tasks: Iterable[Any] = (), horizon_ns: int | None = None) -> Comparison:
    """Run ``taskset`` (jobs: ``hetproc._refsched.Job`` records or mappings, as for
    ``simulate_schedule``; ``tasks``: periodic ones, expanded up to ``horizon_ns``) on
    ``platform`` and compare every job with the reference simulator. ``policy``, when
    given, must be what the devices the set uses are configured with."""
    jobs = _refsched.expand(taskset, tasks, horizon_ns)
    devices = {j.device: _device_policy(platform, j.device) for j in jobs}
    if policy is not None:
        wrong = {d: dp.policy for d, dp in devices.items() if dp.policy != policy}
        if wrong:
            raise errors.InvalidRequest(f"the platform's devices run {wrong}, not {policy!r}")
    dispatch_ns = int(round(platform.spec.dispatch_us * platform.spec.time_scale * 1000))
    ref = _refsched.simulate_schedule(jobs, devices=devices, dispatch_ns=dispatch_ns)
    clients: dict[str, Any] = {"": platform.client}
    try:
        t0, fences = _submit(platform, clients, jobs)
        failures = _wait(fences, jobs)
        starts = _modeled_starts(platform, fences)
        rows = [_row(o, fences[o.name], starts, t0, failures.get(o.name)) for o in ref.jobs]
    finally:
        for name, c in clients.items():
            if name:
                c.close()
    return Comparison(rows, _summary(platform, rows, ref, devices))


def _device_policy(platform: Platform, device: str) -> _refsched.DevicePolicy:
    spec = platform.spec
    return _refsched.DevicePolicy.from_spec(spec.device(device).scheduler, spec.time_scale,
                                            spec.engine(device).timeslice_ms)


def _submit(platform: Platform, clients: dict[str, Any],
            jobs: list[_refsched.Job]) -> tuple[int, dict[str, Fence]]:
    """Every job at its arrival, in arrival then submission order; returns the origin.
    A job's client names a connection of its own (opened here, kept in ``clients``)."""
    contexts: dict[tuple, Any] = {}
    for j in jobs:
        client = clients.get(j.client)
        if client is None:
            client = clients[j.client] = platform.connect(j.client)
        key = (j.client, j.device, j.context, j.priority, j.weight)
        if key not in contexts:
            ctx = contexts[key] = client.context(j.device, priority=j.priority,
                                                 name=j.context[:64], weight=j.weight)
            # contexts and fence pools ready, off the clock (``submit_nowait`` fills the pool)
            ctx.submit_nowait("work", ms=0).wait(5)
    timeout_ms = min(600_000.0, 1000.0 + sum(j.duration_ns for j in jobs) / MS)
    t0 = platform.now() + LEAD_NS + LEAD_PER_JOB_NS * len(jobs)
    fences: dict[str, Fence] = {}
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_ns, i))
    for i in order:
        j = jobs[i]
        late = [d for d in j.after if d not in fences]
        if late:  # its fence must exist when it is submitted, at its arrival
            raise errors.InvalidRequest(f"job {j.name!r} waits for {late}, which arrive after it")
        at = t0 + j.arrival_ns
        kw: dict[str, Any] = {"ms": j.duration_ns / MS, "timeout_ms": timeout_ms,
                              "wait": [fences[d] for d in j.after]}
        if j.deadline_ns:
            kw["deadline_ms"] = max(j.deadline_ns - j.arrival_ns, 1) / MS
        if j.handoff_ns:
            kw["handoff_ms"] = j.handoff_ns / MS
        ctx = contexts[(j.client, j.device, j.context, j.priority, j.weight)]
        fences[j.name] = ctx.submit_many([command("work", **kw)], nowait=True, at_ns=at)[0]
    return t0, fences


def _wait(fences: dict[str, Fence], jobs: list[_refsched.Job]) -> dict[str, str]:
    budget = WAIT_MARGIN_S + sum(j.duration_ns for j in jobs) / 1e9
    deadline = time.monotonic() + budget
    failures: dict[str, str] = {}
    for name, f in fences.items():
        try:
            f.wait(max(0.1, deadline - time.monotonic()))
        except errors.HetprocError as exc:  # the product's failure is a result, per job
            failures[name] = f"{type(exc).__name__}: {exc}"[:200]
    return failures


def _modeled_starts(platform: Platform, fences: dict[str, Fence]) -> dict[int, int]:
    """cid -> modeled start, from the devices' EXEC records (a2 = the modeled start)."""
    recs = platform.trace_records()[0]
    ex = recs[(recs["stage"] == int(Stage.EXEC)) & (recs["phase"] == END)]
    wanted = {f.cid for f in fences.values()}
    return {cid: a2 for cid, a2 in zip(ex["cid"].tolist(), ex["a2"].tolist()) if cid in wanted}


def _row(o: _refsched.JobOutcome, f: Fence, starts: dict[int, int], t0: int,
         error: str | None) -> dict[str, Any]:
    j = o.job
    start = end = None
    if error is None:
        end = f.signal_time() - j.handoff_ns - t0
        if f.cid in starts:
            start = starts[f.cid] - t0
    missed = bool(j.deadline_ns) and (end is None or end > j.deadline_ns)
    return {"job": j.name, "device": j.device, "priority": j.priority,
            "arrival_ns": j.arrival_ns, "deadline_ns": j.deadline_ns,
            "ref_start_ns": o.start_ns, "ref_end_ns": o.end_ns, "ref_missed": o.missed,
            "start_ns": start, "end_ns": end, "missed": missed, "error": error,
            "start_err_ns": None if start is None else start - o.start_ns,
            "end_err_ns": None if end is None else end - o.end_ns,
            "same": error is None and start == o.start_ns and end == o.end_ns}


def _summary(platform: Platform, rows: list[dict[str, Any]], ref: Any,
             devices: Mapping[str, _refsched.DevicePolicy]) -> dict[str, Any]:
    def worst(key: str) -> int | None:
        errs = [abs(r[key]) for r in rows if r[key] is not None]
        return max(errs) if errs else None

    metrics = platform.metrics()["devices"]
    return {
        "jobs": len(rows),
        "deadlines": sum(1 for r in rows if r["deadline_ns"]),
        "ref_misses": sum(r["ref_missed"] for r in rows),
        "misses": sum(r["missed"] for r in rows),
        "failed": sum(r["error"] is not None for r in rows),
        "differing": sum(not r["same"] for r in rows),
        "max_start_err_ns": worst("start_err_ns"),
        "max_end_err_ns": worst("end_err_ns"),
        "ref_preemptions": sum(len(o.preempted) for o in ref.jobs),
        "preemptions": sum(int(metrics[d]["preemptions"]) for d in devices),
        "model_lags": sum(int(metrics[d].get("model_lags", 0)) for d in devices),
        "policy": {d: dp.policy for d, dp in devices.items()},
    }

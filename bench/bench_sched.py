"""Modeled time and preemption (seed §7, §10, §11; invariant 8).

* ``modeled_time``: Poisson arrivals of fixed-length commands (2 ms of modeled work) to
  one device at 60 % and 80 % load. Per command: the modeled start (from the device's
  trace, the EXEC slice), the host's own start (HOST_EXEC) and the lag. Rows: the host's
  start minus the modeled start (p50, p99: the host latency the model absorbs), the lag
  count, and the mean modeled queueing wait against the Lindley recursion computed on the
  same arrival times (``W' = max(0, W + S - gap)``, the exact M/D/1 wait of that sequence):
  an exact model gives the ratio 1.000; the host's own wait (host start minus arrival)
  beside it shows what a model anchored at the device's wake-up would have reported.
* ``preemption``: a low-priority stream of long jobs (50 ms) keeps one device busy while
  high-priority 1 ms commands arrive every ~23 ms; for each preemption granularity
  (``chunk_ms``, 0 = no preemption) and a 50 us switch cost: the high-priority modeled
  latency (p50, max) against the no-preemption run, the preemptions and the share of
  device time spent switching.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import hetproc
from ipc import Stage

from ._registry import benchmark, make_row

SERVICE_MS = 2.0
MS = 1_000_000


def _platform(policy: str = "fifo", chunk_ms: float = 0.0, switch_us: float = 0.0,
              device: str = "npu0") -> hetproc.Platform:
    spec = hetproc.load_platform()
    sched = hetproc.SchedSpec(policy=policy, chunk_ms=chunk_ms, switch_us=switch_us)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == device else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices), time_scale=1.0)


def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


def _poisson_run(load: float, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(SERVICE_MS / load, n) * MS
    with _platform() as plat:
        c = plat.client
        npu = c.context("npu0")
        npu.submit("work", ms=0).wait(5)
        t_first = time.monotonic_ns() + 20 * MS
        arrivals = (t_first + np.cumsum(gaps)).astype(np.int64)
        fences = []
        for t in arrivals.tolist():
            _sleep_until(t)
            fences.append(npu.submit_nowait("work", ms=SERVICE_MS, at_ns=t))
        for f in fences:
            f.wait(10)
        recs = plat.trace_records()[0]
        model = plat.metrics()["devices"]["npu0"]["modeled_time"]
    by_cid = {f.cid: i for i, f in enumerate(fences)}
    m0 = np.zeros(n, np.int64)
    host0 = np.zeros(n, np.int64)
    lag = np.zeros(n, np.int64)
    ex = recs[(recs["stage"] == int(Stage.EXEC)) & (recs["phase"] == 2)]
    for cid, a2 in zip(ex["cid"].tolist(), ex["a2"].tolist()):
        if cid in by_cid:
            m0[by_cid[cid]] = a2
    he = recs[recs["stage"] == int(Stage.HOST_EXEC)]
    for cid, a0, a1 in zip(he["cid"].tolist(), he["a0"].tolist(), he["a1"].tolist()):
        if cid in by_cid:
            host0[by_cid[cid]], lag[by_cid[cid]] = a0, a1
    ok = (m0 > 0) & (host0 > 0)
    # The exact M/D/1 waits of this arrival sequence (Lindley).
    s = int(SERVICE_MS * MS)
    lindley = np.zeros(n, np.int64)
    for i in range(1, n):
        lindley[i] = max(0, lindley[i - 1] + s - (arrivals[i] - arrivals[i - 1]))
    return {"start_error_us": (host0 - m0)[ok] / 1e3, "lags": int((lag > 0).sum()),
            "modeled_wait_ms": float(np.mean((m0 - arrivals)[ok]) / 1e6),
            "host_wait_ms": float(np.mean((host0 - arrivals)[ok]) / 1e6),
            "lindley_wait_ms": float(np.mean(lindley[ok]) / 1e6), "commands": int(ok.sum()),
            "supervisor_summary": model}


@benchmark("modeled_time")
def modeled_time(quick: bool) -> dict:
    n = 150 if quick else 600
    rows, runs = [], {}
    for load in (0.6, 0.8):
        r = runs[f"{int(load * 100)}%"] = _poisson_run(load, n, seed=int(load * 100))
        tag = f"{int(load * 100)}% load"
        err = r["start_error_us"]
        rows += [
            make_row(f"{tag}: host start - modeled start, p50", float(np.percentile(err, 50)),
                     target="absorbed unless lagged"),
            make_row(f"{tag}: host start - modeled start, p99", float(np.percentile(err, 99))),
            make_row(f"{tag}: lags (host past the modeled end)", None, value=r["lags"],
                     unit=f"of {r['commands']}"),
            make_row(f"{tag}: modeled wait vs exact M/D/1 (Lindley)", r["modeled_wait_ms"] * 1e3,
                     r["lindley_wait_ms"] * 1e3, target="<= 1.01x",
                     ok=abs(r["modeled_wait_ms"] - r["lindley_wait_ms"])
                     <= 0.01 * max(r["lindley_wait_ms"], 1e-3)),
            make_row(f"{tag}: host-observed wait vs exact M/D/1", r["host_wait_ms"] * 1e3,
                     r["lindley_wait_ms"] * 1e3, target="what the model absorbs"),
        ]
    return {"rows": rows, "runs": {k: {kk: vv for kk, vv in v.items() if kk != "start_error_us"}
                                   for k, v in runs.items()}}


def _preemption_run(chunk_ms: float, switch_us: float, urgent_n: int) -> dict:
    with _platform("priority", chunk_ms=chunk_ms, switch_us=switch_us) as plat:
        c = plat.client
        low, high = c.context("npu0", priority=0), c.context("npu0", priority=5)
        low.submit("work", ms=0).wait(5)
        background = [low.submit_nowait("work", ms=50, timeout_ms=5000) for _ in range(2)]
        t_next = time.monotonic_ns() + 10 * MS
        lat = []
        for i in range(urgent_n):
            _sleep_until(t_next)
            t_next = max(t_next, time.monotonic_ns())  # behind schedule: it arrives now
            f = high.submit_nowait("work", ms=1, at_ns=t_next)
            background = [b for b in background if not b.done()]
            while len(background) < 2:  # the long jobs never stop coming
                background.append(low.submit_nowait("work", ms=50, timeout_ms=5000))
            f.wait(5)
            lat.append((f.signal_time() - t_next) / 1e6)
            t_next += int((23 + (i % 3)) * MS)
        for b in background:
            b.wait(5)
        dev = c.metrics()["devices"]["npu0"]
    busy = max(dev["busy_ms"], 1e-9)
    return {"latency_ms": lat, "preemptions": dev["preemptions"], "switch_ms": dev["switch_ms"],
            "switch_share": dev["switch_ms"] / busy, "lags": dev["model_lags"]}


@benchmark("preemption")
def preemption(quick: bool) -> dict:
    n = 12 if quick else 40
    switch_us = 50.0
    runs = {ch: _preemption_run(ch, switch_us, n) for ch in (0.0, 0.5, 1.0, 2.0, 5.0)}
    base = runs[0.0]
    base_p50 = float(np.median(base["latency_ms"])) * 1e3
    rows = []
    for ch, r in runs.items():
        label = "no preemption" if ch == 0 else f"chunk {ch:g} ms"
        p50 = float(np.median(r["latency_ms"])) * 1e3
        rows.append(make_row(f"{label}: high-priority latency p50", p50, base_p50))
        rows.append(make_row(f"{label}: high-priority latency max", max(r["latency_ms"]) * 1e3,
                             max(base["latency_ms"]) * 1e3))
        rows.append(make_row(f"{label}: preemptions", None, value=r["preemptions"], unit=""))
        rows.append(make_row(f"{label}: device time spent switching", None,
                             value=round(100 * r["switch_share"], 3), unit="%"))
    return {"rows": rows, "switch_us": switch_us,
            "runs": {str(k): {kk: (vv if kk != "latency_ms" else
                                   [round(x, 3) for x in vv]) for kk, vv in v.items()}
                     for k, v in runs.items()}}

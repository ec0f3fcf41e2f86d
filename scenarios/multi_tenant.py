"""Three tenants on one NPU (seed §7, §11): why the mixed scheduling policy exists.

* camera: a frame every 33.3 ms (30 fps), 8 ms of inference, deadline 33 ms (priority 10:
  real-time under ``mixed``);
* voice: an always-on model, a 1.5 ms request every 20 ms (priority 1, period 20 ms);
* a third-party LLM: long jobs of 60 ms, two always in flight (priority 0).

The same arrivals run once per scheduling policy of the NPU (``fifo``, ``priority``,
``edf``, ``fair``, ``mixed``), each on a fresh platform whose NPU preempts at 1 ms chunk
boundaries for a 50 us context switch. Every figure is in modeled time (fence signal
times), so the host's own hiccups do not enter the table; the host's lags are counted
beside it. One row per policy: camera deadline misses, voice p99 latency, LLM jobs per
second, preemptions and the device time spent switching.

With ``fifo`` a camera frame waits behind whatever LLM work came first; with ``fair`` the
LLM's share is as large as the camera's; ``mixed`` (and plain priority with preemption,
for this mix) keeps every camera deadline while the LLM still progresses.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import hetproc
from hetproc._config import SchedSpec

POLICIES = ("fifo", "priority", "edf", "fair", "mixed")
CAMERA_PERIOD_MS, CAMERA_MS, CAMERA_DEADLINE_MS = 1000 / 30, 8.0, 33.0
VOICE_PERIOD_MS, VOICE_MS = 20.0, 1.5
LLM_MS, LLM_IN_FLIGHT = 60.0, 2
CHUNK_MS, SWITCH_US = 1.0, 50.0


def _spec(base, policy: str):
    sched = SchedSpec(policy=policy, chunk_ms=CHUNK_MS, switch_us=SWITCH_US)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in base.devices)
    return dataclasses.replace(base, devices=devices)


def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(min(delay, 0.005))


def run_policy(base, policy: str, seconds: float, scale: float, warmup: float = 0.5) -> dict:
    """One policy: ``warmup`` seconds of the same load first (not counted: a platform
    just started and three clients connecting make the host late, and an arrival the host
    delivers after the work it should have preempted cannot preempt it), then ``seconds``."""
    ms = lambda v: int(v * scale * 1e6)  # noqa: E731
    with hetproc.Platform(spec=_spec(base, policy)) as plat:
        tenants = {name: plat.connect(name) for name in ("camera", "voice", "llm")}
        try:
            cam = tenants["camera"].context("npu0", priority=10, name="camera",
                                            period_ms=CAMERA_DEADLINE_MS)
            voice = tenants["voice"].context("npu0", priority=1, name="voice",
                                             period_ms=VOICE_PERIOD_MS)
            llm = tenants["llm"].context("npu0", priority=0, name="llm")
            for ctx in (cam, voice, llm):
                ctx.submit("work", ms=0).wait(5)
            t_start = time.monotonic_ns() + ms(5)
            t0 = t_start + ms(warmup * 1000)  # counted from here
            t_end = t0 + ms(seconds * 1000)
            next_cam, next_voice = t_start, t_start
            cams, voices, jobs, running = [], [], [], []
            late = []  # how far behind its own schedule the client submitted (host)
            while True:
                now = time.monotonic_ns()
                if now >= next_cam and next_cam < t_end:
                    cams.append((next_cam, cam.submit_nowait("work", ms=CAMERA_MS,
                                                             at_ns=next_cam)))
                    late.append(now - next_cam)
                    next_cam += ms(CAMERA_PERIOD_MS)
                    continue
                if now >= next_voice and next_voice < t_end:
                    voices.append((next_voice, voice.submit_nowait("work", ms=VOICE_MS,
                                                                   at_ns=next_voice)))
                    late.append(now - next_voice)
                    next_voice += ms(VOICE_PERIOD_MS)
                    continue
                running = [f for f in running if not f.done()]
                while len(running) < LLM_IN_FLIGHT and now < t_end:
                    f = llm.submit_nowait("work", ms=LLM_MS, timeout_ms=10_000)
                    running.append(f)
                    jobs.append(f)
                if now >= t_end and next_cam >= t_end and next_voice >= t_end:
                    break
                _sleep_until(min(next_cam, next_voice))
            for _, f in cams + voices:
                f.wait(30)
            for f in jobs:
                f.wait(30)
            dev = plat.metrics()["devices"]["npu0"]
            cam_lat = np.array([(f.signal_time() - t) / 1e6 for t, f in cams if t >= t0]) / scale
            voice_lat = np.array([(f.signal_time() - t) / 1e6 for t, f in voices
                                  if t >= t0]) / scale
            llm_done = sum(1 for f in jobs if t0 <= f.signal_time() <= t_end)
        finally:
            for c in tenants.values():
                c.close()
    busy = max(dev["busy_ms"], 1e-9)
    return {"policy": policy, "camera_frames": len(cam_lat), "cam_lat": cam_lat,
            "client_late_ms_max": max(late) / 1e6 if late else 0.0,
            "camera_misses": int((cam_lat > CAMERA_DEADLINE_MS).sum()),
            "camera_p99_ms": float(np.percentile(cam_lat, 99)),
            "voice_p99_ms": float(np.percentile(voice_lat, 99)),
            "llm_jobs_per_s": llm_done / seconds,
            "preemptions": dev["preemptions"], "switch_ms": dev["switch_ms"],
            "switch_share_pct": 100 * dev["switch_ms"] / busy, "host_lags": dev["model_lags"]}


def run(s) -> None:
    seconds = s.option("seconds", 2.0)
    base = s.platform.spec
    rows = [run_policy(base, p, seconds, s.time_scale) for p in POLICIES]
    for r in rows:
        r.pop("cam_lat")
    header = (f"{'policy':9} {'cam miss':>8} {'cam p99':>8} {'voice p99':>9} {'LLM/s':>6} "
              f"{'preempt':>7} {'switch':>7} {'lags':>5} {'late':>6}")
    s.note("table (modeled ms; switch = % of device busy time):\n    " + header + "\n" +
           "\n".join(f"    {r['policy']:9} {r['camera_misses']:>4}/{r['camera_frames']:<3} "
                     f"{r['camera_p99_ms']:>8.1f} {r['voice_p99_ms']:>9.1f} "
                     f"{r['llm_jobs_per_s']:>6.1f} {r['preemptions']:>7} "
                     f"{r['switch_share_pct']:>6.2f}% {r['host_lags']:>5} "
                     f"{r['client_late_ms_max']:>6.1f}" for r in rows))
    s.note("lags: commands whose host finished past their modeled end; late: the most the "
           "client itself submitted behind schedule (ms, host): a busy host shows there")
    by = {r["policy"]: r for r in rows}
    for r in rows:
        for k in ("camera_misses", "camera_p99_ms", "voice_p99_ms", "llm_jobs_per_s",
                  "preemptions", "switch_share_pct"):
            s.metric(f"{r['policy']}_{k}", r[k])
    s.check("mixed: the camera misses no deadline", by["mixed"]["camera_misses"] == 0,
            f"{by['mixed']['camera_misses']} of {by['mixed']['camera_frames']} missed")
    s.check("mixed: the LLM still makes progress", by["mixed"]["llm_jobs_per_s"] > 0)
    s.check("mixed: voice keeps its period (p99 latency under 20 ms)",
            by["mixed"]["voice_p99_ms"] < VOICE_PERIOD_MS)
    s.check("fifo: camera frames wait behind LLM jobs and miss deadlines (why mixed exists)",
            by["fifo"]["camera_misses"] > by["mixed"]["camera_misses"],
            f"fifo {by['fifo']['camera_misses']} vs mixed {by['mixed']['camera_misses']}")
    s.check("preemption happened only where a policy asks for it",
            by["fifo"]["preemptions"] == 0 and by["fair"]["preemptions"] == 0
            and by["mixed"]["preemptions"] > 0)

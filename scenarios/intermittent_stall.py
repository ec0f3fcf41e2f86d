"""Intermittent stall (seed §22): rare slow frames in a camera loop, each attributed to the
stage that really stalled, from the evidence chain alone.

The seed's case: a camera model averages 12 ms, yet one frame in ten thousand takes 80 ms.
With only API start and end times nobody can say whether the framework, runtime, driver or
firmware is at fault. Here every frame is::

    ISP produces the frame (copy, ISP_MS) ──acquire fence──▶ NPU model (relu, NPU_MS)
        ──fence──▶ the client wakes and consumes the frame (a CALLBACK slice)

and a few frames, picked at random (seeded), get a stall of STALL_MS in one stage:

    acquire   the ISP is late with its frame: the upstream producer, not the NPU
    queue     another app (a second client) put a long job on the NPU just before
    execute   the NPU itself runs long
    callback  the client is late: it sleeps before waiting for its frame

``hetproc.trace.explain`` reads the trace (the same JSON ``--trace FILE`` writes) and must name
``acquire``, ``queued``, ``execute`` and ``wake-up`` respectively as each stalled frame's
dominant stage, and every stalled frame must stand out from the normal ones (a frame the
machine itself stalled is explained and reported in a note). One more frame fails:
its acquire fence is signalled with an error (the ISP reports a broken frame), the NPU
command fails, and the supervisor freezes the trace around it; that window must hold the
failed request's stages from the client, the supervisor and the device.

Options (``--set K=V``): frames (150), stalls (8, a multiple of 4), seed (22).
Stalls are scaled with ``--time-scale`` but never below 25 ms: attribution needs a stall
above the OS's own scheduling noise (a few ms on a loaded 2-core machine).
"""

from __future__ import annotations

import time

import numpy as np

import hetproc
from hetproc.drills import Option, Scenario
from hetproc.trace import explain, format_request, frozen_to_chrome, load_trace, slowest
from ipc import Stage

OPTIONS = {
    "frames": Option(150, "camera frames (at least 10 warm-up + stalls + 2)", min=16, max=100_000),
    "stalls": Option(8, "injected stalls, a multiple of 4 (one of each kind per 4)", min=4,
                     max=400),
    "seed": Option(22, "where the stalls fall and of which kind", min=0),
}
QUICK = {"frames": 60, "stalls": 4}
# What it proves is where the host's time went: a stall the evidence chain attributes by
# the trace's host stamps. On the virtual clock a stall takes no host time to find.
NEEDS_REAL_CLOCK = ("its stalls are real host time that the evidence chain attributes "
                    "by host stamps (seed §22); modeled time has no host stall to find")

ISP_MS, NPU_MS, STALL_MS = 2.0, 6.0, 60.0
MIN_STALL_MS = 25.0
SHAPE = (1, 32, 32, 3)
KINDS = ("acquire", "queue", "execute", "callback")
EXPECTED = {"acquire": "acquire", "queue": "queued", "execute": "execute", "callback": "wake-up"}


def run(s: Scenario) -> None:
    frames = s.option("frames")
    n_stalls = s.option("stalls")
    rng = np.random.default_rng(s.option("seed"))
    scale = s.time_scale
    stall_ms = max(STALL_MS * scale, MIN_STALL_MS)  # real ms
    stall_param = stall_ms / scale  # what to ask for, since the platform scales "ms"
    warmup = 10
    if frames < warmup + n_stalls + 2 or n_stalls % len(KINDS):
        raise hetproc.InvalidRequest(f"need frames >= {warmup + n_stalls + 2} and stalls a "
                                    f"multiple of {len(KINDS)}, got {frames} and {n_stalls}")
    picked = rng.choice(np.arange(warmup, frames), n_stalls + 1, replace=False)
    kinds = list(rng.permutation(np.repeat(KINDS, n_stalls // len(KINDS))))
    plan = {int(f): str(k) for f, k in zip(picked[:-1], kinds)}
    error_frame = int(picked[-1])

    c = s.client
    isp = c.context("isp0", name="camera ISP")
    npu = c.context("npu0", name="camera model")
    other = s.platform.connect("third-party app")
    other_npu = other.context("npu0", name="third-party long job")
    raw, frame_buf, feat = (c.alloc(SHAPE, "float32") for _ in range(3))

    npu_cid: dict[int, int] = {}
    latency: dict[int, float] = {}
    wrong = 0
    error_seen = None
    for i in range(frames):
        kind = plan.get(i)
        data = rng.standard_normal(SHAPE, dtype=np.float32)
        raw.array()[...] = data
        if kind == "queue":
            # Another app's long job reaches the NPU first (submit waits for the verdict,
            # so it is queued before the camera's command).
            other_npu.submit("work", ms=stall_param).release()
        t0 = time.monotonic_ns()
        if i == error_frame:
            acquire = c.fence()  # this frame's ISP output arrives broken
        else:
            acquire = isp.submit_nowait("copy", [raw], [frame_buf],
                                        ms=ISP_MS + (stall_param if kind == "acquire" else 0.0))
        done = npu.submit_nowait("relu", [frame_buf], [feat], wait=[acquire],
                                 ms=NPU_MS + (stall_param if kind == "execute" else 0.0))
        npu_cid[i] = done.cid
        if i == error_frame:
            time.sleep(stall_ms / 1000.0)  # the ISP gives up on the frame late, then fails it
            acquire.signal(hetproc.DeviceFault)
        acquire.release()
        if kind == "callback":
            time.sleep(stall_ms / 1000.0)  # the client's callback thread is late
        try:
            done.wait(10.0 + 0.01 * stall_ms)
        except hetproc.DependencyFailed as exc:
            error_seen = exc
        else:
            with c.trace.span("CALLBACK", done.cid):  # consume the frame
                if not np.array_equal(feat.array(), np.maximum(data, 0)):
                    wrong += 1
        latency[i] = (time.monotonic_ns() - t0) / 1e6
        done.release()

    # -- the evidence -------------------------------------------------------------------
    trace = load_trace(s.trace())
    results = []
    for f in sorted(plan):
        req = explain(trace, npu_cid[f])
        dom = req.dominant if req is not None else None
        results.append({"frame": f, "kind": plan[f], "cid": npu_cid[f],
                        "total_ms": round(req.total, 3) if req else None,
                        "dominant": dom.name if dom else None,
                        "dominant_ms": round(dom.dur, 3) if dom else None})
    s.metric("stalls", results)
    for kind in KINDS:
        mine = [r for r in results if r["kind"] == kind]
        right = [r for r in mine if r["dominant"] == EXPECTED[kind]]
        s.check(f"every '{kind}' stall is attributed to '{EXPECTED[kind]}'",
                len(right) == len(mine) > 0,
                f"{len(right)}/{len(mine)}: " + ", ".join(
                    f"frame {r['frame']} -> {r['dominant']} ({r['dominant_ms']} ms)" for r in mine))
    normal = [npu_cid[i] for i in range(warmup, frames) if i not in plan and i != error_frame]
    normal_ms = sorted(r.total for r in slowest(trace, len(normal), among=normal))
    p95 = normal_ms[int(0.95 * (len(normal_ms) - 1))] if normal_ms else 0.0
    quickest_stall = min(r["total_ms"] or 0.0 for r in results)
    s.check("every stalled frame stands out (slower than 95 % of the normal frames)",
            quickest_stall > p95,
            f"quickest stall {quickest_stall:.3f} ms, normal p95 {p95:.3f} ms")
    # The machine stalls too (other processes, page faults): a normal frame as slow as an
    # injected stall is explained the same way, and reported rather than hidden.
    for r in slowest(trace, 3, among=normal):
        if r.total >= quickest_stall:
            dom = r.dominant
            s.note(f"frame request {r.cid:#x} was slow without an injected stall: "
                   f"{r.total:.3f} ms, "
                   f"dominant {dom.name if dom else '?'}")
    for kind in KINDS:  # one worked example per kind, for the reader of the report
        example = next(r for r in results if r["kind"] == kind)
        s.note(f"'{kind}' stall, frame {example['frame']}:\n"
               + format_request(trace, explain(trace, example["cid"])))

    lat = np.array([latency[i] for i in range(warmup, frames)
                    if i not in plan and i != error_frame])
    s.metric("frames", frames)
    s.metric("stall_ms", stall_ms)
    s.metric("normal_latency_p50_ms", float(np.median(lat)))
    s.metric("normal_latency_p99_ms", float(np.percentile(lat, 99)))
    s.metric("stalled_latency_min_ms", min(latency[f] for f in plan))
    s.check("every consumed frame's output is correct", wrong == 0, f"{wrong} wrong")

    # -- the frozen window around the failed frame -----------------------------------------
    bad = npu_cid[error_frame]
    s.check("the broken frame fails its NPU request with DependencyFailed",
            error_seen is not None and error_seen.correlation_id in (0, bad),
            repr(error_seen))
    windows = [w for w in s.frozen() if bad in w["cids"]]
    s.metric("frozen_windows", len(s.frozen()))
    ok = bool(windows)
    detail = "no window holds the failed request"
    if windows:
        w = windows[0]
        mine = w["records"][w["records"]["cid"] == bad]
        stages = {int(x) for x in mine["stage"]}
        pids = {int(x) for x in mine["pid"]}
        want = {int(Stage.SUBMIT), int(Stage.QUEUED), int(Stage.ACQUIRE_WAIT), int(Stage.SIGNAL)}
        froze = load_trace(frozen_to_chrome(w))
        req = explain(froze, bad)
        dom = req.dominant.name if req and req.dominant else None
        ok = want <= stages and len(pids) >= 3 and dom == "acquire"
        detail = (f"window {w['id']} ({w['reason']}): {len(w['records'])} records, "
                  f"{len(mine)} of the request from {len(pids)} processes; explained: {dom}")
    s.check("a window frozen around the failure holds the request from client, supervisor "
            "and device, and explains it", ok, detail)
    other.close()

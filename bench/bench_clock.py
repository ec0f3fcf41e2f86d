"""How fast modeled time goes by the host's clock, per run (``clock``).

For a few built-in scenarios and a drill, each run as ``hetproc run``/``drill`` runs it
(a fresh platform, its report), and a workload dated ahead (the trace digest's test
workload, grown: two contexts competing on npu0, a GPU step after each NPU command),
the rows say:

* ``modeled / wall``: the report's ``modeled_s`` over its ``wall_s`` (the modeled time the
  run's commands span, in the model's seconds, over the host seconds the scenario ran):
  above 1, faster than real time. With the real clock this is the time scale's inverse at
  best, less whatever the scenario spends between its commands;
* ``wall per command``: ``wall_s`` over the commands the run's trace digest covers, and
  ``host CPU per command``: the CPU seconds of the platform's processes (supervisor,
  devices, clients: the report's ``cpu_s``, whole run) over the same count; each against
  the raw semaphore round trip measured in the same run (``sem_pingpong``): how many
  fence round trips' worth of host time one command costs, waits for modeled time
  included in the first, not in the second.

The ``--json`` output keeps each run's report fields (clock, modeled_s, wall_s,
trace_digest, lags). No target for these: they are the figures a virtual clock is to
improve. One row has one: the dated workload run again (3 runs, 10 in a full run) gives
one trace digest, whatever the host's load.

Then the same runs on both clocks (``_clockpair``): modeled / wall on each, the virtual
run's wall against the real one's, the host cost of one jump of the virtual clock, and
the CPU per command of each process kind. In a full run (not ``--quick``: about 40 s
more), the quick acceptance matrix on both clocks (``clock_matrix``): the virtual run's
wall against the real one's (target 0.2: five times faster), and how much of it is
platform start and stop. And what one platform start and stop costs through the
platform starter against a fresh interpreter, alternated in the same run
(``start_stop``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import hetproc
from hetproc.drills import Scenario, run_drill, run_on_platform, run_scenario

from ._baselines import raw_result
from ._clockpair import pair_rows
from ._registry import benchmark, make_row
from ._stats import summarize
from .clock_matrix import compare, matrix_rows
from .start_stop import rows as start_stop_rows

MS = 1_000_000
# (scenario, quick options, full options), at time scale 1 unless the scenario needs less
# (multi_tenant is not here: it runs each policy on platforms of its own, which its report
# does not cover)
SCENARIOS = (("video_pipeline", {"frames": 40}, {"frames": 300}),
             ("intermittent_stall", {"frames": 60, "stalls": 4}, {"frames": 300, "stalls": 8}),
             ("camera_lifecycle", {"frames": 20}, {"frames": 60}))
DRILL = "hang"
REPEATS = (3, 10)  # runs of the dated workload (quick, full): one digest is the target


def _dated(frames: int) -> Any:
    """``frames`` groups of the digest test's workload, every command dated ahead."""
    def run(s: Scenario) -> None:
        c = s.client
        low, high = c.context("npu0", priority=1, name="low"), c.context("npu0", name="high")
        gpu = c.context("gpu0")
        t0 = time.monotonic_ns() + 50 * MS + frames * MS  # every submit is in by then
        fences = []
        for k in range(frames):
            t = t0 + k * 8 * MS
            npu = [low.submit_nowait("work", ms=3, at_ns=t),
                   high.submit_nowait("work", ms=1, priority=9, at_ns=t + MS + 300_000)]
            fences += npu + [gpu.submit_nowait("work", ms=1.5, wait=[f], at_ns=t) for f in npu]
        for f in fences:
            f.wait(10)
        s.check("every command ran", all(f.done() for f in fences))
    return run


def _dated_report(frames: int) -> dict[str, Any]:
    spec = hetproc.load_platform()
    sched = hetproc.SchedSpec(policy="priority", chunk_ms=1.0)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    spec = dataclasses.replace(spec, devices=devices, time_scale=1.0)
    return run_on_platform(_dated(frames), "dated_ahead", "", spec, {})


def _cpu_s(r: dict[str, Any]) -> float | None:
    """CPU seconds the platform's processes (supervisor, devices, clients) used."""
    cpu = ((r.get("metrics") or {}).get("platform_metrics") or {}).get("cpu_s") or {}
    used = [v for v in cpu.values() if isinstance(v, (int, float))]
    return sum(used) if used else None


def _rows(label: str, r: dict[str, Any], rtt_us: float) -> list[dict]:
    modeled, wall, n = r.get("modeled_s"), r.get("wall_s"), r.get("trace_commands") or 0
    speed = modeled / wall if modeled is not None and wall else None
    cpu = _cpu_s(r)
    return [make_row(f"{label}: modeled / wall ({modeled or 0:.3f} s in {wall or 0:.3f} s)",
                     None, value=None if speed is None else round(speed, 3),
                     unit="x real time", ok=r["ok"]),
            make_row(f"{label}: wall per command ({n} commands) / sem rtt",
                     wall * 1e6 / n if wall and n else None, rtt_us,
                     digest=(r.get("trace_digest") or "")[:12]),
            make_row(f"{label}: host CPU per command (all its processes) / sem rtt",
                     cpu * 1e6 / n if cpu is not None and n else None, rtt_us)]


def _fields(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("ok", "clock", "modeled_s", "wall_s", "trace_digest", "trace_commands", "lags",
            "determinism_breaks", "duration_s")
    return {k: r.get(k) for k in keys}


@benchmark("clock")
def clock(quick: bool) -> dict:
    rtt_us = summarize(raw_result("sem_pingpong", quick)["rtt_ns"])["p50_us"]
    runs: dict[str, dict[str, Any]] = {}
    for name, q, full in SCENARIOS:
        runs[name] = run_scenario(name, options=q if quick else full)
    runs[f"drill {DRILL}"] = run_drill(DRILL)
    runs["dated ahead"] = _dated_report(10 if quick else 60)
    rows = [row for label, r in runs.items() for row in _rows(label, r, rtt_us)]
    again = [runs["dated ahead"]] + [_dated_report(10 if quick else 60)
                                     for _ in range(REPEATS[0 if quick else 1] - 1)]
    digests = sorted({r["trace_digest"] for r in again}, key=str)
    rows.append(make_row(f"dated ahead: distinct trace digests over {len(again)} runs", None,
                         value=len(digests), unit="digests", target="1", ok=len(digests) == 1))
    pairs, pair_runs = pair_rows(quick, rtt_us)
    starts, start_stop = start_stop_rows(quick)  # what a platform start costs, each way
    pairs += starts
    matrix = None if quick else compare(quick=True)
    if matrix is not None:
        pairs += matrix_rows(matrix)
    return {"rows": rows + pairs, "runs": {k: _fields(r) for k, r in runs.items()},
            "pairs": pair_runs, "matrix": matrix, "start_stop": start_stop,
            "dated_digests": [r["trace_digest"] for r in again],
            "dated_lags": [r["lags"] for r in again]}

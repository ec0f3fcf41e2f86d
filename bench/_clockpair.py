"""The same runs on both clocks (``clock``'s pair rows): how much faster the virtual clock is.

Each scenario (and a drill) runs once on the real clock, the baseline, then once on the
virtual clock, in the same bench run, with the same options. Per run the rows say:

* ``modeled / wall`` on each clock: the report's ``modeled_s`` over its ``wall_s``
  (multi_tenant runs each policy on platforms of its own, which its report does not
  cover: its rows have wall times only);
* ``virtual wall / real wall``: below 1, the virtual clock ran the same work faster
  (the issue's target for the acceptance matrix: 0.2, five times faster);
* ``host cost per jump``: the virtual run's wall seconds, and the CPU seconds of its
  platform's processes, over the clock's jumps (every event the clock moved to), against
  the raw semaphore round trip: how many fence round trips one modeled event costs;
* ``loop turns per jump``: how many times the supervisor's loop looked whether the
  platform waits, per jump (1 is the least: each turn costs a wake-up and a look);
* ``virtual host CPU / real host CPU``: the CPU the same work cost its platform's
  processes and its client on each clock. Near or below 1, the virtual clock's own
  bookkeeping costs little: what bounds its speed is the CPU every command costs on
  either clock (hidden in modeled sleeps on the real one);
* ``CPU per command`` of each run's supervisor, devices and clients
  (``clock_matrix.component_rows``): where that host time goes, on both clocks.
"""

from __future__ import annotations

import time
from typing import Any

from hetproc.drills import run_drill, run_scenario

from ._registry import make_row
from .clock_matrix import component_rows, cpu_by_kind

# (label, scenario or None for a drill, quick options, full options)
PAIRS = (("video_pipeline", "video_pipeline", {"frames": 40}, {"frames": 1000}),
         ("multi_tenant", "multi_tenant", {"seconds": 0.5}, {"seconds": 2.0}),
         ("camera_lifecycle", "camera_lifecycle", {"frames": 20}, {"frames": 60}),
         ("drill hang", None, {}, {}))


def _run(scenario: str | None, label: str, options: dict[str, Any], clock: str) -> dict:
    """One run's report, with the CPU this process (its client) spent on it: the
    report's entry for the client is the whole bench process's so far."""
    cpu0 = time.process_time()
    if scenario is None:
        r = run_drill(label.split()[-1], clock=clock)
    else:
        r = run_scenario(scenario, options=options, clock=clock)
    r["bench_client_cpu_s"] = time.process_time() - cpu0
    return r


def _platform(r: dict[str, Any]) -> dict[str, Any]:
    return (r.get("metrics") or {}).get("platform_metrics") or {}


def _cpu_s(r: dict[str, Any]) -> float | None:
    """CPU seconds of the run's platform processes and its client. The report's entry
    for this process is its whole life (every run of the bench before this one): the
    run's own share (``bench_client_cpu_s``) replaces it."""
    kinds = cpu_by_kind(r)
    if r.get("bench_client_cpu_s") is not None:
        kinds["clients"] = r["bench_client_cpu_s"]
    return sum(kinds.values()) or None


def _speed(r: dict[str, Any]) -> float | None:
    modeled, wall = r.get("modeled_s"), r.get("wall_s")
    return round(modeled / wall, 3) if modeled and wall else None


def _rows(label: str, real: dict[str, Any], virt: dict[str, Any], rtt_us: float) -> list[dict]:
    jumps = (_platform(virt).get("clock") or {}).get("jumps") or 0
    wall_r, wall_v, cpu, cpu_r = real.get("wall_s"), virt.get("wall_s"), _cpu_s(virt), _cpu_s(real)
    rows = [make_row(f"{label}: modeled / wall, {clock} clock ({r.get('modeled_s') or 0:.3f} s "
                     f"in {r.get('wall_s') or 0:.3f} s)", None, value=_speed(r),
                     unit="x real time", ok=r["ok"])
            for clock, r in (("real", real), ("virtual", virt))]
    rows.append(make_row(f"{label}: virtual wall / real wall (same work)",
                         wall_v * 1e6 if wall_v else None, wall_r * 1e6 if wall_r else None,
                         ok=real["ok"] and virt["ok"],
                         digest=(virt.get("trace_digest") or "")[:12]))
    rows.append(make_row(f"{label}: virtual host CPU / real host CPU (same work, all its "
                         "processes)", cpu * 1e6 if cpu else None,
                         cpu_r * 1e6 if cpu_r else None))
    rows.append(make_row(f"{label}: virtual wall per jump ({jumps} jumps) / sem rtt",
                         wall_v * 1e6 / jumps if wall_v and jumps else None, rtt_us))
    rows.append(make_row(f"{label}: virtual host CPU per jump (all its processes) / sem rtt",
                         cpu * 1e6 / jumps if cpu is not None and jumps else None, rtt_us))
    turns = (_platform(virt).get("clock") or {}).get("loop_turns") or 0
    rows.append(make_row(f"{label}: supervisor loop turns per jump", None,
                         value=round(turns / jumps, 3) if jumps else None, unit="turns"))
    moves = (_platform(virt).get("clock") or {}).get("jumps_by_devices") or 0
    rows.append(make_row(f"{label}: instants a device moved to on a lease, per jump", None,
                         value=round(moves / jumps, 3) if jumps else None, unit="moves"))
    return (rows + component_rows(f"{label}, virtual", virt, rtt_us)
            + component_rows(f"{label}, real", real, rtt_us))


def pair_rows(quick: bool, rtt_us: float) -> tuple[list[dict], dict[str, Any]]:
    """Every pair's rows, and each run's time fields (``--json``)."""
    rows: list[dict] = []
    runs: dict[str, Any] = {}
    for label, scenario, q, full in PAIRS:
        options = q if quick else full
        real = _run(scenario, label, options, "real")
        virt = _run(scenario, label, options, "virtual")
        rows += _rows(label, real, virt, rtt_us)
        runs[label] = {clock: {k: r.get(k) for k in ("ok", "modeled_s", "wall_s",
                                                     "trace_digest", "determinism_breaks")}
                       for clock, r in (("real", real), ("virtual", virt))}
        runs[label]["jumps"] = (_platform(virt).get("clock") or {}).get("jumps")
    return rows, runs

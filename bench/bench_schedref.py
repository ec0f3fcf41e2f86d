"""The product's schedules against the reference simulator (``hetproc.simulate_schedule``).

``sched_reference``: the task sets of the scheduler's rework, each run on a real platform
(npu0 alone, chunk 1 ms, no switch cost, time scale 1) by ``hetproc.drills``'s
``compare``, which submits every job ahead, dated with its arrival, and reads back its
modeled start and end. Per case: the deadlines the product misses beside the
simulator's, the largest start and end errors against the simulator, the jobs whose
start or end differ, the preemptions asked for and the host lags. The target is the
simulator's schedule exactly (0 differing jobs): these rows say how far the product is
from it.

* ``nested priority``: low 20 ms at 0, mid 10 ms at 2 ms, high 2 ms at 4 ms (``priority``):
  the reference ends high at 6 ms, mid at 14, low at 32.
* ``edf U=0.9``: periodic, implicit deadlines, periods 10/25/50 ms, work 4/5/15 ms (every
  event on the chunk grid), 2 s = 320 deadlines (quick: 0.5 s, 80): the reference misses
  none.
* ``rm fixed priorities``: the same set with rate-monotonic priorities under ``priority``
  (response-time analysis: 4, 9, 45 ms, all within their periods): no miss.
* ``fifo``: the same set under ``fifo`` for 1 s (quick: 0.5 s): arrival order, no
  preemption; the reference misses some, and the product must miss the same ones.
* ``timeslice 2 ms``: three 10 ms commands of one priority from three contexts at 0,
  beside the periodic set with every task at that priority, for 0.5 s (quick: 0.25 s),
  under ``priority`` with a 2 ms timeslice: every context takes turns, round robin, and a
  task's next job waits for its previous one (one context); the reference misses some.

Every case runs on both clocks: the rows marked "(virtual clock)" are the same sets on
``clock="virtual"``, where the target is the same and no host lag can occur.
"""

from __future__ import annotations

import dataclasses

import hetproc
from hetproc.drills._schedcheck import compare

from ._registry import benchmark, make_row

MS = 1_000_000
NESTED = [dict(name="low", priority=0, arrival_ms=0, duration_ms=20),
          dict(name="mid", priority=5, arrival_ms=2, duration_ms=10),
          dict(name="high", priority=9, arrival_ms=4, duration_ms=2)]
PERIODS = ((10, 4), (25, 5), (50, 15))  # U = 0.4 + 0.2 + 0.3 = 0.9


def _tasks(priorities: bool) -> list[dict]:
    n = len(PERIODS)
    return [dict(name=f"T{p}", period_ms=p, duration_ms=c, context=f"T{p}",
                 priority=(n - i if priorities else 0))
            for i, (p, c) in enumerate(PERIODS)]


THREE = [dict(name=n, context=n, priority=0, arrival_ms=0, duration_ms=10) for n in "ABC"]


def _platform(policy: str, timeslice_ms: float = 0.0, clock: str = "real") -> hetproc.Platform:
    spec = hetproc.load_platform()
    sched = hetproc.SchedSpec(policy=policy, chunk_ms=1.0, switch_us=0.0,
                              timeslice_ms=timeslice_ms)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d.name == "npu0" else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices), time_scale=1.0,
                            clock=clock)


def _case(policy: str, jobs=(), tasks=(), horizon_ms: int = 0,
          timeslice_ms: float = 0.0, clock: str = "real") -> dict:
    with _platform(policy, timeslice_ms, clock) as plat:
        result = compare(plat, jobs, policy, tasks=tasks, horizon_ns=horizon_ms * MS)
    return {"summary": result.summary, "differing": result.differing()[:12]}


def _rows(label: str, s: dict) -> list[dict]:
    def us(ns: int | None) -> float | None:
        return None if ns is None else ns / 1e3

    return [
        make_row(f"{label}: deadlines missed (reference: {s['ref_misses']})", None,
                 value=s["misses"], unit=f"of {s['deadlines']}",
                 target=f"== {s['ref_misses']}", ok=s["misses"] == s["ref_misses"]),
        make_row(f"{label}: max |start - reference start|", us(s["max_start_err_ns"]),
                 target="0", ok=s["max_start_err_ns"] == 0),
        make_row(f"{label}: max |end - reference end|", us(s["max_end_err_ns"]),
                 target="0", ok=s["max_end_err_ns"] == 0),
        make_row(f"{label}: jobs differing from the reference", None, value=s["differing"],
                 unit=f"of {s['jobs']}", target="0", ok=s["differing"] == 0),
        make_row(f"{label}: preemptions asked (reference: {s['ref_preemptions']}), host lags",
                 None, value=s["preemptions"], unit=f"lags {s['model_lags']}"),
    ]


@benchmark("sched_reference")
def sched_reference(quick: bool) -> dict:
    periodic_ms = 500 if quick else 2000
    cases = {}
    for clock, tag in (("real", ""), ("virtual", " (virtual clock)")):
        cases.update({
            "nested priority" + tag: _case("priority", jobs=NESTED, clock=clock),
            "edf U=0.9" + tag: _case("edf", tasks=_tasks(False), horizon_ms=periodic_ms,
                                     clock=clock),
            "rm fixed priorities" + tag: _case("priority", tasks=_tasks(True),
                                               horizon_ms=periodic_ms, clock=clock),
            "fifo" + tag: _case("fifo", tasks=_tasks(False),
                                horizon_ms=500 if quick else 1000, clock=clock),
            "timeslice 2 ms" + tag: _case("priority", jobs=THREE, tasks=_tasks(False),
                                          horizon_ms=250 if quick else 500,
                                          timeslice_ms=2.0, clock=clock),
        })
    rows = [row for label, c in cases.items() for row in _rows(label, c["summary"])]
    return {"rows": rows, "cases": cases}

"""``hetproc acceptance``: the matrix of seed §21 -- every scenario and drill, with
pass/fail, the error seen, leaks, and recovery time. Success on the happy path alone
proves nothing; this is the table a release is judged by.

The scenarios are the scripts the ``scenarios`` package holds (discovered; ``--quick``
runs each with its own ``QUICK`` options). With ``jobs > 1`` the cells run in separate
processes, each starting its own platform, and ``on_row`` hears of each as it ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from typing import Any, Callable

from ._drills import DRILLS, run_drill
from ._scenario import load_scenario, quick_options, run_scenario, scenario_names

OnRow = Callable[[list[dict[str, Any]], list[str]], None]


def cells(quick: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, name, options) of every cell, scenarios first."""
    out = []
    for name in scenario_names():
        options = quick_options(load_scenario(name)) if quick else {}
        out.append(("scenario", name, options))
    out += [("drill", name, {}) for name in DRILLS]
    return out


def run_cell(kind: str, name: str, options: dict[str, Any], platform_file: str | None,
             time_scale: float | None) -> dict[str, Any]:
    """One cell, on its own platform: its row of the matrix."""
    if kind == "scenario":
        report = run_scenario(name, platform_file=platform_file, time_scale=time_scale,
                              options=options)
    else:
        report = run_drill(name, platform_file=platform_file, time_scale=time_scale)
    return _row(kind, name, report)


def run_matrix(*, platform_file: str | None = None, time_scale: float | None = None,
               quick: bool = False, jobs: int = 1, on_row: OnRow | None = None) -> dict[str, Any]:
    todo = cells(quick)
    order = {(k, n): i for i, (k, n, _) in enumerate(todo)}
    rows: list[dict[str, Any]] = []

    def done(row: dict[str, Any]) -> None:
        rows.append(row)
        rows.sort(key=lambda r: order[(r["kind"], r["name"])])
        if on_row is not None:
            finished = {(r["kind"], r["name"]) for r in rows}
            on_row(list(rows), [n for k, n, _ in todo if (k, n) not in finished])

    if jobs <= 1:
        for kind, name, options in todo:
            done(run_cell(kind, name, options, platform_file, time_scale))
    else:
        # Fresh interpreters, not forks: a fork of a process with threads (the CLI's
        # progress display) may inherit a held lock.
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_cell, k, n, o, platform_file, time_scale)
                       for k, n, o in todo]
            for fut in cf.as_completed(futures):
                done(fut.result())
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


def _row(kind: str, name: str, report: dict[str, Any]) -> dict[str, Any]:
    failed = [c for c in report["checks"] if not c["passed"]]
    left = report["left_behind"]
    return {"kind": kind, "name": name, "ok": report["ok"],
            "failed_checks": [c["name"] for c in failed],
            "failed_details": {c["name"]: c["detail"] for c in failed},
            "checks": len(report["checks"]),
            "error": report.get("error"),
            "leaks": len(left["objects"]) + len(left["processes"]),
            "recovery_ms": report["metrics"].get("recovery_ms"),
            "duration_s": report["duration_s"]}

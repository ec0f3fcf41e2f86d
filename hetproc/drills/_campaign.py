"""``hetproc campaign DRILL --seeds N``: one drill under many seeds, failures grouped with
the seeds that reproduce them.

Every run is ``hetproc drill DRILL --seed S --json`` in a subprocess of its own: locally
(``jobs`` at once) or as a task on a Dask cluster (``scheduler``; the optional
``hetproc[dask]`` extra). A Dask worker is a daemonic process and may not fork children of
its own through multiprocessing, so the task starts the platform one process further
away, and returns the run's compact result. The summary is the same JSON whichever
backend ran the seeds (runs sorted by seed).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ipc import errors

from ..client import same_code_env
from . import _timefields
from ._drills import DRILLS

RUN_TIMEOUT_S = 300.0  # one drill run, platform start and stop included
CONNECT_TIMEOUT_S = 5.0  # a scheduler that does not answer by then is not there


def campaign_task(drill: str, seed: int, platform_file: str | None = None,
                  time_scale: float | None = None, clock: str | None = None) -> dict[str, Any]:
    """One seeded run in a subprocess; its compact result. Runs on any backend."""
    cmd = [sys.executable, "-m", "hetproc", "drill", drill, "--seed", str(seed), "--json"]
    if platform_file:
        cmd += ["--platform", platform_file]
    if time_scale is not None:
        cmd += ["--time-scale", repr(time_scale)]
    if clock is not None:
        cmd += ["--clock", clock]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=same_code_env()) as proc:
        with _lock:
            _running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()  # it stops its platform, as on any SIGTERM
            proc.communicate(timeout=30)
            return {"seed": seed, "ok": False,
                    "failed_checks": [f"ran past {RUN_TIMEOUT_S:.0f} s"],
                    "error": "timeout", "leaks": 0, "duration_s": time.monotonic() - t0}
        finally:
            with _lock:
                _running.discard(proc)
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    try:
        report = json.loads(out.stdout)
    except ValueError:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"seed": seed, "ok": False, "failed_checks": [f"exit {out.returncode}: {last}"],
                "error": last, "leaks": 0, "duration_s": time.monotonic() - t0}
    left = report["left_behind"]
    return {"seed": seed, "ok": report["ok"],
            "failed_checks": [c["name"] for c in report["checks"] if not c["passed"]],
            "details": {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]},
            "error": report.get("error"), "leaks": len(left["objects"]) + len(left["processes"]),
            "duration_s": report["duration_s"], **_timefields.of_report(report)}


_lock = threading.Lock()
_running: set[subprocess.Popen] = set()  # the local runs in progress (this process's children)


def _stop_running() -> None:
    """SIGTERM to every run in progress: each stops its platform and exits."""
    with _lock:
        procs = list(_running)
    for proc in procs:
        proc.terminate()


def run_campaign(drill: str, *, seeds: int, seed_base: int = 0, jobs: int = 1,
                 scheduler: str | None = None, platform_file: str | None = None,
                 time_scale: float | None = None, clock: str | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``drill`` once per seed (``seed_base`` on, ``seeds`` of them), each in its own
    process, locally ``jobs`` at once or on a Dask ``scheduler``; the summary
    (``summarise``): passes, failures grouped by check with the seeds that reproduce
    them, and every run. The same JSON whichever backend ran it."""
    if drill not in DRILLS:
        raise errors.InvalidRequest(f"no drill {drill!r}; known: {', '.join(DRILLS)}")
    say = progress or (lambda text: None)
    todo = list(range(seed_base, seed_base + seeds))
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []

    def done(run: dict[str, Any]) -> None:
        runs.append(run)
        failed = sum(1 for r in runs if not r["ok"])
        say(f"{len(runs)} of {len(todo)} seeds run, {failed} failed")

    if scheduler:
        backend = f"dask {scheduler}"
        _on_dask(scheduler, drill, todo, platform_file, time_scale, clock, done)
    else:
        backend = f"local, {jobs} at once"
        pool = cf.ThreadPoolExecutor(max_workers=jobs)  # threads only wait
        try:
            futures = [pool.submit(campaign_task, drill, s, platform_file, time_scale, clock)
                       for s in todo]
            for fut in cf.as_completed(futures):
                done(fut.result())
        except BaseException:  # a signal: no further seed starts, the running ones stop
            pool.shutdown(wait=False, cancel_futures=True)
            _stop_running()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return summarise(drill, runs, backend, time.monotonic() - t0)


def _on_dask(scheduler: str, drill: str, seeds: list[int], platform_file: str | None,
             time_scale: float | None, clock: str | None,
             done: Callable[[dict[str, Any]], None]) -> None:
    try:
        from dask.distributed import Client, as_completed
    except ImportError:
        raise errors.InvalidRequest("--scheduler needs the 'dask' extra: "
                                    "pip install 'hetproc[dask]'") from None
    try:
        client = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as exc:  # refused, unreachable, a bad address
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise errors.InvalidRequest(f"--scheduler {scheduler}: cannot reach the Dask "
                                    f"scheduler ({first})") from None
    with client:
        futures = client.map(campaign_task, [drill] * len(seeds), seeds,
                             [platform_file] * len(seeds), [time_scale] * len(seeds),
                             [clock] * len(seeds), pure=False)
        for fut in as_completed(futures):
            done(fut.result())


def summarise(drill: str, runs: list[dict[str, Any]], backend: str,
              duration_s: float) -> dict[str, Any]:
    """Runs sorted by seed; each failed check with the seeds that reproduce it."""
    runs = sorted(runs, key=lambda r: r["seed"])
    by_check: dict[str, list[int]] = {}
    for r in runs:
        for check in r["failed_checks"] or ([] if r["ok"] else ["(no check named)"]):
            by_check.setdefault(check, []).append(r["seed"])
    failures = [{"check": c, "seeds": s} for c, s in
                sorted(by_check.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    failed = sum(1 for r in runs if not r["ok"])
    return {"drill": drill, "seeds": len(runs), "backend": backend,
            "passed": len(runs) - failed, "failed": failed, "failures": failures,
            "runs": runs, "duration_s": round(duration_s, 3), "ok": failed == 0}

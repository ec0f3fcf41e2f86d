"""``hetproc campaign DRILL --seeds N``: one drill under many seeds, failures grouped with
the seeds that reproduce them; ``--tie-seeds N`` (virtual clock): one drill under many tie
orders, each run with its trace digest, a failure with the tie seed that reproduces it.

Every run is ``hetproc drill DRILL --seed S --json`` in a subprocess of its own: locally
(``jobs`` at once) or as a task on a Dask cluster (``scheduler``; the optional
``hetproc[dask]`` extra). A Dask worker is a daemonic process and may not fork children of
its own through multiprocessing, so the task starts the platform one process further
away, and returns the run's compact result. The summary is the same JSON whichever
backend ran the seeds (runs sorted by seed, then tie seed).

A run is a fault seed (``--seed``: the fault plan and the drill's own choices) and, when
tie orders are explored, a tie seed (``--tie-seed``: the platform's ``tie_seed``, what it
orders is in ``hetproc.supervisor._clock``); ``--seeds`` and ``--tie-seeds`` together run
every pair. Each run carries the command line that reruns it alone (``rerun``), and so
does each failure (its first run's): on the virtual clock that rerun gives the same trace
digest.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ipc import errors

from ..client import same_code_env
from . import _timefields
from ._drills import DRILLS, drill_spec

RUN_TIMEOUT_S = 300.0  # one drill run, platform start and stop included
CONNECT_TIMEOUT_S = 5.0  # a scheduler that does not answer by then is not there


def campaign_task(drill: str, seed: int, platform_file: str | None = None,
                  time_scale: float | None = None, clock: str | None = None,
                  tie_seed: int | None = None) -> dict[str, Any]:
    """One seeded run in a subprocess; its compact result. Runs on any backend."""
    args = rerun_args(drill, seed, platform_file, time_scale, clock, tie_seed)
    cmd = [sys.executable, "-m", "hetproc", *args, "--json"]
    key = {"seed": seed, "tie_seed": tie_seed, "rerun": shlex.join(["hetproc", *args])}
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
            return {**key, "ok": False,
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
        return {**key, "ok": False, "failed_checks": [f"exit {out.returncode}: {last}"],
                "error": last, "leaks": 0, "duration_s": time.monotonic() - t0}
    left = report["left_behind"]
    return {**key, "ok": report["ok"],
            "failed_checks": [c["name"] for c in report["checks"] if not c["passed"]],
            "details": {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]},
            "error": report.get("error"), "leaks": len(left["objects"]) + len(left["processes"]),
            "duration_s": report["duration_s"], **_timefields.of_report(report)}


def rerun_args(drill: str, seed: int, platform_file: str | None, time_scale: float | None,
               clock: str | None, tie_seed: int | None) -> list[str]:
    """``hetproc drill ...``'s arguments for one run of a campaign (without --json)."""
    args = ["drill", drill, "--seed", str(seed)]
    if platform_file:
        args += ["--platform", platform_file]
    if time_scale is not None:
        args += ["--time-scale", repr(time_scale)]
    if clock is not None:
        args += ["--clock", clock]
    if tie_seed is not None:
        args += ["--tie-seed", str(tie_seed)]
    return args


_lock = threading.Lock()
_running: set[subprocess.Popen] = set()  # the local runs in progress (this process's children)


def _stop_running() -> None:
    """SIGTERM to every run in progress: each stops its platform and exits."""
    with _lock:
        procs = list(_running)
    for proc in procs:
        proc.terminate()


def run_campaign(drill: str, *, seeds: int = 1, seed_base: int = 0,
                 tie_seeds: int | None = None, tie_seed_base: int = 0, jobs: int = 1,
                 scheduler: str | None = None, platform_file: str | None = None,
                 time_scale: float | None = None, clock: str | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``drill`` once per seed (``seed_base`` on, ``seeds`` of them) and, with
    ``tie_seeds`` (virtual clock), once per tie seed (``tie_seed_base`` on) for each seed,
    each run in its own process, locally ``jobs`` at once or on a Dask ``scheduler``; the
    summary (``summarise``): passes, failures grouped by check with the seeds that
    reproduce them, and every run. The same JSON whichever backend ran it."""
    if drill not in DRILLS:
        raise errors.InvalidRequest(f"no drill {drill!r}; known: {', '.join(DRILLS)}")
    ties: list[int | None] = [None]
    if tie_seeds is not None:  # refused before any run starts if not on the virtual clock
        drill_spec(drill, platform_file=platform_file, clock=clock, tie_seed=tie_seed_base)
        ties = list(range(tie_seed_base, tie_seed_base + tie_seeds))
    todo = [(s, t) for s in range(seed_base, seed_base + seeds) for t in ties]
    say = progress or (lambda text: None)
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []

    def done(run: dict[str, Any]) -> None:
        runs.append(run)
        failed = sum(1 for r in runs if not r["ok"])
        say(f"{len(runs)} of {len(todo)} runs, {failed} failed")

    task = [drill, platform_file, time_scale, clock]
    if scheduler:
        backend = f"dask {scheduler}"
        _on_dask(scheduler, task, todo, done)
    else:
        backend = f"local, {jobs} at once"
        _locally(jobs, task, todo, done)
    return summarise(drill, runs, backend, time.monotonic() - t0, tie_seeds=tie_seeds)


def _locally(jobs: int, task: list[Any], todo: list[tuple[int, int | None]],
             done: Callable[[dict[str, Any]], None]) -> None:
    drill, platform_file, time_scale, clock = task
    pool = cf.ThreadPoolExecutor(max_workers=jobs)  # threads only wait
    try:
        futures = [pool.submit(campaign_task, drill, s, platform_file, time_scale, clock, t)
                   for s, t in todo]
        for fut in cf.as_completed(futures):
            done(fut.result())
    except BaseException:  # a signal: no further seed starts, the running ones stop
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_running()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _on_dask(scheduler: str, task: list[Any], todo: list[tuple[int, int | None]],
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
    drill, platform_file, time_scale, clock = task
    n = len(todo)
    with client:
        futures = client.map(campaign_task, [drill] * n, [s for s, _ in todo],
                             [platform_file] * n, [time_scale] * n, [clock] * n,
                             [t for _, t in todo], pure=False)
        for fut in as_completed(futures):
            done(fut.result())


def summarise(drill: str, runs: list[dict[str, Any]], backend: str,
              duration_s: float, tie_seeds: int | None = None) -> dict[str, Any]:
    """Runs sorted by seed (then tie seed); each failed check with the seeds (and tie
    seeds) that reproduce it and the command line that reruns the first of them."""
    runs = sorted(runs, key=lambda r: (r["seed"], r.get("tie_seed") or 0))
    by_check: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        for check in r["failed_checks"] or ([] if r["ok"] else ["(no check named)"]):
            by_check.setdefault(check, []).append(r)
    failures = [_failure(check, failed, tie_seeds is not None) for check, failed in
                sorted(by_check.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    failed = sum(1 for r in runs if not r["ok"])
    digests = {r.get("trace_digest") for r in runs if r.get("trace_digest")}
    return {"drill": drill, "seeds": len(runs), "tie_seeds": tie_seeds, "backend": backend,
            "passed": len(runs) - failed, "failed": failed, "failures": failures,
            "trace_digests": len(digests), "runs": runs,
            "duration_s": round(duration_s, 3), "ok": failed == 0}


def _failure(check: str, runs: list[dict[str, Any]], ties: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"check": check, "runs": len(runs),
                           "seeds": sorted({r["seed"] for r in runs})}
    if ties:
        out["tie_seeds"] = sorted({r["tie_seed"] for r in runs})
    out["rerun"] = runs[0].get("rerun")
    return out

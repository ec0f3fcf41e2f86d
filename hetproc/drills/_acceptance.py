"""``hetproc acceptance``: the matrix of seed §21 -- every scenario and drill, with
pass/fail, the error seen, leaks, and recovery time. Success on the happy path alone
proves nothing; this is the table a release is judged by.

The scenarios are the scripts the ``scenarios`` package holds (discovered; ``--quick``
runs each with its own ``QUICK`` options). With ``jobs > 1`` the cells run in separate
processes, each starting its own platform, and ``on_row`` hears of each as it ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import _timefields
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
             time_scale: float | None, clock: str | None = None) -> dict[str, Any]:
    """One cell, on its own platform: its row of the matrix."""
    if kind == "scenario":
        report = run_scenario(name, platform_file=platform_file, time_scale=time_scale,
                              options=options, clock=clock)
    else:
        report = run_drill(name, platform_file=platform_file, time_scale=time_scale,
                           clock=clock)
    return _row(kind, name, report)


def run_matrix(*, platform_file: str | None = None, time_scale: float | None = None,
               quick: bool = False, jobs: int = 1, on_row: OnRow | None = None,
               clock: str | None = None) -> dict[str, Any]:
    """Every cell, each on its own platform (with ``jobs`` > 1, that many at once, each
    in a process of its own); ``{"rows", "ok"}`` in cell order. ``on_row`` hears the rows
    so far and the cells still to come whenever one ends; ``clock``: every platform's."""
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
        with _collector_between_cells() as between:
            for kind, name, options in todo:
                done(run_cell(kind, name, options, platform_file, time_scale, clock))
                between()
    else:
        _in_workers(jobs, todo, platform_file, time_scale, clock, done)
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


@contextlib.contextmanager
def _collector_between_cells() -> Iterator[Callable[[], None]]:
    """``between()`` after each cell: what it dropped is collected, what outlived it (the
    modules it imported -- numpy's, onnx's --, caches, the rows) is frozen out of the
    cyclic collector. A drill collects before it counts (``Drill.start``): that full
    collection then walks what the cell made, not every object of the process (~25 ms
    each once numpy and onnx are loaded, on either clock). Frozen objects are still freed
    by their reference counts; at the end they go back to the collector, unless the
    caller had frozen objects of its own (then what froze stays so)."""
    own = gc.get_freeze_count() == 0

    def between() -> None:
        gc.collect()
        gc.freeze()

    try:
        yield between
    finally:
        if own:
            gc.unfreeze()


def _in_workers(jobs: int, todo: list[tuple[str, str, dict[str, Any]]],
                platform_file: str | None, time_scale: float | None, clock: str | None,
                done: Callable[[dict[str, Any]], None]) -> None:
    """The cells in ``jobs`` worker processes. A signal to this process (SIGTERM, or the
    exception its handler raises) stops the rest at once: cells not started are
    cancelled, the running ones are told to stop (SIGTERM: each stops its platform and
    removes its objects), and the workers are gone before the signal goes on."""
    # Fresh interpreters, not forks: a fork of a process with threads (the CLI's
    # progress display) may inherit a held lock.
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                  initializer=_worker_signals)
    futures: list[cf.Future] = []
    try:
        with _sigint_ignored_by_children():  # the workers start here
            for k, n, o in todo:
                futures.append(pool.submit(_cell_in_worker, k, n, o, platform_file,
                                           time_scale, clock))
        for fut in cf.as_completed(futures):
            done(fut.result())
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # nothing more starts; idle ones leave
        _stop_workers()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_STOP_WAIT_S = 10.0  # a worker stopping its platform; then it is killed


def _stop_workers() -> None:
    """SIGTERM to each worker (a running cell stops its platform), then each leaves on
    the pool's word; one that has not within ``_STOP_WAIT_S`` is killed."""
    workers = [p for p in multiprocessing.active_children() if p.is_alive()]
    for p in workers:  # only this process's children: the pool's workers
        p.terminate()
    for p in workers:
        p.join(_STOP_WAIT_S)
        if p.is_alive():
            p.kill()
            p.join(1.0)


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Workers are born ignoring SIGINT: a Ctrl-C at the terminal reaches the whole
    process group, and only this process decides (a worker still importing would print a
    KeyboardInterrupt traceback). The disposition is inherited through exec; Python keeps
    an ignored SIGINT ignored. Here only for the moment the workers start."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


_stopping = False  # in a worker: a SIGTERM came; no further cell starts
_running = False   # in a worker: a cell (and its platform) is running


def _worker_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_stop)


def _cell_in_worker(*args: Any) -> dict[str, Any]:
    global _running
    if _stopping:
        raise CellStopped(signal.SIGTERM)
    _running = True
    try:
        return run_cell(*args)
    finally:
        _running = False
        gc.collect()  # as ``_collector_between_cells``: the pool's process is ours
        gc.freeze()


def _worker_stop(signum: int, frame: Any) -> None:
    global _stopping
    _stopping = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup that follows must finish
    if _running:  # idle, it leaves when the pool says so (dying would break the pool)
        raise CellStopped(signum)


class CellStopped(BaseException):
    """A worker was told to stop (a BaseException: no scenario's ``except Exception``
    swallows it); the cell's platform is stopped on the way out."""


def _row(kind: str, name: str, report: dict[str, Any]) -> dict[str, Any]:
    failed = [c for c in report["checks"] if not c["passed"]]
    left = report["left_behind"]
    return {"kind": kind, "name": name, "ok": report["ok"],
            "failed_checks": [c["name"] for c in failed],
            "failed_details": {c["name"]: c["detail"] for c in failed},
            "checks": len(report["checks"]),
            "error": report.get("error"),
            "platform_errors": [] if report["ok"] else _first_errors(report),
            "leaks": len(left["objects"]) + len(left["processes"]),
            "recovery_ms": report["metrics"].get("recovery_ms"),
            "duration_s": report["duration_s"], "skipped": report.get("skipped"),
            **_timefields.of_report(report)}


def _first_errors(report: dict[str, Any], most: int = 3) -> list[str]:
    """What the platform froze its first windows around (``evidence.frozen``): a failed
    cell's root cause, where the error that stopped the run names only its symptom (a
    consumer's ``DependencyFailed`` says its input failed with ``DeviceFault``; the
    producer's window says which exception the device raised)."""
    frozen = (report.get("evidence") or {}).get("frozen") or []
    return [str(w.get("reason")) for w in frozen[:most]]

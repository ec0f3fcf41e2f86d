"""The one answer to "what did a platform leave behind?".

A stopped platform must leave no named object under its prefix (``/dev/shm``: segments,
semaphores) and none of its processes alive. The scenario runner, the drills, the pytest
plugin (``hetproc.testing``), the test suite's autouse guard and the benchmarks all ask
the same question, so they all ask it here.
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil

from ipc import entries_with_prefix

from ..client import Platform, starter_pid

__all__ = ["leftovers", "assert_no_leftovers", "alive", "new_children", "platform_pids",
           "started_prefixes"]


def alive(pids: Iterable[int]) -> list[int]:
    """The pids among ``pids`` that still run (a zombie has exited: it holds nothing)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def leftovers(prefix: str, pids: Iterable[int] = ()) -> dict[str, list]:
    """What a stopped platform left: named objects under its prefix, live processes."""
    return {"objects": entries_with_prefix(prefix), "processes": alive(pids)}


def assert_no_leftovers(prefix: str, pids: Iterable[int] = ()) -> None:
    """``leftovers`` as a test assertion: fails naming what the platform left."""
    left = leftovers(prefix, pids)
    assert left == {"objects": [], "processes": []}, f"platform {prefix} left {left}"


def platform_pids(plat) -> list[int]:
    """A running platform's supervisor and device pids: what must be gone after stop."""
    m = plat.metrics()
    return [plat.pid] + [d["pid"] for d in m["devices"].values() if d["pid"]]


def new_children(before: Iterable[int]) -> list[psutil.Process]:
    """This process's live descendants not in ``before`` (pids), leaving out Python's own
    multiprocessing resource tracker and this process's platform starter (by its pid:
    ``starter_pid``), which outlive any one platform by design. The supervisors the
    starter forked are its children, so still our descendants: a leaked one is found."""
    known = set(before) | {starter_pid()}
    out = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in known:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(proc.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(proc)
    return out


def started_prefixes() -> list[str]:
    """The prefixes of every platform this process started, oldest first: a suite or a
    benchmark notes the length before, and checks the ones after it."""
    return list(Platform.started_prefixes)

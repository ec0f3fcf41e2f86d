"""Opt-in profile of a process's loop, for finding where per-command time goes.

``HETPROC_PROFILE=<dir>`` in the environment of a platform's owner: the supervisor and
each device process run their loop under ``cProfile`` and write
``<dir>/<role>-<pid>.prof`` when the loop ends (``pstats`` reads it). Wall time (a CPU-time
timer costs a system call per function call): blocking calls show as their own rows.
Unset, this costs nothing. ``bench.bench_fastpath`` uses it for its per-command profile.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

ENV = "HETPROC_PROFILE"


@contextlib.contextmanager
def profiled(role: str) -> Iterator[None]:
    where = os.environ.get(ENV, "")
    if not where:
        yield
        return
    import cProfile

    sys.setprofile(None)  # a forked child drops its parent's profiler
    # ``HETPROC_PROFILE_CPU=1``: CPU time instead (a system call per function call, so
    # every row is inflated alike; what the process spent, not what it waited for).
    # (A timer with a unit must return an int: ``process_time`` with unit 1.0 raised
    # TypeError on every call and the process spun printing it.)
    prof = (cProfile.Profile(time.process_time_ns, 1e-9) if os.environ.get(ENV + "_CPU")
            else cProfile.Profile())
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        try:
            prof.dump_stats(os.path.join(where, f"{role}-{os.getpid()}.prof"))
        except OSError:
            pass

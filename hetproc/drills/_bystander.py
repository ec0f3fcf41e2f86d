"""The drills' bystander: another client (the "camera") that keeps working on its own
device while a drill breaks something else, so that a drill can check the fault stayed in
its scope."""

from __future__ import annotations

import threading
import time
from typing import Any

from ipc import errors

from ..client import now
from ..client import sleep as platform_sleep  # modeled on the virtual clock


class Bystander:
    """Another client that keeps submitting small jobs on its own device meanwhile.

    On the real clock a thread submits one job after another until ``stop``. On the
    virtual clock that thread would make the drill's timeline the host's (how many jobs
    fit depends on when the thread runs, and a process counts as waiting while any of its
    threads waits), so the camera's jobs are dated ahead instead: up to ``VIRTUAL_JOBS``
    of them, one every ``VIRTUAL_PERIOD_MS`` of modeled time. ``stop`` collects the jobs
    that arrived by then, as the thread's last job ends on the real clock; the ones
    dated later have not begun and go with the camera's connection (waiting for them
    ran up to 400 ms of modeled camera work after a drill of 30: most of a short
    drill's host time, checking nothing)."""

    VIRTUAL_JOBS = 40
    VIRTUAL_PERIOD_MS = 10.0

    def __init__(self, platform, device: str) -> None:
        self.client = platform.connect("camera")
        self.ctx = self.client.context(device, priority=10, name="camera")
        self.failures: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._dated: list[tuple[int, Any]] = []  # (arrival, fence)
        self._thread: threading.Thread | None = None
        if platform.spec.clock == "virtual":
            t0 = now(self.client)
            step = round(self.VIRTUAL_PERIOD_MS * platform.spec.time_scale * 1e6)
            arrivals = [t0 + k * step for k in range(self.VIRTUAL_JOBS)]
            self._dated = [(at, self.ctx.submit_nowait("work", ms=1, at_ns=at))
                           for at in arrivals]
        else:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                f = self.ctx.submit("work", ms=1)
                f.wait(5)
                f.release()
                self.done += 1
            except errors.HetprocError as exc:
                self.failures.append(exc.name)
                platform_sleep(10, self.client)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            deadline = time.monotonic() + 10
            while self._thread.is_alive() and time.monotonic() < deadline:
                platform_sleep(1, self.client)  # a wait in hetproc: its last job may end
            self._thread.join(1)
        stopped_at = now(self.client) if self._dated else 0
        for at, f in self._dated:
            if at > stopped_at:
                break  # not begun: dropped with the connection (``close``)
            try:
                f.wait(5)
                self.done += 1
            except errors.HetprocError as exc:
                self.failures.append(exc.name)
            f.release()
        self.client.close()

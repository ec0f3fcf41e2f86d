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
    threads waits), so the camera's jobs are dated ahead instead: ``VIRTUAL_JOBS`` of
    them, one every ``VIRTUAL_PERIOD_MS`` of modeled time, collected at ``stop``."""

    VIRTUAL_JOBS = 40
    VIRTUAL_PERIOD_MS = 10.0

    def __init__(self, platform, device: str) -> None:
        self.client = platform.connect("camera")
        self.ctx = self.client.context(device, priority=10, name="camera")
        self.failures: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._dated: list[Any] = []
        self._thread: threading.Thread | None = None
        if platform.spec.clock == "virtual":
            t0 = now(self.client)
            step = round(self.VIRTUAL_PERIOD_MS * platform.spec.time_scale * 1e6)
            self._dated = [self.ctx.submit_nowait("work", ms=1, at_ns=t0 + k * step)
                           for k in range(self.VIRTUAL_JOBS)]
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
        for f in self._dated:
            try:
                f.wait(5)
                self.done += 1
            except errors.HetprocError as exc:
                self.failures.append(exc.name)
            f.release()
        self.client.close()

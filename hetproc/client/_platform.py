"""Starting and stopping a platform: the supervisor process and its devices.

The supervisor is never forked from the caller (which may be multi-threaded: forking a
multi-threaded process is unsafe). It is forked by this process's platform starter
(``_starter``: one single-threaded process per owner that imported the supervisor's
modules once), or, when there is none (``HETPROC_STARTER=0``, or the starter is gone),
started as a fresh interpreter with ``subprocess``. Either way it runs the same main,
then forks the devices itself. The owner's control connection doubles as a lifeline: if
the owner dies, the supervisor sees EOF and tears the platform down.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ipc import cleanup_prefix, errors, socket_address

from .. import trace as _trace
from .._config import PlatformSpec, load_platform, to_raw
from . import _now
from ._client import Client
from ._roles import forget_trace_role, publish_trace_role
from ._starter import ForkedSupervisor, start_supervisor

START_TIMEOUT = 20.0
# Where this hetproc was imported from: the supervisor runs the same code as its owner,
# whatever the owner's working directory or the other copies on the path.
CODE_ROOT = str(Path(__file__).resolve().parents[2])


def same_code_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that must import this very hetproc."""
    path = os.pathsep.join(p for p in (CODE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


class Platform:
    """A running emulated SoC. Use as a context manager::

        with hetproc.Platform() as plat:
            npu = plat.client.context("npu0")
    """

    # Prefixes of the platforms this process started, oldest first: lets a test suite
    # check its own platforms for leftovers while other suites run beside it.
    started_prefixes: ClassVar[list[str]] = []  # shared by every Platform of the process

    def __init__(self, platform_file: str | Path | None = None, *,
                 time_scale: float | None = None, spec: PlatformSpec | None = None,
                 name: str = "owner", trace: bool | None = None,
                 limits: dict[str, Any] | None = None, share_trace: bool = False,
                 clock: str | None = None) -> None:
        """``trace``: force the ring trace on or off; None keeps the platform file's
        setting, unless ``HETPROC_TRACE=0`` (or ``1``) is set in the environment.
        ``limits``: override keys of the platform file's ``[limits]`` table.
        ``share_trace``: grant this user a trace role, so that ``hetproc trace export
        PREFIX`` from another terminal reads the live trace (``_roles``).
        ``clock``: "real" or "virtual" (None keeps the platform file's ``clock``); on the
        virtual clock modeled time jumps to the next event once every process of the
        platform waits (``hetproc.supervisor._clock``)."""
        self.spec = (spec or load_platform(platform_file)).with_time_scale(time_scale)
        self.spec = self.spec.with_clock(clock)
        self.spec = self.spec.with_limits(**(limits or {}))
        if trace is None and os.environ.get("HETPROC_TRACE", "") in ("0", "1"):
            trace = os.environ["HETPROC_TRACE"] == "1"
        if trace is not None and trace != self.spec.trace.enabled:
            self.spec = self.spec.with_trace(enabled=trace)
        self._raw = {"raw": to_raw(self.spec), "source": self.spec.source}
        self.prefix = ""
        # The supervisor: forked by the starter, or a fresh interpreter (same calls).
        self.proc: ForkedSupervisor | subprocess.Popen | None = None
        self.client: Client | None = None
        self._name = name
        self._share_trace = share_trace

    @property
    def address(self) -> str:
        """The supervisor's control socket: what ``hetproc.connect`` takes."""
        return socket_address(self.prefix)

    @property
    def pid(self) -> int:
        """The supervisor's process id (0 before ``start``)."""
        return self.proc.pid if self.proc else 0

    def start(self) -> Platform:
        """Start the supervisor (which starts one process per device), wait until it
        serves, and connect ``client`` as the platform's owner; returns the platform.
        Raises ``PlatformError`` if the supervisor exits, refuses the platform or does not
        get ready in time (a half-started platform is stopped first)."""
        self.prefix = "pending"
        env = same_code_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc, read_fd = _supervisor(self._raw, env)
        lines: list[dict[str, Any]] = []
        try:
            ready = _read_ready(read_fd, self.proc, START_TIMEOUT, lines)
        except BaseException:  # a signal, a timeout: no half-started platform outlives it
            self.proc.kill()
            self.proc.wait(5)
            if lines:
                cleanup_prefix(lines[0]["prefix"])
            self.proc = None
            raise
        finally:
            os.close(read_fd)
        self.prefix = ready["prefix"]
        Platform.started_prefixes.append(self.prefix)
        try:
            self.client = Client(self.address, self._name, owner=True)
            if self._share_trace:
                publish_trace_role(self.prefix, self.client.grant_role(scope="trace"))
        except BaseException:
            self.stop()  # a half-started platform must not outlive the failed start
            raise
        return self

    def connect(self, name: str = "", *, role: int | None = None) -> Client:
        """Another client in this process (other processes use ``hetproc.connect(address)``).
        It is a normal tenant unless given a ``role`` token from ``client.grant_role()``."""
        return Client(self.address, name, role=role)

    def now(self) -> int:
        """The platform's now in ns (``Client.now`` of the owner's client)."""
        assert self.client is not None
        return _now.now(self.client)

    def sleep(self, ms: float) -> None:
        """Let ``ms`` of the platform's time pass (``Client.sleep``)."""
        assert self.client is not None
        _now.sleep(ms, self.client)

    def metrics(self) -> dict[str, Any]:
        """``Client.metrics()`` of the owner's client (it sees every tenant)."""
        assert self.client is not None
        return self.client.metrics()

    def unwedge(self, device: str) -> dict[str, Any]:
        """Reset a wedged device (its reset failed, ``DeviceWedged``) and let it serve
        again (a fresh device process, a new epoch): ``{"device", "was_wedged",
        "epoch"}``. ``DeviceWedged`` if the reset fails again (it stays wedged)."""
        assert self.client is not None
        return unwedge(self.client, device)

    # -- evidence (seed §22) ---------------------------------------------------------------

    def export_trace(self, path: str | Path) -> dict[str, Any]:
        """Write every process's ring, as it is now, as Chrome Trace Event JSON (open it
        in ui.perfetto.dev); returns counts (records, slices, flows)."""
        assert self.client is not None
        return _trace.export_trace(self.client, path)

    def trace_records(self):
        """``(records, process names, track names)``: the rings now, merged by time."""
        assert self.client is not None
        return _trace.snapshot(self.client)

    def frozen_windows(self, *, records: bool = True) -> list[dict[str, Any]]:
        """The windows frozen around errors (oldest first), each with its records."""
        assert self.client is not None
        return _trace.frozen_windows(self.client, records=records)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop devices and supervisor; remove every named object. Safe to call twice."""
        if self.proc is None:
            return
        forget_trace_role(self.prefix)  # first: a grant never outlives its platform
        try:
            if self.client is not None:
                try:
                    self.client.connection.request("shutdown")
                except errors.HetprocError:
                    pass
                self.client.close()
        finally:
            self.client = None
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
            finally:
                cleanup_prefix(self.prefix)  # whatever a supervisor killed mid-way left
                self.proc = None

    def kill_supervisor(self) -> None:
        """SIGKILL the supervisor (for drills): devices follow, objects stay until cleanup."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5.0)

    def __enter__(self) -> Platform:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _supervisor(raw: dict[str, Any], env: dict[str, str]
                ) -> tuple[ForkedSupervisor | subprocess.Popen, int]:
    """Start a supervisor for ``raw`` in ``env``: forked by this process's starter, else
    a fresh interpreter. Returns it and the read end of its ready pipe."""
    proc, read_fd = _with_pipe(raw, lambda spec_fd, write_fd:
                               start_supervisor(spec_fd, write_fd, env))
    if proc is not None:
        return proc, read_fd
    # No starter. The fresh one gets a pipe and spec file of its own: the starter may
    # still hold the first ones, and a late fork must not write where its lines come.
    os.close(read_fd)

    def fresh(spec_fd: int, write_fd: int) -> subprocess.Popen:
        # Its own process group: a Ctrl-C at the terminal reaches the owner alone (which
        # stops the platform), never a supervisor still importing, which would print a
        # KeyboardInterrupt traceback.
        return subprocess.Popen(
            [sys.executable, "-m", "hetproc.supervisor", "--spec-fd", str(spec_fd),
             "--ready-fd", str(write_fd)],
            pass_fds=(write_fd, spec_fd), stdin=subprocess.DEVNULL, process_group=0, env=env)

    popen, read_fd = _with_pipe(raw, fresh)
    assert popen is not None
    return popen, read_fd


P = TypeVar("P")


def _with_pipe(raw: dict[str, Any], start: Callable[[int, int], P]) -> tuple[P, int]:
    """``start(spec_fd, ready_write_fd)`` with a new ready pipe and spec file, closed
    here once it returns (the child holds its own); its result and the pipe's read end."""
    read_fd, write_fd = os.pipe()
    try:
        spec_fd = _spec_file(raw)
        try:
            return start(spec_fd, write_fd), read_fd
        finally:
            os.close(spec_fd)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)


def _read_ready(fd: int, proc: ForkedSupervisor | subprocess.Popen, timeout: float,
                lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Read the supervisor's two start lines (prefix, then ready) within ``timeout``, into
    ``lines`` (the caller's: it knows the prefix if the wait is interrupted)."""
    deadline = time.monotonic() + timeout
    buf = b""
    while len(lines) < 2:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
        if not ready:
            proc.kill()
            proc.wait(5)
            raise errors.PlatformError(f"platform did not start within {timeout} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            proc.wait(5)
            if lines:
                cleanup_prefix(lines[0]["prefix"])
            raise errors.PlatformError(f"supervisor exited during start (status {proc.returncode})")
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            lines.append(json.loads(line))
    if not lines[1].get("ok"):
        proc.wait(5)
        cleanup_prefix(lines[0]["prefix"])
        raise errors.PlatformError(f"platform failed to start: {lines[1].get('error')}")
    return {"prefix": lines[0]["prefix"], "pid": lines[1]["pid"]}


def connect(platform: str, name: str = "", *, role: int | None = None) -> Client:
    """Connect to a running platform from any process.

    ``platform`` is its prefix (as ``hetproc status`` prints it, ``Platform.prefix``) or
    its socket address (``Platform.address``).
    """
    address = platform if platform.startswith("\0") else socket_address(platform)
    return Client(address, name, role=role)


def unwedge(client: Client, device: str) -> dict[str, Any]:
    """Unwedge ``device`` through ``client``, which must be privileged (the owner, or a
    role it granted): ``{"device", "was_wedged", "epoch"}``; ``DeviceWedged`` if its reset
    fails again, ``NotPermitted`` without the role."""
    reply = client.connection.request("device_unwedge", device=device)
    return {k: reply[k] for k in ("device", "was_wedged", "epoch")}


def _spec_file(raw: dict[str, Any]) -> int:
    """The spec as an anonymous file, inherited by the supervisor: a platform file of any
    size (a command line stops at ~128 KiB per argument: "Argument list too long")."""
    fd = os.memfd_create("hetproc-spec", os.MFD_CLOEXEC)
    try:
        data = json.dumps(raw).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd

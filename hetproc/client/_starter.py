"""The owner's side of the platform starter (the starter itself, its protocol and what its
children inherit: ``hetproc.supervisor._starter``).

The first ``Platform.start`` of a process spawns one starter: a fresh interpreter (the
same code and environment as a supervisor's) that imports the supervisor's modules once
and waits on a socket pair only this process and it hold. Every start then asks it to
fork a supervisor (milliseconds, where a fresh interpreter takes ~0.3 s of imports). The
starter forks with ``CLONE_PARENT``: the supervisor is *this* process's child, as when it
was spawned here, so it knows its owner by ``getppid()`` and watches it die, and
``ForkedSupervisor`` waits, signals (through a pidfd: no pid-reuse race) and reaps it
here, with the true exit status, whatever becomes of the starter.

Nothing depends on the starter: ``start_supervisor`` returns None, and the caller starts a
fresh interpreter as before, when ``HETPROC_STARTER=0`` and when the starter is gone or
answers wrong (a warning on the ``hetproc.starter`` logger says why; ``starter_info``
counts it). A broken starter is replaced at the next start, at most ``MAX_BROKEN`` times
per process; so is one that began with another interpreter-level environment
(``PYTHON*``, ``LD_*``, the thread counts...: what an interpreter reads only at its
start), since its children could not take the owner's.

Lifetime: the starter ends with its owner (the socket's EOF, a parent-death signal) and
at the owner's interpreter exit; a child forked from the owner forgets it (its own first
start makes its own). The leftover checks leave it out by ``starter_pid``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ipc import close_all

__all__ = ["ForkedSupervisor", "start_supervisor", "starter_pid", "starter_info",
           "STARTER_ENV", "STATUS_LOST"]

STARTER_ENV = "HETPROC_STARTER"  # "0": every supervisor in a fresh interpreter
READY_TIMEOUT = 30.0  # the starter's imports: ~0.3 s on an idle host
REPLY_TIMEOUT = 10.0  # a fork's answer: milliseconds
STATUS_LOST = 255  # the status of a supervisor something else in this process reaped
MAX_BROKEN = 3  # broken starters one process replaces; past that, fresh interpreters
MAX_MESSAGE = 1 << 16  # the starter's answers are small
MAX_REQUEST = 1 << 17  # the starter's limit (``MAX_MESSAGE`` there): a larger environment
# What an interpreter reads at its start, never after: a starter that began with other
# values cannot give a supervisor the owner's.
_STARTUP_ENV = re.compile(r"^(PYTHON|LD_|OPENBLAS_|OMP_|MKL_|GOTO|MALLOC_|LC_|LANG)")
_SLICE_S = 0.05  # longest a reader holds the socket while others wait for their answer
_ANSWERS: dict[str, dict[str, type]] = {"ready": {"pid": int}, "forked": {"id": int, "pid": int},
                                         "refused": {"error": str}}

log = logging.getLogger("hetproc.starter")
T = TypeVar("T")


class StarterError(Exception):
    """The starter cannot fork this supervisor; the caller starts a fresh one."""


class Starter:
    """One owner's starter process and the socket to it (thread-safe)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.owner_pid = os.getpid()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hetproc.supervisor", f"--starter-fd={theirs.fileno()}",
                 f"--owner-pid={self.owner_pid}"],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, process_group=0, env=env)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine
        self.broken = ""  # why this starter is no longer asked (set once)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._hello: dict[str, Any] | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        try:
            hello = self._await(lambda: self._hello, READY_TIMEOUT)
        except BaseException:  # a signal stopped the start: no starter outlives it
            self.proc.kill()
            self.close()
            raise
        if hello is None:
            why = self.broken or f"no word within {READY_TIMEOUT} s"
            self.close()
            raise StarterError(f"the starter did not get ready: {why}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self, spec_fd: int, ready_fd: int, env: dict[str, str]) -> ForkedSupervisor:
        """A supervisor forked with these descriptors and the caller's process state, as
        the caller's child."""
        if self.broken:
            raise StarterError(self.broken)
        rid = next(self._ids)
        stdio = [n for n in (1, 2) if _is_open(n)]
        req = {"op": "fork", "id": rid, "env": env, "umask": _umask(),
               "ignored": [int(s) for s in signal.valid_signals()
                           if s not in (signal.SIGKILL, signal.SIGSTOP)
                           and signal.getsignal(s) == signal.SIG_IGN],
               "mask": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
               "affinity": sorted(os.sched_getaffinity(0)),
               "nice": os.getpriority(os.PRIO_PROCESS, 0), "stdio": stdio}
        data = json.dumps(req).encode()
        if len(data) > MAX_REQUEST:
            raise StarterError(f"a request of {len(data)} bytes (the environment is large)")
        cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with self._lock:
                socket.send_fds(self.sock, [data], [*stdio, cwd, spec_fd, ready_fd])
        except (OSError, ValueError) as exc:  # ValueError: closed by another thread
            self._break(f"its socket failed: {exc}")
            raise StarterError(self.broken) from None
        finally:
            os.close(cwd)
        try:
            reply = self._await(lambda: self._replies.pop(rid, None), REPLY_TIMEOUT)
        except BaseException:  # a signal stopped the start: so does the child, if made
            self._kill_late_child(rid)
            raise
        if reply is None:
            self._break(self.broken or f"no answer to a fork within {REPLY_TIMEOUT} s")
            self.proc.kill()  # wedged or gone: it forks nothing more
            raise StarterError(self.broken)
        if reply["op"] == "refused":
            raise StarterError(f"the starter refused: {reply['error']}")
        return ForkedSupervisor(reply["pid"], self.pid)

    def _kill_late_child(self, rid: int) -> None:
        """After an interrupted fork request: if the child was made, it is ours and
        nobody will wait for it. Kill and reap it (unreaped, its pid is still it)."""
        try:
            reply = self._await(lambda: self._replies.pop(rid, None), 2.0)
        except BaseException:
            reply = None
        if reply is not None and reply["op"] == "forked":
            try:
                os.kill(reply["pid"], signal.SIGKILL)
                os.waitpid(reply["pid"], 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def close(self, wait: float = 2.0) -> None:
        """Close the socket (the starter ends on its EOF) and reap the starter."""
        self._break(self.broken or "closed")
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(wait)

    # -- reading ------------------------------------------------------------------------

    def _await(self, got: Callable[[], T | None], timeout: float) -> T | None:
        """Read answers until ``got()`` has what the caller waits for, the starter
        breaks, or ``timeout`` passes. One reader at a time: a reader files every
        answer where its waiter looks, and holds the socket a short slice at most."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                value = got()
                if value is not None or self.broken:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._read(min(remaining, _SLICE_S))

    def _read(self, timeout: float) -> None:
        """One answer if one comes within ``timeout`` (the lock held)."""
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return
            data, anc, flags, _ = self.sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4 * 4),
                                                    socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError) as exc:  # ValueError: closed meanwhile
            self._break(f"its socket failed: {exc}")
            return
        fds = _fds(anc)
        close_all(fds)  # the starter sends none
        if not data:
            self._break(f"it closed its socket (exit status {self.proc.poll()})")
            return
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or fds:
                raise ValueError(f"a truncated answer, or one with descriptors ({flags:#x})")
            msg = _decode(data)
        except ValueError as exc:
            self._break(f"it answered wrong: {exc}")
            return
        if msg["op"] == "ready":
            self._hello = msg
        elif msg.get("id") is None:  # refused, about no request of ours
            self._break(f"it refused to serve: {msg['error']}")
        else:
            self._replies[msg["id"]] = msg

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
        try:
            self.sock.close()
        except OSError:
            pass


class ForkedSupervisor:
    """A supervisor the starter forked as this process's child, with the calls
    ``Platform`` makes of a ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``,
    ``wait(timeout)``, ``send_signal``, ``kill``, ``terminate``. It waits on a pidfd and
    signals through it; the status is ``waitpid``'s (Popen's convention: negative for a
    signal; ``STATUS_LOST`` if someone else in this process reaped it first)."""

    def __init__(self, pid: int, starter_pid: int) -> None:
        self.pid = pid
        self.args = ["hetproc.supervisor", f"(forked by starter {starter_pid})"]
        self.returncode: int | None = None
        # Our unreaped child (a zombie at worst): the pid is still this process.
        self._pidfd = os.pidfd_open(pid)
        self._done = weakref.finalize(self, _release, pid, self._pidfd)

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._wait(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return status

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # ended already: as Popen, nothing to signal

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ended, _, _ = select.select([self._pidfd], [], [], timeout)
        if not ended:
            return None
        status = _reap(self.pid, block=True)
        self.returncode = STATUS_LOST if status is None else status
        self._done.detach()
        os.close(self._pidfd)
        return self.returncode


def _reap(pid: int, block: bool) -> int | None:
    """``pid``'s exit status, reaping it; None if it runs (``block`` False) or someone
    else reaped it (then a warning: its status is lost)."""
    try:
        got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        log.info("supervisor %d was reaped elsewhere in this process: its exit status "
                    "is lost (%d)", pid, STATUS_LOST)
        return None
    return os.waitstatus_to_exitcode(status) if got else None


_unreaped: set[int] = set()  # children whose handle went away before they ended


def _release(pid: int, pidfd: int) -> None:
    """A handle dropped unwaited (as a Popen is): reap its child now if it ended, else
    at a later start (``_reap_dropped``), so that no zombie stays."""
    os.close(pidfd)
    if _reap(pid, block=False) is None:
        _unreaped.add(pid)


def _reap_dropped() -> None:
    for pid in list(_unreaped):
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got = pid
        if got:
            _unreaped.discard(pid)


# -- this process's starter -----------------------------------------------------------------

_lock = threading.Lock()
_current: Starter | None = None
_broken = 0  # starters of this process that broke (then replaced, up to MAX_BROKEN)
_info: dict[str, Any] = {"forks": 0, "fallbacks": 0, "last_fallback": "", "starters": 0}


def start_supervisor(spec_fd: int, ready_fd: int,
                     env: dict[str, str]) -> ForkedSupervisor | None:
    """A supervisor forked by this process's starter (spawned on first use), running
    ``python -m hetproc.supervisor --spec-fd --ready-fd`` 's main in ``env``; None when
    the caller must start a fresh interpreter instead (the module docstring says when)."""
    global _current, _broken
    if os.environ.get(STARTER_ENV, "") == "0":
        return None
    with _lock:
        starter = _current
        if starter is not None and (starter.broken or _startup_differs(starter.env, env)):
            # A starter has no child and holds nothing: replacing it loses nothing.
            _current = None
            if starter.broken:
                _broken += 1
                log.warning("hetproc starter %d is broken (%s): replacing it", starter.pid,
                            starter.broken)
            else:
                log.debug("hetproc starter %d began with another interpreter start-up "
                          "environment (%s): replacing it", starter.pid,
                          ", ".join(_startup_differs(starter.env, env)))
            starter.close(0.5)
            starter = None
        if starter is None:
            if _broken >= MAX_BROKEN:
                _fallback(f"{_broken} starters of this process broke already", logging.DEBUG)
                return None
            try:
                starter = _current = Starter(env)
                _info["starters"] += 1
            except (StarterError, OSError) as exc:
                _broken += 1
                _fallback(str(exc))
                return None
    _reap_dropped()
    try:
        proc = starter.fork(spec_fd, ready_fd, env)
    except StarterError as exc:
        _fallback(str(exc))
        return None
    _info["forks"] += 1
    return proc


def _startup_differs(began: dict[str, str], env: dict[str, str]) -> list[str]:
    """The variables an interpreter reads at its start whose values differ."""
    return sorted(k for k in set(env) | set(began)
                  if _STARTUP_ENV.match(k) and env.get(k) != began.get(k))


def _fallback(why: str, level: int = logging.WARNING) -> None:
    _info["fallbacks"] += 1
    _info["last_fallback"] = why
    log.log(level, "hetproc: a supervisor in a fresh interpreter (no starter): %s", why)
    return None


def starter_pid() -> int:
    """This process's starter's pid (0 if none): the one process a leftover check must
    leave out, since it lives as long as its owner."""
    starter = _current
    return starter.pid if starter is not None and starter.owner_pid == os.getpid() else 0


def starter_info() -> dict[str, Any]:
    """``{"pid", "forks", "fallbacks", "last_fallback", "starters", "broken"}`` of this
    process: what the starter did for it (a fallback says why)."""
    starter = _current
    return {**_info, "pid": starter_pid(), "broken": starter.broken if starter else ""}


def _shutdown() -> None:
    global _current
    starter, _current = _current, None
    if starter is not None and starter.owner_pid == os.getpid():
        starter.close()


def _forget_in_child() -> None:
    """A child forked from the owner: the parent's starter is not its own. Close the
    inherited socket (the starter would not see its owner's EOF while we hold it)."""
    global _current, _broken, _lock
    _lock = threading.Lock()
    starter, _current, _broken = _current, None, 0
    _info.update(forks=0, fallbacks=0, last_fallback="", starters=0)
    if starter is not None:
        try:
            starter.sock.close()
        except OSError:
            pass


atexit.register(_shutdown)
os.register_at_fork(after_in_child=_forget_in_child)


# -- helpers ------------------------------------------------------------------------------


def _decode(data: bytes) -> dict[str, Any]:
    msg = json.loads(data)
    if not isinstance(msg, dict) or msg.get("op") not in _ANSWERS:
        raise ValueError(f"an unknown answer {str(msg)[:80]!r}")
    for key, kind in _ANSWERS[msg["op"]].items():
        if type(msg.get(key)) is not kind:
            raise ValueError(f"answer {msg['op']!r} without a {kind.__name__} {key!r}")
    if msg["op"] == "refused" and msg.get("id") is not None and type(msg["id"]) is not int:
        raise ValueError("a refusal with a bad id")
    return msg


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            out += [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, usable, 4)]
    return out




def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` would, for a moment,
    for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022

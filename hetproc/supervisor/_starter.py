"""The platform starter: one process per owner that imported the supervisor's modules
once, and forks a supervisor for each ``Platform.start`` of its owner (a fork costs
milliseconds; a fresh interpreter spends ~0.3 s importing numpy, psutil, msgpack and the
supervisor's ~100 modules). The owner's side is ``hetproc.client._starter``::

    owner process                   starter                           supervisor
    ┌───────────────┐  socketpair  ┌─────────────────────────┐ clone  ┌───────────────┐
    │ Platform.start│─(SEQPACKET)─▶│ python -m               │(PARENT)│ _main.main:   │
    │               │  fork + fds  │   hetproc.supervisor    │───────▶│ the very main │
    │               │◀─────────────│   --starter-fd N        │        │ of a fresh one│
    │   its parent ─┼──────┐forked │ imports once, then forks│        └───────────────┘
    └───────────────┘      └────────────────────────────────────────────────▲
                            (waits, signals, reaps it like the child it is)─┘

The child is made with ``clone(CLONE_PARENT)``: a fork whose parent is the starter's
parent, the owner. So the supervisor is the owner's child exactly as when the owner
spawned it: ``os.getppid()`` is the owner (the supervisor trusts the kernel's word for who
owns the platform, and watches that process die), and the owner reaps it and reads its
exit status itself, whatever becomes of the starter. Python's own fork hooks run around
it (``PyOS_BeforeFork``/``PyOS_AfterFork_*``, as ``os.fork`` calls them), so ``random``
reseeds and every ``register_at_fork`` handler runs.

One JSON object per datagram (at most ``MAX_MESSAGE`` bytes), descriptors beside it
(``SCM_RIGHTS``):

    owner -> starter   {"op": "fork", "id", "env", "umask", "ignored", "mask", "affinity",
                        "nice", "stdio"}   + the owner's stdout/stderr (those ``stdio`` lists),
                                             its cwd, the spec file, the ready pipe
    starter -> owner   {"op": "ready", "pid"}            once, when the imports are done
                       {"op": "forked", "id", "pid"}     the owner's new child
                       {"op": "refused", "id", "error"}  nothing was forked

The child is made to look like ``python -m hetproc.supervisor`` started by the owner at
that moment: its own process group, the owner's stdout/stderr, cwd, environment, umask,
ignored signals, signal mask, CPU affinity and nice value, every other descriptor closed,
every other signal at its default, numpy's global generator reseeded (it does not reseed
after a fork); it runs ``_main.main`` and the exit functions, then ``os._exit``. What it
cannot take from the owner is what an interpreter fixes at its start: the
``PYTHON*``/``LD_*``/thread-count variables the starter itself began with (the owner's side
replaces the starter when those differ) and the hash seed (the starter's children share
one).

The socket pair is the only way in: nobody else holds either end. A message that is not a
well-formed request (too long, not JSON, the wrong fields or descriptors) is refused with
the reason and forks nothing; the starter goes on serving. It ends when its owner does:
EOF on the socket, ``PR_SET_PDEATHSIG`` (checked against the owner's pid, since the signal
also comes when only the owner's thread that started it ends), and a periodic parent
check. It owns no named object and no child.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import ctypes
import gc
import json
import os
import platform
import select
import signal
import socket
import stat
import sys
import threading
import traceback
from typing import Any, NoReturn

from ipc import close_all

from ._devices import close_inherited

MAX_MESSAGE = 1 << 17  # a request, the environment most of it (one datagram fits a buffer)
MAX_FDS = 8
MAX_SPEC = 1 << 22  # a spec parsed ahead for the child (a larger one, the child parses)
_PARENT_CHECK_S = 2.0
_PR_SET_PDEATHSIG = 1
_DEATH_SIGNAL = signal.SIGUSR2
_FORK_KEYS = {"op": str, "id": int, "env": dict, "umask": int, "ignored": list, "mask": list,
              "affinity": list, "nice": int, "stdio": list}


class BadRequest(Exception):
    """A message the starter does not act on; the reason goes back to the owner."""


def starter_main(argv: list[str]) -> int:
    """The starter process: returns only when it cannot serve (its status, 1)."""
    ap = argparse.ArgumentParser(prog="hetproc-starter")
    ap.add_argument("--starter-fd", type=int, required=True)
    ap.add_argument("--owner-pid", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a closed terminal belong
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # to the owner
    _die_with_owner(args.owner_pid)
    _standard_fds_open()  # a received descriptor never lands on 0, 1 or 2
    sock = socket.socket(fileno=args.starter_fd)
    from . import _main  # noqa: F401  (the point of the starter: every module, once)

    warm_numpy()
    gc.collect()
    gc.freeze()  # what the imports made is never collected: its pages stay shared
    threads = len(os.listdir("/proc/self/task"))
    starter = Starter(sock, args.owner_pid)
    unfit = (f"the starter has {threads} threads after its imports (forking a process "
             "with threads is unsafe)" if threads != 1 or threading.active_count() != 1
             else f"no clone system call known for {platform.machine()}"
             if _SYS_CLONE is None else "")
    if unfit:  # refuse to be a starter at all: the owner starts fresh interpreters
        starter.send({"op": "refused", "id": None, "error": unfit})
        return 1
    starter.send({"op": "ready", "pid": os.getpid()})
    status = starter.run()
    # The owner is gone: leave at once, without the interpreter's teardown of every
    # module (tens of ms) -- there is nothing to flush, close or remove.
    os._exit(status)


def warm_numpy() -> None:
    """What numpy does on its first use of a function, done here once and not in every
    child: its global generator's first call initialises it (~15 ms), and the first
    ``percentile`` imports ``numpy.ma`` (~18 ms in a forked child). A supervisor calls it in
    its first metrics after a command (``_timing``): without this, every platform's
    owner waited for that import once, on either clock."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return
    numpy.random.seed()
    numpy.percentile(numpy.zeros(2, numpy.int64), [50, 99])


class Starter:
    """The starter's loop: requests in, children forked for the owner, answers out."""

    def __init__(self, sock: socket.socket, owner_pid: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.owner_pid = owner_pid
        # Answers not sent yet (the owner reads when it waits for one): never block on it.
        self.out: collections.deque[bytes] = collections.deque()
        self.forked = 0
        self.refused = 0

    def run(self) -> int:
        while True:
            r, w, _ = select.select([self.sock], [self.sock] if self.out else [], [],
                                    _PARENT_CHECK_S)
            if os.getppid() != self.owner_pid:
                return 0  # the owner is gone (its pid is no longer our parent's)
            if r and not self.read():
                return 0
            if w:
                self.flush()

    # -- requests -----------------------------------------------------------------------

    def read(self) -> bool:
        """Take one message; False when the owner closed its end."""
        try:
            data, fds, flags = _recv(self.sock)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data and not fds and _peer_closed(self.sock):
            return False
        rid = None
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise BadRequest(f"a truncated message ({len(data)} bytes, flags {flags:#x})")
            req = decode_fork(data, len(fds))
            rid = req["id"]
            check_fds(fds)
            self.fork(req, fds)
        except BadRequest as exc:
            self.refuse(rid if rid is not None else _peek_id(data), str(exc), fds)
        except Exception as exc:  # a bug here must not end the starter: say it, go on
            self.refuse(rid, f"{type(exc).__name__}: {exc}", fds)
        return True

    def refuse(self, rid: int | None, error: str, fds: list[int]) -> None:
        close_all(fds)
        self.refused += 1
        self.send({"op": "refused", "id": rid, "error": error})

    def fork(self, req: dict[str, Any], fds: list[int]) -> None:
        from ._main import remember_spec

        data = _spec_bytes(fds[-2])
        if data is not None:
            remember_spec(data)  # parsed here once, not in each child
        sys.stdout.flush()
        sys.stderr.flush()
        pid = fork_for_parent()
        if pid == 0:
            _child(req, fds)
        close_all(fds)
        self.forked += 1
        self.send({"op": "forked", "id": req["id"], "pid": pid})

    # -- answers ------------------------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        self.out.append(json.dumps(msg).encode())
        self.flush()

    def flush(self) -> None:
        while self.out:
            try:
                self.sock.send(self.out[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.out.clear()  # the owner is gone: the loop sees the EOF
                return
            self.out.popleft()


_CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(platform.machine())


def fork_for_parent() -> int:
    """``os.fork``, but the child's parent is ours (``clone(CLONE_PARENT)``): 0 in the
    child, its pid in the caller. With every argument past the flags zero, the child runs
    on a copy of the caller's stack, as after ``fork``. Only in a single-threaded
    process (the starter checks that it is one)."""
    if _SYS_CLONE is None:
        raise BadRequest(f"no clone system call known for {platform.machine()}")
    zero = ctypes.c_ulong(0)
    _PYTHON.PyOS_BeforeFork()
    pid = _LIBC.syscall(ctypes.c_long(_SYS_CLONE),
                        ctypes.c_ulong(_CLONE_PARENT | signal.SIGCHLD), zero, zero, zero, zero)
    if pid == 0:
        _PYTHON.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    _PYTHON.PyOS_AfterFork_Parent()
    if pid < 0:
        raise BadRequest(f"clone failed: {os.strerror(err)}")
    return int(pid)


# The interpreter's C API and the C library, called with the interpreter lock held (a
# PyDLL): the lock is then held by this very thread in the child too.
_PYTHON = ctypes.pythonapi
_LIBC = ctypes.PyDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def decode_fork(data: bytes, nfds: int) -> dict[str, Any]:
    """A fork request from its bytes, every field checked (``BadRequest`` otherwise)."""
    if len(data) > MAX_MESSAGE:
        raise BadRequest(f"a message of {len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        req = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    if not isinstance(req, dict) or req.get("op") != "fork":
        raise BadRequest(f"not a fork request: {str(req)[:80]!r}")
    for key, kind in _FORK_KEYS.items():
        if type(req.get(key)) is not kind:
            raise BadRequest(f"field {key!r} is not a {kind.__name__}")
    env = req["env"]
    if not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
               and "\0" not in k + v for k, v in env.items()):
        raise BadRequest("the environment holds a name or value that is not a string")
    valid = {int(s) for s in signal.valid_signals()}
    for key in ("ignored", "mask"):
        if not all(type(s) is int and s in valid for s in req[key]):
            raise BadRequest(f"field {key!r} holds a number that is no signal")
    if not req["affinity"] or not all(type(c) is int and 0 <= c < 1 << 16
                                      for c in req["affinity"]):
        raise BadRequest("field 'affinity' is not a set of CPUs")
    if not 0 <= req["umask"] <= 0o777 or not -20 <= req["nice"] <= 19:
        raise BadRequest("umask or nice out of range")
    if req["stdio"] not in ([], [1], [2], [1, 2]):
        raise BadRequest(f"field 'stdio' is {req['stdio']!r}")
    want = len(req["stdio"]) + 3  # stdio, cwd, spec, ready
    if nfds != want:
        raise BadRequest(f"{nfds} descriptors with a request that needs {want}")
    return req


def _peek_id(data: bytes) -> int | None:
    """The id of a request refused for another field: its owner hears of it at once."""
    try:
        req = json.loads(data)
    except (ValueError, RecursionError):
        return None
    rid = req.get("id") if isinstance(req, dict) else None
    return rid if type(rid) is int else None


def check_fds(fds: list[int]) -> None:
    """The descriptors are what the request says: a directory, a file, a pipe."""
    cwd, spec, ready = fds[-3:]
    for fd, test, what in ((cwd, stat.S_ISDIR, "a directory"),
                           (spec, stat.S_ISREG, "a file"), (ready, stat.S_ISFIFO, "a pipe")):
        if not test(os.fstat(fd).st_mode):
            raise BadRequest(f"the descriptor for {what} is not one")


# -- the child ----------------------------------------------------------------------------


def _child(req: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: become the owner's fresh supervisor, run it, exit."""
    code = 1
    try:
        code = _run_supervisor(req, fds)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _run_supervisor(req: dict[str, Any], fds: list[int]) -> int:
    os.setpgid(0, 0)  # as ``process_group=0``: a Ctrl-C at the terminal reaches the owner
    reset_signals(set(req["ignored"]))
    signal.pthread_sigmask(signal.SIG_SETMASK, req["mask"])
    *stdio, cwd, spec_fd, ready_fd = fds
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for n in (1, 2):
        if n in req["stdio"]:
            os.dup2(stdio[req["stdio"].index(n)], n)
        else:
            os.dup2(null, n)  # the owner has none: nothing it writes goes anywhere
    os.fchdir(cwd)
    close_inherited({0, 1, 2, spec_fd, ready_fd})
    os.umask(req["umask"])
    env = req["env"]  # the owner's: usually the starter's own, but for a variable or two
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    try:
        os.sched_setaffinity(0, req["affinity"])
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, req["nice"])
    except OSError:
        pass  # a lower nice than the starter's needs a privilege the owner had
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # its global generator does not reseed after a fork
    # The exit functions the imports registered are a fresh supervisor's too (the
    # starter registers none of its own): they run after main, as at interpreter exit.
    argv = ["--spec-fd", str(spec_fd), "--ready-fd", str(ready_fd)]
    sys.argv = [os.path.join(os.path.dirname(__file__), "__main__.py"), *argv]
    from ._main import main

    # Copy now the pages the starter's imports left shared with us: a refcount written
    # on an object's first use faults its page in, and after "ready" those faults would
    # be host lag in the platform's first modeled milliseconds (~7 ms here, before).
    gc.get_objects()
    status = main(argv)
    atexit._run_exitfuncs()
    return status


def reset_signals(ignored: set[int]) -> None:
    """Every disposition as a fresh interpreter has it when started by an owner that
    ignores ``ignored`` (an ignored signal stays ignored across exec)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler: Any = signal.SIG_DFL
        if sig in ignored or sig in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN  # Python ignores these two at its start
        elif sig == signal.SIGINT:
            handler = signal.default_int_handler
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass  # the C library's own real-time signals


# -- helpers ------------------------------------------------------------------------------


def _recv(sock: socket.socket) -> tuple[bytes, list[int], int]:
    fds: list[int] = []
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(MAX_FDS * 4),
                                       socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += [int.from_bytes(payload[i:i + 4], sys.byteorder)
                    for i in range(0, usable, 4)]
    return data, fds, flags


def _spec_bytes(fd: int) -> bytes | None:
    """The spec file's bytes, read without moving its offset (the child reads it whole);
    None past ``MAX_SPEC``."""
    size = os.fstat(fd).st_size
    if size > MAX_SPEC:
        return None
    data = os.pread(fd, size + 1, 0)
    return data if len(data) == size else None


def _peer_closed(sock: socket.socket) -> bool:
    """An empty read is the peer's EOF, or an empty datagram: the poll tells which."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLRDHUP) for _, ev in p.poll(0))




def _standard_fds_open() -> None:
    for n in (0, 1, 2):
        try:
            os.fstat(n)
        except OSError:
            fd = os.open(os.devnull, os.O_RDWR)
            if fd != n:
                os.dup2(fd, n)
                os.close(fd)


def _die_with_owner(owner_pid: int) -> None:
    """Die with the owner. The kernel's parent-death signal comes when the *thread* that
    started us ends, which may be any thread of a live owner: the handler checks that the
    owner itself is gone (we are then someone else's child)."""
    def on_parent_death(signum: int, frame: object) -> None:
        if os.getppid() != owner_pid:
            os._exit(0)  # nothing to clean: no named object, no child of ours

    signal.signal(_DEATH_SIGNAL, on_parent_death)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(_DEATH_SIGNAL), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass  # the periodic parent check still ends us
    if os.getppid() != owner_pid:  # the owner died before prctl took effect
        os._exit(0)

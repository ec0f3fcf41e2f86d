"""The supervisor process's main, run by ``python -m hetproc.supervisor`` (a fresh
interpreter) or in a child the platform starter forked (``_starter``): both paths run this
one function, so a supervisor behaves alike whichever way it began.

A supervisor that dies of an exception (a bug: a client's request cannot do it, see
``_server.Supervisor.on_request``) still tears the platform down, then exits 1 and leaves
a dump file (``hetproc-crash-<prefix>.txt`` in the platform's trace ``dump_dir``, else the
temp directory) with the traceback; its path goes to stderr.

It writes two JSON lines to ``--ready-fd``: first the prefix (so the owner can clean up even
if the start fails later), then ``{"ok": true, "pid": ...}`` once every device runs, or
``{"ok": false, "error": ...}``. SIGTERM ends the serve loop; SIGINT and SIGHUP are ignored, because
the owner decides when the platform stops.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

from ipc import cleanup_prefix, new_prefix, profiled

from .. import _schema  # noqa: F401  (see below)
from .._config import PlatformSpec, parse_platform
from ._server import Supervisor

# ``parse_platform`` imports ``_schema`` on its first call (a client that never parses a
# platform file does without it). A supervisor always parses one, first thing: imported
# here, the platform starter imports it once (it imports this module), and the
# supervisors it forks find it, rather than each importing (compiling, when no bytecode
# is cached) it again while its owner waits for the platform to start.


def _read_spec(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


# Specs the platform starter parsed for the supervisors it forks (``remember_spec``), by
# their bytes, each with its ``to_dict()`` (what ``hello`` answers): a child finds its own
# here, made once in the starter rather than in every child (where making them also
# copies every page of the starter's it writes to).
_PARSED: dict[bytes, tuple[PlatformSpec, dict[str, Any]]] = {}
_PARSED_KEPT = 8


def remember_spec(data: bytes) -> None:
    """Parse ``data``, a spec as ``--spec-fd`` carries it, for the children forked after
    this (in the starter). One that does not parse is left alone: the child parses it
    again and fails on it as a fresh supervisor does. Parsing is a pure function of the
    bytes (no environment, no working directory)."""
    if data in _PARSED:
        return
    try:
        arg = json.loads(data)
        spec = parse_platform(arg["raw"], arg["source"])
        as_dict = spec.to_dict()
    except Exception:
        return
    if len(_PARSED) >= _PARSED_KEPT:
        del _PARSED[next(iter(_PARSED))]
    _PARSED[data] = (spec, as_dict)


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetproc-supervisor")
    given = ap.add_mutually_exclusive_group(required=True)
    given.add_argument("--spec", help="platform spec as JSON")
    given.add_argument("--spec-fd", type=int, help="an inherited file holding the spec as "
                                                     "JSON (any size; read, then closed)")
    ap.add_argument("--prefix", help="default: a new one carrying this process's pid")
    ap.add_argument("--ready-fd", type=int, required=True)
    return ap


# Built at import: the platform starter's children find it built (~1.4 ms of a forked
# child's start, most of it copying the starter's pages it writes to).
_ARGS = _arg_parser()


def main(argv: list[str] | None = None) -> int:
    args = _ARGS.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the owner, again
    data = args.spec.encode() if args.spec is not None else _read_spec(args.spec_fd)
    spec, spec_dict = _PARSED.get(data) or (None, None)
    if spec is None:
        spec_arg = json.loads(data)
        spec = parse_platform(spec_arg["raw"], spec_arg["source"])
    args.prefix = args.prefix or new_prefix(os.getpid())
    # First line: the prefix, so the owner can clean up even if the start fails later.
    os.write(args.ready_fd, (json.dumps({"prefix": args.prefix}) + "\n").encode())
    sup = None
    status = 0
    try:
        sup = Supervisor(spec, args.prefix, spec_dict)
        signal.signal(signal.SIGTERM, lambda *_: setattr(sup, "running", False))
        sup.spawn(*sup.reg.devices.values())
        os.write(args.ready_fd, (json.dumps({"ok": True, "pid": os.getpid()}) + "\n").encode())
        os.close(args.ready_fd)
        quiet_collector()
        with profiled("supervisor"):
            sup.serve()
    except BaseException as exc:
        try:
            os.write(args.ready_fd, (json.dumps({"ok": False, "error": repr(exc)}) + "\n").encode())
        except OSError:
            pass
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            status = 1
            write_crash_dump(spec.trace.dump_dir, args.prefix, traceback.format_exc())
    finally:
        try:
            if sup is not None:
                sup.shutdown()
            else:
                cleanup_prefix(args.prefix)
        except Exception:
            status = 1
            write_crash_dump(spec.trace.dump_dir, args.prefix, traceback.format_exc())
            cleanup_prefix(args.prefix)
    return status


def quiet_collector() -> None:
    """The supervisor holds many long-lived records (commands, fences, buffers, the
    tables): the cyclic collector walking them every 700 allocations cost ~7 % of a
    command's CPU (measured in-process, 37.2 -> 34.6 us per no-op command in batches of
    64). What exists once the platform is up lives as long as it does: frozen out of the
    collector. Cycles made later are still collected, every 10,000 allocations."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def write_crash_dump(dump_dir: str, prefix: str, text: str) -> str | None:
    """Say why we died where a person will look: a file, and its path on stderr."""
    name = f"hetproc-crash-{prefix.strip('.')}.txt"
    path = os.path.join(dump_dir or tempfile.gettempdir(), name)
    written: str | None = path
    try:
        with open(path, "a") as f:
            f.write(f"supervisor pid {os.getpid()} of platform {prefix} died at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}:\n{text}\n")
    except OSError:
        written = None
    print(f"hetproc supervisor died; dump: {written}\n{text}", file=sys.stderr)
    return written


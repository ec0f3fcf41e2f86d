"""Client processes of their own that drills and conformance cases start: a fresh
interpreter each, as a user's client is, talked to by lines (it prints what it did, and
reads a line from its stdin to go on), every read of its output bounded by a deadline (a
child that hangs or dies in its start must not hang the drill).

The pipes are unbuffered bytes: a line the child wrote is read from the pipe itself, never
from a buffer of this process that ``select`` cannot see (two lines that arrived together
would leave the second one there, and the next read would wait on an empty pipe)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from ..client import same_code_env

LINE_S = 60.0  # a fresh interpreter's imports take ~0.3 s on an idle host

# The client-crash drill's doomed client: four buffers and one command of argv[2] ms in
# flight on gpu0, then "ready", then a hetproc wait until it is killed.
DOOMED = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "doomed-app")
ctx = c.context("gpu0", name="doomed")
bufs = [c.alloc(1 << 14, "float32") for _ in range(4)]
ctx.submit("work", bufs, [], ms=float(sys.argv[2]))
print("ready", flush=True)
hetproc.sleep(60_000)  # a hetproc wait: on the virtual clock it holds nothing
"""


def spawn(code: str, prefix: str, *args: str) -> subprocess.Popen:
    """``code`` in a fresh interpreter, argv[1] the platform ``prefix``, then ``args``."""
    return subprocess.Popen([sys.executable, "-c", code, prefix, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                            env=same_code_env())


def read_line(proc: subprocess.Popen, timeout: float = LINE_S) -> str:
    """The next line ``proc`` printed, stripped; what it had printed of a line when it
    closed its output; "" when nothing came within ``timeout`` seconds."""
    assert proc.stdout is not None
    fd, line = proc.stdout.fileno(), bytearray()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        byte = os.read(fd, 1)  # (a line is a few bytes: no read ahead of its end)
        if not byte or byte == b"\n":
            return line.decode(errors="replace").strip()
        line += byte


def tell(proc: subprocess.Popen) -> None:
    """Let the process go on to its next step (it reads a line to know when)."""
    assert proc.stdin is not None
    proc.stdin.write(b"\n")


def end(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs, reap it, close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()

"""The client-crash drill's doomed client: a process of its own (it dies by SIGKILL with
work in flight), started as a user's client is, in a fresh interpreter."""

from __future__ import annotations

import select
import subprocess
import sys

from ..client import same_code_env

SCRIPT = """
import sys, hetproc
c = hetproc.connect(sys.argv[1], "doomed-app")
ctx = c.context("gpu0", name="doomed")
bufs = [c.alloc(1 << 14, "float32") for _ in range(4)]
ctx.submit("work", bufs, [], ms=float(sys.argv[2]))
print("ready", flush=True)
hetproc.sleep(60_000)  # a hetproc wait: on the virtual clock it holds nothing
"""
START_S = 60.0  # a fresh interpreter's imports: ~0.3 s on an idle host


def start(prefix: str, hold_ms: float) -> subprocess.Popen:
    """The doomed client on the platform ``prefix``: four buffers, one command of
    ``hold_ms`` in flight on gpu0; it prints "ready" once the command is submitted."""
    return subprocess.Popen([sys.executable, "-c", SCRIPT, prefix, str(hold_ms)],
                            stdout=subprocess.PIPE, text=True, env=same_code_env())


def said_ready(proc: subprocess.Popen, timeout: float = START_S) -> bool:
    """Whether ``proc`` printed "ready" within ``timeout`` seconds (a client that hangs
    in its start, or dies in it, must not hang the drill: a bounded wait for the line)."""
    out = proc.stdout  # a pipe (stdout=PIPE), typed as maybe-None
    if out is None or not select.select([out], [], [], timeout)[0]:
        return False
    return out.readline().strip() == "ready"

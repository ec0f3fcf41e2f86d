"""SIGINT, SIGTERM and SIGHUP end a CLI run the same way: stop the platform, remove
everything, say so in one line.

The first of them raises ``Interrupted`` in the main thread, so the runner's ``finally``
stops the platform (the supervisor and the devices ignore SIGINT and SIGHUP: the terminal
sends those to the whole process group, and the owner decides when they stop). Further
signals are ignored while that cleanup runs: a second Ctrl-C must not leave half of it
undone. The signal is also remembered (``check``), for the case where its exception was
turned into another error inside a C call.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_AGAIN_S = 0.001  # a signal that landed in a finalizer comes again this much later


class Interrupted(BaseException):
    """A signal asked the command to stop (a BaseException: no ``except Exception`` in a
    scenario swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


received: int = 0  # the first signal seen; 0: none


def _in_finalizer(frame: Any) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` (a fence dropped mid-run)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_signal(signum: int, frame: Any) -> None:
    global received
    if _in_finalizer(frame):
        # An exception raised in a finalizer is printed ("Exception ignored in ...") and
        # dropped: the signal comes again a moment later, once the finalizer returned
        # (from a timer thread: sent from here, it would come back into this handler).
        again = threading.Timer(_AGAIN_S, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    received = received or signum
    raise Interrupted(signum)


def check() -> None:
    """Raise ``Interrupted`` if a signal came but its exception was lost: a signal that
    lands inside a C call (a semaphore wait) surfaces there as that call's own error,
    which a scenario may catch; the run then ended early, and must still exit as asked."""
    if received:
        raise Interrupted(received)


def install() -> None:
    for sig in HANDLED:
        signal.signal(sig, _on_signal)

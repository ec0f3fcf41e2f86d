"""Imported first by the package: the ``hetproc`` command's signals while it imports."""

from __future__ import annotations


def quiet_stop_while_the_command_starts() -> None:
    """The ``hetproc`` command imports this package (about half a second) before its
    ``main`` installs the handlers that stop a run cleanly; a Ctrl-C in that time printed
    a KeyboardInterrupt traceback. Nothing has started yet, so such a signal ends the
    command with one line. Only for the console script: a program that imports hetproc
    keeps its own signal handling."""
    import os
    import signal
    import sys
    if not sys.argv or os.path.basename(sys.argv[0]) != "hetproc":
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def stop(signum: int, frame: object) -> None:
        os.write(2, f"hetproc: stopped by {signal.Signals(signum).name} before anything "
                    "started\n".encode())
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)




quiet_stop_while_the_command_starts()

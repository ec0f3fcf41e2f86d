"""The ``hetproc`` command (``python -m hetproc``): run, drill, acceptance, trace, status,
cleanup. Runs in the user's shell process and drives whole platforms through
``hetproc.drills`` and ``hetproc.trace``."""

from ._main import main

__all__ = ["main"]

"""``python -m hetproc.supervisor``: the supervisor process, started by ``Platform.start``.

It writes two JSON lines to ``--ready-fd``: first the prefix (so the owner can clean up even
if the start fails later), then ``{"ok": true, "pid": ...}`` once every device runs, or
``{"ok": false, "error": ...}``. SIGTERM ends the serve loop; SIGINT and SIGHUP are ignored, because
the owner decides when the platform stops.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from ipc import cleanup_prefix, new_prefix

from .._config import parse_platform
from ._server import Supervisor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetproc-supervisor")
    ap.add_argument("--spec", required=True, help="platform spec as JSON")
    ap.add_argument("--prefix", help="default: a new one carrying this process's pid")
    ap.add_argument("--ready-fd", type=int, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the owner, again
    spec_arg = json.loads(args.spec)
    spec = parse_platform(spec_arg["raw"], spec_arg["source"])
    args.prefix = args.prefix or new_prefix(os.getpid())
    # First line: the prefix, so the owner can clean up even if the start fails later.
    os.write(args.ready_fd, (json.dumps({"prefix": args.prefix}) + "\n").encode())
    sup = None
    try:
        sup = Supervisor(spec, args.prefix)
        signal.signal(signal.SIGTERM, lambda *_: setattr(sup, "running", False))
        sup.start_devices()
        os.write(args.ready_fd, (json.dumps({"ok": True, "pid": os.getpid()}) + "\n").encode())
        os.close(args.ready_fd)
        sup.serve()
    except BaseException as exc:
        try:
            os.write(args.ready_fd, (json.dumps({"ok": False, "error": repr(exc)}) + "\n").encode())
        except OSError:
            pass
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            import traceback
            traceback.print_exc()
    finally:
        if sup is not None:
            sup.shutdown()
        else:
            cleanup_prefix(args.prefix)
    return 0



sys.exit(main())

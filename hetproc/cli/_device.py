"""``hetproc device unwedge NAME [PREFIX]``: reset a wedged device of a live platform.

A device whose reset failed (``DeviceWedged``) runs nothing until someone unwedges it;
this command asks the platform's supervisor to do so, as ``Platform.unwedge`` does from
Python. Like the other commands that reach a live platform (``trace export``), it needs a
privileged role: the token the owner's ``grant_role()`` gave, in ``HETPROC_ROLE``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ipc import errors

from ._status import live_platforms

EXIT_OK = 0

_TEXT = """
    Reset a wedged device of a live platform and let it serve again: the device's
    reset failed (its commands ended with DeviceWedged, work for it is refused), and
    only an explicit unwedge brings it back. PREFIX names the platform (as 'hetproc
    status' prints it); without it, the one live platform of this machine. Needs the
    role token the platform's owner granted, in HETPROC_ROLE. Exit 1 if the reset
    fails again (the device stays wedged)."""


def add_command(sub: Any, make: Callable[..., argparse.ArgumentParser],
                role: Callable[[str], int | None]) -> None:
    dev = sub.add_parser("device", help="act on a live platform's devices",
                         description="Act on the devices of a live platform.")
    dev.set_defaults(func=None, help_of=dev)
    dsub = dev.add_subparsers(title="commands", metavar="COMMAND")
    p = make(dsub, "unwedge", "reset a wedged device and let it serve again", _TEXT,
             lambda args: cmd_unwedge(args, role))
    p.add_argument("name", metavar="NAME", help="the device, e.g. npu0")
    p.add_argument("platform", nargs="?", metavar="PREFIX",
                   help="its prefix (default: the only live platform)")


def _the_platform(prefix: str | None) -> str:
    if prefix:
        return prefix
    live = [p["prefix"] for p in live_platforms(query=False)]
    if len(live) != 1:
        raise errors.InvalidRequest(f"{len(live)} live platforms: name one by its prefix "
                                    f"({', '.join(live) or 'hetproc status lists them'})")
    return live[0]


def cmd_unwedge(args: argparse.Namespace, role: Callable[[str], int | None]) -> int:
    from ..client import connect, unwedge
    prefix = _the_platform(args.platform)
    with connect(prefix, "hetproc-device", role=role(prefix)) as client:
        out = unwedge(client, args.name)
    if out["was_wedged"]:
        print(f"{out['device']} unwedged: reset, serving again (epoch {out['epoch']})")
    else:
        print(f"{out['device']} was not wedged: nothing to do")
    return EXIT_OK

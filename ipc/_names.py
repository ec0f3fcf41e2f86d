"""Names of the platform's named objects, the manifest that lists them, and cleanup.

Every named object of one platform (shared-memory segments, semaphores, the manifest
itself) lives under one prefix ``hp.<supervisor pid>.<random>.``. On Linux both POSIX
shared memory and named semaphores appear in ``/dev/shm`` (semaphores as ``sem.<name>``),
so the prefix alone finds everything a platform made, even objects created after the
manifest was last written. The control socket lives in the abstract Unix namespace, which
the kernel removes with its last descriptor: it can never leak.

The manifest (``/dev/shm/<prefix>manifest.json``) records the supervisor's and the
devices' pids with their start times, so that ``cleanup`` can tell a dead platform from a
live one even when pids are reused. Any process of the same user can rewrite it, so
cleanup believes it only as far as it can check: a recorded process is signalled only when
it is *proven* the platform's own -- same user, the recorded start time, and it maps one
of the platform's command rings (only its supervisor and devices do; clients never) --
and only names under the platform's prefix are unlinked, whatever the manifest lists.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import posix_ipc
import psutil

SHM_DIR = Path("/dev/shm")
ROOT = "hp."
_PREFIX_RE = re.compile(r"^(?:sem\.)?(hp\.(\d+)\.[0-9a-f]{6}\.)")
MANIFEST_SUFFIX = "manifest.json"


def new_prefix(pid: int | None = None) -> str:
    """A prefix unique on this machine: the creator's pid plus 24 random bits."""
    return f"{ROOT}{pid or os.getpid()}.{secrets.token_hex(3)}."


def socket_address(prefix: str) -> str:
    """Abstract-namespace address of a platform's control socket (leading NUL)."""
    return "\0" + prefix + "ctl"


def prefix_of(entry: str) -> str | None:
    """The platform prefix of a ``/dev/shm`` entry name, or None if it is not ours."""
    m = _PREFIX_RE.match(entry)
    return m.group(1) if m else None


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class Manifest:
    """The on-disk list of a platform's pids and objects, rewritten atomically."""

    def __init__(self, prefix: str, data: dict[str, Any] | None = None) -> None:
        self.prefix = prefix
        self.data: dict[str, Any] = data or {"prefix": prefix, "objects": [], "processes": {}}

    @property
    def path(self) -> Path:
        return SHM_DIR / (self.prefix + MANIFEST_SUFFIX)

    def add_object(self, kind: str, name: str) -> None:
        self.data["objects"].append([kind, name])

    def set_process(self, role: str, pid: int | None) -> None:
        if pid is None:
            self.data["processes"].pop(role, None)
        else:
            self.data["processes"][role] = [pid, process_start_time(pid)]

    def write(self) -> None:
        tmp = SHM_DIR / (self.prefix + "tmp." + MANIFEST_SUFFIX)
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def processes(self) -> list[tuple[str, int, float | None]]:
        """The recorded (role, pid, start time) entries that are well formed."""
        procs = self.data.get("processes") if isinstance(self.data, dict) else None
        out = []
        for role, entry in (procs.items() if isinstance(procs, dict) else ()):
            if (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and entry[0] > 0 and (entry[1] is None or type(entry[1]) in (int, float))):
                out.append((str(role), entry[0], entry[1]))
        return out

    def objects(self) -> list[tuple[str, str]]:
        """The recorded (kind, name) entries that name an object under this prefix: a
        tampered manifest must not get cleanup to unlink anyone else's objects."""
        objs = self.data.get("objects") if isinstance(self.data, dict) else None
        out = []
        for entry in (objs if isinstance(objs, list) else ()):
            if (isinstance(entry, list) and len(entry) == 2 and entry[0] in ("shm", "sem")
                    and isinstance(entry[1], str) and "/" not in entry[1]
                    and prefix_of(entry[1]) == self.prefix):
                out.append((entry[0], entry[1]))
        return out

    @classmethod
    def load(cls, prefix: str) -> Manifest | None:
        try:
            return cls(prefix, json.loads((SHM_DIR / (prefix + MANIFEST_SUFFIX)).read_text()))
        except (OSError, ValueError):
            return None


def unlink_object(kind: str, name: str) -> bool:
    """Remove one named object; True if it existed."""
    try:
        if kind == "shm":
            posix_ipc.unlink_shared_memory(name)
        elif kind == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            return False
        return True
    except posix_ipc.ExistentialError:
        return False


def entries_with_prefix(prefix: str) -> list[str]:
    try:
        return [e for e in os.listdir(SHM_DIR) if prefix_of(e) == prefix]
    except OSError:
        return []


def remove_prefix(prefix: str) -> list[str]:
    """Unlink every ``/dev/shm`` entry under ``prefix``; returns what was removed."""
    removed = []
    for entry in entries_with_prefix(prefix):
        path = SHM_DIR / entry
        try:
            path.unlink()
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


def platform_prefixes() -> set[str]:
    try:
        return {p for p in map(prefix_of, os.listdir(SHM_DIR)) if p}
    except OSError:
        return set()


def platform_is_alive(prefix: str) -> bool:
    """A platform is alive while its supervisor runs. The pid in the prefix is the
    supervisor's (it made the prefix) and cannot be forged without renaming every object;
    the manifest's record is believed when its process is proven ours."""
    pid = int(prefix.split(".")[1])
    if platform_process(prefix, pid, None, any_object=True):
        return True
    manifest = Manifest.load(prefix)
    if manifest is None:
        # No manifest yet (starting) or lost: fall back on the creator pid in the prefix.
        return process_start_time(pid) is not None
    for role, pid, start in manifest.processes():
        if role == "supervisor" and start is not None and platform_process(prefix, pid, start):
            return True
    return False


def platform_process(prefix: str, pid: int, start_time: float | None, *,
                     any_object: bool = False) -> bool:
    """Proof that ``pid`` is one of this platform's own processes: same user, not a
    zombie, started at ``start_time`` (when given), and mapping one of the platform's
    command rings (``any_object``: any of its objects, enough to prove liveness)."""
    try:
        proc = psutil.Process(pid)
        if proc.uids().real != os.getuid() or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if start_time is not None and abs(proc.create_time() - start_time) >= 0.05:
            return False
        mark = prefix if any_object else prefix + "ring."
        return any(os.path.basename(m.path).startswith(mark)
                   for m in proc.memory_maps(grouped=True))
    except (psutil.Error, OSError, ValueError):
        return False


def kill_recorded_processes(manifest: Manifest, *, timeout: float = 2.0) -> list[int]:
    """SIGKILL every recorded process proven to be the platform's own; wait for it to go.
    A tampered entry (an unrelated pid, a forged start time) is left alone."""
    killed = []
    for _, pid, start in manifest.processes():
        if pid == os.getpid() or start is None:
            continue
        if platform_process(manifest.prefix, pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for pid in killed:
        try:
            psutil.Process(pid).wait(timeout=max(0.0, deadline - time.monotonic()))
        except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
            pass
    return killed


def cleanup_dead(*, include_live: bool = False) -> dict[str, Any]:
    """Remove the objects and processes of every platform whose supervisor is dead.

    Live platforms are left alone unless ``include_live`` (which is for a platform's own
    owner tearing it down after its supervisor stopped answering).
    """
    report: dict[str, Any] = {"platforms": [], "killed": [], "removed": [], "live": []}
    for prefix in sorted(platform_prefixes()):
        if not include_live and platform_is_alive(prefix):
            report["live"].append(prefix)
            continue
        report["platforms"].append(prefix)
        report.update(_cleanup_one(prefix, report))
    return report


def cleanup_prefix(prefix: str) -> dict[str, Any]:
    """Tear one platform down from the outside: kill its processes, unlink its objects."""
    report: dict[str, Any] = {"platforms": [prefix], "killed": [], "removed": [], "live": []}
    return _cleanup_one(prefix, report)


def _cleanup_one(prefix: str, report: dict[str, Any]) -> dict[str, Any]:
    manifest = Manifest.load(prefix)
    if manifest is not None:
        report["killed"] += kill_recorded_processes(manifest)
        for kind, name in manifest.objects():
            if unlink_object(kind, name):
                report["removed"].append(name)
    report["removed"] += remove_prefix(prefix)
    return report

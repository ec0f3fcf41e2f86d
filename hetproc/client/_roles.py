"""A platform's trace, shared with the user who started it: the trace role's token file.

Reading a live platform's trace needs a role (the owner's, or one it granted): a tenant
sees its own work only. The owner of a platform started with ``share_trace=True`` (what
``hetproc run`` does) grants a trace-only role (``grant_role(scope="trace")``: the trace
and frozen windows, no faults, no other tenant's metrics) and leaves its token where only
its user can read it::

    /dev/shm/<prefix>role.trace    mode 0600, created exclusively, never through a link

so that same user, from another terminal, reads the trace (``hetproc trace export
PREFIX``): the grant is the owner's, the file's mode keeps it to the user. The file goes
with the platform's other objects (``Platform.stop``, ``hetproc cleanup``). A file that
another user owns, or that anyone else may read, is not a grant and is ignored.
"""

from __future__ import annotations

import os
import stat

from ipc import SHM_DIR

ROLE_FILE = "role.trace"
_TOKEN_BYTES = 32


def role_path(prefix: str) -> str:
    return os.fspath(SHM_DIR / f"{prefix}{ROLE_FILE}")


def publish_trace_role(prefix: str, token: int) -> str:
    """Leave ``token`` (a trace role the owner granted) for the owner's user; its path."""
    path = role_path(prefix)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, f"{int(token)}\n".encode())
    finally:
        os.close(fd)
    return path


def read_trace_role(prefix: str) -> int | None:
    """The trace role left for this user on platform ``prefix``, or None (no such file,
    or one this user does not own alone)."""
    try:
        fd = os.open(role_path(prefix), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                or st.st_mode & 0o077):
            return None
        text = os.read(fd, _TOKEN_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def forget_trace_role(prefix: str) -> None:
    try:
        os.unlink(role_path(prefix))
    except FileNotFoundError:
        pass

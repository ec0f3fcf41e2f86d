"""The client side of mappings and sharing: mixed into Client, Context, Buffer and Fence.

Kept apart from ``_client`` so the request plumbing and the memory API evolve separately;
every method here is one request to the supervisor (``hetproc.supervisor._iommu`` has the rules).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Iterable

from ipc import errors

if TYPE_CHECKING:
    from ._client import Buffer, Client, Fence


class ClientMemory:
    def import_buffer(self: "Client", token: int) -> "Buffer":
        """The buffer another client exported: the same handle, segment and offset, with
        the permission the export granted ("r" for ``read_only``). Free it when done: the
        memory lives until its owner and every importer let go."""
        from ._client import Buffer
        return Buffer(self, self._request("import", token=int(token), kind="buffer"))

    def import_fence(self, token: int) -> "Fence":
        """A fence another client exported, to wait on or to pass in ``wait=``; release
        it when done (it keeps the fence's slot alive until then)."""
        from ._client import Fence
        reply = self._request("import", token=int(token), kind="fence")  # type: ignore[attr-defined]
        # Owned: the import is a reference, and release() (or dropping it) gives it back.
        return Fence(self, reply["fence"], cid=reply.get("cid", 0), owned=True)  # type: ignore[arg-type]

    def memory_events(self, since: int = 0, limit: int = 4096, *,
                      cids: Iterable[int] | None = None, timeout: float = 5.0) -> dict[str, Any]:
        """The memory timeline: maps, unmaps, cleans, invalidates, copies, reformats and
        kernel slices, oldest first; ``{"events", "last_seq", "missed"}``.

        With ``cids``: only those requests' events, once every command of them retired
        (a fence wakes its waiter before the supervisor has read the device's record);
        ``FenceTimeout`` after ``timeout`` seconds."""
        if cids is None:
            return self._request("mem_events", since=since, limit=limit)  # type: ignore[attr-defined]
        wanted = [int(c) for c in cids]
        deadline = time.monotonic() + timeout
        while True:
            out = self._request("mem_events", since=since, limit=limit, cids=wanted)  # type: ignore[attr-defined]
            if not any(out.get("open", {}).values()):
                return out
            if time.monotonic() > deadline:
                raise errors.FenceTimeout(f"requests {wanted} still running after {timeout} s")
            time.sleep(0.002)


class ContextMemory:
    def map(self, buf: "Buffer", perm: str = "rw") -> str:
        """Map ``buf`` into this context ("r", "w" or "rw") until ``unmap``: later submits
        pay no map cost. Mapping more than the client may reach is an IommuFault."""
        return self.client._request("map", ctx=self.handle, buf=buf.handle, perm=perm)["perm"]  # type: ignore[attr-defined]

    def unmap(self, buf: "Buffer") -> bool:
        """Drop the mapping; False if commands still use it (it goes when they finish)."""
        return self.client._request("unmap", ctx=self.handle, buf=buf.handle)["unmapped"]  # type: ignore[attr-defined]


class BufferMemory:
    def export(self: "Buffer", read_only: bool = False) -> int:
        """A token another client turns into this buffer with ``import_buffer``."""
        return self.client._request("export", buf=self.handle, read_only=bool(read_only))["token"]

    def identity(self: "Buffer") -> dict[str, Any]:
        """Segment, its inode (the same in every process that maps it), offset and handle:
        what the zero-copy evidence compares between producer, delegate and device."""
        try:
            inode = os.stat(f"/dev/shm/{self.segment}").st_ino
        except OSError:
            inode = 0
        return {"segment": self.segment, "inode": inode, "offset": self.offset,
                "buf": self.handle}


class FenceMemory:
    def export(self: "Fence") -> int:
        """A token another client turns into this fence with ``import_fence``."""
        try:
            return self.client._request("export", fence=self.handle)["token"]
        except errors.StaleHandle:
            raise errors.StaleHandle(f"fence {self.handle:#x} was released") from None

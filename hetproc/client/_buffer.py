"""``Buffer``: a tensor in shared memory, mapped into this process without a copy.

The supervisor places a buffer in one of this process's segments (an exportable one in a
segment of its own) and hands the segment over as a descriptor; ``array()`` is a numpy view
of that mapping. A free waits for the last view: the block must never be handed to another
tenant while this process can still write it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc import Segment, errors

if TYPE_CHECKING:
    from ._client import Client


class Buffer:
    """A tensor in shared memory: ``array()`` maps it as numpy (no copy, ever).

    Made by ``Client.alloc`` / ``Context.alloc`` or ``Client.import_buffer``; passed to
    commands as inputs and outputs; shared with ``export``; given back with ``free``
    (after which every use raises ``StaleHandle``).
    """

    def __init__(self, client: Client, desc: dict[str, Any]) -> None:
        self.client = client
        self._conn = client.connection
        self.handle: int = desc["buf"]
        self.segment: str = desc["segment"]
        self.offset: int = desc["offset"]
        self.nbytes: int = desc["nbytes"]
        self.shape = tuple(desc["shape"])
        self.dtype = np.dtype(desc["dtype"])
        self.strides = tuple(desc["strides"]) if desc.get("strides") else None
        self.layout: str | None = desc.get("layout")
        self.usage = tuple(desc["usage"]) if desc.get("usage") else None
        self.perm: str = desc.get("perm", "rw")  # "r": imported read-only
        self.exportable: bool = bool(desc.get("exportable"))  # in a segment of its own
        if self.exportable:
            self._conn.own_segment(self.handle, self.segment)
        self._freed = False
        self._views: list[weakref.ref] = []  # anchors of the views handed out

    def array(self) -> np.ndarray:
        """A numpy view of the shared memory. Writes are seen by devices that run later;
        reading a device's output is only safe after waiting on the fence it signals.
        ``StaleHandle`` after ``free()``, ``PlatformClosed`` after the client closed."""
        if self._freed:
            raise errors.StaleHandle(f"buffer {self.handle:#x} was freed")
        self._conn.trace.map_buffer(self.segment, self.handle, self.nbytes)
        try:
            seg: Segment = self._conn.segments.get(self.segment)
        except KeyError:
            raise errors.PlatformClosed(f"buffer {self.handle:#x}: its segment is not mapped "
                                        "in this process (client closed?)") from None
        checked = seg.view(self.offset, self.shape, self.dtype, self.strides)  # bounds
        anchor = _ViewAnchor(checked.shape, checked.dtype, buffer=seg.map, offset=self.offset,
                             strides=checked.strides)
        self._views = [r for r in self._views if r() is not None] + [weakref.ref(anchor)]
        view = anchor.view(np.ndarray)
        if "w" not in self.perm:
            view.flags.writeable = False  # a read-only import: the CPU mapping is too
        return view

    def free(self) -> None:
        """Give the buffer back (freeing twice is harmless). While a numpy view taken
        before is alive (or any array derived from one), the block stays this client's:
        the free request goes with the first request after the last such view is gone,
        so the block can never be handed to another tenant under a live view."""
        if self._freed:
            return
        self._freed = True
        self._conn.free(self.handle, self._views)

    def live_handle(self) -> int:
        """The handle, for a command; ``StaleHandle`` once freed (its free may still wait
        for the last view), as the supervisor would say once the free is through."""
        if self._freed:
            raise errors.StaleHandle(f"buffer {self.handle:#x} was freed")
        return self.handle

    # -- sharing -------------------------------------------------------------

    def export(self, read_only: bool = False) -> int:
        """A token another client turns into this buffer with ``import_buffer``. Only a
        buffer allocated ``exportable=True`` (a segment of its own) may be exported:
        ``NotPermitted`` otherwise, as an importer would map its owner's other buffers;
        ``StaleHandle`` once freed."""
        handle = self.live_handle()
        return self._conn.request("export", buf=handle, read_only=bool(read_only))["token"]

    def identity(self) -> dict[str, Any]:
        """Segment, its inode (the same in every process that maps it), offset and handle:
        what the zero-copy evidence compares between producer, delegate and device."""
        try:
            inode = self._conn.segments.get(self.segment).inode
        except KeyError:
            inode = 0
        return {"segment": self.segment, "inode": inode, "offset": self.offset,
                "buf": self.handle}

    def __repr__(self) -> str:
        return f"Buffer({self.handle:#x}, shape={self.shape}, dtype={self.dtype.name})"


class _ViewAnchor(np.ndarray):
    """The base of every array ``Buffer.array()`` hands out: numpy keeps a view's base
    chain down to the first array of another type, so every slice, reshape or transpose
    of the view holds this anchor alive, and a weak set of anchors says whether any view
    of a buffer is still alive."""


__all__ = ["Buffer"]

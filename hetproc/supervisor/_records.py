"""What the supervisor knows about clients, contexts, buffers and fences.

Lifetimes (seed §1): a buffer or fence is referenced by its client and by every command
that may still touch it; it is reclaimed only when the client let go *and* no such command
remains. ``refs`` counts the commands.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc import Block, FrameReader, errors, span_bytes


@dataclass(eq=False)
class ClientRec:
    id: int
    name: str
    pid: int
    owner: bool
    conn: Any
    contexts: set[int] = field(default_factory=set)
    buffers: set[int] = field(default_factory=set)
    fences: set[int] = field(default_factory=set)
    # The connection's state in the supervisor's loop: bytes read but not yet a whole
    # frame, frames read but not yet served, replies not yet sent.
    reader: FrameReader = field(default_factory=FrameReader)
    pending: collections.deque = field(default_factory=collections.deque)
    outbuf: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class ContextRec:
    handle: int
    client: ClientRec
    device: str
    priority: int
    name: str
    lost: errors.HetprocError | None = None
    inflight: int = 0
    submitted: int = 0
    # Which cache maintenance the runtime does for this context on a non-coherent device:
    # "both" (correct), "clean" (forgets to invalidate), "invalidate", "none".
    cache_maintenance: str = "both"


@dataclass(eq=False)
class BufferRec:
    handle: int
    block: Block
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None
    nbytes: int
    client: ClientRec
    refs: int = 0
    released: bool = False  # the client freed it; reclaim when refs drop to 0
    trusted: bool = True
    # Zero-copy preconditions (seed §5) and sharing; see hetproc.supervisor._handoff / _iommu.
    layout: str | None = None      # "NHWC", "NCHW"... for rank-4 tensors; None: no layout
    usage: tuple[str, ...] | None = None  # device kinds/names that may map it; None: any
    byte_offset: int = 0           # where the tensor starts inside its block
    internal: bool = False         # a runtime-made reformat/copy buffer, never a client's
    last_writer: str | None = None  # device of the last command that wrote it
    importers: dict[int, str] = field(default_factory=dict)  # client id -> "r" / "rw"
    # Non-coherent devices that may hold this buffer dirty in their cache (written, not
    # cleaned): its block is reused only after each of them forgot those lines.
    dirty_on: set[str] = field(default_factory=set)

    @property
    def offset(self) -> int:
        """Byte offset of the tensor's first element in its segment."""
        return self.block.offset + self.byte_offset

    def descriptor(self) -> list:
        return [self.block.segment, self.offset, list(self.shape), self.dtype,
                list(self.strides) if self.strides else None]

    def spec(self) -> tuple[tuple[int, ...], str]:
        return self.shape, self.dtype


@dataclass(eq=False)
class FenceRec:
    handle: int
    client: ClientRec | None
    refs: int = 0
    released: bool = False
    bound: bool = False  # some command will signal it; no second command may
    error: dict | None = None
    importers: set[int] = field(default_factory=set)  # client ids that imported it


def nbytes_of(shape: tuple[int, ...], dtype: str, strides: tuple[int, ...] | None) -> int:
    return span_bytes(shape, np.dtype(dtype).itemsize, strides)

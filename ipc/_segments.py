"""POSIX shared-memory segments, numpy views on them, and a pool that reuses memory.

A fresh shared-memory page costs ~0.6 ms per MiB in page faults on first touch, while a
reused one runs at memcpy speed, so steady-state allocation must never create a segment:
``BlockPool`` hands out buddy blocks of a few budget-sized segments and recycles freed
blocks, merged. Every block is 4 KiB aligned (more than the 64 bytes a device may demand).
"""

from __future__ import annotations

import errno
import fcntl
import math
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import posix_ipc

from ._buddy import BuddyAllocator

PAGE = mmap.PAGESIZE
MIN_BLOCK = 4096
SCAN_BYTES = 256 << 10  # freed blocks this large are scanned for holes before the scrub


class Segment:
    """One mapped shared-memory object. Only its creator unlinks it.

    Named (``create`` / ``attach``: a POSIX shm object under the platform's prefix, which
    any process of the same user can open by name), or anonymous (``anonymous``: a memfd
    that never has a name; other processes get it only as a descriptor passed to them,
    ``from_fd``). ``key`` is how caches and blocks refer to it: the name, or the small id
    its creator gave an anonymous one. ``inode`` is the same in every process mapping it.
    """

    def __init__(self, name: str, size: int, *, create: bool, prefault: bool = False,
                 keep_fd: bool = False) -> None:
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, size=size if create else 0)
        self.fd = -1  # kept open only on request (finding the holes of a pool segment)
        try:
            self.size = shm.size
            self.map = mmap.mmap(shm.fd, self.size)
            self.inode = os.fstat(shm.fd).st_ino
        finally:
            if keep_fd:
                self.fd = shm.fd
            else:
                shm.close_fd()
        self.name = name
        self.key: str | int = name
        self.writable = True
        self.created = create
        self.anonymous = False
        if prefault:
            self.prefault()

    map: mmap.mmap  # set at once, or on first use for an anonymous one (``mapped``)

    @classmethod
    def anonymous_segment(cls, label: str, size: int, key: int, *,
                          mapped: bool = True) -> Segment:
        """A nameless segment (memfd) of ``size`` bytes, sparse until touched; its
        descriptor is kept (``fd``) to be passed to the processes that may map it. Not
        ``mapped``: this process maps it only when it first reads ``map`` (a mapping
        holds a descriptor of its own: a segment only passed on costs one, not two)."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls._over_fd(fd, label, key, created=True, mapped=mapped)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, key: int, *, size: int | None = None,
                keep_fd: bool = False) -> Segment:
        """Map a segment handed over as a descriptor. ``size``: what the sender said it
        is (ValueError if the object is not exactly that). The descriptor is closed
        unless ``keep_fd`` (the mapping holds the memory, not the descriptor). A
        descriptor opened read-only (``read_only_descriptor``) is mapped read-only: the
        kernel refuses every write through the mapping (``writable`` is False)."""
        try:
            st = os.fstat(fd)
            if size is not None and st.st_size != size:
                raise ValueError(f"segment {key}: {st.st_size} bytes, announced {size}")
            if st.st_size <= 0:
                raise ValueError(f"segment {key} is empty")
            seg = cls._over_fd(fd, f"segment {key}", key, created=False)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(seg.fd)
            seg.fd = -1
        return seg

    @classmethod
    def _over_fd(cls, fd: int, label: str, key: int, *, created: bool,
                 mapped: bool = True) -> Segment:
        seg = cls.__new__(cls)
        st = os.fstat(fd)
        seg.size = st.st_size
        seg.writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        if mapped:
            seg.map = seg._map_fd(fd)
        seg.inode = st.st_ino
        seg.fd = fd
        seg.name = label
        seg.key = key
        seg.created = created
        seg.anonymous = True
        return seg

    def _map_fd(self, fd: int) -> mmap.mmap:
        return mmap.mmap(fd, self.size, access=(
            mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ))

    def __getattr__(self, name: str) -> mmap.mmap:
        # Only a segment made without its mapping gets here (any other attribute is
        # found before): it maps itself on first use, through the descriptor it kept.
        if name != "map" or self.__dict__.get("fd", -1) < 0:
            raise AttributeError(name)
        self.map = self._map_fd(self.fd)
        return self.map

    @property
    def mapped(self) -> bool:
        """This process maps the segment (a mapping holds one more descriptor)."""
        return "map" in self.__dict__

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = False,
               keep_fd: bool = False) -> Segment:
        return cls(name, size, create=True, prefault=prefault, keep_fd=keep_fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        return cls(name, 0, create=False)

    def prefault(self) -> None:
        """Touch every page now, so the first real use does not pay the page faults."""
        view = np.frombuffer(self.map, dtype=np.uint8)
        view[::PAGE] = 0
        del view

    def view(self, offset: int, shape: Sequence[int], dtype: np.dtype | str,
             strides: Sequence[int] | None = None) -> np.ndarray:
        """A numpy array over this segment; bounds are checked, never trusted."""
        dt = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        strides = tuple(int(s) for s in strides) if strides else None
        extent = span_bytes(shape, dt.itemsize, strides)
        if offset < 0 or offset + extent > self.size:
            raise ValueError(f"view [{offset}, +{extent}) outside segment of {self.size} bytes")
        return np.ndarray(shape, dt, buffer=self.map, offset=offset, strides=strides)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.mapped:
            return
        try:
            self.map.close()
        except BufferError:
            # numpy views still exist; the mapping goes away with the last of them.
            pass

    def unlink(self) -> None:
        if self.anonymous:
            return  # never had a name: it goes with its last descriptor and mapping
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass


def read_only_descriptor(fd: int) -> int:
    """A new descriptor of ``fd``'s object that can only read it (the caller closes it).

    It is a fresh open of the object (its own open file description), so nothing done
    with it reaches the original's write access: a mapping of it is read-only, and the
    kernel refuses ``mprotect`` to writable, a writable ``mmap`` and ``write``. The
    object's mode becomes owner-read-only, so reopening it for writing through
    ``/proc/<pid>/fd`` is refused too; descriptors opened before keep their access.
    """
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fchmod(ro, 0o400)
    except BaseException:
        os.close(ro)
        raise
    return ro


def span_bytes(shape: Sequence[int], itemsize: int, strides: Sequence[int] | None) -> int:
    """Bytes from the first to one past the last element of a strided view."""
    if any(s == 0 for s in shape):
        return 0
    if not strides:
        return math.prod(shape) * itemsize  # math.prod: 0.1 us; np.prod: 6 us
    if any(st < 0 for st in strides):
        raise ValueError("negative strides are not allowed in shared buffers")
    return sum((n - 1) * st for n, st in zip(shape, strides)) + itemsize


class SegmentCache:
    """Mappings by key, cached: attaching costs 3-5 us, a lookup far less.

    A named segment (a ``str`` key) is attached on first use; an anonymous one (an
    ``int`` key) only exists here once its descriptor was received and ``add``ed:
    ``get`` of an unknown id asks ``fetch`` (e.g. read the descriptors waiting on a
    socket), then raises ``KeyError``. ``imports`` counts every mapping made (attached
    or added), whenever: what a map brought in is its growth, never the change of
    ``len``, which a fetch that reads drops too makes smaller."""

    def __init__(self, fetch: Callable[[], None] | None = None) -> None:
        self._segments: dict[str | int, Segment] = {}
        self.fetch = fetch
        self.imports = 0

    def get(self, key: str | int) -> Segment:
        seg = self._segments.get(key)
        if seg is None:
            if type(key) is str:
                seg = self._segments[key] = Segment.attach(key)
                self.imports += 1
            else:
                if self.fetch is not None:
                    self.fetch()
                    seg = self._segments.get(key)
                if seg is None:
                    raise KeyError(f"segment {key!r} was never handed to this process")
        return seg

    def __contains__(self, key: str | int) -> bool:
        return key in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    def keys(self) -> list[str | int]:
        return list(self._segments)

    def add(self, seg: Segment) -> None:
        old = self._segments.get(seg.key)
        if old is not None and old is not seg:
            old.close()
        self._segments[seg.key] = seg
        self.imports += 1

    def forget(self, key: str | int) -> None:
        seg = self._segments.pop(key, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


@dataclass(frozen=True)
class Block:
    segment: str | int  # the segment's key: its name, or the id of an anonymous one
    offset: int
    capacity: int


def block_size(nbytes: int) -> int:
    """The power-of-two size of the block that holds ``nbytes`` (at least one page)."""
    return max(MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())


class BlockPool:
    """Shared memory handed out as buddy blocks (``ipc._buddy``), zeroed between owners.

    The budget ``limit`` is one address range cut into power-of-two chunks; each chunk is
    one shared-memory segment, created (sparse: tmpfs gives pages on first touch) when a
    block is first placed in it and kept until ``close``. Freed blocks coalesce, so a
    request that fits in an aligned free region succeeds whatever came and went before.

    Tenants never see each other's bytes: a new segment reads as zeros, and ``free``
    zeroes a block before it can be handed out again. ``free`` is called only once no
    device may still touch the block (invariant 1), so nothing writes into it after the
    scrub -- except a client that kept a view past ``free``, which the client API must
    prevent. The freeing process pays for the scrub (``zero_bytes``; costs in ``bench``).
    """

    def __init__(self, prefix: str, *, limit: int,
                 on_new_segment: Callable[[Segment], None] = lambda seg: None,
                 make_segment: Callable[[int, int], Segment] | None = None) -> None:
        """``make_segment(chunk index, size)``: how a chunk's segment is made (default: a
        named one, ``<prefix>m<index>``); blocks name their segment by its ``key``."""
        self._prefix = prefix
        self._limit = limit
        self._on_new = on_new_segment
        self._make = make_segment or (lambda index, size: Segment.create(
            f"{prefix}m{index}", size, keep_fd=True))
        self.buddy = BuddyAllocator(limit, MIN_BLOCK)
        self.segments: dict[str | int, Segment] = {}
        self._by_chunk: list[Segment | None] = [None] * len(self.buddy.chunks)
        self.reserved_bytes = 0
        self.zeroed_bytes = 0  # bytes actually written by scrubs (holes are skipped)

    @property
    def used_bytes(self) -> int:
        return self.buddy.used_bytes

    @property
    def live_blocks(self) -> int:
        return self.buddy.live_blocks

    @property
    def free_bytes(self) -> int:
        return self.buddy.free_bytes

    def largest_free_block(self) -> int:
        return self.buddy.largest_free()

    def allocate(self, nbytes: int) -> Block:
        """A zero-filled block of at least ``nbytes``; MemoryError past the budget."""
        try:
            address = self.buddy.allocate(nbytes)
        except MemoryError as exc:
            raise MemoryError(f"memory budget of {self._limit} bytes: {exc}") from None
        index, base = self.buddy.chunk_of(address)
        try:
            seg = self._chunk_segment(index)
        except BaseException:
            self.buddy.free(address)
            raise
        return Block(seg.key, address - base, self.buddy.size_of(address))

    def free(self, block: Block, release: bool = False) -> None:
        """Scrub the block, then give it back (it may merge with free neighbours).
        ``release``: hand its pages back to the kernel instead (they read as zeros, and
        the next owner pays for fresh ones): what keeps freed memory from piling up."""
        seg = self.segments.get(block.segment)
        if seg is None or seg not in self._by_chunk:
            raise ValueError(f"{block} is not from this pool")
        index = self._by_chunk.index(seg)
        address = self.buddy.chunks[index][0] + block.offset
        if self.buddy.live_size(address) != block.capacity:
            raise ValueError(f"{block} is not a live block of this pool (double free?)")
        if not (release and release_pages(seg, block.offset, block.capacity)):
            self.zeroed_bytes += zero_bytes(seg, block.offset, block.capacity, seg.fd)
        self.buddy.free(address)

    def _chunk_segment(self, index: int) -> Segment:
        seg = self._by_chunk[index]
        if seg is None:
            size = self.buddy.chunks[index][1]
            seg = self._make(index, size)
            self._by_chunk[index] = seg
            self.segments[seg.key] = seg
            self.reserved_bytes += size
            self._on_new(seg)
        return seg

    def close(self, unlink: bool) -> None:
        for seg in self.segments.values():
            seg.close()
            if unlink:
                seg.unlink()
        self.segments.clear()
        self._by_chunk = [None] * len(self.buddy.chunks)


def release_pages(seg: Segment, offset: int, nbytes: int) -> bool:
    """Give ``[offset, +nbytes)``'s pages back to the kernel (they read as zeros after).
    A segment this process does not map is mapped for the call only, at that range.
    False when that fails (no descriptor left for the mapping): scrub it instead."""
    if seg.mapped:
        seg.map.madvise(mmap.MADV_REMOVE, offset, nbytes)
        return True
    if seg.fd < 0:
        return False
    try:
        window = mmap.mmap(seg.fd, nbytes, offset=offset)
    except (OSError, ValueError):
        return False
    try:
        window.madvise(mmap.MADV_REMOVE)
    finally:
        window.close()
    return True


def zero_bytes(seg: Segment, offset: int, nbytes: int, fd: int = -1) -> int:
    """Make ``[offset, +nbytes)`` read as zeros in every process that maps it.

    The pages stay in the shared object, so the next owner maps them with a minor fault
    instead of paying for fresh zero pages (~0.6 ms per MiB). Given the object's ``fd``,
    the zeros are written with ``pwrite`` -- straight into the shared pages, without
    mapping them into this process: no page faults here, and the scrubber is not counted
    as a second user of every page that ever changed owner -- and only where the object
    holds pages (``SEEK_DATA``): a hole already reads as zeros. Returns the bytes written.
    """
    if fd < 0:
        view = np.frombuffer(seg.map, dtype=np.uint8, count=nbytes, offset=offset)
        view.fill(0)
        del view  # dropped at once, so the mapping can still be closed
        return nbytes
    written = 0
    for start, stop in _data_runs(fd, offset, offset + nbytes):
        pos = start
        while pos < stop:
            n = os.pwrite(fd, _ZEROS[:min(len(_ZEROS), stop - pos)], pos)
            if n <= 0:
                raise OSError(f"pwrite of zeros into {seg.name} wrote {n} bytes")
            pos += n
        written += stop - start
    return written


_ZEROS = memoryview(bytes(1 << 20))


def _data_runs(fd: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` that hold pages; the whole range when unknown."""
    if fd < 0 or stop - start < SCAN_BYTES:
        return [(start, stop)]
    runs, pos = [], start
    try:
        while pos < stop:
            data = os.lseek(fd, pos, os.SEEK_DATA)
            if data >= stop:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), stop)
            runs.append((data, hole))
            pos = hole
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data past pos: the rest is a hole
            return runs
        return [(start, stop)]  # cannot tell: write it all
    return runs

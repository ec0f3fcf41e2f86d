"""A device's view of memory: its own IOMMU check and, when it is not coherent, its cache.

::

    exec packet ──▶ acquire()   1. IOMMU: every descriptor's permission must cover the
                                   access (inputs need "r", outputs "w"), else IommuFault
                                   and nothing is touched
                                2. hold the transient map, run the invalidates asked for
                                3. numpy views: coherent -> straight onto shared memory;
                                   non-coherent -> onto this process's private copy
                    kernel runs on the views
                ──▶ release()   4. run the cleans asked for (write-back), hold the unmap
                ──▶ report()    what happened, with timestamps, for the completion record

Why a private copy: on a real SoC a non-coherent device reads through caches that do not
snoop other agents, so after it read a buffer, later writes by others stay invisible until
it invalidates, and its own writes sit in its cache until it cleans. Emulating that with
real memory in the device process makes the stale read *happen* when the runtime forgets
the maintenance, instead of being a counter that says it would have.

The cache holds whole buffers (a "line" is one buffer's byte span), up to ``cache_bytes``,
least recently used out first; evicting a dirty buffer writes it back, as a write-back
cache does. A buffer larger than the whole cache streams past it (read and written in
place): a real cache keeps at most its size of a large buffer, and copying 64 MiB into
private memory would make every large hand-off look like a copy in PSS/USS.
Only the elements of a view are written back, never the padding between strided rows:
the padding may belong to someone else's write.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc

from ipc import SegmentCache, clock, errors

from ._hold import hold_until

MAX_REPORTED_IDS = 8  # identity evidence per command; keeps the completion record small
_EV_ORDER = ("map", "invalidate", "clean", "unmap")


# A cache line's key: (segment id, offset, buffer handle).
_Key = tuple[int, int, int]
# What a view of an operand is made of: (shape, dtype, strides or None for C order).
_Layout = tuple[tuple[int, ...], np.dtype, tuple[int, ...] | None]


class _Operand:
    __slots__ = ("key", "shared", "span", "perm", "handle", "segment", "offset", "layout")

    def __init__(self, key: _Key, shared: np.ndarray | None, span: int, perm: str,
                 layout: _Layout) -> None:
        self.key, self.shared, self.span, self.perm = key, shared, span, perm
        self.segment, self.offset, self.handle = key
        self.layout = layout


class _Line:
    __slots__ = ("data", "dirty", "written")

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.dirty = False
        # The views last written through, (shared, private): a write-back copies
        # private -> shared.
        self.written: tuple[np.ndarray, np.ndarray] | None = None


class DeviceMemory:
    """Descriptors in, numpy views out; see the module docstring."""

    def __init__(self, segments: SegmentCache, *, coherent: bool, cache_bytes: int) -> None:
        self.segments = segments
        self.coherent = coherent
        self.capacity = 0 if coherent else max(0, cache_bytes)
        # Keyed by (segment, offset, buffer handle): a block that changed owner comes with
        # a new handle, so a line filled for its previous owner can never be hit by the
        # next one, whatever maintenance the next one's context skips.
        self.lines: OrderedDict[_Key, _Line] = OrderedDict()
        # Bytes the lines hold: a fill adds, a drop or an eviction subtracts; a fill
        # evicts (least recently used first) until it is within ``capacity`` again.
        self.used = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0,
                      "dropped_dirty": 0, "streamed": 0}
        self._reset()

    def _reset(self) -> None:
        self.cursor = 0          # the modeled time the last acquire/release ended at
        self._anchored = False   # True: modeled work runs from a given start, not from now
        self._ins: list[_Operand] = []
        self._outs: list[_Operand] = []
        self._events: dict[str, list[int]] = {}
        self._kernel: list[int] = []
        self._released = False
        # True: the command touches no memory (``no_buffers``): ``report`` gives None.
        self.idle = False

    # -- the command's life ------------------------------------------------------------

    def acquire(self, cmd: dict[str, Any], between: Callable[[], None], *,
                views: bool = True, t0: int = 0, hold: Callable = hold_until) -> tuple[list, list]:
        """Check, map, invalidate; return the (inputs, outputs) views for the kernel
        (empty lists without ``views``: a command that only holds time reads nothing).

        ``t0``: the command's modeled start; the modeled map and invalidate work runs from
        there (not from whenever the host got here), and ``cursor`` says where it ended.
        ``hold(deadline, between)`` holds the device until a modeled deadline."""
        if not cmd["ins"] and not cmd["outs"] and "mem" not in cmd:
            self.no_buffers(t0)  # no buffer, no memory work: the no-op path stays short
            return [], []
        self._reset()
        self._anchored = bool(t0)
        mem = cmd.get("mem") or {}
        # Every operand is checked before anything is touched: a refused access leaves
        # every buffer, and this device's cache, as it was.
        self._ins = [self._operand(d, "r", "input", i, views) for i, d in enumerate(cmd["ins"])]
        self._outs = [self._operand(d, "w", "output", i, views)
                      for i, d in enumerate(cmd["outs"])]
        t = t0 or clock.now_ns()
        t = self._modeled("map", t, int(mem.get("map_ns", 0)), int(mem.get("map_bytes", 0)))
        forget = mem.get("forget")
        if forget:  # a block about to be reused: its stale lines must go
            for seg, off in _forget_keys(forget):
                self._forget(seg, off)
        for idx, ns in _pairs(mem.get("inv"), len(self._ins)):
            op = self._ins[idx]
            self._drop(op.key)
            t = self._modeled("invalidate", t, ns, op.span)
        hold(t, between)
        self.cursor = t
        if not views:
            self._kernel = [t if self._anchored else clock.now_ns()]
            return [], []
        ins = [self._array(op, write=False) for op in self._ins]
        outs = [self._array(op, write=True) for op in self._outs]
        self._kernel = [t if self._anchored else clock.now_ns()]  # kernel on the model
        return ins, outs

    def no_buffers(self, t0: int = 0) -> None:
        """``acquire`` for a command with no buffer and no memory work: nothing to check,
        map or report (``report`` gives None); its modeled time starts at ``t0``."""
        self.idle = True
        self.cursor = t0 or clock.now_ns()

    def release(self, cmd: dict[str, Any], between: Callable[[], None], *, t0: int = 0,
                hold: Callable = hold_until) -> None:
        """After the kernel: clean what was asked, hold the unmap (from modeled ``t0``)."""
        if self.idle:
            self.cursor = t0 or clock.now_ns()
            return
        mem = cmd.get("mem") or {}
        self._released = True
        t = t0 or clock.now_ns()
        if len(self._kernel) == 1:
            self._kernel.append(t)
        for idx, ns in _pairs(mem.get("clean"), len(self._outs)):
            op = self._outs[idx]
            self._write_back(op.key)
            t = self._modeled("clean", t, ns, op.span)
        t = self._modeled("unmap", t, int(mem.get("unmap_ns", 0)), int(mem.get("map_bytes", 0)))
        hold(t, between)
        self.cursor = t

    def save(self) -> tuple:
        """The current command's memory state, for a preemption (``restore`` puts it back).
        The memory then holds no command: the urgent one starts from nothing, so one that
        fails before it maps anything (an input fence failed) reports nothing of the
        suspended command's, and never drops its outputs' dirty lines as a failed
        command's partial writes (the suspended command then signalled success with
        outputs that never reached memory)."""
        state = (self.cursor, self._anchored, self._ins, self._outs, self._events,
                 self._kernel, self._released, self.idle)
        self._reset()
        return state

    def restore(self, state: tuple) -> None:
        (self.cursor, self._anchored, self._ins, self._outs, self._events, self._kernel,
         self._released, self.idle) = state

    def shared_outputs(self) -> list[np.ndarray]:
        """The current outputs as they are in shared memory, past any cache."""
        return [op.shared for op in self._outs if op.shared is not None]

    def forget(self) -> None:
        """``report`` for a command nobody reads a report of (a queue's): a failed
        command's partial writes are dropped all the same, then the state is reset."""
        if self.idle:
            return
        if not self._released:
            for op in self._outs:
                self._drop(op.key)
        self._reset()

    def report(self) -> dict[str, Any] | None:
        """What this command did to memory, for the completion record; then forget it.

        A command that failed before ``release`` leaves partial writes in the cache: they
        are discarded, so a later eviction can never write a failed command's output over
        memory someone else wrote since. None when the command touched no memory.
        """
        if self.idle:
            return None
        if not self._released:
            for op in self._outs:
                self._drop(op.key)
        rep: dict[str, Any] = {
            "ev": [[k, *self._events[k]] for k in _EV_ORDER if k in self._events],
            "ids": [[role, op.segment, self._inode(op.segment), op.offset, op.handle]
                    for role, ops in (("i", self._ins), ("o", self._outs)) for op in ops
                    ][:MAX_REPORTED_IDS],
        }
        if len(self._kernel) == 2:
            rep["k"] = self._kernel
        self._reset()
        return rep

    # -- descriptors and the IOMMU check -------------------------------------------------

    def _operand(self, desc: Any, need: str, role: str, index: int,
                 view: bool = True) -> _Operand:
        try:
            seg, offset, shape, dtype, strides, perm, handle = desc
            if not isinstance(perm, str) or not isinstance(handle, int):
                raise TypeError("permission and handle fields have the wrong types")
        except (ValueError, TypeError) as exc:
            raise errors.IommuFault(f"{role} {index}: descriptor {desc!r} carries no "
                                    f"mapping: {exc}") from None
        if need not in perm:
            raise errors.IommuFault(
                f"{role} {index} (buffer {handle:#x}): the mapping grants {perm or 'nothing'!r}, "
                f"the access needs {need!r}",
                detail={"buffer": handle, "perm": perm, "need": need, "by": "device"})
        try:
            # Segment.view's checks, inlined: this runs for every operand of every command.
            segment = self.segments.get(seg)
            dt = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, np.dtype(dtype))
            shape = tuple(shape)
            strides = tuple(strides) if strides else None
            span = _span(shape, dt.itemsize, strides)
            if type(offset) is not int or offset < 0 or offset + span > segment.size:
                raise ValueError(f"[{offset}, +{span}) is outside the segment")
            shared = (np.ndarray(shape, dt, buffer=segment.map, offset=offset, strides=strides)
                      if view else None)
        except (ValueError, TypeError, KeyError, posix_ipc.ExistentialError) as exc:
            raise errors.IommuFault(f"{role} {index}: buffer descriptor {desc[:5]!r} is not "
                                    f"mappable: {exc}") from None
        return _Operand((seg, offset, handle), shared, span, perm, (shape, dt, strides))

    def _inode(self, segment: int) -> int:
        """The segment's inode: the same number in every process that maps it."""
        try:
            return self.segments.get(segment).inode
        except (KeyError, OSError, posix_ipc.ExistentialError):
            return 0

    def forget_segment(self, segment: int) -> None:
        """The segment is gone (every block of it was freed): its lines go too, and
        with them the last views that would keep it mapped."""
        for key in [k for k in self.lines if k[0] == segment]:
            self._drop(key)

    # -- the emulated cache --------------------------------------------------------------

    def _array(self, op: _Operand, *, write: bool) -> np.ndarray:
        if op.shared is None:  # acquire(views=False) maps none and asks for none
            raise errors.InternalError(f"buffer {op.handle:#x} was mapped without a view")
        if self.capacity == 0 or op.span == 0 or op.span > self.capacity:
            if self.capacity:
                self.stats["streamed"] += 1
            view = op.shared
            if not write and "w" not in op.perm:
                view = view.view()
                view.flags.writeable = False  # a read-only mapping: a stray write faults
            return view
        line = self.lines.get(op.key)
        if line is not None and line.data.nbytes != op.span:
            self._evict(op.key)  # the block now holds a buffer of another size
            line = None
        if line is None:
            self.stats["misses"] += 1
            line = _Line(np.empty(op.span, np.uint8))
            # Fill on allocate, for writes too: a write-back must not replace bytes the
            # kernel did not write with garbage.
            line.data[:] = np.frombuffer(self.segments.get(op.segment).map, np.uint8,
                                         op.span, op.offset)
            self.lines[op.key] = line
            self.used += op.span
            while self.used > self.capacity:
                self._evict(next(iter(self.lines)))
        else:
            self.stats["hits"] += 1
            self.lines.move_to_end(op.key)
        shape, dtype, strides = op.layout
        view = np.ndarray(shape, dtype, buffer=line.data, offset=0, strides=strides)
        if write:
            line.dirty = True
            line.written = (op.shared, view)
        elif "w" not in op.perm:
            view.flags.writeable = False
        return view

    def _forget(self, segment: int, offset: int) -> None:
        """Drop every line of the block at (segment, offset), whichever owner filled it."""
        for key in [k for k in self.lines if k[0] == segment and k[1] == offset]:
            self._drop(key)

    def _write_back(self, key: _Key) -> int:
        line = self.lines.get(key)
        if line is None or not line.dirty or line.written is None:
            return 0
        shared, private = line.written
        np.copyto(shared, private)  # elements only: strided padding stays alone
        line.dirty = False
        self.stats["writebacks"] += 1
        return private.nbytes

    def _drop(self, key: _Key) -> None:
        """Invalidate: forget the lines; dirty data in them is lost, as on hardware."""
        line = self.lines.pop(key, None)
        if line is not None:
            self.used -= line.data.nbytes
            if line.dirty:
                self.stats["dropped_dirty"] += 1

    def _evict(self, key: _Key) -> None:
        self._write_back(key)
        line = self.lines.pop(key)
        self.used -= line.data.nbytes
        self.stats["evictions"] += 1

    def _modeled(self, kind: str, t: int, ns: int, nbytes: int) -> int:
        """Account ``ns`` of modeled work starting at ``t`` (or now, if later, unless the
        command runs on an anchored modeled timeline)."""
        if ns <= 0 and kind in ("map", "unmap"):
            return t
        t0 = t if self._anchored else max(t, clock.now_ns())
        t1 = t0 + max(0, ns)
        ev = self._events.get(kind)
        if ev is None:
            self._events[kind] = [t0, t1, nbytes, 1]
        else:  # one slice per kind and command: the record must stay small
            ev[1], ev[2], ev[3] = t1, ev[2] + nbytes, ev[3] + 1
        return t1


_DTYPES: dict[str, np.dtype] = {}


def _span(shape: tuple, itemsize: int, strides: tuple | None) -> int:
    """``ipc.span_bytes`` without numpy scalars (a tenth of the cost, same answer)."""
    # (Loops, not ``all`` over a generator: these run for every operand of every command.)
    for n in shape:
        if type(n) is not int or n < 0:
            raise ValueError(f"shape {shape!r} is not non-negative ints")
    if 0 in shape:
        return 0
    if not strides:
        return math.prod(shape) * itemsize
    if len(strides) != len(shape):
        raise ValueError(f"strides {strides!r} do not fit shape {shape!r}")
    for st in strides:
        if type(st) is not int or st < 0:
            raise ValueError(f"strides {strides!r} do not fit shape {shape!r}")
    return sum((n - 1) * st for n, st in zip(shape, strides)) + itemsize


def _forget_keys(items: Any) -> list[tuple[int, int]]:
    """The (segment, offset) keys of a purge request; malformed entries are ignored."""
    if not isinstance(items, list):
        return []
    return [(s, o) for s, o in (x for x in items if isinstance(x, list) and len(x) == 2)
            if type(s) is int and type(o) is int]


def _pairs(items: Any, limit: int) -> list[tuple[int, int]]:
    """``[[index, ns], ...]`` from a packet, checked: the device trusts nothing it reads."""
    out = []
    for item in items or ():
        if (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and type(item[1]) is int and 0 <= item[0] < limit and item[1] >= 0):
            out.append((item[0], item[1]))
        else:
            raise errors.BadPacket(f"bad cache maintenance entry {item!r}")
    return out

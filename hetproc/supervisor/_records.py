"""What the supervisor knows: clients, contexts, buffers, fences, and the ``Registry``
that holds them.

Lifetimes (seed §1): a buffer or fence is referenced by its client and by every command
that may still touch it; it is reclaimed only when the client let go *and* no such command
remains. ``refs`` counts the commands. Only ``_lifetimes`` frees or reclaims.

The ``Registry`` is the supervisor's tables, shared by its parts: each part reads what it
needs and changes only what it owns (``_lifetimes`` the references and the pool,
``_commands`` the queues and counters, ``_recovery`` its incidents).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc import PENDING, Block, FenceTable, FrameReader, SlotMap, errors, span_bytes

from ._descriptors import DescriptorBudget

if TYPE_CHECKING:
    from .._config import EngineTimes, PlatformSpec
    from ._devices import Command, DeviceHandle


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
    # Identity from the kernel (SO_PEERCRED at accept), never from a packet.
    uid: int = -1
    privileged: bool = False  # the owner, or a holder of a role the owner granted
    trace_reader: bool = False  # privileged, or a holder of a trace role the owner granted
    hello_deadline: float = 0.0  # monotonic s; a connection silent past it is closed
    # Only ``_lifetimes`` changes this (register, release_buffer); it counts the bytes of
    # the buffers in ``buffers``, as ``_quotas`` checks them.
    bytes: int = 0
    # Request ids answered lately and their reply frames: a retry under the same id is
    # answered again, never run again (``_server.on_request``).
    last_id: int = 0
    answered: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    # Buffer segments (ids) whose descriptors went to this connection, and descriptors
    # of replies not sent yet: (position in ``outbuf`` of the byte they go with, fds).
    segments: set[int] = field(default_factory=set)
    outfds: list = field(default_factory=list)
    # Only ``_resets`` changes these: resets that touched this client's contexts, its
    # guilty and innocent commands, when its contexts were banned, and why the client
    # itself is banned ("" while it is not).
    resets: ResetCounts = field(default_factory=lambda: ResetCounts())
    bans: list[int] = field(default_factory=list)
    banned: str = ""
    # Those of ``segments`` handed read-only (a read-only import): their descriptor was
    # opened read-only, so the client's mapping cannot write (``_requests.hand_segment``).
    read_only_segments: set[int] = field(default_factory=set)
    # Only ``context_create`` changes this: the contexts this client made, which numbers
    # the unnamed ones ("#N") in the run's command log.
    contexts_made: int = 0
    # Descriptors taken for the reply being built (``hand_segment``), in ``segs`` order:
    # the loop gives them to the outbox with the reply, or closes them with a refusal.
    handing: list[int] = field(default_factory=list)
    # Its waiter slot on the virtual clock's segment (-1: none; ``_clock`` hands it out).
    clock_slot: int = -1
    clock_bell: int = 0  # a fence never completed: what its ``hetproc.sleep`` sleeps on


@dataclass(eq=False)
class ContextRec:
    handle: int
    client: ClientRec
    device: str
    priority: int
    name: str
    lost: errors.HetprocError | None = None
    # Only ``_commands`` changes this (commit +1, retire -1): its committed commands not
    # yet retired.
    inflight: int = 0
    submitted: int = 0
    # Which cache maintenance the runtime does for this context on a non-coherent device:
    # "both" (correct), "clean" (forgets to invalidate), "invalidate", "none".
    cache_maintenance: str = "both"
    period_ns: int = 0    # default relative deadline of its commands (0: none)
    weight: float = 1.0   # its client's share under the fair scheduler
    # A recoverable context survives a hang of its own (only that command fails) until it
    # is banned; one that is not is lost at its first (``_resets``).
    recoverable: bool = False
    # Only ``_resets`` changes these: its reset statistics and status, and when it hung.
    resets: ResetCounts = field(default_factory=lambda: ResetCounts())
    hangs: list[int] = field(default_factory=list)
    # Its stable name in the run's command log ("client/context", "client/#N"): what a
    # trace digest hashes instead of a handle (``_runlog``). Set once, at creation.
    label: str = ""


@dataclass(eq=False, slots=True)
class ResetCounts:
    """What resets did to a context, or to a client's contexts (``gem_reset_stats``):
    how many resets touched it, how many of its commands were guilty of one, how many
    were innocent victims, and its part in the last reset that touched it."""

    resets: int = 0
    guilty: int = 0
    innocent: int = 0
    status: str = "none"  # "guilty", "innocent", "unknown" (the cause was not a command)


@dataclass(eq=False)
class BufferRec:
    handle: int
    block: Block
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None
    nbytes: int
    client: ClientRec
    # Only ``_lifetimes`` changes this (take_refs and hold_buffer +1, ``_unref_buffer`` -1):
    # the committed commands not yet retired that name it among their inputs or outputs,
    # and the queue bindings not yet let go (``_queue_bindings``). Never below 0.
    refs: int = 0
    # Only ``_lifetimes`` sets this, once (its client freed it or left); it is reclaimed
    # when ``refs`` is 0 and no importer holds it: until then it is quarantined.
    released: bool = False
    trusted: bool = True
    # Zero-copy preconditions (seed §5) and sharing; see hetproc.supervisor._handoff / _iommu.
    layout: str | None = None      # "NHWC", "NCHW"... for rank-4 tensors; None: no layout
    usage: tuple[str, ...] | None = None  # device kinds/names that may map it; None: any
    byte_offset: int = 0           # where the tensor starts inside its block
    internal: bool = False         # a runtime-made reformat/copy buffer, never a client's
    exportable: bool = False       # in a segment of its own (``_memory``): may be exported
    last_writer: str | None = None  # device of the last command that wrote it
    importers: dict[int, str] = field(default_factory=dict)  # client id -> "r" / "rw"
    # Non-coherent devices that may hold this buffer dirty in their cache (written, not
    # cleaned): its block is reused only after each of them forgot those lines.
    dirty_on: set[str] = field(default_factory=set)
    # Only ``_hazards`` changes these: the last command that writes it and has not retired
    # (None: none), and the unretired ones that read it since (None: none).
    hz_writer: Any = None
    hz_readers: dict | None = None

    @property
    def offset(self) -> int:
        """Byte offset of the tensor's first element in its segment."""
        return self.block.offset + self.byte_offset

    def descriptor(self, perm: str) -> list:
        """What a command's record names it by: ``[segment, offset, shape, dtype,
        strides, perm, handle]`` (``perm``: what its command may do with it)."""
        block = self.block
        return [block.segment, block.offset + self.byte_offset, list(self.shape), self.dtype,
                list(self.strides) if self.strides else None, perm, self.handle]

    def spec(self) -> tuple[tuple[int, ...], str]:
        return self.shape, self.dtype


_NOBODY: frozenset[int] = frozenset()


@dataclass(eq=False, slots=True)
class FenceRec:
    """One per live fence, made per command: slotted, and its client sets are a shared
    empty one until an import (they are replaced, never changed in place)."""

    handle: int
    client: ClientRec | None
    # Only ``_lifetimes`` changes this (take_refs, import_fence and hold_fence +1,
    # ``_unref_fence`` -1): the unretired commands that wait on it or signal it, its
    # importers, and the descriptors and merges that watch it (``_fencefds``). The
    # slot is recycled only once it is 0 and ``released``.
    refs: int = 0
    released: bool = False  # only ``_lifetimes`` sets it, once: its owner let go
    bound: bool = False  # some command will signal it; no second command may
    # Only the failure path (``_failures``) writes this: the record of its failure,
    # written before the fence is signalled (unless the device signalled it first).
    error: dict | None = None
    importers: frozenset[int] = _NOBODY  # client ids that imported it
    signallers: frozenset[int] = _NOBODY  # importers granted the signal right
    # Only ``_lifetimes.take_refs`` sets this, with ``bound``: the command that signals it
    # (the hazard check walks up through it). None: a client or a queue signals it.
    producer: Any = None


def nbytes_of(shape: tuple[int, ...], dtype: str, strides: tuple[int, ...] | None) -> int:
    return span_bytes(shape, np.dtype(dtype).itemsize, strides)


@dataclass(eq=False)
class Registry:
    """The supervisor's tables and the few queries over them that every part asks."""

    spec: PlatformSpec
    fences: FenceTable
    devices: dict[str, DeviceHandle]
    # The state table, written one way: through ``slots`` (one ``device_workers.StateSlot``
    # per device, by index); ``state``, its ``STATE_DTYPE`` rows, is for slow-path readers
    # (metrics, dumps) only.
    slots: list
    state: np.ndarray
    clients: dict[Any, ClientRec] = field(default_factory=dict)  # by connection
    contexts: SlotMap = field(default_factory=lambda: SlotMap("context"))
    buffers: SlotMap = field(default_factory=lambda: SlotMap("buffer"))
    fence_recs: dict[int, FenceRec] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=lambda: {
        "submitted": 0, "completed": 0, "failed": 0, "bad_packets": 0,
        "first_submit_us": None, "submit_us_total": 0.0, "submit_count": 0})
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    dumps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    # Only ``_resets`` changes this: the wedged devices (name -> why), which run nothing
    # until unwedged; ``_validation.context_of`` refuses work for them.
    wedged: dict[str, dict] = field(default_factory=dict)
    # Tokens the owner granted -> their scope: "all" (privileged) or "trace" (reads the
    # platform's trace, every tenant's: what its user reads from another terminal).
    role_tokens: dict[int, str] = field(default_factory=dict)
    # The platform's descriptors, shared by every tenant (``_descriptors``).
    descriptors: DescriptorBudget = field(
        default_factory=lambda: DescriptorBudget(1 << 20, lambda: 0))
    engines: dict[str, EngineTimes] = field(default_factory=dict)  # only ``engine`` fills it

    def tenant(self, client: ClientRec) -> list[ClientRec]:
        """Every connection of ``client``'s process (the kernel's pid): quotas count here,
        so a second connection gets no fresh quota."""
        return [c for c in self.clients.values() if c.pid == client.pid]

    def engine(self, dev: Any) -> EngineTimes:
        """Device ``dev``'s engine times (``PlatformSpec.engine``), resolved once."""
        times = self.engines.get(dev.name)
        if times is None:
            times = self.engines[dev.name] = self.spec.engine(dev.name)
        return times

    def scaled_ns(self, ms: float) -> int:
        """A modeled duration in ms, times the platform's time scale, in ns."""
        if ms < 0:
            raise errors.InvalidRequest(f"negative duration {ms} ms")
        return round(ms * self.spec.time_scale * 1e6)  # 4.35 ms is 4,350,000 ns, not 4,349,999

    def note_event(self, kind: str, **detail: Any) -> None:
        self.events.append({"event": kind, "t": time.time(), **detail})

    def signalled(self, cmd: Command) -> bool:
        """Every output fence of ``cmd`` already completed (its record may be lost)."""
        return all(self.fences.poll(h)[0] != PENDING for h in cmd.signal if h in self.fence_recs)

    def quarantine_count(self) -> int:
        """Buffers their client freed that a command may still touch: not reusable yet."""
        return sum(1 for _, b in self.buffers.items() if b.released and b.refs > 0)

    def device_state(self, dev: DeviceHandle) -> dict[str, Any]:
        st = self.state[dev.index]
        return {name: (st[name].tolist() if hasattr(st[name], "tolist") else st[name])
                for name in st.dtype.names if not name.startswith("_")}

    def buffer_ownership(self, cmd: Command | None) -> list[dict[str, Any]]:
        """Who holds which buffer: the guilty command's, and every quarantined one."""
        mine = {id(b) for b in (cmd.ins + cmd.outs)} if cmd else set()
        return [{"handle": h, "client": b.client.name, "refs": b.refs, "released": b.released,
                 "trusted": b.trusted, "segment": b.block.segment, "offset": b.block.offset,
                 "nbytes": b.nbytes, "of_guilty": id(b) in mine}
                for h, b in self.buffers.items() if id(b) in mine or (b.released and b.refs)]

    def live_clients(self) -> list[ClientRec]:
        """Clients that said hello (a connection that did not is nobody yet)."""
        return [c for c in self.clients.values() if c.id]

"""The inter-process core of hetproc: names, shared segments, fences, rings, packets.

This layer knows nothing about devices: it moves bytes and wake-ups between processes
with deadlines, and says clearly what went wrong. ``device_workers`` and ``hetproc`` are
built on it; nothing here imports them.
"""

from . import _clock as clock
from . import errors
from ._buddy import BuddyAllocator
from ._channel import Channel, FrameReader, pack_frame
from ._fdpass import SegmentReceiver, SegmentSender, close_all, segment_socketpair
from ._fencefd import RECORD as FENCE_FD_RECORD
from ._fencefd import Status as FenceFdStatus
from ._fencefd import complete as fence_fd_complete
from ._fencefd import new_pair as fence_fd_pair
from ._fencefd import status as fence_fd_status
from ._fencefd import wait as fence_fd_wait
from ._fences import (
    CID_BY_CLIENT,
    CID_BY_HANDOFF,
    FAILED,
    PENDING,
    SIGNALLED,
    FenceTable,
    make_cid,
    make_handle,
    split_cid,
    split_handle,
)
from ._fences import nudge as nudge_fence
from ._fences import wait_once as wait_fence_once
from ._fences import watch as watch_fence
from ._names import (
    SHM_DIR,
    Manifest,
    cleanup_dead,
    cleanup_prefix,
    entries_with_prefix,
    new_prefix,
    platform_is_alive,
    platform_prefixes,
    platform_process,
    socket_address,
)
from ._packets import (
    I64,
    MAX_PACKET,
    U64,
    VERSION,
    Int,
    List,
    Map,
    Num,
    OneOf,
    Plain,
    Spec,
    Str,
    Tuple,
    check_fields,
    decode,
    encode,
    unpack,
)
from ._profile import profiled
from ._queues import CLOSED as QUEUE_CLOSED
from ._queues import F_CHECKED as QUEUE_CHECKED
from ._queues import F_MODELED as QUEUE_MODELED
from ._queues import F_TIMEOUT as QUEUE_TIMEOUT
from ._queues import LOST as QUEUE_LOST
from ._queues import MAX_BINDINGS as QUEUE_MAX_BINDINGS
from ._queues import MAX_RULES as QUEUE_MAX_RULES
from ._queues import OPEN as QUEUE_OPEN
from ._queues import Binding, BindingTable, QueueRecord, QueueRing, queue_bytes, table_bytes
from ._queues import decode_record as decode_queue_record
from ._queues import encode_record as encode_queue_record
from ._ring import Ring
from ._segments import (
    Block,
    BlockPool,
    Segment,
    SegmentCache,
    block_size,
    read_only_descriptor,
    span_bytes,
)
from ._slotmap import SlotMap
from ._trace import BEGIN, COUNTER, END, INSTANT, RECORD_DTYPE, Stage, TraceRing, merge, stage_name
from ._tracebank import COUNTERS, TraceBank

__all__ = [
    "errors", "clock",
    "Channel", "FrameReader", "pack_frame",
    "FenceTable", "PENDING", "SIGNALLED", "FAILED", "make_handle", "split_handle",
    "make_cid", "split_cid", "CID_BY_CLIENT", "CID_BY_HANDOFF",
    "watch_fence", "nudge_fence", "wait_fence_once",
    "FenceFdStatus", "FENCE_FD_RECORD", "fence_fd_pair", "fence_fd_complete",
    "fence_fd_status", "fence_fd_wait",
    "Manifest", "SHM_DIR", "cleanup_dead", "cleanup_prefix", "entries_with_prefix", "new_prefix",
    "platform_is_alive", "platform_process", "platform_prefixes", "socket_address",
    "VERSION", "MAX_PACKET", "encode", "decode", "unpack", "check_fields",
    "Spec", "Int", "Num", "Str", "List", "Tuple", "Map", "OneOf", "Plain", "U64", "I64",
    "Ring", "profiled",
    "QueueRing", "QueueRecord", "queue_bytes", "decode_queue_record", "encode_queue_record",
    "Binding", "BindingTable", "table_bytes", "QUEUE_MAX_BINDINGS", "QUEUE_MAX_RULES",
    "QUEUE_CHECKED",
    "QUEUE_MODELED", "QUEUE_TIMEOUT",
    "QUEUE_OPEN", "QUEUE_LOST", "QUEUE_CLOSED",
    "BuddyAllocator",
    "Block", "BlockPool", "Segment", "SegmentCache", "block_size", "span_bytes",
    "read_only_descriptor",
    "SegmentSender", "SegmentReceiver", "segment_socketpair", "close_all",
    "SlotMap",
    "Stage", "TraceRing", "TraceBank", "RECORD_DTYPE", "BEGIN", "END", "INSTANT", "COUNTER",
    "merge", "stage_name", "COUNTERS",
]

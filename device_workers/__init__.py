"""Emulated processors: the loop each device process runs, its kernels and its timing.

Built on ``ipc`` only. The supervisor (in ``hetproc``) forks one process per device and
calls ``device_main`` in it.
"""

from ._boot import DeviceBoot
from ._commands import (
    COMMAND_SCHEMAS,
    LEAST_URGENT,
    decode_command,
    decode_completions,
    encode_command,
)
from ._faults import QUEUE_KINDS as QUEUE_FAULT_KINDS
from ._faults import fires
from ._graph_asset import asset_layout, plan_bytes, read_asset, write_asset
from ._graph_ops import GRAPH_OPS, op_flops, run_op, unsupported
from ._intake import RING_CORRUPT_EXIT_STATUS
from ._kernels import checksum_of, read_checksum
from ._kernels import validate as validate_kernel
from ._operands import admit, check_depth, maintenance, modeled_ns, watchdog_budget
from ._state import STATE_DTYPE, DeviceState, StateSlot, state_table
from ._tracing import (
    QUEUE_TRACK_BASE,
    SIGNALLED_AT_END,
    SLOT_SUPERVISOR,
    TRACK_SUPERVISOR,
    device_slot,
    device_track,
    queue_track,
)
from ._worker import DeviceWorker, device_main

__all__ = ["DeviceBoot", "DeviceWorker", "device_main", "COMMAND_SCHEMAS",
           "decode_command", "decode_completions", "encode_command", "LEAST_URGENT",
           "RING_CORRUPT_EXIT_STATUS",
           "DeviceState", "StateSlot", "STATE_DTYPE", "state_table",
           "validate_kernel", "check_depth", "modeled_ns", "watchdog_budget", "maintenance",
           "admit", "fires", "QUEUE_FAULT_KINDS", "checksum_of", "read_checksum",
           "QUEUE_TRACK_BASE", "SIGNALLED_AT_END", "SLOT_SUPERVISOR", "TRACK_SUPERVISOR",
           "device_slot", "device_track", "queue_track",
           "GRAPH_OPS", "run_op", "unsupported", "op_flops",
           "asset_layout", "plan_bytes", "write_asset", "read_asset"]

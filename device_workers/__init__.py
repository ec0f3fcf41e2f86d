"""Emulated processors: the loop each device process runs, its kernels and its timing.

Built on ``ipc`` only. The supervisor (in ``hetproc``) forks one process per device and
calls ``device_main`` in it.
"""

from ._commands import COMMAND_SCHEMAS, decode_command, decode_completions
from ._state import STATE_DTYPE, DeviceState, state_table
from ._worker import RING_CORRUPT_EXIT_STATUS, DeviceBoot, DeviceWorker, device_main

__all__ = ["DeviceBoot", "DeviceWorker", "device_main", "COMMAND_SCHEMAS",
           "decode_command", "decode_completions", "RING_CORRUPT_EXIT_STATUS",
           "DeviceState", "STATE_DTYPE", "state_table"]

"""Emulated processors: the loop each device process runs, its kernels and its timing.

Built on ``ipc`` only. The supervisor (in ``hetproc``) forks one process per device and
calls ``device_main`` in it.
"""

from ._kernels import OPS, read_checksum
from ._state import STATE_DTYPE, DeviceState, state_table
from ._worker import COMMAND_SCHEMAS, DeviceBoot, DeviceWorker, device_main

__all__ = ["DeviceBoot", "DeviceWorker", "device_main", "COMMAND_SCHEMAS",
           "DeviceState", "STATE_DTYPE", "state_table", "OPS", "read_checksum"]

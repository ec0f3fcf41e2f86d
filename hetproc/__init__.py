"""hetproc: a heterogeneous SoC (CPU, NPU, GPU, DSP, ISP) emulated as real OS processes.

Public API::

    Platform          start / stop a platform (supervisor + one process per device)
    connect(address)  join a running platform from another process
    Client            a connection: contexts, buffers, fences, metrics
    Context           the unit of submission, isolation and failure on one device
    Buffer, Fence     a shared tensor, a completion event (export / import to share them)
    BufferPool        buffers recycled only when every release fence completed (seed §17)
    command(...)      one entry of Context.submit_many
    load_platform     read a platform file (None: the built-in default)

Evidence (seed §22): ``Platform.export_trace(path)`` (Chrome Trace JSON for Perfetto),
``Platform.frozen_windows()``, ``Platform.trace_records()``, ``Client.trace.span(stage,
cid)``; ``hetproc.trace._explain`` attributes a request's latency to its stages.

Errors: every class of ``ipc.errors`` is re-exported here (``hetproc.DeviceTimeout``...).
"""

from ipc.errors import *  # noqa: F401,F403  (the one error hierarchy)
from ipc.errors import __all__ as _error_names

from .client._bufpool import BufferPool, PoolStatistics
from .client._client import FOREVER, Buffer, Client, Context, Fence, command
from ._config import DeviceSpec, PlatformSpec, Timing, load_platform
from .client._platform import Platform, connect

__all__ = [
    "Platform", "connect", "Client", "Context", "Buffer", "Fence", "command", "FOREVER",
    "BufferPool", "PoolStatistics",
    "load_platform", "PlatformSpec", "DeviceSpec", "Timing",
    *_error_names,
]

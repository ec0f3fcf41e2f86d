"""The application's side (runs in the user's process): ``Platform`` starts a platform or
``connect`` joins one; ``Client``, ``Context``, ``Buffer``, ``Fence`` and ``BufferPool`` speak
to its supervisor over the control socket and touch shared memory directly for data and
for completion. Nothing here imports the supervisor.

``Connection`` is the seam under them: one per client (``Client.connection``), holding the
socket and what rides on it; the other objects, and readers such as ``hetproc.trace``,
use its documented calls (``request``, ``notify``, ``segments``...)."""

from ._buffer import Buffer
from ._bufpool import BufferPool, PoolStatistics
from ._client import FOREVER, Client
from ._connection import Connection
from ._context import Context, ResetStats, ResetStatus, command
from ._fence import Fence, fence_fd_done, merge_fences, wait_fence_fd
from ._now import now, sleep
from ._pipeline import Pipeline, PipelineReport, PipelineStage
from ._platform import Platform, connect, same_code_env, unwedge
from ._queue import Queue
from ._roles import read_trace_role
from ._starter import starter_info, starter_pid

__all__ = ["Platform", "connect", "Client", "Context", "Buffer", "Fence", "command", "FOREVER",
           "BufferPool", "PoolStatistics", "Pipeline", "PipelineStage", "PipelineReport",
           "Queue", "same_code_env", "Connection", "merge_fences", "wait_fence_fd",
           "fence_fd_done", "read_trace_role", "ResetStatus", "ResetStats", "unwedge", "now",
           "sleep", "starter_pid", "starter_info"]

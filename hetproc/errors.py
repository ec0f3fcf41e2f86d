"""The one error hierarchy, under the name users import: ``hetproc.errors``.

The classes are defined in ``ipc.errors`` (the lowest layer: devices and the supervisor
speak the same codes) and exported here and from ``hetproc`` itself; they show as
``hetproc.X`` in tracebacks. Every error answers the seed's questions (§8, §14) on the
object itself: ``scope``, ``retryable``, ``buffers_trusted``, ``fallback_possible``,
``evidence`` (frozen window, incident dump) and ``others_affected``; see ``ipc.errors``
for each field and each class for when it is raised and when it is not.

::

    HetprocError
    ├── InvalidRequest        the request was wrong: nothing ran, retrying cannot help
    │   ├── BadPacket, InvalidHandle (StaleHandle, ForeignHandle), ShapeError,
    │   │   DtypeError, UnsupportedOp
    │   ├── IommuFault ── ForeignBuffer
    │   └── SyncHazard        a buffer touched unordered (read/write after write/read)
    ├── Timeout               a deadline passed (every timeout, whatever its cause)
    │   ├── FenceTimeout, DeviceTimeout (PreemptTimeout), DependencyTimeout,
    │   │   RequestTimeout
    │   └── CompileTimeout (also a ResourceError)
    ├── Cancelled             the client's own cancel: not a failure
    ├── DeviceFault           execution failed on a device
    │   ├── DependencyFailed, DeviceCrashed, WrongOutput, DeviceRestarted, DeviceWedged
    │   ├── ContextLost ── ContextBanned
    │   └── CancelledByReset (also a Cancelled): caught in someone's reset
    ├── ResourceError         OutOfMemory (QuotaExceeded), DescriptorsExhausted,
    │                         AllocationFailed, MapFailed, CompileTimeout
    └── PlatformError         PlatformClosed, SupervisorLost, InternalError (our bug)
"""

import ipc.errors as _source
from ipc.errors import *  # noqa: F403  (re-exported under the name users import)
from ipc.errors import __all__

for _name in __all__:
    _obj = getattr(_source, _name)
    if isinstance(_obj, type):
        _obj.__module__ = "hetproc"  # tracebacks say hetproc.DeviceTimeout
del _name, _obj, _source

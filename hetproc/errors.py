"""The error hierarchy, under the name users look for: ``hetproc.errors.DeviceTimeout``.

The classes live in ``ipc.errors`` (the lowest layer: error codes cross process
boundaries) and are the same objects here and in ``hetproc`` itself.
"""

from ipc.errors import *  # noqa: F401,F403
from ipc.errors import __all__  # noqa: F401

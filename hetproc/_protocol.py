"""Packets of the control channel (client <-> supervisor). Data never travels here:
tensors stay in shared memory and packets carry handles."""

from __future__ import annotations

_L = list
_I = int
_NUM = (int, float)

REQUESTS = {
    "hello": {"id": _I, "name": str, "pid": _I, "owner?": bool},
    "ping": {"id": _I},
    "context_create": {"id": _I, "device": str, "priority?": _I, "name?": str,
                       "cache_maintenance?": (bool, str), "period_ms?": _NUM, "weight?": _NUM},
    "context_destroy": {"id": _I, "ctx": _I},
    "alloc": {"id": _I, "shape": _L, "dtype": str, "strides?": _L, "align?": _I,
              "layout?": str, "usage?": _L},
    "free": {"id": _I, "buf": _I},
    "fence_create": {"id": _I, "count?": _I},
    "fence_release": {"id": _I, "fences": _L},
    "fence_error": {"id": _I, "fence": _I},
    "submit": {"id": _I, "ctx": _I, "cmds": _L, "t_ns?": _I},
    "cancel": {"id": _I, "ctx": _I},
    "metrics": {"id": _I},
    # memory: per-context IOMMU mappings, explicit sharing, the memory timeline
    "map": {"id": _I, "ctx": _I, "buf": _I, "perm?": str},
    "unmap": {"id": _I, "ctx": _I, "buf": _I},
    "export": {"id": _I, "buf?": _I, "fence?": _I, "read_only?": bool},
    "import": {"id": _I, "token": _I, "kind?": str},
    "mem_events": {"id": _I, "since?": _I, "limit?": _I, "cids?": _L},
    "shutdown": {"id": _I},
    "inject": {"id": _I, "fault": dict},
    "faults_clear": {"id": _I},
    "incidents": {"id": _I},
    "dumps": {"id": _I},
    "prepare": {"id": _I, "ctx": _I, "kernel": str},
    "trace_info": {"id": _I},
    "trace_frozen": {"id": _I, "window?": _I, "offset?": _I, "flush?": bool},
    "power_vote": {"id": _I, "ctx": _I, "level": _NUM},
}

COMMAND = {"kernel": str, "signal?": _I, "ins?": _L, "outs?": _L, "wait?": _L, "params?": dict,
           "ms?": _NUM, "handoff_ms?": _NUM, "cid?": _I, "timeout_ms?": _NUM,
           "checked?": bool, "priority?": _I, "deadline_ms?": _NUM}

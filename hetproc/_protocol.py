"""Packets of the control channel (client <-> supervisor). Data never travels here:
tensors stay in shared memory and packets carry handles."""

from __future__ import annotations

_L = list
_I = int
_NUM = (int, float)

REQUESTS = {
    # ``pid`` is ignored (the kernel says who the peer is); ``role`` a token the owner granted
    "hello": {"id": _I, "name": str, "pid?": _I, "owner?": bool, "role?": _I},
    "grant_role": {"id": _I},
    "fence_signal": {"id": _I, "fence": _I, "error?": _I},
    "ping": {"id": _I},
    "context_create": {"id": _I, "device": str, "priority?": _I, "name?": str,
                       "cache_maintenance?": (bool, str), "period_ms?": _NUM, "weight?": _NUM},
    "context_destroy": {"id": _I, "ctx": _I},
    "alloc": {"id": _I, "shape": _L, "dtype": str, "strides?": _L, "align?": _I,
              "layout?": str, "usage?": _L, "exportable?": bool},
    "free": {"id": _I, "buf": _I},
    "free_many": {"id": _I, "bufs": _L},  # frees the client deferred while views lived
    "fence_create": {"id": _I, "count?": _I},
    # user-mode submission queues: a ring the client writes and the device reads
    "queue_open": {"id": _I, "ctx": _I, "slots?": _I},
    "queue_close": {"id": _I, "queue": _I},
    "fence_release": {"id": _I, "fences": _L},
    "fence_error": {"id": _I, "fence": _I},
    "submit": {"id": _I, "ctx": _I, "cmds": _L, "t_ns?": _I},
    "cancel": {"id": _I, "ctx": _I},
    "metrics": {"id": _I},
    # memory: per-context IOMMU mappings, explicit sharing, the memory timeline
    "map": {"id": _I, "ctx": _I, "buf": _I, "perm?": str},
    "unmap": {"id": _I, "ctx": _I, "buf": _I},
    "export": {"id": _I, "buf?": _I, "fence?": _I, "read_only?": bool, "signal?": bool},
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

# Ranges and size caps, checked for every field of every request (and every command of a
# submit) before its handler runs: what passes can be encoded for a ring and changes no
# table by its size alone. Limits that a platform sets (durations, names, priorities)
# come from its ``[limits]`` table and are checked in ``supervisor._validation``.
HANDLE = (0, (1 << 63) - 1)
INT_RANGES = {
    "id": HANDLE, "ctx": HANDLE, "buf": HANDLE, "fence": HANDLE, "token": HANDLE,
    "role": HANDLE, "since": HANDLE, "t_ns": HANDLE, "offset": HANDLE, "window": HANDLE, "signal": HANDLE,
    "cid": (0, (1 << 64) - 1), "count": (1, 1024), "limit": (1, 65536), "align": (1, 1 << 30), "slots": (1, 1 << 16), "queue": HANDLE,
    "error": (0, 0xFFFF), "priority": (-(1 << 31), 1 << 31), "pid": (-(1 << 63), (1 << 63) - 1),
}
STR_CAPS = {"device": 64, "dtype": 16, "layout": 16, "perm": 2, "kind": 16, "kernel": 64,
            "cache_maintenance": 16}  # "name": the platform's ``max_name``
LIST_CAPS = {"shape": 8, "strides": 8, "usage": 8, "fences": 4096, "cmds": 4096, "cids": 4096,
             "bufs": 4096, "ins": 16, "outs": 16, "wait": 64}
LIST_ITEMS = {"shape": int, "strides": int, "fences": int, "cids": int, "bufs": int, "ins": int,
              "outs": int, "wait": int, "usage": str, "cmds": dict}
DURATIONS = ("ms", "handoff_ms", "timeout_ms", "deadline_ms", "period_ms")
PARAMS_BYTES = 1024   # a command's packed params (a ring slot is 2 KiB)
PARAMS_DEPTH = 4      # nesting of params and of an injected fault's map

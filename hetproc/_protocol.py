"""Packets of the control channel (client <-> supervisor), both directions. Data never
travels here: tensors stay in shared memory and packets carry handles.

Every field of every message is declared once, below, with ``ipc``'s specs: its type and
its bounds (range, length cap, choices, the spec of its items), per message -- a field
called ``kind`` in one request says nothing of a ``kind`` in another. Two readers use the
declaration:

* ``ipc.decode`` checks a request's shape against ``REQUESTS``, the types alone (derived
  below): a packet of the wrong shape is malformed (``BadPacket``);
* the supervisor's validator (``supervisor._validation``) checks every value against its
  declared bounds before the handler runs: a value out of bounds is ``InvalidRequest``.
  A bound marked ``limit`` is the platform's (its ``[limits]`` table), tighter than the
  one declared here.

Adding a field to a request is one line here; its handler then reads it.

The other direction: ``RESULTS`` declares what the answer to each request carries, and a
client checks every answer against it (``result_of``) after decoding it with ``REPLIES``,
which also covers the notices (``NOTICE``). The supervisor builds both with the functions
at the end, never by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ipc import (
    I64,
    MAX_PACKET,
    U64,
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
    unpack,
)

# -- the vocabulary -------------------------------------------------------------------------

ID = Int(0, I64)          # a request id; 0: a notice, whose sender waits for no answer
HANDLE = Int(0, I64)      # a context, buffer, fence, queue, token, window...
CID = Int(0, U64)         # a correlation id (``ipc.make_cid``)
PRIORITY = Int(-(1 << 31), 1 << 31)  # the client's role bounds it further (its handler)
NAME = Str(1 << 20, printable=True, limit="max_name")  # shown in reports and logs
DURATION = Num(0.0, limit="max_duration_ms")            # modeled ms
NUMBER = Num()            # finite; its handler bounds it
PARAMS_DEPTH = 4          # nesting of a command's params and of an injected fault's map


def text(max_len: int) -> Str:
    """A short printable string (a device, dtype, kernel, layout...)."""
    return Str(max_len, printable=True)


def handles(max_len: int) -> List:
    return List(HANDLE, max_len=max_len)


def plain_map(max_bytes: int) -> Map:
    """A client's free-form map (a command's params, a fault's parameters): nested at most
    ``PARAMS_DEPTH`` deep, at most ``max_bytes`` once packed."""
    return Map(values=Plain(depth=PARAMS_DEPTH - 1), max_len=max_bytes, max_bytes=max_bytes)


# -- client -> supervisor -------------------------------------------------------------------

# One command of a submit. ``cid``: the client's own (``ipc.make_cid``), else the
# supervisor numbers it.
COMMAND: dict[str, Any] = {
    "kernel": text(64), "signal?": HANDLE, "ins?": handles(16), "outs?": handles(16),
    "wait?": handles(64), "params?": plain_map(1024),  # a ring slot is 2 KiB
    "ms?": DURATION, "handoff_ms?": DURATION, "cid?": CID, "timeout_ms?": DURATION,
    "checked?": bool, "priority?": PRIORITY, "deadline_ms?": DURATION, "preemptible?": bool}

REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    # ``pid`` is ignored (the kernel says who the peer is); ``role`` a token the owner granted
    "hello": {"id": ID, "name": NAME, "pid?": Int(-I64 - 1, I64), "owner?": bool,
              "role?": HANDLE},
    "grant_role": {"id": ID, "scope?": Str(8, choices=frozenset({"all", "trace"}))},
    "fence_signal": {"id": ID, "fence": HANDLE, "error?": Int(0, 0xFFFF)},
    "ping": {"id": ID},
    "context_create": {"id": ID, "device": text(64), "priority?": PRIORITY, "name?": NAME,
                       "cache_maintenance?": OneOf((bool, text(16))), "period_ms?": DURATION,
                       "weight?": NUMBER, "recoverable?": bool},
    "context_destroy": {"id": ID, "ctx": HANDLE},
    "alloc": {"id": ID, "shape": handles(8), "dtype": text(16), "strides?": handles(8),
              "align?": Int(1, 1 << 30), "layout?": text(16), "usage?": List(text(64), 8),
              "exportable?": bool},
    "free": {"id": ID, "buf": HANDLE},
    "free_many": {"id": ID, "bufs": handles(4096)},  # frees the client deferred while views lived
    "fence_create": {"id": ID, "count?": Int(1, 1024)},
    # user-mode submission queues: a ring the client writes and the device reads
    "queue_open": {"id": ID, "ctx": HANDLE, "slots?": Int(1, 1 << 16)},
    "queue_close": {"id": ID, "queue": HANDLE},
    # a buffer the queue's records may name (a slot of its binding table), and letting go
    "queue_bind": {"id": ID, "queue": HANDLE, "buf": HANDLE},
    "queue_unbind": {"id": ID, "queue": HANDLE, "buf": HANDLE},
    "fence_release": {"id": ID, "fences": handles(4096)},
    "fence_error": {"id": ID, "fence": HANDLE},
    # fences as descriptors (sync_file) and merged fences (``supervisor._fencefds``)
    "fence_fd": {"id": ID, "fence": HANDLE},
    "fence_merge": {"id": ID, "fences": handles(64)},
    "submit": {"id": ID, "ctx": HANDLE, "cmds": List(Map(fields=COMMAND), 4096), "t_ns?": HANDLE},
    "cancel": {"id": ID, "ctx": HANDLE},
    "metrics": {"id": ID},
    # memory: per-context IOMMU mappings, explicit sharing, the memory timeline
    "map": {"id": ID, "ctx": HANDLE, "buf": HANDLE, "perm?": text(2)},
    "unmap": {"id": ID, "ctx": HANDLE, "buf": HANDLE},
    "export": {"id": ID, "buf?": HANDLE, "fence?": HANDLE, "read_only?": bool, "signal?": bool},
    "import": {"id": ID, "token": HANDLE, "kind?": text(16)},
    "mem_events": {"id": ID, "since?": HANDLE, "limit?": Int(1, 65536), "cids?": handles(4096)},
    "shutdown": {"id": ID},
    "inject": {"id": ID, "fault": plain_map(256)},
    "faults_clear": {"id": ID},
    "incidents": {"id": ID},
    "dumps": {"id": ID},
    "run_digest": {"id": ID, "rows_from?": Int(0, I64)},
    "prepare": {"id": ID, "ctx": HANDLE, "kernel": text(64)},
    "trace_info": {"id": ID},
    "trace_frozen": {"id": ID, "window?": HANDLE, "offset?": HANDLE, "flush?": bool},
    "power_vote": {"id": ID, "ctx": HANDLE, "level": NUMBER},
    # resets: a context's (``ctx``) or the process's statistics; unwedging a device
    "reset_stats": {"id": ID, "ctx?": HANDLE},
    "device_unwedge": {"id": ID, "device": text(64)},
}


def wire_type(spec: Any) -> Any:
    """The type (or tuple of types) a value of ``spec`` has on the wire."""
    if isinstance(spec, OneOf):
        return tuple(t for o in spec.options if o is not None for t in _as_tuple(wire_type(o)))
    if isinstance(spec, Spec):
        return _WIRE_TYPES[type(spec)]
    return spec  # a plain type (bool)


def _as_tuple(t: Any) -> tuple:
    return t if isinstance(t, tuple) else (t,)


_WIRE_TYPES = {Int: int, Num: (int, float), Str: str, List: list, Map: dict}

# What ``ipc.decode`` checks of a request: every field's type, none of its bounds.
REQUESTS = {op: {f: wire_type(spec) for f, spec in fields.items()}
            for op, fields in REQUEST_FIELDS.items()}


def fields_of(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A schema's fields by their names (``"name?"``: optional), with their specs."""
    return {f.rstrip("?"): spec for f, spec in schema.items()}


# -- supervisor -> client -------------------------------------------------------------------

# A context's part in the last reset that touched it (GL robustness' reset status).
RESET_STATUSES = frozenset(("none", "guilty", "innocent", "unknown"))
# The wire form of an error (``HetprocError.to_dict``); ``detail`` is free-form.
ERROR = Map(max_len=16)
# A report the client passes on without reading it field by field (metrics, the platform's
# spec, trace windows...): any plain value, bounded by the packet's caps.
REPORT = OneOf((None, bool, int, float, str, bytes, list, dict))
SEGMENT = Int(0, U64)  # a segment's id; its descriptor comes with the reply (``segs``)
SEGS = List(Tuple((SEGMENT, Int(0, I64))), max_len=4)  # [[segment, bytes]]
BUFFER = {"buf": HANDLE, "segment": SEGMENT, "offset": Int(0, I64), "exportable": bool,
          "nbytes": Int(0, I64), "shape": List(Int(0, I64), 8), "dtype": text(16),
          "strides": OneOf((None, List(Int(0, I64), 8))), "layout": OneOf((None, text(64))),
          "usage": OneOf((None, List(text(64), 8))), "segs": SEGS}

# What the reply to each request carries besides its id and ``ok`` (when it succeeded).
RESULTS: dict[str, dict[str, Any]] = {
    "hello": {"client_id": HANDLE, "prefix": text(255), "platform": Str(255),
              "supervisor_pid": Int(1, I64), "fence_segment": text(255),
              "state_segment": text(255), "time_scale": Num(0.0), "devices": List(text(64), 256),
              "spec": REPORT, "trace": REPORT, "privileged": bool, "max_priority": Int(0, I64),
              "clock?": REPORT},
    "grant_role": {"token": HANDLE},
    "fence_signal": {"signalled": bool},
    "ping": {},
    "context_create": {"ctx": HANDLE},
    "context_destroy": {},
    "alloc": BUFFER,
    "free": {"reclaimed": bool},
    "free_many": {},
    "fence_create": {"fences": handles(1024)},
    "queue_open": {"qid": HANDLE, "sid": SEGMENT, "slots": Int(1, 1 << 16), "bytes": Int(0, I64),
                   "doorbell": text(255), "tag": HANDLE, "max_hold_ns": Int(0, I64), "segs": SEGS,
                   "kernels?": List(text(64), max_len=64)},
    "queue_close": {},
    "queue_bind": {"slot": Int(0, 1 << 16), "gen": Int(1, U64), "perm": text(2)},
    "queue_unbind": {},
    "fence_release": {},
    "fence_error": {"error": OneOf((None, ERROR))},
    # the descriptor comes with the reply (SCM_RIGHTS); the client puts it in ``fds``
    "fence_fd": {"fds": List(Int(0, I64), max_len=1)},
    "fence_merge": {"fence": HANDLE},
    # [seq, cid, fence] per command: items not walked (this runs per command in the client;
    # a fence handle is checked by the fence table where it is used)
    "submit": {"cmds": List(list, 4096)},
    "cancel": {"cancelled": Int(0, I64)},
    "metrics": {"metrics": REPORT},
    "map": {"perm": text(2)},
    "unmap": {"unmapped": bool},
    "export": {"token": HANDLE},
    "import": {**{f + "?": spec for f, spec in BUFFER.items()}, "perm?": text(2),
               "fence?": HANDLE, "cid?": CID, "signal?": bool},
    "mem_events": {"events": REPORT, "last_seq": Int(0, I64), "missed": Int(0, I64),
                   "open?": REPORT},
    "shutdown": {},
    "inject": {"rule": REPORT},
    "faults_clear": {},
    "incidents": {"history": REPORT, "active": REPORT, "verdicts": REPORT, "events": REPORT,
                  "faults": REPORT},
    "dumps": {"dumps": REPORT},
    "run_digest": {"digest": REPORT},
    "prepare": {"device": text(64), "fallback": OneOf((None, text(64))), "error?": ERROR},
    "trace_info": {"segment": text(255), "rings": REPORT, "capacity": Int(0, I64),
                   "enabled": REPORT, "names": REPORT, "tracks": REPORT, "running": REPORT},
    "trace_frozen": {"windows?": REPORT, "pending?": bool, "suppressed?": REPORT,
                     "window?": REPORT, "records?": bytes, "offset?": Int(0, I64),
                     "total?": Int(0, I64)},
    "power_vote": {"level": NUMBER, "device_level": NUMBER},
    "reset_stats": {"status": Str(16, choices=RESET_STATUSES), "in_progress": bool, "wedged": bool,
                    "banned": bool, "resets": Int(0, I64), "guilty": Int(0, I64),
                    "innocent": Int(0, I64)},
    "device_unwedge": {"device": text(64), "was_wedged": bool, "epoch": Int(0, I64)},
}
# A notice: an answer nobody asked for (id 0) -- a fence's failure record, sent to the
# fence's owner and importers ahead of its wake; a queue lost with its device; a
# connection refused at the door.
NOTICE = {"id": Int(0, 0), "ok": bool, "fence?": HANDLE, "queue?": HANDLE, "error": ERROR}
# Every reply is a map with its request's id and whether it succeeded; what else it holds
# depends on the request (its handler's result).
REPLY = {"id": ID, "ok": bool, "error?": OneOf((None, ERROR)), "fence?": HANDLE,
         "queue?": HANDLE, "*": object}
REPLIES = {"reply": REPLY}  # what a client decodes: a reply, or a notice
ANSWERS = {op: {"id": ID, "ok": bool, **results} for op, results in RESULTS.items()}


def result_of(op: str, reply: dict[str, Any]) -> dict[str, Any]:
    """A successful reply to ``op``, checked against its declaration (``RESULTS``)."""
    check_fields(reply, ANSWERS[op], op)
    return reply


def reply(req_id: int, result: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"op": "reply", "id": req_id, "ok": True, **(result or {})}


def refusal(req_id: int, error: Mapping[str, Any]) -> dict[str, Any]:
    """A request's error (``error``: ``HetprocError.to_dict()``)."""
    return {"op": "reply", "id": req_id, "ok": False, "error": error}


def notice(error: Mapping[str, Any], **about: int) -> dict[str, Any]:
    """A notice (see ``NOTICE``): ``fence=`` or ``queue=`` names what failed."""
    msg = {"op": "reply", "id": 0, "ok": False, **about, "error": error}
    check_fields(msg, NOTICE, "notice")  # rare, and never sent malformed
    return msg


# -- lenient reads: what can still be learnt from a packet that was refused ----------------
# Bounded by the packet's size alone (its containers may be what was refused); each field
# read is checked against its declared spec, and anything else is ignored.

def request_id_of(frame: bytes) -> int:
    """The id of a request that was refused, if it has a valid one; else -1 (then the
    answer goes out as id 0, a notice)."""
    msg = _lenient(frame)
    rid = msg.get("id")
    return rid if rid and ID.ok(rid) else -1


def signal_fences_of(frame: bytes) -> list[int]:
    """The client-chosen signal fences of a submit that was refused."""
    cmds = _lenient(frame).get("cmds")
    if type(cmds) is not list:
        return []
    ok = COMMAND["signal?"].ok
    return [c["signal"] for c in cmds if type(c) is dict and ok(c.get("signal"))]


def _lenient(frame: bytes) -> dict:
    try:
        msg = unpack(frame, max_items=MAX_PACKET) if len(frame) <= MAX_PACKET else None
    except Exception:  # msgpack raises many unrelated types on garbage
        return {}
    return msg if isinstance(msg, dict) else {}

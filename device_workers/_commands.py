"""The two record kinds that cross a device's rings, and their validating decoders.

A ring lives in shared memory that any process of the same user can open and scribble
on, so both readers treat every record as hostile:

* the device decodes each **command** with ``decode_command`` before it changes any
  state (state table, cache, fences): every field has a type, a range and a size cap --
  64-bit counters that fit their state-table words, durations below ``MAX_DURATION_NS``,
  at most ``MAX_OPERANDS`` buffer descriptors of at most ``MAX_DIMS`` dimensions, at most
  ``MAX_FENCES`` fence handles -- so nothing past the check can overflow, hang for ever
  or raise outside the command's own error handling;
* the supervisor decodes each **completion batch** with ``decode_completions``: the same
  kind of contract, so a forged record can neither crash it (an unhashable ``seq``, a
  string where a number goes) nor smuggle huge data into its logs.

Anything malformed raises ``BadPacket`` (of the one hierarchy in ``ipc.errors``), never
another exception type.
"""

from __future__ import annotations

from typing import Any, Callable

from ipc import (I64, U64, Int, List, Map, Num, OneOf, Plain, Spec, Str, Tuple, check_fields,
                 decode, errors, unpack)

from . import _faults

MAX_OPERANDS = 64           # buffers per command, inputs and outputs each
MAX_DIMS = 8                # dimensions of one buffer view
MAX_EXTENT = 1 << 40        # one dimension, one stride, one offset (bytes or elements)
MAX_FENCES = 1024           # handles a command waits on or signals
MAX_DURATION_NS = 3600 * 10**9  # no modeled duration, delay or timeout beyond an hour
MAX_MESSAGE = 4096          # characters of an error message in a completion record
MAX_BATCH = 64              # completion records in one ring slot (2 KiB: ~16 fit)
PERMS = frozenset(("", "r", "w", "rw"))
MEM_STEPS = frozenset(("map", "invalidate", "clean", "unmap"))

_dims = List(Int(0, MAX_EXTENT), max_len=MAX_DIMS)
_DESCRIPTOR_FIELDS = Tuple((
    Str(255),                     # segment name
    Int(0, MAX_EXTENT),           # byte offset in the segment
    _dims,                        # shape
    Str(32),                      # dtype (numpy checks the spelling where it maps it)
    OneOf((None, _dims)),         # strides, or nil for C order
    Str(2, choices=PERMS),        # the IOMMU permission the supervisor granted
    Int(0, U64),                  # buffer handle (identity evidence)
))


def _dims_ok(v: Any) -> bool:
    return (type(v) is list and len(v) <= MAX_DIMS
            and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in v))


class _Descriptor(Spec):
    """``_DESCRIPTOR_FIELDS`` with its predicate written out: descriptors are the bulk
    of a command, and the generic record check costs twice as much per operand."""

    def check(self, value: Any, where: Any) -> None:
        _DESCRIPTOR_FIELDS.check(value, where)

    def _predicate(self) -> Callable[[Any], bool]:
        def ok(v: Any) -> bool:
            return (type(v) is list and len(v) == 7
                    and type(v[0]) is str and len(v[0]) <= 255
                    and type(v[1]) is int and 0 <= v[1] <= MAX_EXTENT
                    and _dims_ok(v[2]) and type(v[3]) is str and len(v[3]) <= 32
                    and (v[4] is None or _dims_ok(v[4])) and v[5] in PERMS
                    and type(v[6]) is int and 0 <= v[6] <= U64)
        return ok


DESCRIPTOR = _Descriptor()
_duration = Int(0, MAX_DURATION_NS)
_fences = List(Int(0, U64), max_len=MAX_FENCES)
_pairs = List(Tuple((Int(0, MAX_OPERANDS - 1), _duration)), max_len=MAX_OPERANDS)
MEM_REQUEST = Map(fields={
    "map_ns?": _duration, "unmap_ns?": _duration, "map_bytes?": Int(0, I64),
    "inv?": _pairs, "clean?": _pairs,
    "forget?": List(Tuple((Str(255), Int(0, MAX_EXTENT))), max_len=MAX_OPERANDS),
})
FAULT = Map(fields={
    "kind": Str(32, choices=_faults.KINDS),
    "step?": Str(32, choices=_faults.STEPS),
    "seconds?": Num(0, 600), "after_s?": Num(0, 600),
    "*": Plain(depth=2, items=64, max_len=256),  # rule options the device ignores
}, max_len=32)

COMMAND_SCHEMAS = {
    "exec": {"seq": Int(0, I64), "pidx": Int(0, I64), "cid": Int(0, I64),
             "kernel": Str(64), "checked?": bool,
             "params": Map(values=Plain(depth=4, items=1024), max_len=64),
             "ins": List(DESCRIPTOR, max_len=MAX_OPERANDS),
             "outs": List(DESCRIPTOR, max_len=MAX_OPERANDS),
             "wait": _fences, "signal": _fences,
             "hold_ns": _duration, "delay_ns": _duration, "dep_timeout_ns": _duration,
             "fault?": FAULT, "mem?": MEM_REQUEST,
             # modeled time (invariant 8), preemption and the voted speed (seed §7, §11)
             "arrive_ns?": Int(0, I64), "pre?": bool, "spd?": Num(0.0, 1.0)},
    "stop": {},
}


def decode_command(data: bytes) -> dict[str, Any]:
    """A command from the device's ring, checked whole; ``BadPacket`` otherwise."""
    return decode(data, COMMAND_SCHEMAS)


def best_effort_ids(data: bytes) -> tuple[int, int]:
    """The (seq, pidx) a refused command claims, each 0 unless plausible: lets the device
    refuse that very command and keep its ring order; a forged pair names nothing."""
    try:
        msg = unpack(data)
    except Exception:  # garbage: nothing to name
        return 0, 0
    if not isinstance(msg, dict):
        return 0, 0
    seq, pidx = msg.get("seq", 0), msg.get("pidx", 0)
    return (seq if type(seq) is int and 0 < seq <= I64 else 0,
            pidx if type(pidx) is int and 0 < pidx <= I64 else 0)


# -- completions: device -> supervisor ---------------------------------------------------

_t = Int(0, I64)  # a monotonic-clock stamp in ns
MEM_REPORT = Map(fields={
    "ev?": List(Tuple((Str(16, choices=MEM_STEPS), _t, _t, Int(0, I64), Int(0, I64))),
                max_len=len(MEM_STEPS)),
    "ids?": List(Tuple((Str(1, choices=frozenset("io")), Str(255), Int(0, U64),
                        Int(0, MAX_EXTENT), Int(0, U64))), max_len=2 * MAX_OPERANDS),
    "k?": List(_t, min_len=2, max_len=2),
})
COMPLETION = {
    "seq": Int(0, I64), "epoch": Int(0, U64), "code": Int(0, 0xFFFF),
    "msg": Str(MAX_MESSAGE), "t_start": _t, "t_end": _t,
    "t_take?": _t, "t_signal?": _t, "cid?": Int(0, I64), "unsignalled?": bool,
    "tb?": Str(MAX_MESSAGE),  # the end of a kernel's traceback
    "mem?": OneOf((None, MEM_REPORT)),
    # modeled start and end, how late the host finished past it, the speed it ran at,
    # the modeled temperature and whether it was throttled
    "m0?": _t, "m1?": _t, "lag?": Int(0, I64), "spd?": Num(0.0, 1.0),
    "temp?": Num(-300.0, 1e6), "thr?": bool,
}


def decode_completions(data: bytes) -> list[dict[str, Any]]:
    """A batch of completion records from a device's ring, each checked whole.

    Every value that comes out has the type and range the supervisor relies on (``seq``
    an int it can look up, ``code`` a 16-bit error code, ...); anything else raises
    ``BadPacket`` and the batch is refused as a whole.
    """
    try:
        batch = unpack(data)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise errors.BadPacket(f"undecodable completion batch: {type(exc).__name__}: "
                               f"{exc}"[:300]) from None
    if type(batch) is not list or not 1 <= len(batch) <= MAX_BATCH:
        raise errors.BadPacket(f"a completion batch must be a list of 1..{MAX_BATCH} "
                               f"records, got {type(batch).__name__}")
    for i, rec in enumerate(batch):
        if type(rec) is not dict:
            raise errors.BadPacket(f"completion {i} is a {type(rec).__name__}, not a map")
        for key in rec:
            if type(key) is not str:
                raise errors.BadPacket(f"completion {i} has a key {key!r:.40} that is not a string")
        check_fields(rec, COMPLETION, where=f"completion {i}")
    return batch

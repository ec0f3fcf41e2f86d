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

Two formats reach both readers, each checked as strictly: the fixed-layout records the
supervisor and the device write on the hot path (``encode_command``; ``encode_ran`` or
``encode_completion`` per record, ``completion_batch`` per ring slot: a struct header
whose every field is range-checked, no map to build or walk; about a fifth of the CPU of
a msgpack map and its schema check, measured by ``python -m bench --only
codec,fastpath``), and msgpack maps (the ``stop`` record, and
the general form anything may still write). The first byte tells them apart: 0xC1 is
never used by msgpack.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from ipc import (
    I64,
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
    decode,
    errors,
    unpack,
)

from . import _faults
from ._passed import Passed

MAX_OPERANDS = 64           # buffers per command, inputs and outputs each
MAX_DIMS = 8                # dimensions of one buffer view
MAX_EXTENT = 1 << 40        # one dimension, one stride, one offset (bytes or elements)
MAX_FENCES = 1024           # handles a command waits on or signals
MAX_QUEUE_GRANTS = 256      # imported fences a queue attach names (later imports: qgrant)
MAX_DURATION_NS = 3600 * 10**9  # no modeled duration, delay or timeout beyond an hour
MAX_MESSAGE = 4096          # characters of an error message in a completion record
MAX_BATCH = 64              # completion records in one ring slot (2 KiB: ~16 fit)
PERMS = frozenset(("", "r", "w", "rw"))
MEM_STEPS = frozenset(("map", "invalidate", "clean", "unmap"))

_dims = List(Int(0, MAX_EXTENT), max_len=MAX_DIMS)
_DESCRIPTOR_FIELDS = Tuple((
    Int(0, U64),                  # segment id (the segment came as a descriptor)
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
                    and type(v[0]) is int and 0 <= v[0] <= U64
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
    "forget?": List(Tuple((Int(0, U64), Int(0, MAX_EXTENT))), max_len=MAX_OPERANDS),
})
FAULT = Map(fields={
    "kind": Str(32, choices=_faults.KINDS),
    "step?": Str(32, choices=_faults.STEPS),
    "seconds?": Num(0, 600), "after_s?": Num(0, 600),
    "*": Plain(depth=2, items=64, max_len=256),  # rule options the device ignores
}, max_len=32)

# A fault rule the supervisor forwards for a queue's commands (``_faults.Rule``).
QUEUE_FAULT = Map(fields={
    "kind": Str(32, choices=_faults.QUEUE_KINDS), "at?": Int(1, I64), "every?": Int(1, I64),
    "probability?": Num(0.0, 1.0), "count?": Int(0, I64),
    "params?": Map(values=Plain(depth=2, items=64, max_len=256), max_len=32),
})
_QUEUE_FAULTS = List(QUEUE_FAULT, max_len=64)
# What a queue that runs kernels on bound buffers is held to (``_queues.Terms``).
QUEUE_TERMS = Map(fields={
    "entries": Int(1, 4096), "kernels": List(Str(64), min_len=1, max_len=64),
    "timing": Tuple((Map(values=Num(0.0, 1e9), max_len=64), Num(0.0, 1e9), Num(0.0, 1e9),
                     Num(0.0, 1e6))),
    "watchdog": Tuple((_duration, _duration)),
    "params": Tuple((Int(0, 16), Int(0, 1 << 20), Int(0, 1 << 20))),
    "cache?": Tuple((_duration, Num(0.0, 1e12), _duration, Num(0.0, 1e12), Int(0, I64))),
    "mode": Str(16, choices=frozenset(("both", "clean", "invalidate", "none"))),
    "quota?": Tuple((Num(0.0, 1e12), Num(0.0, 1e18))),
    "faults?": _QUEUE_FAULTS, "seed?": Int(0, U64),
})

COMMAND_SCHEMAS: dict[str, dict[str, Any]] = {
    "exec": {"seq": Int(0, I64), "pidx": Int(0, I64), "cid": Int(0, I64),
             "kernel": Str(64), "checked?": bool,
             "params": Map(values=Plain(depth=4, items=1024), max_len=64),
             "ins": List(DESCRIPTOR, max_len=MAX_OPERANDS),
             "outs": List(DESCRIPTOR, max_len=MAX_OPERANDS),
             "wait": _fences, "signal": _fences,
             "hold_ns": _duration, "delay_ns": _duration, "dep_timeout_ns": _duration,
             "fault?": FAULT, "mem?": MEM_REQUEST,
             # modeled time (invariant 8), preemption and the voted speed (seed §7, §11)
             "arrive_ns?": Int(0, I64), "pre?": bool, "nopre?": bool, "spd?": Num(0.0, 1.0),
             "urg?": Int(0, I64), "ctx?": Int(0, U64)},
    "stop": {},
    # user-mode queues (``_queues``): the supervisor attaches and detaches them in order
    # with the commands it pushes
    "qattach": {"qid": Int(1, U64), "sid": Int(1, U64), "slots": Int(1, 1 << 16),
                "tag": Int(0, U64), "max_hold_ns": _duration, "dep_timeout_ns": _duration,
                "dispatch_ns": _duration, "first": Int(0, I64),
                "grants?": List(Int(0, U64), max_len=MAX_QUEUE_GRANTS), "tenant?": Int(0, U64),
                "table?": Int(1, U64), "terms?": QUEUE_TERMS},
    "qdetach": {"qid": Int(1, U64)},
    "qgrant": {"qid": Int(1, U64), "fence": Int(0, U64)},
    "qfaults": {"qid": Int(1, U64), "rules": _QUEUE_FAULTS},
}


# -- the fixed-layout command record (what the supervisor writes) -----------------------
#
# One command in one ring slot, no map to build or walk: a fixed header, the kernel name,
# the wait and signal fence handles as u64, then (only when the command has any) a small
# msgpack map of the variable parts -- params, operand descriptors, fault, memory work --
# checked against the same specs as the map format. The first byte is 0xC1, which msgpack
# never uses, so a record and a map can never be mistaken for each other. The reader
# checks every header field's range, the exact length, and the tail's schema.

RECORD_TAG = 0xC1
_F_CHECKED, _F_PRE, _F_SPD, _F_NOPRE = 1, 2, 4, 8
_CMD_FLAGS = _F_CHECKED | _F_PRE | _F_SPD | _F_NOPRE
# tag, flags, kernel length, pad, n_wait, n_signal, tail length,
# seq, pidx, cid, hold_ns, delay_ns, dep_timeout_ns, arrive_ns, urg, spd
CMD_HEAD = struct.Struct("<BBBBHHI8qd")
LEAST_URGENT = I64  # ``urg`` of a command nothing is compared with (no preemption)
MAX_KERNEL = 64
_TAIL: dict[str, Any] = {"params?": COMMAND_SCHEMAS["exec"]["params"],
         "ins?": COMMAND_SCHEMAS["exec"]["ins"], "outs?": COMMAND_SCHEMAS["exec"]["outs"],
         "fault?": FAULT, "mem?": MEM_REQUEST,
         "ctx?": Int(0, U64)}  # its context, on a device that timeslices (``_preempt``)
_U64S = [struct.Struct(f"<{n}Q") for n in range(4)]
_EMPTY = b""


def encode_command(seq: int, pidx: int, cid: int, kernel: str, wait: list[int],
                   signal: list[int], hold_ns: int, delay_ns: int, dep_timeout_ns: int,
                   arrive_ns: int, *, checked: bool = False, pre: bool = False,
                   nopre: bool = False,
                   spd: float | None = None, params: dict | None = None,
                   ins: list | None = None, outs: list | None = None,
                   fault: dict | None = None, mem: dict | None = None,
                   urg: int = LEAST_URGENT, ctx: int | None = None) -> bytes:
    """The record of one ``exec`` command (see ``decode_command``); ``urg``: its urgency
    on a preemptive device (lower preempts higher: ``_preempt``); ``ctx``: its context,
    on a device that timeslices (a context's commands never take turns)."""
    k = kernel.encode()
    tail: dict[str, Any] = {}
    if params:
        tail["params"] = params
    if ins:
        tail["ins"] = ins
    if outs:
        tail["outs"] = outs
    if fault:
        tail["fault"] = fault
    if mem:
        tail["mem"] = mem
    if ctx is not None:
        tail["ctx"] = ctx
    tail_bytes = msgpack.packb(tail, use_bin_type=True) if tail else _EMPTY
    nw, ns = len(wait), len(signal)
    flags = (_F_CHECKED if checked else 0) | (_F_PRE if pre else 0) | (
        _F_SPD if spd is not None else 0) | (_F_NOPRE if nopre else 0)
    head = CMD_HEAD.pack(RECORD_TAG, flags, len(k), 0, nw, ns, len(tail_bytes), seq, pidx,
                         cid, hold_ns, delay_ns, dep_timeout_ns, arrive_ns, urg,
                         0.0 if spd is None else spd)
    fences = (_U64S[nw + ns] if nw + ns < 4 else struct.Struct(f"<{nw + ns}Q")).pack(
        *wait, *signal)
    return b"".join((head, k, fences, tail_bytes))


def _bad(what: str) -> errors.BadPacket:
    return errors.BadPacket(f"command record: {what}")


# The header again with ``spd`` as its raw 64 bits: the common record has no speed, and
# "no speed" must be exactly +0.0, all bits clear (not -0.0, not a NaN), one compare.
_CMD_HEAD_RAW = struct.Struct("<BBBBHHI8qQ")
_F64 = struct.Struct("<d")
_SPD_AT = CMD_HEAD.size - 8
# Several fields are checked at once where that is exact: an OR of ints is negative iff one
# of them is, and it is below a power of two iff each of them is. A record that fails a
# combined check goes through the field-by-field one, which says which field is wrong.
_FENCE_BITS = MAX_FENCES.bit_length() - 1  # below 2 ** this, both counts are in range
_KERNEL_NAMES: dict[bytes, str] = {}  # the few kernel names seen, decoded once each


def _check_head(flags: int, pad: int, klen: int, nw: int, ns: int, seq: int, pidx: int,
                cid: int, hold: int, delay: int, dep: int, arrive: int) -> None:
    """The header's checks one field at a time, raising for the first that fails."""
    if flags & ~_CMD_FLAGS or pad:
        raise _bad(f"unknown flags {flags:#x} or padding {pad}")
    if klen > MAX_KERNEL or nw > MAX_FENCES or ns > MAX_FENCES:
        raise _bad(f"kernel name of {klen} bytes, {nw} wait and {ns} signal fences "
                   f"(at most {MAX_KERNEL}, {MAX_FENCES}, {MAX_FENCES})")
    if not (0 <= seq <= I64 and 0 <= pidx <= I64 and 0 <= cid <= I64 and 0 <= arrive):
        raise _bad(f"seq {seq}, pidx {pidx}, cid {cid}, arrive_ns or urg {arrive} out of "
                   "range")
    if not (0 <= hold <= MAX_DURATION_NS and 0 <= delay <= MAX_DURATION_NS
            and 0 <= dep <= MAX_DURATION_NS):
        raise _bad(f"hold_ns {hold}, delay_ns {delay} or dep_timeout_ns {dep} outside "
                   f"0..{MAX_DURATION_NS}")


_HEAD_BYTES = CMD_HEAD.size
_TAG = b"\xc1"


def decode_command(data: bytes) -> dict[str, Any]:
    """A command from the device's ring, checked whole; ``BadPacket`` otherwise. A
    fixed-layout record (what the supervisor writes) or a msgpack map (``stop``, and the
    general form of ``exec``): both end in the same dict, every field in its range."""
    if data[:1] != _TAG:
        return decode(data, COMMAND_SCHEMAS)
    n = len(data)
    if n < _HEAD_BYTES:
        raise _bad(f"{n} bytes, shorter than its {_HEAD_BYTES}-byte header")
    (_tag, flags, klen, pad, nw, ns, tlen, seq, pidx, cid, hold, delay, dep, arrive, urg,
     spd_bits) = _CMD_HEAD_RAW.unpack_from(data)
    # Every header field in its range (seq, pidx, cid, arrive_ns are signed 64-bit: only
    # their sign is left to check); the field-by-field check runs when this one fails.
    if (flags & ~_CMD_FLAGS or pad or klen > MAX_KERNEL or (nw | ns) >> _FENCE_BITS
            or (seq | pidx | cid | arrive | hold | delay | dep | urg) < 0
            or hold > MAX_DURATION_NS or delay > MAX_DURATION_NS or dep > MAX_DURATION_NS):
        _check_head(flags, pad, klen, nw, ns, seq, pidx, cid, hold, delay, dep, arrive | urg)
    nf = nw + ns
    off = _HEAD_BYTES + klen
    if n != off + 8 * nf + tlen:
        raise _bad(f"{n} bytes, but its header describes {off + 8 * nf + tlen}")
    if flags & _F_SPD:
        spd = _F64.unpack_from(data, _SPD_AT)[0]
        if not 0.0 <= spd <= 1.0:  # NaN fails too
            raise _bad(f"spd {spd} outside 0..1")
    elif spd_bits:  # anything but +0.0
        raise _bad("spd set without its flag")
    raw = data[_HEAD_BYTES:off]
    kernel = _KERNEL_NAMES.get(raw)
    if kernel is None:
        try:
            kernel = raw.decode()
        except UnicodeDecodeError:
            raise _bad("kernel name is not UTF-8") from None
        if len(_KERNEL_NAMES) < 256:
            _KERNEL_NAMES[raw] = kernel
    if nw:
        fences = (_U64S[nf] if nf < 4 else struct.Struct(f"<{nf}Q")).unpack_from(data, off)
        wait, signal = list(fences[:nw]), list(fences[nw:])
    elif ns == 1:
        wait, signal = [], [_U64S[1].unpack_from(data, off)[0]]
    else:
        wait = []
        signal = list((_U64S[ns] if ns < 4 else struct.Struct(f"<{ns}Q")).unpack_from(data, off))
    cmd = {"op": "exec", "seq": seq, "pidx": pidx, "cid": cid, "kernel": kernel,
           "wait": wait, "signal": signal, "hold_ns": hold, "delay_ns": delay,
           "dep_timeout_ns": dep, "arrive_ns": arrive, "params": {}, "ins": [], "outs": []}
    if urg != LEAST_URGENT:
        cmd["urg"] = urg
    if flags:
        if flags & _F_CHECKED:
            cmd["checked"] = True
        if flags & _F_PRE:
            cmd["pre"] = True
        if flags & _F_NOPRE:
            cmd["nopre"] = True
        if flags & _F_SPD:
            cmd["spd"] = spd
    if tlen:
        raw = bytes(data[off + 8 * nf:])  # hashable whatever buffer type came
        try:
            tail = unpack(raw)
        except Exception as exc:  # msgpack raises many unrelated types on garbage
            raise _bad(f"undecodable tail: {type(exc).__name__}") from None
        if raw not in _TAILS_PASSED:
            _check_tail(tail)
            _TAILS_PASSED.add(raw, True)
        cmd.update(tail)  # a fresh object per command, whether checked now or before
    return cmd


# The tails that passed ``_check_tail``, by their exact bytes (``_passed``): the map is a
# pure function of them. The schema walk was most of a steady command's decode.
_TAILS_PASSED: Passed[bool] = Passed(1024)


def _check_tail(tail: Any) -> None:
    if type(tail) is not dict or not tail:
        raise _bad("its tail must be a non-empty map")
    for key in tail:
        if type(key) is not str:
            raise _bad(f"tail key {key!r:.40} is not a string")
    check_fields(tail, _TAIL, where="command record tail")


def best_effort_ids(data: bytes) -> tuple[int, int]:
    """The (seq, pidx) a refused command claims, each 0 unless plausible: lets the device
    refuse that very command and keep its ring order; a forged pair names nothing."""
    if data[:1] == b"\xc1":
        if len(data) < CMD_HEAD.size:
            return 0, 0
        seq, pidx = CMD_HEAD.unpack_from(data)[7:9]
        return (seq if 0 < seq <= I64 else 0, pidx if 0 < pidx <= I64 else 0)
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
    "ids?": List(Tuple((Str(1, choices=frozenset("io")), Int(0, U64), Int(0, U64),
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


# -- the fixed-layout completion batch (what the device writes) ----------------------------
#
# [tag 0xC1, count, 0, 0] then per record a fixed part -- seq, epoch, the stamps, cid, the
# modeled start/end/lag, speed, temperature, code, which optional fields are present,
# the lengths of what follows -- the message (UTF-8) and, when there is any, a msgpack
# map with the memory report and the traceback. Absent optional fields must be zero.

BATCH_HEAD = struct.Struct("<BBH")
# seq, epoch, t_start, t_end, t_take, t_signal, cid, m0, m1, lag, spd, temp,
# code, flags, msg length, tail length
DONE = struct.Struct("<qQ8q2d4H")
_D_TAKE, _D_SIGNAL, _D_CID, _D_UNSIGNALLED, _D_MODELED, _D_TEMP, _D_THR = (
    1, 2, 4, 8, 16, 32, 64)
_DONE_FLAGS = 127
_DONE_TAIL = {"tb?": COMPLETION["tb?"], "mem?": COMPLETION["mem?"]}
# What ``check_fields`` passes of a tail (a map with string keys), as one predicate: per
# record, the check (and the name of the record it builds) runs only to say why not.
_DONE_TAIL_OK = Map(fields=_DONE_TAIL).ok
_MAX_MSG_BYTES = 4 * MAX_MESSAGE


RAN_FLAGS = _D_TAKE | _D_SIGNAL | _D_CID | _D_MODELED  # a command that ran and signalled
RAN_TEMP_FLAGS = RAN_FLAGS | _D_TEMP


def encode_ran(seq: int, epoch: int, t_start: int, t_end: int, t_take: int, t_signal: int,
               cid: int, m0: int, m1: int, lag: int, spd: float, temp: float | None = None,
               thr: bool = False, tail: bytes = _EMPTY) -> bytes:
    """One record of a command that ran to its end and signalled its fences, no message:
    what ``encode_completion`` makes of that record's map, without the map (a device's
    most common record). ``tail``: its memory report, if any (``ran_tail``)."""
    if temp is None:
        head = DONE.pack(seq, epoch, t_start, t_end, t_take, t_signal, cid, m0, m1, lag, spd,
                         0.0, 0, RAN_FLAGS, 0, len(tail))
    else:
        head = DONE.pack(seq, epoch, t_start, t_end, t_take, t_signal, cid, m0, m1, lag, spd,
                         temp, 0, RAN_TEMP_FLAGS | (_D_THR if thr else 0), 0, len(tail))
    return head + tail if tail else head


def ran_tail(mem: dict[str, Any], limit: int) -> bytes:
    """The tail ``encode_completion`` gives a ran record's memory report, or none when the
    record would not fit a ring slot of ``limit`` bytes alone: its evidence goes, not its
    outcome (``_outbox.encoded``)."""
    tail = msgpack.packb({"mem": mem}, use_bin_type=True)
    return tail if BATCH_HEAD.size + DONE.size + len(tail) <= limit else _EMPTY


def encode_completion(r: dict[str, Any]) -> bytes:
    """One completion record (its fixed part, message and tail), for ``completion_batch``."""
    get = r.get
    flags = 0
    if "t_take" in r:
        flags |= _D_TAKE
    if "t_signal" in r:
        flags |= _D_SIGNAL
    if "cid" in r:
        flags |= _D_CID
    if get("unsignalled"):
        flags |= _D_UNSIGNALLED
    if "m0" in r:
        flags |= _D_MODELED
    if "temp" in r:
        flags |= _D_TEMP | (_D_THR if get("thr") else 0)
    msg = r["msg"].encode()
    tail = {}
    if get("tb"):
        tail["tb"] = r["tb"]
    if get("mem") is not None:
        tail["mem"] = r["mem"]
    tail_bytes = msgpack.packb(tail, use_bin_type=True) if tail else _EMPTY
    return b"".join((DONE.pack(r["seq"], r["epoch"], r["t_start"], r["t_end"],
                               get("t_take", 0), get("t_signal", 0), get("cid", 0),
                               get("m0", 0), get("m1", 0), get("lag", 0), get("spd", 0.0),
                               get("temp", 0.0), r["code"], flags, len(msg),
                               len(tail_bytes)),
                     msg, tail_bytes))


def completion_batch(records: list[bytes]) -> bytes:
    """One ring slot of encoded records (``encode_completion``, ``encode_ran``): the
    batch ``decode_completions`` reads."""
    return BATCH_HEAD.pack(RECORD_TAG, len(records), 0) + b"".join(records)


def encode_completions(records: list[dict[str, Any]]) -> bytes:
    """One ring slot of completion records (see ``decode_completions``)."""
    return completion_batch([encode_completion(r) for r in records])


def _bad_done(i: int, what: str) -> errors.BadPacket:
    return errors.BadPacket(f"completion {i}: {what}")


def _decode_done_batch(data: bytes) -> list[dict[str, Any]]:
    n = len(data)
    if n < BATCH_HEAD.size:
        raise errors.BadPacket(f"completion batch of {n} bytes")
    _tag, count, pad = BATCH_HEAD.unpack_from(data)
    if not 1 <= count <= MAX_BATCH or pad:
        raise errors.BadPacket(f"a completion batch must hold 1..{MAX_BATCH} records, "
                               f"got {count} (padding {pad})")
    out = []
    off, size, unpack_from = BATCH_HEAD.size, DONE.size, DONE.unpack_from
    for i in range(count):
        if off + size > n:
            raise _bad_done(i, "truncated")
        (seq, epoch, t0, t1, take, sig, cid, m0, m1, lag, spd, temp, code, flags, mlen,
         tlen) = unpack_from(data, off)
        off += size
        if off + mlen + tlen > n:
            raise _bad_done(i, f"message of {mlen} and tail of {tlen} bytes overrun the batch")
        if flags & ~_DONE_FLAGS or mlen > _MAX_MSG_BYTES:
            raise _bad_done(i, f"unknown flags {flags:#x} or a message of {mlen} bytes")
        if not (0 <= seq and 0 <= t0 and 0 <= t1 and 0 <= take and 0 <= sig and 0 <= cid
                and 0 <= m0 and 0 <= m1 and 0 <= lag):
            raise _bad_done(i, "a negative seq, stamp, cid or lag")
        rec = {"seq": seq, "epoch": epoch, "code": code, "t_start": t0, "t_end": t1}
        if flags & _D_TAKE:
            rec["t_take"] = take
        elif take:
            raise _bad_done(i, "t_take without its flag")
        if flags & _D_SIGNAL:
            rec["t_signal"] = sig
        elif sig:
            raise _bad_done(i, "t_signal without its flag")
        if flags & _D_CID:
            rec["cid"] = cid
        elif cid:
            raise _bad_done(i, "cid without its flag")
        if flags & _D_UNSIGNALLED:
            rec["unsignalled"] = True
        if flags & _D_MODELED:
            if not 0.0 <= spd <= 1.0:
                raise _bad_done(i, f"spd {spd} outside 0..1")
            rec["m0"], rec["m1"], rec["lag"], rec["spd"] = m0, m1, lag, spd
        elif m0 or m1 or lag or spd != 0.0:
            raise _bad_done(i, "modeled times without their flag")
        if flags & _D_TEMP:
            if not -300.0 <= temp <= 1e6:
                raise _bad_done(i, f"temperature {temp} out of range")
            rec["temp"], rec["thr"] = temp, bool(flags & _D_THR)
        elif temp != 0.0 or flags & _D_THR:
            raise _bad_done(i, "temperature without its flag")
        try:
            msg = data[off:off + mlen].decode()
        except UnicodeDecodeError:
            raise _bad_done(i, "message is not UTF-8") from None
        if len(msg) > MAX_MESSAGE:
            raise _bad_done(i, f"message of {len(msg)} characters")
        rec["msg"] = msg
        off += mlen
        if tlen:
            try:
                tail = unpack(data[off:off + tlen])
            except Exception as exc:  # msgpack raises many unrelated types on garbage
                raise _bad_done(i, f"undecodable tail: {type(exc).__name__}") from None
            if type(tail) is not dict or not tail:
                raise _bad_done(i, "its tail must be a non-empty map")
            for key in tail:
                if type(key) is not str:
                    raise _bad_done(i, f"tail key {key!r:.40} is not a string")
            if not _DONE_TAIL_OK(tail):
                check_fields(tail, _DONE_TAIL, where=f"completion {i} tail")  # raises
            rec.update(tail)
            off += tlen
        out.append(rec)
    if off != n:
        raise errors.BadPacket(f"completion batch has {n - off} bytes past its records")
    return out


def decode_completions(data: bytes) -> list[dict[str, Any]]:
    """A batch of completion records from a device's ring, each checked whole.

    Every value that comes out has the type and range the supervisor relies on (``seq``
    an int it can look up, ``code`` a 16-bit error code, ...); anything else raises
    ``BadPacket`` and the batch is refused as a whole. The fixed-layout batch (what a
    device writes) and a msgpack list of maps both end in the same records.
    """
    if data[:1] == b"\xc1":
        return _decode_done_batch(data)
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

"""What one command costs to encode and check, per format: the measurement behind the
choice of a fast submission path.

The supervisor today turns a validated command into a msgpack map per command, and the
device decodes it and checks every field against its schema (``ipc.check_fields``);
completions come back as msgpack maps. Candidates, each doing the same work a real
command needs (the same fields, the same bounds checks at the reader):

- ``msgpack map``: today's packet, packed by the supervisor, decoded and schema-checked
  by the device;
- ``struct record``: one fixed-layout record per command (``struct.pack_into`` in place
  in a ring buffer), operands as small indices into a descriptor table the device holds,
  every field range-checked by the reader;
- ``numpy records, batch of 64``: the same layout as a structured array, a batch written
  and checked at once (vector compares), as ``submit_many`` would.

Everything runs in this process: it measures CPU per command of the codec itself, not
the wake-ups (``submit_noop`` measures the whole path). Rows are ratios to the msgpack
map measured in the same run.
"""

from __future__ import annotations

import struct
import time

import msgpack
import numpy as np

from device_workers import COMMAND_SCHEMAS
from ipc import VERSION, check_fields, decode

from ._registry import benchmark, make_row

_BATCH = 64
# seq, pidx, cid, hold_ns, delay_ns, dep_timeout_ns, kernel id, flags, n_in, n_out,
# n_wait, n_signal, 4 operand indices, 2 wait fences, 1 signal fence
_RECORD = struct.Struct("<QQQqqqHHBBBB4H2QQ")
_DTYPE = np.dtype([("seq", "<u8"), ("pidx", "<u8"), ("cid", "<u8"), ("hold_ns", "<i8"),
                   ("delay_ns", "<i8"), ("dep_ns", "<i8"), ("kernel", "<u2"), ("flags", "<u2"),
                   ("n_in", "u1"), ("n_out", "u1"), ("n_wait", "u1"), ("n_signal", "u1"),
                   ("ops", "<u2", 4), ("wait", "<u8", 2), ("signal", "<u8")])
_MAX_HOLD_NS = 3600 * 10**9
_KERNELS = 16
_DESCRIPTORS = 4096


def _msgpack_command(i: int) -> dict:
    desc = ["hp.1.abc.pool.0", 4096 * i, [1, 64, 64, 3], "float32", None, "r", 0x10000 + i]
    return {"v": VERSION, "op": "exec", "seq": i, "pidx": i, "cid": (1 << 40) | i,
            "kernel": "relu", "checked": False, "params": {}, "ins": [desc],
            "outs": [desc[:5] + ["w", desc[6] + 1]], "wait": [0x300000001 + i],
            "signal": [0x500000001 + i], "hold_ns": 1_000_000, "delay_ns": 0,
            "dep_timeout_ns": 2_000_000_000}


def _per_command_msgpack(n: int) -> float:
    cmds = [_msgpack_command(i) for i in range(n)]
    t0 = time.perf_counter()
    for c in cmds:
        data = msgpack.packb(c)
        msg = decode(data, COMMAND_SCHEMAS)
        for d in msg["ins"] + msg["outs"]:  # the device's descriptor bounds check
            if not (isinstance(d[1], int) and d[1] >= 0 and len(d) == 7):
                raise ValueError
    return (time.perf_counter() - t0) / n


def _check_record(f: tuple) -> None:
    (_seq, _pidx, _cid, hold, delay, dep, kernel, _flags, n_in, n_out, n_wait, n_sig,
     o0, o1, o2, o3, _w0, _w1, _sig) = f
    if not (0 <= hold < _MAX_HOLD_NS and 0 <= delay < _MAX_HOLD_NS and 0 <= dep < _MAX_HOLD_NS
            and kernel < _KERNELS and n_in + n_out <= 4 and n_wait <= 2 and n_sig <= 1):
        raise ValueError("record out of range")
    for op in (o0, o1, o2, o3)[:n_in + n_out]:
        if op >= _DESCRIPTORS:
            raise ValueError("operand index out of range")


def _per_command_struct(n: int) -> float:
    ring = bytearray(_RECORD.size * 256)
    pack_into, unpack_from, size = _RECORD.pack_into, _RECORD.unpack_from, _RECORD.size
    t0 = time.perf_counter()
    for i in range(n):
        off = (i & 255) * size
        pack_into(ring, off, i, i, (1 << 40) | i, 1_000_000, 0, 2_000_000_000, 3, 0, 1, 1, 1, 1,
                  i & 4095, (i + 1) & 4095, 0, 0, 0x300000001 + i, 0, 0x500000001 + i)
        _check_record(unpack_from(ring, off))
    return (time.perf_counter() - t0) / n


def _per_command_numpy(n: int) -> float:
    batch = np.zeros(_BATCH, _DTYPE)
    rounds = max(1, n // _BATCH)
    idx = np.arange(_BATCH, dtype=np.uint64)
    t0 = time.perf_counter()
    for r in range(rounds):
        base = np.uint64(r * _BATCH)
        batch["seq"] = idx + base
        batch["pidx"] = idx + base
        batch["cid"] = (1 << 40) | (idx + base)
        batch["hold_ns"] = 1_000_000
        batch["dep_ns"] = 2_000_000_000
        batch["kernel"] = 3
        batch["n_in"] = batch["n_out"] = batch["n_wait"] = batch["n_signal"] = 1
        batch["ops"][:, 0] = (idx + base) & 4095
        batch["ops"][:, 1] = (idx + base + 1) & 4095
        ok = ((batch["hold_ns"] >= 0) & (batch["hold_ns"] < _MAX_HOLD_NS)
              & (batch["dep_ns"] >= 0) & (batch["dep_ns"] < _MAX_HOLD_NS)
              & (batch["kernel"] < _KERNELS) & (batch["ops"] < _DESCRIPTORS).all(axis=1)
              & (batch["n_in"].astype(np.uint16) + batch["n_out"] <= 4))
        if not ok.all():
            raise ValueError("record out of range")
    return (time.perf_counter() - t0) / (rounds * _BATCH)


_DONE_SCHEMA = {"seq": int, "epoch": int, "code": int, "msg": str, "t_start": int,
                "t_end": int, "t_take": int, "cid": int, "t_signal": int}


def _completions_msgpack(n: int) -> float:
    recs = [{"seq": i, "epoch": 1, "code": 0, "msg": "", "t_start": i, "t_end": i + 5,
             "t_take": i, "cid": i, "t_signal": i + 6} for i in range(16)]
    rounds = max(1, n // 16)
    t0 = time.perf_counter()
    for _ in range(rounds):
        batch = msgpack.unpackb(msgpack.packb(recs), raw=False)
        for r in batch:
            check_fields(r, _DONE_SCHEMA, where="completion")
    return (time.perf_counter() - t0) / (rounds * 16)


_COMPLETION = np.dtype([("seq", "<u8"), ("epoch", "<u4"), ("code", "<u4"), ("t_start", "<u8"),
                        ("t_end", "<u8"), ("t_take", "<u8"), ("cid", "<u8"), ("t_signal", "<u8")])


def _completions_numpy(n: int) -> float:
    recs = np.zeros(16, _COMPLETION)
    rounds = max(1, n // 16)
    seq = np.arange(16, dtype=np.uint64)
    t0 = time.perf_counter()
    for _ in range(rounds):
        recs["seq"] = seq
        recs["t_end"] = seq + 5
        back = np.frombuffer(recs.tobytes(), _COMPLETION)
        if not ((back["code"] < 100) & (back["t_end"] >= back["t_start"])).all():
            raise ValueError
    return (time.perf_counter() - t0) / (rounds * 16)


@benchmark("codec")
def bench_codec(quick: bool) -> dict:
    n = 2_000 if quick else 40_000
    best = {}
    for name, fn in (("msgpack", _per_command_msgpack), ("struct", _per_command_struct),
                     ("numpy", _per_command_numpy), ("done_msgpack", _completions_msgpack),
                     ("done_numpy", _completions_numpy)):
        best[name] = min(fn(n) for _ in range(3)) * 1e6  # best of 3: the least disturbed
    base = best["msgpack"]
    return {"rows": [
        make_row("command codec: msgpack map + schema check (today)", base, base),
        make_row("command codec: struct record + range checks", best["struct"], base),
        make_row(f"command codec: numpy records, batch of {_BATCH}", best["numpy"], base),
        make_row("completion codec: msgpack maps + schema check (today)", best["done_msgpack"],
                 best["done_msgpack"]),
        make_row("completion codec: numpy records, batch of 16", best["done_numpy"],
                 best["done_msgpack"]),
    ], "us_per_command": best}

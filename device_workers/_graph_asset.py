"""A compiled partition ("graph asset") in one byte buffer, and the loop that runs it.

Layout of the asset (one shared-memory buffer of uint8, read-only for the device)::

    0   magic  b"HPGRAPH1"
    8   u32    plan length        12  u32  crc32 of the plan      16  u64  total length
    24  plan   msgpack map (below)
    ..  weights, each at a 64-byte aligned offset named by the plan

Plan::

    {"v": 1,
     "weights": [[tensor, offset, dtype, shape], ...],           # in the asset
     "inputs":  [[tensor, operand, offset, dtype, shape], ...],  # operand >= 1 of ins
     "steps":   [[op, [tensor or -1, ...], [tensor, ...], attrs], ...],
     "outputs": [[tensor, operand, offset, dtype, shape], ...]}  # operand of outs

Tensors are small integers. Every field is checked before a byte is viewed: a malformed
or truncated asset is an ``InvalidRequest`` for that command, never a crash of the device.
The plan lives in shared memory because a ring slot (2 KiB) holds only the command.
"""

from __future__ import annotations

import math
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from ipc.errors import InvalidRequest

from ._graph_ops import op_function

__all__ = ["MAGIC", "HEADER_BYTES", "ALIGN", "asset_layout", "write_asset", "read_asset",
           "run_plan"]

MAGIC = b"HPGRAPH1"
_HEADER = struct.Struct("<8sIIQ")
HEADER_BYTES = _HEADER.size
ALIGN = 64
MAX_STEPS = 1 << 20
MAX_PLAN_BYTES = 64 << 20
_DTYPES = frozenset(("float16", "float32", "float64", "int8", "uint8", "int16", "uint16",
                     "int32", "uint32", "int64", "uint64", "bool"))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def asset_layout(plan_bytes: int, weights: Sequence[np.ndarray]) -> tuple[int, list[int]]:
    """(total bytes, offset of each weight) for a plan of ``plan_bytes`` and these weights."""
    off = _align(HEADER_BYTES + plan_bytes)
    offsets = []
    for w in weights:
        offsets.append(off)
        off = _align(off + w.nbytes)
    return max(off, ALIGN), offsets


def write_asset(dest: np.ndarray, plan: dict[str, Any], weights: Sequence[np.ndarray],
                offsets: Sequence[int]) -> None:
    """Fill ``dest`` (uint8, ``asset_layout`` bytes) with header, plan and weights."""
    blob = msgpack.packb(plan, use_bin_type=True)
    dest.fill(0)  # alignment gaps too: one model compiles to the same bytes every time
    dest[:HEADER_BYTES] = np.frombuffer(
        _HEADER.pack(MAGIC, len(blob), zlib.crc32(blob), dest.nbytes), np.uint8)
    dest[HEADER_BYTES:HEADER_BYTES + len(blob)] = np.frombuffer(blob, np.uint8)
    for w, off in zip(weights, offsets):
        raw = np.ascontiguousarray(w).reshape(-1).view(np.uint8)
        dest[off:off + raw.nbytes] = raw


def plan_bytes(plan: dict[str, Any]) -> int:
    return len(msgpack.packb(plan, use_bin_type=True))


def _plan_of(asset: np.ndarray) -> dict[str, Any]:
    """The decoded, structurally checked plan. Decoding and checking a plan of thousands
    of steps costs milliseconds, so the result is kept per plan digest (crc32 and length,
    recomputed over the actual bytes on every run: a changed plan never reuses a stale
    decode)."""
    if asset.dtype != np.uint8 or asset.ndim != 1 or asset.nbytes < HEADER_BYTES:
        raise InvalidRequest("graph: input 0 is not a graph asset (too small or not bytes)")
    magic, n, crc, total = _HEADER.unpack(asset[:HEADER_BYTES].tobytes())
    if magic != MAGIC:
        raise InvalidRequest("graph: input 0 is not a graph asset (bad magic)")
    if total != asset.nbytes or n > min(MAX_PLAN_BYTES, asset.nbytes - HEADER_BYTES):
        raise InvalidRequest(f"graph: asset is truncated ({asset.nbytes} of {total} bytes)")
    blob = asset[HEADER_BYTES:HEADER_BYTES + n]
    if zlib.crc32(blob.data) != crc:
        raise InvalidRequest("graph: asset plan checksum mismatch (corrupt asset)")
    key = (crc, n)
    plan = _DECODED.get(key)
    if plan is None:
        try:
            plan = msgpack.unpackb(blob.tobytes(), raw=False, strict_map_key=False)
        except Exception as exc:
            raise InvalidRequest(f"graph: asset plan does not decode: {exc}") from None
        if not isinstance(plan, dict) or plan.get("v") != 1:
            raise InvalidRequest("graph: asset plan has an unknown version")
        plan["steps"] = _checked_steps(plan)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[key] = plan
    return plan


_DECODED: dict[tuple[int, int], dict[str, Any]] = {}
_DECODED_MAX = 64


def _checked_steps(plan: dict) -> list[tuple[Callable, list, list, dict, str]]:
    steps = _list(plan, "steps")
    if len(steps) > MAX_STEPS:
        raise InvalidRequest(f"graph: {len(steps)} steps exceed {MAX_STEPS}")
    out = []
    for k, step in enumerate(steps):
        op, args, results, attrs = _entry(step, 4, "steps")
        if not isinstance(op, str) or not isinstance(args, list) or not isinstance(
                results, list) or not isinstance(attrs, dict):
            raise InvalidRequest(f"graph: step {k} is malformed")
        fn = op_function(op)
        args = [None if a == -1 else _tid(a) for a in args]
        attrs = {key: _attr_value(v, k) for key, v in attrs.items()}
        out.append((fn, args, [_tid(r) for r in results], attrs, op))
    return out


def _attr_value(v: Any, k: int) -> Any:
    """Attributes are plain values; a small tensor (ConstantOfShape's value) comes as
    {"ndarray": [dtype, shape, bytes]} and is rebuilt here, its size checked."""
    if not (isinstance(v, dict) and set(v) == {"ndarray"}):
        return v
    try:
        dtype, shape, raw = v["ndarray"]
        arr = np.frombuffer(raw, dtype=np.dtype(dtype))
        if dtype not in _DTYPES or arr.size != math.prod(shape):
            raise ValueError("size does not match shape")
        return arr.reshape(shape)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"graph: step {k} has a malformed tensor attribute: {exc}") from None


def read_asset(asset: np.ndarray) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The plan and the weights (views into ``asset``), every field checked."""
    plan = _plan_of(asset)
    weights = {}
    for entry in _list(plan, "weights"):
        tid, off, dtype, shape = _entry(entry, 4, "weights")
        weights[_tid(tid)] = _view(asset, off, dtype, shape, "weight")
    return plan, weights


def _list(plan: dict, key: str) -> list:
    v = plan.get(key, [])
    if not isinstance(v, list):
        raise InvalidRequest(f"graph: plan field {key!r} is not a list")
    return v


def _entry(e: Any, n: int, where: str) -> list:
    if not isinstance(e, list) or len(e) != n:
        raise InvalidRequest(f"graph: malformed {where} entry {str(e)[:80]}")
    return e


def _tid(t: Any) -> int:
    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 31:
        raise InvalidRequest(f"graph: bad tensor id {t!r}")
    return t


def _view(buf: np.ndarray, off: Any, dtype: Any, shape: Any, what: str) -> np.ndarray:
    if dtype not in _DTYPES or not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise InvalidRequest(f"graph: {what} has a bad dtype/shape {dtype!r} {shape!r}")
    if not isinstance(off, int) or isinstance(off, bool) or off < 0:
        raise InvalidRequest(f"graph: {what} has a bad offset {off!r}")
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if off + nbytes > buf.nbytes:
        raise InvalidRequest(f"graph: {what} [{off}, {off + nbytes}) lies outside its "
                             f"{buf.nbytes}-byte buffer")
    return buf[off:off + nbytes].view(dt).reshape(shape)


def _operand(arrays: Sequence[np.ndarray], i: Any, what: str) -> np.ndarray:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(arrays):
        raise InvalidRequest(f"graph: {what} names operand {i!r} of {len(arrays)}")
    return arrays[i]


def run_plan(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
             between: Callable[[], None]) -> int:
    """Run the asset in ``ins[0]`` on the other operands: ops back to back, ``between()``
    between them at most every ~100 us (heartbeat, progress, cancel). Returns the number
    of steps run."""
    plan, env = read_asset(ins[0])
    for entry in _list(plan, "inputs"):
        tid, operand, off, dtype, shape = _entry(entry, 5, "inputs")
        env[_tid(tid)] = _view(_operand(ins, operand, "an input"), off, dtype, shape, "input")
    steps = plan["steps"]
    last = time.monotonic_ns()
    for k, (fn, args, results, attrs, op) in enumerate(steps):
        try:
            arrays = [None if a is None else env[a] for a in args]
        except KeyError as exc:
            raise InvalidRequest(f"graph: step {k} ({op}) reads tensor {exc} "
                                 "before it exists") from None
        try:
            produced = fn(arrays, attrs)
        except (ValueError, IndexError, TypeError, ArithmeticError, MemoryError) as exc:
            raise InvalidRequest(f"{op}: {type(exc).__name__}: {exc}") from None
        for tid, arr in zip(results, produced):
            env[tid] = arr
        # Heartbeat, progress and cancel between ops, at most every ~100 us: often enough
        # for a prompt cancel, rare enough that no-op ops run at memory speed.
        now = time.monotonic_ns()
        if now - last > 100_000:
            last = now
            between()
    for entry in _list(plan, "outputs"):
        tid, operand, off, dtype, shape = _entry(entry, 5, "outputs")
        dest = _view(_operand(outs, operand, "an output"), off, dtype, shape, "output")
        src = env.get(_tid(tid))
        if src is None or src.shape != dest.shape:
            raise InvalidRequest(f"graph: output tensor {tid} is missing or has shape "
                                 f"{None if src is None else src.shape}, expected {dest.shape}")
        np.copyto(dest, src, casting="unsafe")
    return len(steps)

"""Numpy kernels a device process runs on shared-memory buffers.

Two entry points: ``validate`` checks (shape, dtype) pairs only, so the supervisor can refuse
a request at submit time; ``run_kernel`` validates the real arrays again, then writes into the
caller's output arrays in place. Every op is one row of ``_TABLE``: operand counts, accepted
params, a checker and a runner.

Chunking: work is cut into pieces costing about ``CHUNK_WORK`` units (one unit ~ copying one
element; each op weighs its items, e.g. a float32 multiply-add is 1/32) along the flattened
elements (elementwise ops) or output rows (matmul, conv2d, resize), and ``between_chunks()``
is called between pieces, i.e. ``chunks - 1`` times; work that fits one piece never calls it.
Tests may set ``CHUNK_WORK = 0`` for one item (element or row) per piece.
Whatever ``between_chunks`` raises (``Cancelled``) propagates and leaves outputs partially
written. Outputs of matmul, conv2d and resize must not overlap their inputs (checked);
elementwise ops may run exactly in place (output is an input) but not on shifted overlaps.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from device_workers._passed import KernelChecks, SpecChecks
from ipc.errors import DtypeError, InvalidRequest, ShapeError, UnsupportedOp

__all__ = ["OPS", "CHUNK_WORK", "validate", "run_kernel", "checksum_of", "read_checksum"]

# ~0.5-1 ms of numpy work per piece on this class of core: fine-grained enough for prompt
# cancellation, coarse enough that per-piece overhead (and BLAS efficiency) stays fine.
CHUNK_WORK = 1 << 20
# Measured relative cost of one multiply-add (unit: copying one element).
_MAC_COST = {np.dtype("float32"): 1 / 32, np.dtype("float64"): 1 / 8, np.dtype("int32"): 3.0}
_CONV_MAC_COST = 1 / 4  # tensordot over an im2col copy: dearer than a plain GEMM

Spec = tuple[tuple[int, ...], np.dtype]
Params = Mapping[str, Any]
Between = Callable[[], None]

_NUMERIC_KINDS = "biuf"
_FLOATS = frozenset(np.dtype(t) for t in ("float16", "float32", "float64"))
_INTS = frozenset(np.dtype(f"{s}int{b}") for s in ("", "u") for b in (8, 16, 32, 64))
_MATMUL = frozenset(np.dtype(t) for t in ("float32", "float64", "int32"))
_F32 = frozenset([np.dtype("float32")])
_QUANT = frozenset(np.dtype(t) for t in ("int8", "uint8"))
_BYTES = frozenset([np.dtype("uint8")])


# -- checking helpers: each raises with a message naming the operand and what was expected --


def _names(what: set | frozenset) -> str:
    return "/".join(sorted(str(d) for d in what))


def _dtype(spec: Spec, name: str, allowed: frozenset) -> None:
    if spec[1] not in allowed:
        raise DtypeError(f"{name} has dtype {spec[1]}, expected {_names(allowed)}")


def _shape(spec: Spec, name: str, want: tuple[int, ...]) -> None:
    if spec[0] != tuple(want):
        raise ShapeError(f"{name} has shape {spec[0]}, expected {tuple(want)}")


def _rank(spec: Spec, name: str, ndim: int, layout: str) -> None:
    if len(spec[0]) != ndim:
        raise ShapeError(f"{name} has shape {spec[0]}, expected rank {ndim} ({layout})")
    if 0 in spec[0]:
        raise ShapeError(f"{name} has shape {spec[0]}, expected no zero-sized dimension")


def _all_like(ins: list[Spec], outs: list[Spec], first: Spec, *, dtype: bool) -> None:
    """Every operand has ``first``'s shape (and dtype when asked)."""
    named = [(f"input {i}", s) for i, s in enumerate(ins)]
    for name, spec in named + [(f"output {i}", s) for i, s in enumerate(outs)]:
        _shape(spec, name, first[0])
        if dtype and spec[1] != first[1]:
            raise DtypeError(f"{name} has dtype {spec[1]}, expected {first[1]} like input 0")


def _real(p: Params, key: str, default: float | None, *, positive: bool = False) -> float:
    v = p.get(key, default)
    if v is None:
        raise InvalidRequest(f"param {key!r} is required")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise InvalidRequest(f"param {key!r} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise InvalidRequest(f"param {key!r} must be > 0, got {v!r}")
    return float(v)


def _int(p: Params, key: str, default: int, lo: int, hi: int) -> int:
    v = p.get(key, default)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or not (
            lo <= int(v) <= hi):
        raise InvalidRequest(f"param {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


def _choice(p: Params, key: str, choices: tuple[str, ...]) -> str:
    v = p.get(key, choices[0])
    if v not in choices:
        raise InvalidRequest(f"param {key!r} must be one of {choices}, got {v!r}")
    return v


def _numeric_checked(dt: np.dtype, name: str) -> np.dtype:
    if dt.kind not in _NUMERIC_KINDS:
        raise DtypeError(f"{name} has dtype {dt}, expected a bool, integer or float dtype")
    return dt


# -- chunk driver -------------------------------------------------------------------------


def _pieces(n: int, unit: float, fn: Callable[[int, int], object], between: Between) -> None:
    """Call ``fn(start, stop)`` over ``range(n)`` in pieces of ~CHUNK_WORK / unit items."""
    step = max(1, int(CHUNK_WORK // max(unit, 1e-9)))
    for start in range(0, n, step):
        if start:
            between()
        fn(start, min(n, start + step))


def _elementwise(
    arrays: Sequence[np.ndarray], fn: Callable[..., None], between: Between, cost: float = 1
) -> None:
    """Run ``fn(*slices)`` over same-shape arrays, flattened when all are C-contiguous."""
    flat = all([a.flags.c_contiguous for a in arrays])  # (lists: a generator costs more)
    views = [a.reshape(-1) if flat else a for a in arrays]  # reshape of C-contiguous is a view
    unit = math.prod(views[0].shape[1:]) * cost
    _pieces(len(views[0]), unit, lambda s, e: fn(*[v[s:e] for v in views]), between)


# -- ops: checker(ins, outs, params) and runner(ins, outs, params, between) ----------------


def _check_copy(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _shape(outs[0], "output 0", ins[0][0])


def _run_copy(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
              between: Between) -> None:
    _elementwise([ins[0], outs[0]], lambda i, o: np.copyto(o, i, casting="unsafe"), between)


def _check_fill(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    v = p.get("value", 0)
    if isinstance(v, (bool, np.bool_)):
        return
    if not isinstance(v, numbers.Real):
        raise InvalidRequest(f"param 'value' must be a number, got {v!r}")
    dt = outs[0][1]
    if dt.kind in "iu":
        info = np.iinfo(dt)
        exact = int(v) if isinstance(v, numbers.Integral) else float(v)
        if not (math.isfinite(exact) and exact == int(exact) and info.min <= exact <= info.max):
            raise InvalidRequest(f"param 'value' {v!r} does not fit output 0 dtype {dt}")


def _run_fill(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
              between: Between) -> None:
    v = p.get("value", 0)
    _elementwise([outs[0]], lambda o: o.fill(v), between)


def _check_add(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _all_like(ins, outs, ins[0], dtype=True)


def _run_add(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
             between: Between) -> None:
    _elementwise([ins[0], ins[1], outs[0]], lambda a, b, o: np.add(a, b, out=o), between)


def _check_scale(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _real(p, "factor", 1.0)
    _dtype(ins[0], "input 0", _FLOATS)
    _all_like(ins, outs, ins[0], dtype=True)


def _run_scale(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
               between: Between) -> None:
    f = ins[0].dtype.type(p.get("factor", 1.0))
    _elementwise([ins[0], outs[0]], lambda i, o: np.multiply(i, f, out=o), between)


def _check_relu(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _dtype(ins[0], "input 0", _FLOATS | _INTS)
    _all_like(ins, outs, ins[0], dtype=True)


def _run_relu(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
              between: Between) -> None:
    zero = ins[0].dtype.type(0)
    _elementwise([ins[0], outs[0]], lambda i, o: np.maximum(i, zero, out=o), between)


def _check_matmul(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    (a, b), o = ins, outs[0]
    for name, spec in (("input 0", a), ("input 1", b), ("output 0", o)):
        if len(spec[0]) != 2:
            raise ShapeError(f"{name} has shape {spec[0]}, expected rank 2")
        _dtype(spec, name, _MATMUL)
    if b[0][0] != a[0][1]:
        raise ShapeError(f"input 1 has shape {b[0]}, expected ({a[0][1]}, N) "
                         f"to match input 0 {a[0]}")
    _shape(o, "output 0", (a[0][0], b[0][1]))
    if not a[1] == b[1] == o[1]:
        raise DtypeError(f"operands have dtypes {a[1]}, {b[1]} -> {o[1]}, expected one dtype")


def _run_matmul(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                between: Between) -> None:
    a, b, o = ins[0], ins[1], outs[0]
    unit = a.shape[1] * b.shape[1] * _MAC_COST[a.dtype]
    _pieces(a.shape[0], unit, lambda s, e: np.matmul(a[s:e], b, out=o[s:e]), between)


def _conv_geometry(x: tuple, w: tuple, stride: int, padding: str) -> tuple[int, int, int, int]:
    """(OH, OW, pad_top, pad_left); 'same' pads like TensorFlow (extra row/col at the end)."""
    (_, h, wd, _), (kh, kw, _, _) = x, w
    if padding == "valid":
        if h < kh or wd < kw:
            raise ShapeError(f"input 0 spatial size {(h, wd)} is smaller than "
                             f"the kernel {(kh, kw)}")
        return (h - kh) // stride + 1, (wd - kw) // stride + 1, 0, 0
    oh, ow = -(-h // stride), -(-wd // stride)
    pad_h = max((oh - 1) * stride + kh - h, 0)
    pad_w = max((ow - 1) * stride + kw - wd, 0)
    return oh, ow, pad_h // 2, pad_w // 2


def _check_conv2d(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    stride = _int(p, "stride", 1, 1, 1 << 16)
    padding = _choice(p, "padding", ("same", "valid"))
    _rank(ins[0], "input 0", 4, "N,H,W,C")
    _rank(ins[1], "input 1", 4, "KH,KW,C,F")
    for i, spec in enumerate(ins):
        _dtype(spec, f"input {i}", _F32)
    _dtype(outs[0], "output 0", _F32)
    (n, _, _, c), (kh, kw, wc, f) = ins[0][0], ins[1][0]
    if wc != c:
        raise ShapeError(f"input 1 has shape {ins[1][0]}, expected ({kh}, {kw}, {c}, F)")
    if len(ins) == 3:
        _shape(ins[2], "input 2 (bias)", (f,))
    oh, ow, _, _ = _conv_geometry(ins[0][0], ins[1][0], stride, padding)
    _shape(outs[0], "output 0", (n, oh, ow, f))


def _padded_rows(x: np.ndarray, lo: int, hi: int, top: int, left: int, width: int) -> np.ndarray:
    """Rows [lo, hi) of x zero-padded by ``top`` rows and ``left`` columns to ``width`` columns."""
    n, h, w, c = x.shape
    buf = np.zeros((n, hi - lo, width, c), x.dtype)
    a, b = max(lo - top, 0), min(hi - top, h)
    if b > a:
        buf[:, a + top - lo : b + top - lo, left : left + w] = x[:, a:b]
    return buf


def _run_conv2d(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                between: Between) -> None:
    x, w, o = ins[0], ins[1], outs[0]
    bias = ins[2] if len(ins) == 3 else None
    stride = int(p.get("stride", 1))
    kh, kw, c, f = w.shape
    _, oh, ow, _ = o.shape
    _, _, top, left = _conv_geometry(x.shape, w.shape, stride, p.get("padding", "same"))
    width = max((ow - 1) * stride + kw, x.shape[2] + left)

    def rows(r0: int, r1: int) -> None:
        # Pad only this band of input rows: memory stays bounded by the chunk, not the image.
        band = _padded_rows(x, r0 * stride, (r1 - 1) * stride + kh, top, left, width)
        win = sliding_window_view(band, (kh, kw), axis=(1, 2))[:, ::stride, ::stride][:, :, :ow]
        res = np.tensordot(win, w, axes=([3, 4, 5], [2, 0, 1]))  # (N, rows, OW, F)
        if bias is not None:
            res += bias
        o[:, r0:r1] = res

    _pieces(oh, x.shape[0] * ow * f * kh * kw * c * _CONV_MAC_COST, rows, between)


def _check_resize(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    mode = _choice(p, "mode", ("nearest", "bilinear"))
    _rank(ins[0], "input 0", 4, "N,H,W,C")
    _rank(outs[0], "output 0", 4, "N,OH,OW,C")
    (n, _, _, c), (_, oh, ow, _) = ins[0][0], outs[0][0]
    _shape(outs[0], "output 0", (n, oh, ow, c))
    allowed = _FLOATS | _INTS if mode == "bilinear" else _FLOATS | _INTS | {np.dtype(bool)}
    _dtype(ins[0], "input 0", allowed)
    if outs[0][1] != ins[0][1]:
        raise DtypeError(f"output 0 has dtype {outs[0][1]}, expected {ins[0][1]} like input 0")


def _bilinear_taps(src: int, dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Half-pixel-centre source taps (i0, i1) and weight of i1 for each output index."""
    pos = np.clip((np.arange(dst) + 0.5) * (src / dst) - 0.5, 0, src - 1)
    i0 = np.floor(pos).astype(np.intp)
    return i0, np.minimum(i0 + 1, src - 1), pos - i0


def _run_resize(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                between: Between) -> None:
    x, o = ins[0], outs[0]
    n, h, w, c = x.shape
    _, oh, ow, _ = o.shape
    if p.get("mode", "nearest") == "nearest":
        # Half-pixel centres in exact integer arithmetic: floor((i + 0.5) * H / OH).
        ys = (2 * np.arange(oh) + 1) * h // (2 * oh)
        xs = (2 * np.arange(ow) + 1) * w // (2 * ow)

        def rows(r0: int, r1: int) -> None:
            o[:, r0:r1] = np.take(np.take(x, ys[r0:r1], axis=1), xs, axis=2)
    else:
        work = np.result_type(x.dtype, np.float32)
        y0, y1, fy = _bilinear_taps(h, oh)
        x0, x1, fx = _bilinear_taps(w, ow)
        fx = fx.astype(work)[None, None, :, None]

        def rows(r0: int, r1: int) -> None:
            # Gather the 4 taps in the source dtype first so float math runs at output size;
            # np.take is several times faster than fancy indexing on a middle axis.
            wy = fy[r0:r1].astype(work)[None, :, None, None]
            ra, rb = np.take(x, y0[r0:r1], axis=1), np.take(x, y1[r0:r1], axis=1)
            t0, t1 = (np.take(ra, i, axis=2).astype(work) for i in (x0, x1))
            b0, b1 = (np.take(rb, i, axis=2).astype(work) for i in (x0, x1))
            top = t0 + (t1 - t0) * fx
            res = top + (b0 + (b1 - b0) * fx - top) * wy
            if o.dtype.kind in "iu":
                np.rint(res, out=res)  # interpolants stay within the input range: no clipping
            np.copyto(o[:, r0:r1], res, casting="unsafe")

    # A row gathers W input and writes OW output elements, each a few passes.
    _pieces(oh, n * c * (2 * w + (16 if p.get("mode") == "bilinear" else 2) * ow), rows, between)


def _check_quantize(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _real(p, "scale", None, positive=True)
    _dtype(ins[0], "input 0", _FLOATS)
    _dtype(outs[0], "output 0", _QUANT)
    info = np.iinfo(outs[0][1])
    _int(p, "zero_point", 0, info.min, info.max)
    _shape(outs[0], "output 0", ins[0][0])


def _run_quantize(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                  between: Between) -> None:
    scale, zp = float(p["scale"]), int(p.get("zero_point", 0))
    info = np.iinfo(outs[0].dtype)

    def q(i: np.ndarray, o: np.ndarray) -> None:
        t = np.divide(i, scale, dtype=np.float64)
        np.rint(t, out=t)  # ties to even
        t += zp
        np.clip(t, info.min, info.max, out=t)
        nan = np.isnan(t)
        if nan.any():  # NaN has no integer: map it to real 0 (nan_to_num is slower)
            t[nan] = zp
        np.copyto(o, t, casting="unsafe")

    _elementwise([ins[0], outs[0]], q, between, cost=8)


def _check_dequantize(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    _real(p, "scale", None, positive=True)
    _dtype(ins[0], "input 0", _QUANT)
    _dtype(outs[0], "output 0", _F32)
    info = np.iinfo(ins[0][1])
    _int(p, "zero_point", 0, info.min, info.max)
    _shape(outs[0], "output 0", ins[0][0])


def _run_dequantize(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                    between: Between) -> None:
    scale, zp = np.float32(p["scale"]), np.float32(p.get("zero_point", 0))

    def dq(i: np.ndarray, o: np.ndarray) -> None:
        np.subtract(i, zp, out=o)
        np.multiply(o, scale, out=o)

    _elementwise([ins[0], outs[0]], dq, between)


def _check_transpose(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    axes = p.get("axes")
    shape = ins[0][0]
    if (not isinstance(axes, (list, tuple)) or len(axes) != len(shape)
            or sorted(axes) != list(range(len(shape)))
            or not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes)):
        raise InvalidRequest(f"param 'axes' must be a permutation of 0..{len(shape) - 1}, "
                             f"got {axes!r}")
    _shape(outs[0], "output 0", tuple(shape[a] for a in axes))


def _run_transpose(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                   between: Between) -> None:
    # A layout reformat (NCHW <-> NHWC) and, when dtypes differ, a cast in the same pass.
    src, o = np.transpose(ins[0], [int(a) for a in p["axes"]]), outs[0]
    row = math.prod(o.shape[1:])

    def rows(r0: int, r1: int) -> None:
        np.copyto(o[r0:r1], src[r0:r1], casting="unsafe")

    _pieces(o.shape[0], row * 2, rows, between)  # strided gathers cost ~2 copies an element


def _check_checksum(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    if math.prod(outs[0][0]) * outs[0][1].itemsize < 8:
        raise ShapeError(f"output 0 has {math.prod(outs[0][0]) * outs[0][1].itemsize} bytes, "
                         "expected at least 8 for the checksum")


def _run_checksum(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
                  between: Between) -> None:
    # The sum of the input's element bytes mod 2**64, little-endian in the output's first 8
    # bytes: exact and dtype-agnostic, so a reader of every byte can prove what it saw.
    total = [np.uint64(0)]

    def add(i: np.ndarray) -> None:
        total[0] += np.ascontiguousarray(i).view(np.uint8).sum(dtype=np.uint64)

    _elementwise([ins[0]], add, between)
    o = outs[0]
    raw = np.frombuffer(np.array([total[0]], "<u8").tobytes(), np.uint8)
    if o.flags.c_contiguous:
        o.reshape(-1).view(np.uint8)[:8] = raw
    else:
        tmp = np.ascontiguousarray(o)
        tmp.reshape(-1).view(np.uint8)[:8] = raw
        np.copyto(o, tmp)


def checksum_of(a: np.ndarray) -> int:
    """What ``checksum`` computes, for a reader that holds the same data."""
    return int(np.ascontiguousarray(a).view(np.uint8).sum(dtype=np.uint64))


def read_checksum(out: np.ndarray) -> int:
    """The checksum a ``checksum`` command left in ``out``."""
    return int(np.ascontiguousarray(out).reshape(-1).view("<u8")[0]) if out.nbytes >= 8 else 0


def _check_graph(ins: list[Spec], outs: list[Spec], p: Params) -> None:
    # Every operand of a graph asset is raw bytes: the plan inside the asset (input 0)
    # names dtype, shape and offset of each tensor, and the device checks them at run time.
    for i, spec in enumerate(ins):
        _rank(spec, f"input {i}", 1, "bytes")
        _dtype(spec, f"input {i}", _BYTES)
    for i, spec in enumerate(outs):
        _rank(spec, f"output {i}", 1, "bytes")
        _dtype(spec, f"output {i}", _BYTES)


def _run_graph(ins: list[np.ndarray], outs: list[np.ndarray], p: Params,
               between: Between) -> None:
    from ._graph_asset import run_plan  # numpy op library: loaded when a graph first runs
    run_plan(ins, outs, between)


def _nothing(*_: Any) -> None:
    """``work`` models held time only; the caller holds it."""


@dataclass(frozen=True)
class _Op:
    n_in: tuple[int, int]  # (min, max) inputs
    n_out: int  # -1: any
    params: frozenset[str] | None  # None: any
    check: Callable[[list[Spec], list[Spec], Params], None]
    run: Callable[[list[np.ndarray], list[np.ndarray], Params, Between], None]
    # False: outputs must not overlap inputs (chunks read what others wrote).
    alias_safe: bool = True


_TABLE: dict[str, _Op] = {
    "copy": _Op((1, 1), 1, frozenset(), _check_copy, _run_copy),
    "fill": _Op((0, 0), 1, frozenset({"value"}), _check_fill, _run_fill),
    "add": _Op((2, 2), 1, frozenset(), _check_add, _run_add),
    "scale": _Op((1, 1), 1, frozenset({"factor"}), _check_scale, _run_scale),
    "matmul": _Op((2, 2), 1, frozenset(), _check_matmul, _run_matmul, alias_safe=False),
    "relu": _Op((1, 1), 1, frozenset(), _check_relu, _run_relu),
    "conv2d": _Op(
        (2, 3), 1, frozenset({"stride", "padding"}), _check_conv2d, _run_conv2d, alias_safe=False
    ),
    "resize": _Op((1, 1), 1, frozenset({"mode"}), _check_resize, _run_resize, alias_safe=False),
    "quantize": _Op((1, 1), 1, frozenset({"scale", "zero_point"}), _check_quantize, _run_quantize),
    "dequantize": _Op((1, 1), 1, frozenset({"scale", "zero_point"}), _check_dequantize,
                      _run_dequantize),
    "transpose": _Op((1, 1), 1, frozenset({"axes"}), _check_transpose, _run_transpose,
                     alias_safe=False),
    "checksum": _Op((1, 1), 1, frozenset(), _check_checksum, _run_checksum, alias_safe=False),
    "graph": _Op((1, 64), -1, frozenset(), _check_graph, _run_graph, alias_safe=False),
    "work": _Op((0, 1 << 30), -1, None, _nothing, _nothing),
}

OPS: tuple[str, ...] = tuple(_TABLE)


# Operands found valid, by (shape, dtype). Only exact ints and a dtype given as a str or an
# ``np.dtype`` are kept: an invalid operand never equals a cached one (``2.0 == 2``).
_SPECS: dict[tuple[tuple[int, ...], Any], Spec] = {}
_SPECS_MAX = 4096
_CHECKED = KernelChecks(lambda *a: _validate(*a), 4096)  # ``run_kernel``'s (``_passed``)
_VALIDATED = SpecChecks(lambda *a: _validate(*a), 4096)  # ``validate``'s: the same calls


def _spec(shape: Any, dtype: Any, name: str) -> Spec:
    if (type(shape) is tuple and (type(dtype) is str or isinstance(dtype, np.dtype))
            and all(type(d) is int for d in shape)):
        spec = _SPECS.get((shape, dtype))
        if spec is None:
            spec = _checked_spec(shape, dtype, name)
            if len(_SPECS) < _SPECS_MAX:
                _SPECS[(shape, dtype)] = spec
        return spec
    return _checked_spec(shape, dtype, name)


def _checked_spec(shape: Any, dtype: Any, name: str) -> Spec:
    try:
        shp = tuple(shape)
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and int(d) >= 0
                   for d in shp):
            raise TypeError
    except TypeError:
        raise ShapeError(f"{name} has shape {shape!r}, expected non-negative ints") from None
    try:
        if dtype is None:  # np.dtype(None) would silently mean float64
            raise TypeError
        dt = np.dtype(dtype)
    except TypeError:
        raise DtypeError(f"{name} has dtype {dtype!r}, which is not a dtype") from None
    return tuple(int(d) for d in shp), _numeric_checked(dt, name)


def _validate(op: str, ins: Sequence[tuple[Any, Any]], outs: Sequence[tuple[Any, Any]],
              params: Params | None) -> _Op:
    params = {} if params is None else params
    entry = _TABLE.get(op) if isinstance(op, str) else None
    if entry is None:
        raise UnsupportedOp(f"unknown op {op!r}; known: {', '.join(OPS)}")
    try:
        lo, hi = entry.n_in
        if not lo <= len(ins) <= hi:
            want = str(lo) if lo == hi else f"{lo}..{hi}"
            raise ShapeError(f"got {len(ins)} inputs, expected {want}")
        if entry.n_out >= 0 and len(outs) != entry.n_out:
            raise ShapeError(f"got {len(outs)} outputs, expected {entry.n_out}")
        if not isinstance(params, Mapping):
            raise InvalidRequest(f"params must be a mapping, got {type(params).__name__}")
        if entry.params is not None:
            extra = set(params) - entry.params
            if extra:
                raise InvalidRequest(f"unknown params {sorted(map(str, extra))}; "
                                     f"accepted: {sorted(entry.params)}")
        specs_in = [_spec(s, d, f"input {i}") for i, (s, d) in enumerate(ins)]
        specs_out = [_spec(s, d, f"output {i}") for i, (s, d) in enumerate(outs)]
        entry.check(specs_in, specs_out, params)
    except InvalidRequest as e:
        # One place adds the op name, so every checker message reads "<op>: <operand> ...".
        raise type(e)(f"{op}: {e.message}", detail={"op": op}) from None
    return entry


def validate(
    op: str,
    inputs: Sequence[tuple[tuple[int, ...], str]],
    outputs: Sequence[tuple[tuple[int, ...], str]],
    params: Params | None,
) -> None:
    """Check a request from (shape, dtype-string) pairs alone (a call that passed once is
    remembered: ``_passed``); raise UnsupportedOp, ShapeError, DtypeError or InvalidRequest."""
    _VALIDATED.check(op, inputs, outputs, params)


def run_kernel(
    op: str,
    inputs: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray],
    params: Params | None,
    between_chunks: Between,
) -> None:
    """Validate the arrays, then compute ``op`` into ``outputs`` in place, calling
    ``between_chunks()`` between pieces of work; its exceptions propagate."""
    params = {} if params is None else params
    entry = _CHECKED.check(op, inputs, outputs, params)
    for i, o in enumerate(outputs):
        if not o.flags.writeable:
            raise InvalidRequest(f"{op}: output {i} is read-only", detail={"op": op})
        if not entry.alias_safe and any(np.may_share_memory(o, a) for a in inputs):
            raise InvalidRequest(f"{op}: output {i} overlaps an input", detail={"op": op})
    # Casts of NaN/inf and integer wrap-around are defined behaviour here, not warnings.
    with np.errstate(all="ignore"):
        entry.run(list(inputs), list(outputs), params, between_chunks)

"""Numpy implementations of the ONNX operators a delegate partition runs, op by op.

One function per ONNX op type: ``fn(inputs, attrs) -> list of outputs``. ``inputs`` holds
numpy arrays in the node's input order, ``None`` for an omitted optional input; ``attrs``
holds plain values (int, float, str, lists of them, or an array for ``Constant``).
Layout is ONNX's own (NCHW for images): the same code is the CPU reference executor in
the application and the body of the ``graph`` kernel in a device process, so a delegated
partition and the reference can only differ by what the plan feeds them.

``unsupported(op, attrs, in_dtypes)`` says why a variant is not implemented (None if it
is): the delegate's support query refuses such a node instead of running it wrongly.
Malformed operands raise ``ShapeError`` / ``DtypeError`` / ``InvalidRequest`` from
``ipc.errors``; nothing here may crash the process that runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ipc.errors import DtypeError, InvalidRequest, ShapeError, UnsupportedOp

__all__ = ["GRAPH_OPS", "run_op", "unsupported", "op_flops"]

Arrays = Sequence["np.ndarray | None"]
Attrs = Mapping[str, Any]

# Ops whose output size comes from data (a shape tensor, scales) are capped: a hostile
# model must not make a device process allocate gigabytes.
MAX_CREATED_ELEMENTS = 1 << 28  # VGG19 folds a 4096 x 25088 weight

_QUANT_TYPES = frozenset(np.dtype(t) for t in ("int8", "uint8", "int16", "uint16"))
_FLOAT_TYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64"))


def _need(inputs: Arrays, n: int, op: str) -> list[np.ndarray]:
    """The first ``n`` inputs, each of them required (an omitted one is refused)."""
    present = [a for a in inputs[:n] if a is not None]
    if len(present) < n:
        raise InvalidRequest(f"{op}: expected at least {n} inputs, got {len(inputs)}")
    return present


def _opt(inputs: Arrays, i: int) -> np.ndarray | None:
    return inputs[i] if len(inputs) > i else None


def _axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def _float(x: np.ndarray, op: str) -> None:
    if x.dtype not in _FLOAT_TYPES:
        raise DtypeError(f"{op}: input has dtype {x.dtype}, expected a float dtype")


# -- elementwise --------------------------------------------------------------------------


def _binary(fn: np.ufunc) -> Callable[[Arrays, Attrs], list[np.ndarray]]:
    def run(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
        a, b = _need(inputs, 2, fn.__name__)
        if a.dtype != b.dtype:
            raise DtypeError(f"{fn.__name__}: operands have dtypes {a.dtype} and {b.dtype}")
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ShapeError(f"{fn.__name__}: shapes {a.shape} and {b.shape} "
                             "do not broadcast") from None
        return [fn(a, b).astype(a.dtype, copy=False)]
    return run


def _relu(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Relu")[0]
    return [np.maximum(x, x.dtype.type(0))]


def _clip(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Clip")[0]
    lo, hi = _opt(inputs, 1), _opt(inputs, 2)
    for name, bound in (("min", lo), ("max", hi)):
        if bound is not None and bound.size != 1:
            raise ShapeError(f"Clip: {name} must be a scalar, got shape {bound.shape}")
    y = x
    if lo is not None:
        y = np.maximum(y, lo.reshape(()).astype(x.dtype))
    if hi is not None:
        y = np.minimum(y, hi.reshape(()).astype(x.dtype))
    return [np.array(y, dtype=x.dtype, copy=True) if y is x else y.astype(x.dtype, copy=False)]


def _sigmoid(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Sigmoid")[0]
    _float(x, "Sigmoid")
    one = x.dtype.type(1)
    return [(one / (one + np.exp(-x))).astype(x.dtype, copy=False)]


def _hard_sigmoid(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "HardSigmoid")[0]
    _float(x, "HardSigmoid")
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    y = np.clip(x * x.dtype.type(alpha) + x.dtype.type(beta), 0, 1)
    return [y.astype(x.dtype, copy=False)]


def _hard_swish(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "HardSwish")[0]
    _float(x, "HardSwish")
    gate = np.clip(x * x.dtype.type(1 / 6) + x.dtype.type(0.5), 0, 1)
    return [(x * gate).astype(x.dtype, copy=False)]


def _identity(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    return _need(inputs, 1, "Identity")


def _constant(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    if "value" not in attrs or not isinstance(attrs["value"], np.ndarray):
        raise InvalidRequest("Constant: only the tensor 'value' attribute is supported")
    return [attrs["value"]]


def _constant_of_shape(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    shape = _ints(_need(inputs, 1, "ConstantOfShape")[0], "ConstantOfShape", "shape")
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_CREATED_ELEMENTS:
        raise ShapeError(f"ConstantOfShape: shape {shape} is negative or too large")
    value = attrs.get("value")
    fill = (value.reshape(-1)[:1] if isinstance(value, np.ndarray) and value.size
            else np.zeros(1, np.float32))
    return [np.full(shape, fill[0], dtype=fill.dtype)]


def _dropout(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    """Inference: the identity (a training-mode Dropout is refused before it runs)."""
    x = _need(inputs, 1, "Dropout")[0]
    return [x, np.ones(x.shape, dtype=bool)]


def _sum(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    arrays = [a for a in inputs if a is not None]
    if not arrays:
        raise InvalidRequest("Sum: no inputs")
    if any(a.dtype != arrays[0].dtype for a in arrays):
        raise DtypeError("Sum: inputs have different dtypes")
    y = arrays[0]
    for a in arrays[1:]:
        y = np.add(y, a)
    return [np.array(y, dtype=arrays[0].dtype, copy=len(arrays) == 1)]


# -- linear algebra -----------------------------------------------------------------------


def _matmul(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    a, b = _need(inputs, 2, "MatMul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("MatMul: operands must have rank >= 1")
    try:
        return [np.matmul(a, b)]
    except ValueError as exc:
        raise ShapeError(f"MatMul: shapes {a.shape} and {b.shape}: {exc}") from None


def _gemm(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    a, b = _need(inputs, 2, "Gemm")
    c = _opt(inputs, 2)
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"Gemm: A and B must be matrices, got {a.shape} and {b.shape}")
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    if a.shape[1] != b.shape[0]:
        raise ShapeError(f"Gemm: inner dimensions differ: {a.shape} x {b.shape}")
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = np.matmul(a, b)
    if alpha != 1.0:
        y = y * a.dtype.type(alpha)
    if c is not None:
        y = y + (c * c.dtype.type(beta) if beta != 1.0 else c)
    return [y.astype(a.dtype, copy=False)]


# -- convolution and pooling ----------------------------------------------------------------


def _spatial(x: np.ndarray, kernel: Sequence[int], attrs: Attrs, op: str, *,
             ceil: bool = False) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads_begin, pads_end, out_sizes) for an N-d window op."""
    nd = len(kernel)
    strides = list(attrs.get("strides") or [1] * nd)
    dilations = list(attrs.get("dilations") or [1] * nd)
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    if len(strides) != nd or len(dilations) != nd or len(pads) != 2 * nd:
        raise ShapeError(f"{op}: strides/dilations/pads do not match {nd} spatial dims")
    if min(strides + dilations + list(kernel)) < 1 or min(pads) < 0:
        raise InvalidRequest(f"{op}: strides, dilations and kernel must be >= 1, pads >= 0")
    size = list(x.shape[2:])
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto = attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    begin, end = pads[:nd], pads[nd:]
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(size, strides)]
        total = [max((o - 1) * s + e - n, 0) for o, s, e, n in zip(out, strides, eff, size)]
        small = [t // 2 for t in total]
        begin = small if auto == "SAME_UPPER" else [t - s for t, s in zip(total, small)]
        end = [t - b for t, b in zip(total, begin)]
    elif auto == "VALID":
        begin, end = [0] * nd, [0] * nd
        out = [(n - e) // s + 1 for n, e, s in zip(size, eff, strides)]
    elif auto == "NOTSET":
        out = []
        for n, b, e_, k, s in zip(size, begin, end, eff, strides):
            span = n + b + e_ - k
            o = (-(-span // s) if ceil else span // s) + 1
            if ceil and (o - 1) * s >= n + b:  # the last window must start inside the data
                o -= 1
            out.append(o)
    else:
        raise InvalidRequest(f"{op}: auto_pad {auto!r} is not one of NOTSET/SAME_UPPER/"
                             "SAME_LOWER/VALID")
    if min(out) < 1:
        raise ShapeError(f"{op}: input {x.shape} is smaller than the window {list(kernel)}")
    return strides, dilations, begin, end, out


def _windows(xp: np.ndarray, kernel: Sequence[int], strides: Sequence[int],
             dilations: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """Strided view (N, C, *out, *kernel) of a padded input: no copy."""
    nd = len(kernel)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    axes = tuple(range(2, 2 + nd))
    win = sliding_window_view(xp, eff, axis=axes)
    index: tuple[slice, ...] = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))
    index += tuple(slice(None, None, d) for d in dilations)
    return win[index]


def _pad_spatial(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: Any) -> np.ndarray:
    if not any(begin) and not any(end):
        return x
    width = [(0, 0), (0, 0)] + list(zip(begin, end))
    return np.pad(x, width, constant_values=value)


def _conv(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, w = _need(inputs, 2, "Conv")
    bias = _opt(inputs, 2)
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ShapeError(f"Conv: X {x.shape} and W {w.shape} must have one rank >= 3")
    _float(x, "Conv")
    group = int(attrs.get("group", 1))
    c = x.shape[1]
    m, cg = w.shape[:2]
    kernel = list(attrs.get("kernel_shape") or w.shape[2:])
    if group < 1 or c % group or m % group or cg * group != c or kernel != list(w.shape[2:]):
        raise ShapeError(f"Conv: X {x.shape}, W {w.shape} and group {group} do not fit")
    if bias is not None and bias.shape != (m,):
        raise ShapeError(f"Conv: bias has shape {bias.shape}, expected ({m},)")
    strides, dil, begin, end, out = _spatial(x, kernel, attrs, "Conv")
    win = _windows(_pad_spatial(x, begin, end, 0), kernel, strides, dil, out)
    nd = len(kernel)
    kaxes = list(range(2 + nd, 2 + 2 * nd))
    if group == 1:
        y = np.tensordot(win, w, axes=([1] + kaxes, [1] + list(range(2, 2 + nd))))
        y = np.moveaxis(y, -1, 1)  # (N, *out, M) -> (N, M, *out)
    elif cg == 1 and m == c:  # depthwise: one filter per channel
        wk = w.reshape((c,) + (1,) * nd + tuple(kernel))
        y = (win * wk).sum(axis=tuple(kaxes))
    else:
        mg = m // group
        parts = []
        for g in range(group):
            wg = w[g * mg:(g + 1) * mg]
            yg = np.tensordot(win[:, g * cg:(g + 1) * cg], wg,
                              axes=([1] + kaxes, [1] + list(range(2, 2 + nd))))
            parts.append(np.moveaxis(yg, -1, 1))
        y = np.concatenate(parts, axis=1)
    if bias is not None:
        y = y + bias.reshape((m,) + (1,) * nd)
    return [np.ascontiguousarray(y, dtype=x.dtype)]


def _pool_kernel(x: np.ndarray, attrs: Attrs, op: str) -> list[int]:
    kernel = list(attrs.get("kernel_shape") or [])
    if x.ndim < 3 or len(kernel) != x.ndim - 2:
        raise ShapeError(f"{op}: kernel_shape {kernel} does not fit input {x.shape}")
    return kernel


def _ceil_extra(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int],
                dil: Sequence[int], begin: Sequence[int], end: Sequence[int],
                out: Sequence[int]) -> list[int]:
    """Padding beyond ``end`` that the last (ceil-mode) window reaches."""
    extra = []
    for n, k, s, d, b, e, o in zip(x.shape[2:], kernel, strides, dil, begin, end, out):
        need = (o - 1) * s + (k - 1) * d + 1
        extra.append(max(0, need - (n + b + e)))
    return extra


def _max_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "MaxPool")[0]
    kernel = _pool_kernel(x, attrs, "MaxPool")
    strides, dil, begin, end, out = _spatial(x, kernel, attrs, "MaxPool",
                                             ceil=bool(attrs.get("ceil_mode", 0)))
    extra = _ceil_extra(x, kernel, strides, dil, begin, end, out)
    low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    xp = _pad_spatial(x, begin, [e + x_ for e, x_ in zip(end, extra)], low)
    win = _windows(xp, kernel, strides, dil, out)
    nd = len(kernel)
    return [np.ascontiguousarray(win.max(axis=tuple(range(-nd, 0))), dtype=x.dtype)]


def _average_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "AveragePool")[0]
    _float(x, "AveragePool")
    kernel = _pool_kernel(x, attrs, "AveragePool")
    strides, dil, begin, end, out = _spatial(x, kernel, attrs, "AveragePool",
                                             ceil=bool(attrs.get("ceil_mode", 0)))
    extra = _ceil_extra(x, kernel, strides, dil, begin, end, out)
    nd = len(kernel)
    full_end = [e + x_ for e, x_ in zip(end, extra)]
    xp = _pad_spatial(x, begin, full_end, 0)
    sums = _windows(xp, kernel, strides, dil, out).sum(axis=tuple(range(-nd, 0)))
    # Count what each window covers: real elements, plus explicit padding when asked;
    # the ceil-mode overhang never counts.
    ones = np.ones((1, 1) + x.shape[2:], np.float64)
    if attrs.get("count_include_pad", 0):
        mask = _pad_spatial(ones, begin, end, 1)
        mask = _pad_spatial(mask, [0] * nd, extra, 0)
    else:
        mask = _pad_spatial(ones, begin, full_end, 0)
    counts = _windows(mask, kernel, strides, dil, out).sum(axis=tuple(range(-nd, 0)))
    return [np.ascontiguousarray(sums / counts, dtype=x.dtype)]


def _global_average_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "GlobalAveragePool")[0]
    _float(x, "GlobalAveragePool")
    if x.ndim < 3:
        raise ShapeError(f"GlobalAveragePool: input {x.shape} has no spatial dims")
    return [x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=x.dtype)]


def _batch_norm(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, scale, b, mean, var = _need(inputs, 5, "BatchNormalization")
    _float(x, "BatchNormalization")
    if x.ndim < 2 or any(t.shape != (x.shape[1],) for t in (scale, b, mean, var)):
        raise ShapeError(f"BatchNormalization: parameters must have shape ({x.shape[1]},)")
    eps = float(attrs.get("epsilon", 1e-5))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    k = (scale / np.sqrt(var + var.dtype.type(eps))).reshape(shape)
    y = (x - mean.reshape(shape)) * k + b.reshape(shape)
    return [y.astype(x.dtype, copy=False)]


def _lrn(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    """Local response normalisation across channels (AlexNet, GoogLeNet)."""
    x = _need(inputs, 1, "LRN")[0]
    _float(x, "LRN")
    size = int(attrs.get("size", 0))
    if size < 1 or x.ndim < 3:
        raise InvalidRequest(f"LRN: size {size} must be >= 1 on an input of rank >= 3")
    alpha, beta = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75))
    bias = float(attrs.get("bias", 1.0))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = np.square(x.astype(np.float64))
    padded = np.pad(sq, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))
    csum = np.cumsum(padded, axis=1)
    csum = np.concatenate([np.zeros_like(csum[:, :1]), csum], axis=1)
    window = csum[:, size:] - csum[:, :-size]
    return [(x / (bias + alpha / size * window) ** beta).astype(x.dtype)]


def _softmax(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Softmax")[0]
    _float(x, "Softmax")
    axis = _axis(int(attrs.get("axis", -1)), x.ndim, "Softmax")
    if attrs.get("coerce_2d", 0):  # opset < 13 semantics: one row per leading index
        rows = x.reshape(math.prod(x.shape[:axis]), -1)
        return [_softmax([rows], {"axis": 1})[0].reshape(x.shape)]
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return [(e / e.sum(axis=axis, keepdims=True)).astype(x.dtype, copy=False)]


# -- shape ops -----------------------------------------------------------------------------


def _ints(a: np.ndarray | None, op: str, what: str) -> list[int]:
    if a is None:
        return []
    if a.dtype.kind not in "iu" or a.ndim > 1:
        raise DtypeError(f"{op}: {what} must be a 1-D integer tensor, got {a.dtype} {a.shape}")
    return [int(v) for v in a.reshape(-1)]


def _reshape(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, shape_t = _need(inputs, 2, "Reshape")
    shape = _ints(shape_t, "Reshape", "shape")
    allow_zero = bool(attrs.get("allowzero", 0))
    if not allow_zero:
        if len([s for s in shape if s == 0]) and len(shape) > 0:
            shape = [x.shape[i] if s == 0 and i < x.ndim else s for i, s in enumerate(shape)]
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"Reshape: target shape {shape} is not valid")
    try:
        return [x.reshape(shape)]
    except ValueError:
        raise ShapeError(f"Reshape: cannot reshape {x.shape} into {shape}") from None


def _flatten(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Flatten")[0]
    axis = int(attrs.get("axis", 1))
    if not -x.ndim <= axis <= x.ndim:
        raise ShapeError(f"Flatten: axis {axis} is out of range for rank {x.ndim}")
    if axis < 0:
        axis += x.ndim
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


def _transpose(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Transpose")[0]
    perm = list(attrs.get("perm") or range(x.ndim - 1, -1, -1))
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"Transpose: perm {perm} is not a permutation of rank {x.ndim}")
    return [np.ascontiguousarray(np.transpose(x, perm))]


def _concat(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    arrays = [a for a in inputs if a is not None]
    if not arrays:
        raise InvalidRequest("Concat: no inputs")
    axis = _axis(int(attrs.get("axis", 0)), arrays[0].ndim, "Concat")
    try:
        return [np.concatenate(arrays, axis=axis)]
    except ValueError as exc:
        raise ShapeError(f"Concat: {exc}") from None


def _squeeze(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Squeeze")[0]
    axes = _ints(_opt(inputs, 1), "Squeeze", "axes") or list(attrs.get("axes") or [])
    if not axes:
        return [x.reshape([d for d in x.shape if d != 1])]
    axes = [_axis(a, x.ndim, "Squeeze") for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        raise ShapeError(f"Squeeze: axes {axes} of {x.shape} are not all 1")
    return [np.squeeze(x, axis=tuple(axes))]


def _unsqueeze(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Unsqueeze")[0]
    axes = _ints(_opt(inputs, 1), "Unsqueeze", "axes") or list(attrs.get("axes") or [])
    rank = x.ndim + len(axes)
    axes = sorted(_axis(a, rank, "Unsqueeze") for a in axes)
    if len(set(axes)) != len(axes) or not axes:
        raise ShapeError(f"Unsqueeze: axes {axes} are empty or repeated")
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return [x.reshape(shape)]


def _arg_max(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "ArgMax")[0]
    axis = _axis(int(attrs.get("axis", 0)), x.ndim, "ArgMax")
    if attrs.get("select_last_index", 0):
        flipped = np.flip(x, axis=axis)
        idx = x.shape[axis] - 1 - np.argmax(flipped, axis=axis)
    else:
        idx = np.argmax(x, axis=axis)
    if attrs.get("keepdims", 1):
        idx = np.expand_dims(idx, axis)
    return [idx.astype(np.int64)]


# -- quantisation --------------------------------------------------------------------------


def _per_axis(p: np.ndarray, x: np.ndarray, attrs: Attrs, op: str) -> np.ndarray:
    """A scale or zero point broadcast against ``x``: scalar, or 1-D along ``axis``."""
    if p.size == 1:
        return p.reshape(())
    if p.ndim != 1:
        raise ShapeError(f"{op}: blocked quantisation (parameter shape {p.shape}) is not supported")
    axis = _axis(int(attrs.get("axis", 1)), x.ndim, op)
    if p.shape[0] != x.shape[axis]:
        raise ShapeError(f"{op}: {p.shape[0]} parameters for axis {axis} of {x.shape}")
    shape = [1] * x.ndim
    shape[axis] = p.shape[0]
    return p.reshape(shape)


def _quantize(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, scale = _need(inputs, 2, "QuantizeLinear")
    zp = _opt(inputs, 2)
    _float(x, "QuantizeLinear")
    dt = zp.dtype if zp is not None else np.dtype(_ONNX_INT_TYPES.get(
        int(attrs.get("output_dtype", 0) or 2), "uint8"))
    if dt not in _QUANT_TYPES:
        raise DtypeError(f"QuantizeLinear: output dtype {dt} is not int8/uint8/int16/uint16")
    s = _per_axis(scale, x, attrs, "QuantizeLinear").astype(np.float64)
    z = _per_axis(zp, x, attrs, "QuantizeLinear").astype(np.float64) if zp is not None else 0.0
    t = np.rint(x.astype(np.float64) / s) + z
    info = np.iinfo(dt)
    return [np.clip(np.nan_to_num(t, nan=0.0), info.min, info.max).astype(dt)]


def _dequantize(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, scale = _need(inputs, 2, "DequantizeLinear")
    zp = _opt(inputs, 2)
    if x.dtype not in _QUANT_TYPES and x.dtype != np.dtype("int32"):
        raise DtypeError(f"DequantizeLinear: input dtype {x.dtype} is not supported")
    s = _per_axis(scale, x, attrs, "DequantizeLinear")
    z = _per_axis(zp, x, attrs, "DequantizeLinear") if zp is not None else 0
    y = (x.astype(np.float64) - np.asarray(z, np.float64)) * s.astype(np.float64)
    return [y.astype(scale.dtype)]


# ONNX TensorProto element types of the integer outputs QuantizeLinear may choose.
_ONNX_INT_TYPES = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16"}


# -- resize --------------------------------------------------------------------------------


def _source_coords(mode: str, out_n: int, in_n: int, scale: float,
                   roi: tuple[float, float]) -> np.ndarray:
    """The input coordinate each output index samples along one axis (ONNX modes). The
    modes that divide by the output length use the unrounded ``scale * in_n``, as ONNX does."""
    x = np.arange(out_n, dtype=np.float64)
    out_f = scale * in_n
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_f != 1 else np.full(out_n, -0.5)
    if mode == "align_corners":
        return x * (in_n - 1) / (out_f - 1) if out_f != 1 else np.zeros(out_n)
    if mode == "asymmetric":
        return x / scale
    if mode == "half_pixel_symmetric":
        adjustment = out_n / out_f
        center = in_n / 2
        return center * (1 - adjustment) + (x + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_f != 1:
            return start * (in_n - 1) + x * (end - start) * (in_n - 1) / (out_f - 1)
        return np.full(out_n, 0.5 * (start + end) * (in_n - 1))
    raise InvalidRequest(f"Resize: coordinate_transformation_mode {mode!r} is not supported")


def _nearest_index(pos: np.ndarray, mode: str, in_n: int) -> np.ndarray:
    if mode == "round_prefer_floor":
        idx = np.where(pos - np.floor(pos) == 0.5, np.floor(pos), np.round(pos))
    elif mode == "round_prefer_ceil":
        idx = np.where(pos - np.floor(pos) == 0.5, np.ceil(pos), np.round(pos))
    elif mode == "floor":
        idx = np.floor(pos)
    elif mode == "ceil":
        idx = np.ceil(pos)
    else:
        raise InvalidRequest(f"Resize: nearest_mode {mode!r} is not supported")
    return np.clip(idx, 0, in_n - 1).astype(np.intp)


def _resize_axis(x: np.ndarray, axis: int, out_n: int, scale: float, attrs: Attrs,
                 roi: tuple[float, float]) -> np.ndarray:
    in_n = x.shape[axis]
    ctm = _text(attrs.get("coordinate_transformation_mode", "half_pixel"))
    pos = _source_coords(ctm, out_n, in_n, scale, roi)
    mode = _text(attrs.get("mode", "nearest"))
    outside = (pos < 0) | (pos > in_n - 1) if ctm == "tf_crop_and_resize" else None
    shape = [1] * x.ndim
    shape[axis] = out_n
    if mode == "nearest":
        y = np.take(x, _nearest_index(pos, _text(attrs.get("nearest_mode", "round_prefer_floor")),
                                      in_n), axis=axis)
    else:
        p = np.clip(pos, 0, in_n - 1)
        i0 = np.floor(p).astype(np.intp)
        i1 = np.minimum(i0 + 1, in_n - 1)
        w = (p - i0).reshape(shape)
        a, b = np.take(x, i0, axis=axis).astype(np.float64), np.take(x, i1, axis=axis)
        y = a + (b - a) * w
    if outside is not None and outside.any():
        y = np.where(outside.reshape(shape), float(attrs.get("extrapolation_value", 0.0)), y)
    return y


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _resize(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = _need(inputs, 1, "Resize")[0]
    roi, scales, sizes = _opt(inputs, 1), _opt(inputs, 2), _opt(inputs, 3)
    axes = [_axis(a, x.ndim, "Resize") for a in (attrs.get("axes") or range(x.ndim))]
    r = len(axes)
    if any(x.shape[a] == 0 for a in axes):  # nothing to sample from
        raise ShapeError(f"Resize: input {x.shape} is empty along a resized axis")
    if scales is not None and scales.size:
        sc = [float(v) for v in scales.reshape(-1)]
        if len(sc) != r or not all(0 < s < math.inf for s in sc):
            raise ShapeError(f"Resize: {len(sc)} scales for {r} axes, each must be > 0 "
                             "and finite")
        outs = [int(math.floor(x.shape[a] * s)) for a, s in zip(axes, sc)]
    elif sizes is not None and sizes.size:
        outs = _ints(sizes, "Resize", "sizes")
        if len(outs) != r or min(outs) < 1:
            raise ShapeError(f"Resize: sizes {outs} do not fit {r} axes")
        sc = [o / x.shape[a] for a, o in zip(axes, outs)]
        policy = _text(attrs.get("keep_aspect_ratio_policy", "stretch"))
        if policy in ("not_larger", "not_smaller"):
            s = min(sc) if policy == "not_larger" else max(sc)
            sc = [s] * r
            outs = [int(math.floor(x.shape[a] * s + 0.5)) for a in axes]
        elif policy != "stretch":
            raise InvalidRequest(f"Resize: keep_aspect_ratio_policy {policy!r} is not supported")
    else:
        raise InvalidRequest("Resize: one of scales or sizes is required")
    if min(outs) < 1:
        raise ShapeError(f"Resize: output size {outs} is empty")
    total = math.prod(x.shape) // max(math.prod(x.shape[a] for a in axes), 1) * math.prod(outs)
    if total > MAX_CREATED_ELEMENTS:
        raise ShapeError(f"Resize: output of {total} elements exceeds {MAX_CREATED_ELEMENTS}")
    rois = [(0.0, 1.0)] * r
    if roi is not None and roi.size == 2 * r:
        flat = [float(v) for v in roi.reshape(-1)]
        rois = list(zip(flat[:r], flat[r:]))
    y = x
    for a, o, s, ro in zip(axes, outs, sc, rois):
        if o != x.shape[a] or s != 1.0 or _text(attrs.get(
                "coordinate_transformation_mode", "half_pixel")) == "tf_crop_and_resize":
            y = _resize_axis(y, a, o, s, attrs, ro)
    if x.dtype.kind in "iu" and y.dtype != x.dtype:
        y = np.rint(y)
    return [np.ascontiguousarray(y).astype(x.dtype, copy=False)]


# -- the table -----------------------------------------------------------------------------

_OPS: dict[str, Callable[[Arrays, Attrs], list[np.ndarray]]] = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul,
    "Add": _binary(np.add), "Mul": _binary(np.multiply), "Sub": _binary(np.subtract),
    "Relu": _relu, "Clip": _clip, "Sigmoid": _sigmoid, "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish, "BatchNormalization": _batch_norm,
    "MaxPool": _max_pool, "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool, "Softmax": _softmax,
    "Reshape": _reshape, "Flatten": _flatten, "Transpose": _transpose, "Concat": _concat,
    "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Resize": _resize,
    "QuantizeLinear": _quantize, "DequantizeLinear": _dequantize, "ArgMax": _arg_max,
    "Constant": _constant, "Identity": _identity,
    "ConstantOfShape": _constant_of_shape, "Dropout": _dropout, "Sum": _sum, "LRN": _lrn,
}

GRAPH_OPS: frozenset[str] = frozenset(_OPS)


def op_function(op: str) -> Callable[[Arrays, Attrs], list[np.ndarray]]:
    """The implementation of ``op`` (callers run it under ``np.errstate(all="ignore")``)."""
    fn = _OPS.get(op)
    if fn is None:
        raise UnsupportedOp(f"op {op!r} is not implemented (implemented: "
                            f"{', '.join(sorted(_OPS))})")
    return fn


def run_op(op: str, inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    """Run one ONNX node; errors are ``ipc.errors`` classes naming the op."""
    fn = _OPS.get(op)
    if fn is None:
        raise UnsupportedOp(f"op {op!r} is not implemented (implemented: "
                            f"{', '.join(sorted(_OPS))})")
    with np.errstate(all="ignore"):
        try:
            return fn(inputs, attrs)
        except (ValueError, IndexError, TypeError, ArithmeticError, MemoryError) as exc:
            raise InvalidRequest(f"{op}: {type(exc).__name__}: {exc}") from None


def unsupported(op: str, attrs: Attrs, in_dtypes: Sequence[str], n_outputs: int = 1) -> str | None:
    """Why this variant of ``op`` is not implemented, or None: checked before placement."""
    if op not in _OPS:
        return f"op {op} is not implemented"
    if op == "BatchNormalization" and (attrs.get("training_mode", 0) or n_outputs > 1):
        return "BatchNormalization in training mode is not implemented"
    if op == "Dropout" and attrs.get("training_mode", 0):
        return "Dropout in training mode is not implemented"
    if op == "MaxPool" and (n_outputs > 1 or attrs.get("storage_order", 0)):
        return "MaxPool with an Indices output is not implemented"
    if op == "Resize":
        mode = _text(attrs.get("mode", "nearest"))
        if mode not in ("nearest", "linear"):
            return f"Resize mode {mode!r} is not implemented (nearest, linear are)"
        if attrs.get("antialias", 0):
            return "Resize with antialias is not implemented"
    if op in ("QuantizeLinear", "DequantizeLinear"):
        if attrs.get("block_size", 0):
            return f"{op} with blocks is not implemented"
        allowed = {"int8", "uint8", "int16", "uint16", "float32", "float16", "float64", "int32"}
        bad = [d for d in in_dtypes if d and d not in allowed]
        if bad:
            return f"{op} on {bad[0]} is not implemented"
    if op == "Constant" and any(k != "value" for k in attrs):
        return "Constant takes only a tensor 'value' here"
    if op in ("Conv", "MaxPool", "AveragePool") and in_dtypes and in_dtypes[0] in ("",):
        return f"{op} input dtype unknown"
    if op in ("Conv",) and in_dtypes and in_dtypes[0] not in ("float16", "float32", "float64"):
        return f"Conv on {in_dtypes[0]} is not implemented"
    return None


def op_flops(op: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]],
             attrs: Attrs) -> float:
    """Arithmetic work of one node (multiply-adds count 2), for the roofline model."""
    out = sum(math.prod(s) for s in out_shapes) if out_shapes else 0
    if op == "Conv" and len(in_shapes) > 1:
        w = in_shapes[1]
        return 2.0 * out * math.prod(w[1:])
    if op in ("Gemm", "MatMul") and len(in_shapes) > 1:
        a = in_shapes[0]
        k = a[-1] if not (op == "Gemm" and attrs.get("transA", 0)) else a[0]
        return 2.0 * out * k
    if op in ("MaxPool", "AveragePool"):
        return float(out * math.prod(attrs.get("kernel_shape") or [1]))
    if op == "GlobalAveragePool" and in_shapes:
        return float(math.prod(in_shapes[0]))
    if op == "LRN":
        return float(out * (int(attrs.get("size", 1)) + 4))
    if op in ("Softmax", "Sigmoid", "HardSwish", "HardSigmoid", "BatchNormalization"):
        return 4.0 * out
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Constant"):
        return 0.0
    return float(out)

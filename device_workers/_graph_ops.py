"""Numpy implementations of the ONNX operators a delegate partition runs, op by op.

One function per ONNX op type: ``fn(inputs, attrs) -> list of outputs``. ``inputs`` holds
numpy arrays in the node's input order, ``None`` for an omitted optional input; ``attrs``
holds plain values (int, float, str, lists of them, or an array for ``Constant``).
Layout is ONNX's own (NCHW for images): the same code is the CPU reference executor in
the application and the body of the ``graph`` kernel in a device process, so a delegated
partition and the reference can only differ by what the plan feeds them.

The ops that slide a window or resample a grid (convolution, pooling, resize) live in
``_graph_spatial``, the operand checks every op shares in ``_graph_checks``; the table
here names them all.

``unsupported(op, attrs, in_dtypes)`` says why a variant is not implemented (None if it
is): the delegate's support query refuses such a node instead of running it wrongly.
Malformed operands raise ``ShapeError`` / ``DtypeError`` / ``InvalidRequest`` from
``ipc.errors``; nothing here may crash the process that runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ipc.errors import DtypeError, InvalidRequest, ShapeError, UnsupportedOp

from ._graph_checks import (
    MAX_CREATED_ELEMENTS,
    Arrays,
    Attrs,
    as_text,
    axis_index,
    int_list,
    need,
    opt,
    require_float,
)
from ._graph_spatial import average_pool, conv, global_average_pool, max_pool, resize

__all__ = ["GRAPH_OPS", "run_op", "unsupported", "op_flops"]

_QUANT_TYPES = frozenset(np.dtype(t) for t in ("int8", "uint8", "int16", "uint16"))


# -- elementwise --------------------------------------------------------------------------


def _binary(fn: np.ufunc) -> Callable[[Arrays, Attrs], list[np.ndarray]]:
    def run(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
        a, b = need(inputs, 2, fn.__name__)
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
    x = need(inputs, 1, "Relu")[0]
    return [np.maximum(x, x.dtype.type(0))]


def _clip(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "Clip")[0]
    lo, hi = opt(inputs, 1), opt(inputs, 2)
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
    x = need(inputs, 1, "Sigmoid")[0]
    require_float(x, "Sigmoid")
    one = x.dtype.type(1)
    return [(one / (one + np.exp(-x))).astype(x.dtype, copy=False)]


def _hard_sigmoid(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "HardSigmoid")[0]
    require_float(x, "HardSigmoid")
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    y = np.clip(x * x.dtype.type(alpha) + x.dtype.type(beta), 0, 1)
    return [y.astype(x.dtype, copy=False)]


def _hard_swish(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "HardSwish")[0]
    require_float(x, "HardSwish")
    gate = np.clip(x * x.dtype.type(1 / 6) + x.dtype.type(0.5), 0, 1)
    return [(x * gate).astype(x.dtype, copy=False)]


def _identity(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    return need(inputs, 1, "Identity")


def _constant(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    if "value" not in attrs or not isinstance(attrs["value"], np.ndarray):
        raise InvalidRequest("Constant: only the tensor 'value' attribute is supported")
    return [attrs["value"]]


def _constant_of_shape(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    shape = int_list(need(inputs, 1, "ConstantOfShape")[0], "ConstantOfShape", "shape")
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_CREATED_ELEMENTS:
        raise ShapeError(f"ConstantOfShape: shape {shape} is negative or too large")
    value = attrs.get("value")
    fill = (value.reshape(-1)[:1] if isinstance(value, np.ndarray) and value.size
            else np.zeros(1, np.float32))
    return [np.full(shape, fill[0], dtype=fill.dtype)]


def _dropout(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    """Inference: the identity (a training-mode Dropout is refused before it runs)."""
    x = need(inputs, 1, "Dropout")[0]
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
    a, b = need(inputs, 2, "MatMul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("MatMul: operands must have rank >= 1")
    try:
        return [np.matmul(a, b)]
    except ValueError as exc:
        raise ShapeError(f"MatMul: shapes {a.shape} and {b.shape}: {exc}") from None


def _gemm(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    a, b = need(inputs, 2, "Gemm")
    c = opt(inputs, 2)
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


# -- normalisation ----------------------------------------------------------------------------

def _batch_norm(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, scale, b, mean, var = need(inputs, 5, "BatchNormalization")
    require_float(x, "BatchNormalization")
    if x.ndim < 2 or any(t.shape != (x.shape[1],) for t in (scale, b, mean, var)):
        raise ShapeError(f"BatchNormalization: parameters must have shape ({x.shape[1]},)")
    eps = float(attrs.get("epsilon", 1e-5))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    k = (scale / np.sqrt(var + var.dtype.type(eps))).reshape(shape)
    y = (x - mean.reshape(shape)) * k + b.reshape(shape)
    return [y.astype(x.dtype, copy=False)]


def _lrn(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    """Local response normalisation across channels (AlexNet, GoogLeNet)."""
    x = need(inputs, 1, "LRN")[0]
    require_float(x, "LRN")
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
    x = need(inputs, 1, "Softmax")[0]
    require_float(x, "Softmax")
    axis = axis_index(int(attrs.get("axis", -1)), x.ndim, "Softmax")
    if attrs.get("coerce_2d", 0):  # opset < 13 semantics: one row per leading index
        rows = x.reshape(math.prod(x.shape[:axis]), -1)
        return [_softmax([rows], {"axis": 1})[0].reshape(x.shape)]
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return [(e / e.sum(axis=axis, keepdims=True)).astype(x.dtype, copy=False)]


# -- shape ops -----------------------------------------------------------------------------




def _reshape(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, shape_t = need(inputs, 2, "Reshape")
    shape = int_list(shape_t, "Reshape", "shape")
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
    x = need(inputs, 1, "Flatten")[0]
    axis = int(attrs.get("axis", 1))
    if not -x.ndim <= axis <= x.ndim:
        raise ShapeError(f"Flatten: axis {axis} is out of range for rank {x.ndim}")
    if axis < 0:
        axis += x.ndim
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


def _transpose(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "Transpose")[0]
    perm = list(attrs.get("perm") or range(x.ndim - 1, -1, -1))
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"Transpose: perm {perm} is not a permutation of rank {x.ndim}")
    return [np.ascontiguousarray(np.transpose(x, perm))]


def _concat(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    arrays = [a for a in inputs if a is not None]
    if not arrays:
        raise InvalidRequest("Concat: no inputs")
    axis = axis_index(int(attrs.get("axis", 0)), arrays[0].ndim, "Concat")
    try:
        return [np.concatenate(arrays, axis=axis)]
    except ValueError as exc:
        raise ShapeError(f"Concat: {exc}") from None


def _squeeze(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "Squeeze")[0]
    axes = int_list(opt(inputs, 1), "Squeeze", "axes") or list(attrs.get("axes") or [])
    if not axes:
        return [x.reshape([d for d in x.shape if d != 1])]
    axes = [axis_index(a, x.ndim, "Squeeze") for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        raise ShapeError(f"Squeeze: axes {axes} of {x.shape} are not all 1")
    return [np.squeeze(x, axis=tuple(axes))]


def _unsqueeze(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "Unsqueeze")[0]
    axes = int_list(opt(inputs, 1), "Unsqueeze", "axes") or list(attrs.get("axes") or [])
    rank = x.ndim + len(axes)
    axes = sorted(axis_index(a, rank, "Unsqueeze") for a in axes)
    if len(set(axes)) != len(axes) or not axes:
        raise ShapeError(f"Unsqueeze: axes {axes} are empty or repeated")
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return [x.reshape(shape)]


def _arg_max(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "ArgMax")[0]
    axis = axis_index(int(attrs.get("axis", 0)), x.ndim, "ArgMax")
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
    axis = axis_index(int(attrs.get("axis", 1)), x.ndim, op)
    if p.shape[0] != x.shape[axis]:
        raise ShapeError(f"{op}: {p.shape[0]} parameters for axis {axis} of {x.shape}")
    shape = [1] * x.ndim
    shape[axis] = p.shape[0]
    return p.reshape(shape)


def _quantize(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, scale = need(inputs, 2, "QuantizeLinear")
    zp = opt(inputs, 2)
    require_float(x, "QuantizeLinear")
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
    x, scale = need(inputs, 2, "DequantizeLinear")
    zp = opt(inputs, 2)
    if x.dtype not in _QUANT_TYPES and x.dtype != np.dtype("int32"):
        raise DtypeError(f"DequantizeLinear: input dtype {x.dtype} is not supported")
    s = _per_axis(scale, x, attrs, "DequantizeLinear")
    z = _per_axis(zp, x, attrs, "DequantizeLinear") if zp is not None else 0
    y = (x.astype(np.float64) - np.asarray(z, np.float64)) * s.astype(np.float64)
    return [y.astype(scale.dtype)]


# ONNX TensorProto element types of the integer outputs QuantizeLinear may choose.
_ONNX_INT_TYPES = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16"}


# -- the table -----------------------------------------------------------------------------

_OPS: dict[str, Callable[[Arrays, Attrs], list[np.ndarray]]] = {
    "Conv": conv, "Gemm": _gemm, "MatMul": _matmul,
    "Add": _binary(np.add), "Mul": _binary(np.multiply), "Sub": _binary(np.subtract),
    "Relu": _relu, "Clip": _clip, "Sigmoid": _sigmoid, "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish, "BatchNormalization": _batch_norm,
    "MaxPool": max_pool, "AveragePool": average_pool,
    "GlobalAveragePool": global_average_pool, "Softmax": _softmax,
    "Reshape": _reshape, "Flatten": _flatten, "Transpose": _transpose, "Concat": _concat,
    "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Resize": resize,
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
        mode = as_text(attrs.get("mode", "nearest"))
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

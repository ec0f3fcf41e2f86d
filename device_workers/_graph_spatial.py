"""The graph ops that slide a window or resample a grid: convolution, pooling, resize.

Same contract as ``_graph_ops``: ``fn(inputs, attrs) -> list of outputs``, ONNX layout
(NCHW), malformed operands raise ``ipc.errors`` classes naming the op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ipc.errors import InvalidRequest, ShapeError

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

__all__ = ["conv", "max_pool", "average_pool", "global_average_pool", "resize"]


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


def conv(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x, w = need(inputs, 2, "Conv")
    bias = opt(inputs, 2)
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ShapeError(f"Conv: X {x.shape} and W {w.shape} must have one rank >= 3")
    require_float(x, "Conv")
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


def max_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "MaxPool")[0]
    kernel = _pool_kernel(x, attrs, "MaxPool")
    strides, dil, begin, end, out = _spatial(x, kernel, attrs, "MaxPool",
                                             ceil=bool(attrs.get("ceil_mode", 0)))
    extra = _ceil_extra(x, kernel, strides, dil, begin, end, out)
    low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    xp = _pad_spatial(x, begin, [e + x_ for e, x_ in zip(end, extra)], low)
    win = _windows(xp, kernel, strides, dil, out)
    nd = len(kernel)
    return [np.ascontiguousarray(win.max(axis=tuple(range(-nd, 0))), dtype=x.dtype)]


def average_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "AveragePool")[0]
    require_float(x, "AveragePool")
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


def global_average_pool(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "GlobalAveragePool")[0]
    require_float(x, "GlobalAveragePool")
    if x.ndim < 3:
        raise ShapeError(f"GlobalAveragePool: input {x.shape} has no spatial dims")
    return [x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=x.dtype)]


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
    ctm = as_text(attrs.get("coordinate_transformation_mode", "half_pixel"))
    pos = _source_coords(ctm, out_n, in_n, scale, roi)
    mode = as_text(attrs.get("mode", "nearest"))
    outside = (pos < 0) | (pos > in_n - 1) if ctm == "tf_crop_and_resize" else None
    shape = [1] * x.ndim
    shape[axis] = out_n
    if mode == "nearest":
        y = np.take(x, _nearest_index(pos, as_text(attrs.get("nearest_mode", "round_prefer_floor")),
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


def resize(inputs: Arrays, attrs: Attrs) -> list[np.ndarray]:
    x = need(inputs, 1, "Resize")[0]
    roi, scales, sizes = opt(inputs, 1), opt(inputs, 2), opt(inputs, 3)
    axes = [axis_index(a, x.ndim, "Resize") for a in (attrs.get("axes") or range(x.ndim))]
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
        outs = int_list(sizes, "Resize", "sizes")
        if len(outs) != r or min(outs) < 1:
            raise ShapeError(f"Resize: sizes {outs} do not fit {r} axes")
        sc = [o / x.shape[a] for a, o in zip(axes, outs)]
        policy = as_text(attrs.get("keep_aspect_ratio_policy", "stretch"))
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
        if o != x.shape[a] or s != 1.0 or as_text(attrs.get(
                "coordinate_transformation_mode", "half_pixel")) == "tf_crop_and_resize":
            y = _resize_axis(y, a, o, s, attrs, ro)
    if x.dtype.kind in "iu" and y.dtype != x.dtype:
        y = np.rint(y)
    return [np.ascontiguousarray(y).astype(x.dtype, copy=False)]

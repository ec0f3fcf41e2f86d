"""Kernels against plain numpy references; rejections; cancellation between chunks."""

from __future__ import annotations

import numpy as np
import pytest

from device_workers import _kernels as K
from ipc.errors import Cancelled, DtypeError, InvalidRequest, ShapeError, UnsupportedOp

RNG = np.random.default_rng(1234)


def nop() -> None:
    pass


def run(op, ins, outs, params=None, between=nop):
    K.run_kernel(op, ins, outs, params or {}, between)


def rand(shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


class Counter:
    """between_chunks that counts calls and raises Cancelled on call number ``cancel_at``."""

    def __init__(self, cancel_at: int | None = None) -> None:
        self.calls, self.cancel_at = 0, cancel_at

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.cancel_at:
            raise Cancelled("test cancel")


# -- references --------------------------------------------------------------------------


def conv_ref(x, w, b, stride, padding):
    n, h, wd, _c = x.shape
    kh, kw, _, f = w.shape
    if padding == "valid":
        oh, ow, top, left = (h - kh) // stride + 1, (wd - kw) // stride + 1, 0, 0
    else:
        oh, ow = -(-h // stride), -(-wd // stride)
        top = max((oh - 1) * stride + kh - h, 0) // 2
        left = max((ow - 1) * stride + kw - wd, 0) // 2
    out = np.zeros((n, oh, ow, f), np.float64)
    for bi in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for ky in range(kh):
                    for kx in range(kw):
                        iy, ix = oy * stride + ky - top, ox * stride + kx - left
                        if 0 <= iy < h and 0 <= ix < wd:
                            out[bi, oy, ox] += x[bi, iy, ix].astype(np.float64) @ w[ky, kx]
    if b is not None:
        out += b
    return out.astype(np.float32)


def resize_ref(x, oh, ow, mode):
    n, h, w, c = x.shape
    out = np.zeros((n, oh, ow, c), np.float64)
    for oy in range(oh):
        for ox in range(ow):
            if mode == "nearest":
                sy = min(int(np.floor((oy + 0.5) * h / oh)), h - 1)
                sx = min(int(np.floor((ox + 0.5) * w / ow)), w - 1)
                out[:, oy, ox] = x[:, sy, sx]
                continue
            fy = min(max((oy + 0.5) * h / oh - 0.5, 0), h - 1)
            fx = min(max((ox + 0.5) * w / ow - 0.5, 0), w - 1)
            y0, x0 = int(fy), int(fx)
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            dy, dx = fy - y0, fx - x0
            out[:, oy, ox] = (
                x[:, y0, x0] * (1 - dy) * (1 - dx)
                + x[:, y0, x1] * (1 - dy) * dx
                + x[:, y1, x0] * dy * (1 - dx)
                + x[:, y1, x1] * dy * dx
            )
    return out


# -- correct results -----------------------------------------------------------------------


def test_ops_listed():
    assert set(K.OPS) == {
        "copy", "fill", "add", "scale", "matmul", "relu", "conv2d", "resize", "quantize",
                          "dequantize",
        "transpose", "checksum", "graph", "work",
    }


def test_copy_same_and_cast():
    x = rand((3, 5))
    o = np.empty_like(x)
    run("copy", [x], [o])
    np.testing.assert_array_equal(o, x)
    oi = np.empty((3, 5), np.int16)
    run("copy", [x * 100], [oi])
    np.testing.assert_array_equal(oi, (x * 100).astype(np.int16))


def test_fill():
    o = np.ones((4, 4), np.int32)
    run("fill", [], [o], {"value": -7})
    assert (o == -7).all()
    of = np.ones(6, np.float32)
    run("fill", [], [of])
    assert (of == 0).all()


def test_add_scale_relu():
    a, b = rand((7, 3)), rand((7, 3))
    o = np.empty_like(a)
    run("add", [a, b], [o])
    np.testing.assert_array_equal(o, a + b)
    run("scale", [a], [o], {"factor": 2.5})
    np.testing.assert_allclose(o, a * np.float32(2.5))
    run("relu", [a], [o])
    np.testing.assert_array_equal(o, np.maximum(a, 0))
    ai = (a * 10).astype(np.int32)
    oi = np.empty_like(ai)
    run("relu", [ai], [oi])
    np.testing.assert_array_equal(oi, np.maximum(ai, 0))


def test_elementwise_non_contiguous_views_written_in_place():
    base = np.zeros((6, 8), np.float32)
    a = rand((6, 8))[:, ::2]
    run("copy", [a], [base[:, 1::2]])
    np.testing.assert_array_equal(base[:, 1::2], a)
    assert (base[:, ::2] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_matmul(dtype):
    a = (rand((9, 5)) * 10).astype(dtype)
    b = (rand((5, 4)) * 10).astype(dtype)
    o = np.empty((9, 4), dtype)
    run("matmul", [a, b], [o])
    np.testing.assert_allclose(o, a @ b, rtol=1e-5)


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_conv2d_matches_naive_loop(padding, stride, bias):
    x, w = rand((2, 7, 6, 3)), rand((3, 2, 3, 4))
    b = rand((4,)) if bias else None
    ref = conv_ref(x, w, b, stride, padding)
    o = np.full(ref.shape, np.nan, np.float32)
    run("conv2d", [x, w] + ([b] if bias else []), [o], {"stride": stride, "padding": padding})
    np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-4)


def test_conv2d_chunked_equals_unchunked(monkeypatch):
    x, w = rand((1, 9, 8, 2)), rand((3, 3, 2, 3))
    whole = np.empty((1, 5, 4, 3), np.float32)
    run("conv2d", [x, w], [whole], {"stride": 2})
    monkeypatch.setattr(K, "CHUNK_WORK", 0)  # one output row per chunk
    parts, c = np.empty_like(whole), Counter()
    run("conv2d", [x, w], [parts], {"stride": 2}, c)
    assert c.calls == 4
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("size", [(8, 10), (3, 2), (5, 5)])
def test_resize(mode, size, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_WORK", 16)  # exercise the row chunks too
    x = rand((2, 5, 5, 3))
    o = np.empty((2, *size, 3), np.float32)
    run("resize", [x], [o], {"mode": mode})
    np.testing.assert_allclose(o, resize_ref(x, *size, mode), rtol=1e-5, atol=1e-5)


def test_resize_bilinear_uint8_rounds():
    x = RNG.integers(0, 256, (1, 4, 4, 1)).astype(np.uint8)
    o = np.empty((1, 7, 9, 1), np.uint8)
    run("resize", [x], [o], {"mode": "bilinear"})
    np.testing.assert_array_equal(o, np.rint(resize_ref(x.astype(np.float64), 7, 9, "bilinear")))


@pytest.mark.parametrize("qdtype", [np.int8, np.uint8])
def test_quantize_dequantize(qdtype):
    x = rand((50,)) * 20
    zp = 3 if qdtype == np.int8 else 128
    info = np.iinfo(qdtype)
    q = np.empty(50, qdtype)
    run("quantize", [x], [q], {"scale": 0.1, "zero_point": zp})
    ref = np.clip(np.rint(x.astype(np.float64) / 0.1) + zp, info.min, info.max).astype(qdtype)
    np.testing.assert_array_equal(q, ref)
    assert q.min() == info.min and q.max() == info.max  # saturated, not wrapped
    d = np.empty(50, np.float32)
    run("dequantize", [q], [d], {"scale": 0.1, "zero_point": zp})
    np.testing.assert_allclose(d, (q.astype(np.float32) - zp) * np.float32(0.1), rtol=1e-6)


def test_quantize_nan_inf():
    q = np.empty(3, np.int8)
    run("quantize", [np.array([np.nan, np.inf, -np.inf], np.float32)], [q],
        {"scale": 1.0, "zero_point": 5})
    np.testing.assert_array_equal(q, [5, 127, -128])


def test_work_touches_nothing():
    o = np.arange(5, dtype=np.float32)
    c = Counter()
    K.run_kernel("work", [np.zeros(3, np.uint8)], [o], {"anything": 1}, c)
    np.testing.assert_array_equal(o, np.arange(5))
    K.validate("work", [], [], {})


# -- rejections: right class, output untouched ----------------------------------------------

F32 = np.float32
BAD = [
    # (op, input arrays, output arrays, params, error class)
    ("nope", [rand(3)], [rand(3)], {}, UnsupportedOp),
    ("copy", [], [rand(3)], {}, ShapeError),
    ("copy", [rand(3)], [rand(4)], {}, ShapeError),
    ("copy", [np.array(["a", "b", "c"])], [rand(3)], {}, DtypeError),
    ("fill", [rand(3)], [rand(3)], {}, ShapeError),
    ("fill", [], [np.zeros(3, np.int8)], {"value": 300}, InvalidRequest),
    ("fill", [], [np.zeros(3, np.int8)], {"value": 1.5}, InvalidRequest),
    ("add", [rand(3), rand(4)], [rand(3)], {}, ShapeError),
    ("add", [rand(3), rand(3, np.float64)], [rand(3)], {}, DtypeError),
    ("add", [rand(3), rand(3)], [rand(3), rand(3)], {}, ShapeError),
    ("add", [rand(3), rand(3)], [rand(3)], {"bogus": 1}, InvalidRequest),
    ("scale", [np.zeros(3, np.int32)], [np.zeros(3, np.int32)], {}, DtypeError),
    ("scale", [rand(3)], [rand(3)], {"factor": "x"}, InvalidRequest),
    ("relu", [rand(3)], [rand(3, np.float64)], {}, DtypeError),
    ("matmul", [rand((2, 3)), rand((4, 5))], [rand((2, 5))], {}, ShapeError),
    ("matmul", [rand((2, 3)), rand((3, 5))], [rand((5, 2))], {}, ShapeError),
    ("matmul", [rand(3), rand((3, 5))], [rand(5)], {}, ShapeError),
    ("matmul", [rand((2, 3), np.float16), rand((3, 5), np.float16)], [rand((2, 5), np.float16)],
     {}, DtypeError),
    ("matmul", [rand((2, 3)), rand((3, 5), np.float64)], [rand((2, 5))], {}, DtypeError),
    ("conv2d", [rand((1, 4, 4, 2)), rand((3, 3, 3, 2))], [rand((1, 4, 4, 2))], {}, ShapeError),
    ("conv2d", [rand((1, 4, 4, 2)), rand((3, 3, 2, 2))], [rand((1, 2, 2, 2))], {}, ShapeError),
    ("conv2d", [rand((1, 4, 4, 2)), rand((3, 3, 2, 2)), rand(3)], [rand((1, 4, 4, 2))], {},
     ShapeError),
    ("conv2d", [rand((1, 2, 2, 2)), rand((3, 3, 2, 2))], [rand((1, 0, 0, 2))],
     {"padding": "valid"}, ShapeError),
    ("conv2d", [rand((1, 4, 4, 2), np.float64), rand((3, 3, 2, 2))], [rand((1, 4, 4, 2))], {},
     DtypeError),
    ("conv2d", [rand((1, 4, 4, 2)), rand((3, 3, 2, 2))], [rand((1, 4, 4, 2))], {"padding": "full"},
     InvalidRequest),
    ("conv2d", [rand((1, 4, 4, 2)), rand((3, 3, 2, 2))], [rand((1, 4, 4, 2))], {"stride": 0},
     InvalidRequest),
    ("conv2d", [rand((1, 4, 4, 2))], [rand((1, 4, 4, 2))], {}, ShapeError),
    ("resize", [rand((1, 4, 4, 2))], [rand((1, 8, 8, 3))], {}, ShapeError),
    ("resize", [rand((4, 4, 2))], [rand((8, 8, 2))], {}, ShapeError),
    ("resize", [rand((1, 4, 4, 2))], [rand((1, 8, 8, 2), np.float64)], {}, DtypeError),
    ("resize", [rand((1, 4, 4, 2))], [rand((1, 8, 8, 2))], {"mode": "cubic"}, InvalidRequest),
    ("quantize", [rand(4)], [np.zeros(4, np.int8)], {}, InvalidRequest),
    ("quantize", [rand(4)], [np.zeros(4, np.int8)], {"scale": 0}, InvalidRequest),
    ("quantize", [rand(4)], [np.zeros(4, np.int8)], {"scale": -1.0}, InvalidRequest),
    ("quantize", [rand(4)], [np.zeros(4, np.int8)], {"scale": 1.0, "zero_point": 200},
     InvalidRequest),
    ("quantize", [rand(4)], [np.zeros(4, np.int16)], {"scale": 1.0}, DtypeError),
    ("quantize", [np.zeros(4, np.int32)], [np.zeros(4, np.int8)], {"scale": 1.0}, DtypeError),
    ("quantize", [rand(4)], [np.zeros(5, np.int8)], {"scale": 1.0}, ShapeError),
    ("dequantize", [np.zeros(4, np.int8)], [rand(4)], {"scale": float("nan")}, InvalidRequest),
    ("dequantize", [np.zeros(4, np.int8)], [rand(4, np.float64)], {"scale": 1.0}, DtypeError),
    ("dequantize", [rand(4)], [rand(4)], {"scale": 1.0}, DtypeError),
]


@pytest.mark.parametrize("op,ins,outs,params,err", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_rejections(op, ins, outs, params, err):
    before = [o.copy() for o in outs]
    with pytest.raises(err) as info:
        K.validate(op, [(a.shape, a.dtype.str) for a in ins],
                   [(a.shape, a.dtype.name) for a in outs], params)
    assert op in str(info.value)
    with pytest.raises(err):
        run(op, ins, outs, params)
    for o, b in zip(outs, before):
        np.testing.assert_array_equal(o, b)


def test_shape_error_is_not_raised_for_bad_params():
    with pytest.raises(InvalidRequest) as info:
        K.validate("scale", [((3,), "float32")], [((3,), "float32")], {"factor": float("inf")})
    assert not isinstance(info.value, (ShapeError, DtypeError))


def test_message_names_operand_and_expectation():
    with pytest.raises(ShapeError, match=r"matmul: input 1 .*\(3, N\)"):
        K.validate("matmul", [((2, 3), "float32"), ((4, 5), "float32")], [((2, 5), "float32")], {})
    with pytest.raises(DtypeError, match=r"output 0 .*float32"):
        K.validate("dequantize", [((2,), "int8")], [((2,), "float16")], {"scale": 1.0})


def test_validate_rejects_garbage_specs():
    with pytest.raises(ShapeError):
        K.validate("copy", [((-1,), "float32")], [((1,), "float32")], {})
    with pytest.raises(DtypeError):
        K.validate("copy", [((1,), "notadtype")], [((1,), "float32")], {})
    K.validate("copy", [([2, 3], "float32")], [((2, 3), "int8")], {})  # lists from msgpack are fine


def test_run_rejects_aliasing_and_read_only():
    a = rand((4, 4))
    with pytest.raises(InvalidRequest):
        run("matmul", [a, rand((4, 4))], [a])
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidRequest):
        run("fill", [], [ro])


# -- chunking and cancellation ---------------------------------------------------------------


def test_matmul_chunks_and_cancel(monkeypatch):
    monkeypatch.setattr(K, "CHUNK_WORK", 0)  # one row per chunk
    a, b = rand((6, 3)), rand((3, 4))
    o = np.zeros((6, 4), np.float32)
    c = Counter()
    run("matmul", [a, b], [o], between=c)
    assert c.calls == 5
    np.testing.assert_allclose(o, a @ b, rtol=1e-5)

    o[:] = 0
    c = Counter(cancel_at=2)
    with pytest.raises(Cancelled):
        run("matmul", [a, b], [o], between=c)
    assert c.calls == 2
    np.testing.assert_allclose(o[:2], (a @ b)[:2], rtol=1e-5)  # partial: the rows done so far
    assert (o[2:] == 0).all()


def test_conv2d_cancel_stops(monkeypatch):
    monkeypatch.setattr(K, "CHUNK_WORK", 0)
    x, w = rand((1, 6, 6, 2)), rand((3, 3, 2, 2))
    o = np.zeros((1, 6, 6, 2), np.float32)
    c = Counter(cancel_at=1)
    with pytest.raises(Cancelled):
        run("conv2d", [x, w], [o], between=c)
    assert c.calls == 1
    assert o[:, 0].any() and not o[:, 1:].any()


def test_large_default_chunking_calls_between():
    a, b = rand((1024, 512)), rand((512, 512))
    o = np.empty((1024, 512), np.float32)
    c = Counter()
    run("matmul", [a, b], [o], between=c)
    assert c.calls >= 1
    x = rand((1 << 21,))
    c = Counter()
    run("relu", [x], [np.empty_like(x)], between=c)
    assert c.calls >= 1


def test_tiny_work_may_skip_between():
    c = Counter(cancel_at=1)
    o = np.empty(4, np.float32)
    run("add", [rand(4), rand(4)], [o], between=c)  # one chunk: never interrupted
    assert c.calls == 0


# -- runtime-inserted reformat and the read-everything checksum ------------------------------


def test_transpose_reformats_nchw_to_nhwc_and_casts():
    x = rand((2, 3, 4, 5))
    o = np.empty((2, 4, 5, 3), np.float64)
    run("transpose", [x], [o], {"axes": [0, 2, 3, 1]}, between=nop)
    np.testing.assert_array_equal(o, x.transpose(0, 2, 3, 1).astype(np.float64))


def test_transpose_rejects_a_non_permutation_and_a_wrong_shape():
    x = rand((2, 3, 4, 5))
    with pytest.raises(InvalidRequest):
        K.validate("transpose", [(x.shape, "float32")], [((2, 4, 5, 3), "float32")],
                   {"axes": [0, 2, 2, 1]})
    with pytest.raises(ShapeError):
        K.validate("transpose", [(x.shape, "float32")], [((2, 3, 4, 5), "float32")],
                   {"axes": [0, 2, 3, 1]})


def test_checksum_reads_every_element_byte_even_through_strides():
    base = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
    view = base[:, :10]  # a padded row stride: the padding is not part of the tensor
    out = np.zeros(8, np.uint8)
    calls = []
    run("checksum", [view], [out], between=lambda: calls.append(1))
    assert K.read_checksum(out) == K.checksum_of(view) == int(view.astype(np.uint64).sum())
    with pytest.raises(ShapeError):
        K.validate("checksum", [((4,), "uint8")], [((4,), "uint8")], {})


def test_an_operand_equal_to_a_valid_one_but_not_exact_is_still_refused():
    """Valid operand layouts are remembered (``_spec``): an operand that compares equal
    to one of them -- float or bool dimensions, ``2.0 == 2``, ``True == 1`` -- must not
    pass as it, before or after the valid one was seen."""
    for _ in range(2):  # the second round, with the valid layout remembered
        K.validate("copy", [((2, 3), "float32")], [((2, 3), "float32")], {})
        for shape in ((2.0, 3), (2, 3.0), (True, 3), (2, np.int64(3) + 0.0)):
            with pytest.raises(ShapeError):
                K.validate("copy", [(shape, "float32")], [((2, 3), "float32")], {})
        with pytest.raises(DtypeError):
            K.validate("copy", [((2, 3), None)], [((2, 3), "float32")], {})
    assert K._spec((2, 3), "float32", "x") == ((2, 3), np.dtype("float32"))

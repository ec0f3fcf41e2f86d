"""ONNX's own node tests (``onnx.backend.test``) for every op hetproc claims, twice: on the
CPU reference executor, and delegated whole to the first accelerator of a real platform
that takes the model (npu0, gpu0, dsp0; skipped when none does).

Variants hetproc does not implement are excluded here by name, each with its reason, and
``test_excluded_variants_are_refused`` proves the support query refuses every one of them
(so a user gets a clear error or a CPU fallback, never a wrong answer)."""

from __future__ import annotations

import os
import re
import unittest
import warnings

import pytest

pytest.importorskip("onnx")
import onnx.backend.test

import hetproc
from hetproc.delegate import backend as hp_backend
from hetproc.delegate.backend import DelegateBackend

warnings.filterwarnings("ignore", category=RuntimeWarning)

CLAIMED = ("conv|basic_conv|gemm|matmul|add|mul|sub|relu|clip|sigmoid|hardsigmoid|hardswish|"
           "batchnorm|maxpool|averagepool|globalaveragepool|softmax|reshape|flatten|transpose|"
           "concat|squeeze|unsqueeze|resize|quantizelinear|dequantizelinear|argmax|constant|"
           "identity|constantofshape|dropout|sum|lrn")
INCLUDE = rf"^test_({CLAIMED})(_.*)?_cpu$"
# Variants not implemented, with the reason; the support query refuses each of them.
EXCLUDED = {
    r"_expanded|_ver\d+": "function expansions and old-opset copies of the same tests",
    r"^test_batchnorm_.*training_mode": "BatchNormalization training mode (inference only)",
    r"^test_maxpool_with_argmax": "MaxPool Indices output",
    r"^test_resize_.*(cubic|antialias)": "Resize cubic / antialias (nearest, linear only)",
    r"^test_(de)?quantizelinear_(e4m3fn|e5m2|float4e2m1|u?int4|u?int2|blocked)":
        "float8 / float4 / 4-bit / 2-bit / blocked quantisation (8- and 16-bit only)",
    r"^test_identity_(sequence|opt)": "sequence and optional types (tensors only)",
    r"^test_constant_pad": "Pad is not a claimed op (the pattern only matches 'constant')",
    r"^test_training_dropout": "Dropout training mode (inference only)",
}

_platform: dict = {}


def _client():
    return _platform["plat"].client


def _build(backend, prefix: str) -> dict:
    bt = onnx.backend.test.BackendTest(backend, __name__)
    bt.include(INCLUDE)
    for pattern in EXCLUDED:
        bt.exclude(pattern)
    cases = {f"{prefix}{name}": case for name, case in bt.test_cases.items()
             if "NodeModel" in name}
    # Drop what the patterns skip instead of collecting thousands of skipped tests.
    keep, drop = re.compile(INCLUDE), re.compile("|".join(EXCLUDED))
    for case in cases.values():
        for attr in [a for a in vars(case) if a.startswith("test_")]:
            if not keep.search(attr) or drop.search(attr):
                delattr(case, attr)
    return cases


globals().update(_build(hp_backend, "Reference"))
class _SkipUnsupported(DelegateBackend):
    """A model no accelerator takes whole is skipped as unsupported, with the reason."""

    def prepare(self, model, device="CPU", **kwargs):
        try:
            return super().prepare(model, device, **kwargs)
        except hetproc.UnsupportedOp as exc:
            raise unittest.SkipTest(f"unsupported on every accelerator: {exc.message}") from None


_DELEGATED = _SkipUnsupported(_client)
globals().update(_build(_DELEGATED, "Delegated"))


@pytest.fixture(scope="module", autouse=True)
def _shared_platform():
    """One real platform for the delegated cases (started once: they are many)."""
    with hetproc.Platform(time_scale=0.01) as plat:
        _platform["plat"] = plat
        yield
        _DELEGATED.close()
        _platform.clear()


def _excluded_cases():
    cases = onnx.backend.test.loader.load_model_tests(kind="node")
    pick = re.compile(INCLUDE.replace("_cpu$", "$"))
    skip = re.compile("|".join(p for p in EXCLUDED if not p.startswith(("_exp", "^test_constant"))))
    return [c for c in cases if pick.match(c.name) and skip.search(c.name)]


def test_excluded_variants_are_refused():
    """Every excluded variant is refused by the support query on every device, the CPU
    included: it never runs with a wrong answer."""
    from hetproc.delegate import Options, plan
    cases = _excluded_cases()
    assert len(cases) >= 25
    for case in cases:
        with pytest.raises(hetproc.InvalidRequest):
            plan(case.model, None, Options())


def test_claimed_ops_are_all_exercised():
    names = [n for n in globals() if n.startswith("ReferenceOnnxBackendNodeModelTest")]
    assert names, "the reference suite was not generated"
    case = globals()[names[0]]
    tests = [t for t in dir(case) if t.startswith("test_")]
    for op in CLAIMED.split("|"):
        assert any(t.startswith(f"test_{op}") for t in tests), op


def test_onnx_runner_alone_skips_every_variant_hetproc_does_not_claim():
    """The way a backend's author runs ONNX's suite: ``BackendTest`` on the backend, no
    exclusion list. Every variant the backend does not implement (functions expanded into
    ops it lacks, int4 / float8, optional and sequence values, BatchNormalization's
    training mode) is refused by ``prepare`` before it runs, as the runner's skip; the
    rest pass. Was: 53 failures, one of them a KeyError."""
    ops = "relu|softmax|clip|batchnorm|quantizelinear|dequantizelinear|identity|hardsigmoid"
    bt = onnx.backend.test.BackendTest(hp_backend, __name__ + "_runner")
    bt.include(rf"^test_({ops})(_.*)?_cpu$")
    suite = unittest.TestSuite()
    for name, case in bt.test_cases.items():
        if "NodeModel" in name:
            suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    with open(os.devnull, "w") as quiet:
        result = unittest.TextTestRunner(stream=quiet, verbosity=0).run(suite)
    assert [t.id() for t, _ in result.failures + result.errors] == []
    skipped = {t.id().rsplit(".", 1)[-1]: why for t, why in result.skipped
               if why != "no matched include pattern"}
    ran = result.testsRun - len(result.skipped)
    assert ran >= 30, ran  # the supported variants did run
    assert "training mode" in skipped["test_batchnorm_epsilon_training_mode_cpu"]
    assert "ReduceMax" in skipped["test_softmax_axis_0_expanded_cpu"]
    assert "int4" in skipped["test_quantizelinear_int4_cpu"]
    assert "float8" in skipped["test_dequantizelinear_e4m3fn_cpu"]
    assert "not a tensor" in skipped["test_identity_sequence_cpu"]
    assert "not a tensor" in skipped["test_identity_opt_cpu"]
    with pytest.raises(hetproc.UnsupportedOp):  # to the API, the same refusal is an error
        hp_backend.prepare(_model_of("test_batchnorm_epsilon_training_mode"))


def _model_of(name: str):
    (case,) = [c for c in onnx.backend.test.loader.load_model_tests(kind="node")
               if c.name == name]
    return case.model

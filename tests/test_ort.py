"""``hetproc.ort``: code written for ONNX Runtime, run unchanged against the real
onnxruntime and against hetproc (real topologies, IO binding, messages), and the parts
only hetproc can drill (strict fallback, provider priority, device resets as ORT's codes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

import hetproc
import hetproc.ort as hort
from hetproc.delegate import light_model_path, mobilenet_like

SPREAD = {"weigh_costs": "0", "min_nodes_per_partition": "1"}  # every supported node offloads
TOPOLOGIES = (["squeezenet", "shufflenet", "bvlc_alexnet", "densenet121", "inception_v1",
               "inception_v2", "resnet50", "vgg19", "zfnet512"]
              if os.environ.get("HETPROC_ORT_ALL_TOPOLOGIES") == "1"
              else ["squeezenet", "shufflenet", "inception_v1"])


@pytest.fixture(scope="module", autouse=True)
def ort_platform():
    """One real platform for the module: sessions that name none run on it."""
    with hetproc.Platform(time_scale=1.0) as plat:
        hort.use_platform(plat)
        try:
            yield plat
        finally:
            hort.shutdown()
            hort.use_platform(None)


@pytest.fixture(autouse=True)
def _sessions_closed():
    yield
    hort.shutdown()  # every session a test left open: contexts, assets, clients


def _x(shape=(1, 3, 32, 32), seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- the same application code on both ----------------------------------------------------


def application(ort, model_path):
    """Written for onnxruntime; nothing in it knows hetproc."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model_path, so, providers=ort.get_available_providers())
    feeds = {}
    for i, arg in enumerate(sess.get_inputs()):
        assert arg.type == "tensor(float)"
        shape = [d if isinstance(d, int) else 1 for d in arg.shape]
        feeds[arg.name] = np.random.default_rng(i + 7).random(shape, np.float32)
    names = [o.name for o in sess.get_outputs()]
    plain = sess.run(None, feeds)
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    for name in names:
        binding.bind_output(name)
    binding.synchronize_inputs()
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    bound = binding.copy_outputs_to_cpu()
    meta = sess.get_modelmeta()
    return {"names": names, "plain": plain, "bound": bound, "graph_name": meta.graph_name,
            "inputs": [str(a) for a in sess.get_inputs()],
            "outputs": [str(a) for a in sess.get_outputs()]}


@pytest.mark.parametrize("name", ["mobilenet_like"] + TOPOLOGIES)
def test_the_same_application_code_gives_onnxruntimes_outputs(name, tmp_path):
    """The light topologies onnx ships have constant weights (their outputs are nearly
    uniform); mobilenet_like has seeded random weights, so its numerics mean something."""
    if name == "mobilenet_like":
        path = str(tmp_path / "m.onnx")
        onnx.save(mobilenet_like(), path)
    else:
        path = light_model_path(name)
        if path is None:
            pytest.skip(f"onnx ships no light_{name}.onnx here")
        path = _with_logits(path, str(tmp_path / f"{name}.onnx"))
    want = application(onnxruntime, path)
    got = application(hort, path)
    assert got["names"] == want["names"] and got["graph_name"] == want["graph_name"]
    assert got["inputs"] == want["inputs"] and got["outputs"] == want["outputs"]
    for kind in ("plain", "bound"):
        for name_, a, b, logits in zip(got["names"], got[kind], want[kind],
                                       _logits_of(got["names"], want[kind])):
            assert a.dtype == b.dtype and a.shape == b.shape
            if logits is not None and np.abs(logits).max() > 1e6:
                # Softmax of equal logits near 1e10: one float32 ulp of difference in
                # the logits (summation order) moves the whole output. The logits are
                # compared instead (an output of their own), and this one must still
                # be a distribution.
                np.testing.assert_allclose(a.reshape(a.shape[0], -1).sum(1), 1, rtol=1e-5)
                continue
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name_)


def _with_logits(path, out):
    """The model with its final Softmax's input as one more graph output."""
    m = onnx.load(path)
    last = m.graph.node[-1]
    if last.op_type == "Softmax":
        logits = onnx.ValueInfoProto()
        logits.CopyFrom(m.graph.output[0])  # a softmax keeps its input's shape
        logits.name = last.input[0]
        m.graph.output.append(logits)
    onnx.save(m, out)
    return out


def _logits_of(names, outputs):
    """Per output: the logits it is the softmax of (the extra output), else None."""
    if len(outputs) == 2 and len(names) == 2:
        return [outputs[1], None]
    return [None] * len(outputs)


def test_the_session_really_ran_on_the_accelerators():
    path = light_model_path("squeezenet")
    if path is None:
        pytest.skip("onnx ships no light models here")
    so = hort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    sess = hort.InferenceSession(path, so, providers=hort.get_available_providers())
    eps = {sub.ep_name for sub in sess.get_provider_graph_assignment_info()}
    assert "HetprocNpuExecutionProvider" in eps
    nodes = sum(len(sub.get_nodes()) for sub in sess.get_provider_graph_assignment_info())
    assert nodes == len(sess._live_model().placement.graph.nodes)


def test_a_dropped_session_gives_back_its_client_contexts_and_buffers(ort_platform):
    import gc
    owner = ort_platform.client
    before = {k: owner.metrics()[k] for k in ("clients", "contexts", "registered_buffers")}
    sess = hort.InferenceSession(mobilenet_like().SerializeToString(),
                                 providers=[("HetprocNpuExecutionProvider", SPREAD)])
    sess.run(None, {"x": _x()})
    during = owner.metrics()
    assert during["clients"] == before["clients"] + 1 and during["contexts"] > before["contexts"]
    del sess  # as an ORT application drops a session: no close() call
    gc.collect()
    after = {k: owner.metrics()[k] for k in ("clients", "contexts", "registered_buffers")}
    assert after == before


def test_metadata_providers_and_options_read_as_onnxruntime_writes_them():
    model = mobilenet_like().SerializeToString()
    ref = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    sess = hort.InferenceSession(model, providers=[
        ("HetprocNpuExecutionProvider", {"device": "npu0"}), "CPUExecutionProvider"])
    assert [str(a) for a in sess.get_inputs()] == [str(a) for a in ref.get_inputs()]
    assert [str(a) for a in sess.get_outputs()] == [str(a) for a in ref.get_outputs()]
    assert sess.get_overridable_initializers() == [] == ref.get_overridable_initializers()
    for field in ("graph_name", "producer_name", "domain", "description", "custom_metadata_map",
                  "version", "graph_description"):
        assert getattr(sess.get_modelmeta(), field) == getattr(ref.get_modelmeta(), field)
    assert sess.get_providers() == ["HetprocNpuExecutionProvider", "CPUExecutionProvider"]
    assert sess.get_provider_options() == {"HetprocNpuExecutionProvider": {"device": "npu0"},
                                           "CPUExecutionProvider": {}}
    assert sess.get_session_options().graph_optimization_level == \
        hort.GraphOptimizationLevel.ORT_ENABLE_ALL
    with pytest.raises(hort.InvalidArgument, match="not a npu"):
        hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider",
                                                 {"device": "gpu0"})])


def test_symbolic_input_dims_compile_one_bucket_per_shape_met():
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Mul", ["r", "r"], ["y"])], "dyn",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    ref = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    sess = hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)])
    assert str(sess.get_inputs()[0]) == str(ref.get_inputs()[0])  # shape=['N', 8]
    for n in (1, 3, 5, 3):
        x = _x((n, 8), seed=n)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   rtol=1e-6)
        assert sess._last_model().placement.partitions[0].device == "npu0"
    assert len(sess._h.buckets) == 2  # 3 and 5; 1 is the model compiled at creation
    with pytest.raises(hort.InvalidArgument, match="index: 1 Got: 7 Expected: 8"):
        sess.run(None, {"x": _x((2, 7))})


def test_wrong_feeds_fail_with_onnxruntimes_class_and_message():
    model = mobilenet_like().SerializeToString()
    ref = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    sess = hort.InferenceSession(model, providers=["HetprocNpuExecutionProvider"])
    x = _x()
    bad = [{"y": x}, {"x": x, "y": x}, {"x": x.astype(np.float64)},
           {"x": _x((1, 3, 31, 32))}, {"x": _x((3, 32, 32))}, {"x": [1.0, 2.0]}]
    for feeds in bad:
        with pytest.raises(Exception) as theirs:
            ref.run(None, feeds)
        with pytest.raises(Exception) as ours:
            sess.run(None, feeds)
        assert type(ours.value).__name__ == type(theirs.value).__name__, feeds
        assert str(ours.value) == str(theirs.value)
    for call in (lambda s: s.run(["nope"], {"x": x}),):
        with pytest.raises(Exception) as theirs:
            call(ref)
        with pytest.raises(hort.InvalidArgument) as ours:
            call(sess)
        assert str(ours.value) == str(theirs.value)
    # A run the application terminates: ORT's FAIL and message.
    ro, ro_ref = hort.RunOptions(), onnxruntime.RunOptions()
    ro.terminate = ro_ref.terminate = True
    with pytest.raises(Exception) as theirs:
        ref.run(None, {"x": x}, ro_ref)
    with pytest.raises(hort.Fail) as ours:
        sess.run(None, {"x": x}, ro)
    assert str(ours.value) == str(theirs.value)
    # The session is not hurt by any of it.
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                               rtol=1e-4, atol=1e-7)


def test_model_files_fail_with_onnxruntimes_codes(tmp_path):
    missing = str(tmp_path / "missing.onnx")
    for src, cls in ((missing, "NoSuchFile"), (b"\x00garbage\xff" * 9, "InvalidProtobuf")):
        with pytest.raises(Exception) as theirs:
            onnxruntime.InferenceSession(src, providers=["CPUExecutionProvider"])
        with pytest.raises(getattr(hort, cls)) as ours:
            hort.InferenceSession(src)
        assert type(theirs.value).__name__ == cls
        assert str(ours.value) == str(theirs.value)
    from onnx import TensorProto, helper
    bad = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["y"])], "g",
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(bad)  # reads a value nothing produces: the checker refuses it
    with pytest.raises(hort.InvalidGraph) as ours:
        hort.InferenceSession(m.SerializeToString())
    assert ours.value.code == 10 and isinstance(ours.value.__cause__, hetproc.InvalidRequest)


def test_provider_order_is_the_priority():
    model = mobilenet_like().SerializeToString()
    so = hort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")

    def owners(first, second):
        s = hort.InferenceSession(model, so, providers=[(first, SPREAD), second])
        got = {n.name: sub.ep_name for sub in s.get_provider_graph_assignment_info()
               for n in sub.get_nodes()}
        out = s.run(None, {"x": _x()})
        s.close()
        return got, out

    npu_first, a = owners("HetprocNpuExecutionProvider", "HetprocGpuExecutionProvider")
    gpu_first, b = owners("HetprocGpuExecutionProvider", "HetprocNpuExecutionProvider")
    # Conv is taken by both: the first listed gets it. Softmax only by the GPU.
    assert npu_first["stem"] == "HetprocNpuExecutionProvider"
    assert gpu_first["stem"] == "HetprocGpuExecutionProvider"
    assert npu_first["prob"] == gpu_first["prob"] == "HetprocGpuExecutionProvider"
    assert npu_first["label"] == "CPUExecutionProvider"  # ArgMax: no accelerator takes it
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)


def test_disable_cpu_ep_fallback_refuses_at_creation():
    model = mobilenet_like().SerializeToString()
    so = hort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(hort.Fail, match=r"fallback to CPU EP has been explicitly disabled.*"
                                        r"ArgMax") as exc:
        hort.InferenceSession(model, so, providers=["HetprocNpuExecutionProvider",
                                                    "HetprocGpuExecutionProvider"])
    assert isinstance(exc.value.__cause__, hetproc.UnsupportedOp)
    # The CPU named explicitly beside it: ORT's conflict, word for word.
    ref_so = onnxruntime.SessionOptions()
    ref_so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(Exception) as theirs:
        onnxruntime.InferenceSession(model, ref_so, providers=["CPUExecutionProvider"])
    with pytest.raises(hort.InvalidArgument) as ours:
        hort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    assert str(ours.value) == str(theirs.value)
    # A model the accelerator takes whole is accepted, and nothing is left to the CPU.
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Mul", ["r", "r"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    s = hort.InferenceSession(helper.make_model(g).SerializeToString(), so,
                              providers=["HetprocNpuExecutionProvider"])
    assert s.get_providers() == ["HetprocNpuExecutionProvider"]
    assert {sub.ep_name for sub in s.get_provider_graph_assignment_info()} == \
        {"HetprocNpuExecutionProvider"}
    x = _x((1, 8))
    np.testing.assert_allclose(s.run(None, {"x": x})[0], np.maximum(x, 0) ** 2, rtol=1e-6)


def test_a_node_without_any_kernel_fails_at_creation_naming_node_and_op():
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="first"),
                           helper.make_node("Erf", ["r"], ["y"], name="the_erf")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(hort.NotImplemented, match=r"Could not find an implementation for "
                                                  r"Erf\(13\) node with name 'the_erf'") as exc:
        hort.InferenceSession(model.SerializeToString())
    assert exc.value.code == 9 and isinstance(exc.value.__cause__, hetproc.UnsupportedOp)


def test_profiling_writes_a_perfetto_valid_trace_with_the_run_tags(tmp_path):
    so = hort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = hort.InferenceSession(mobilenet_like().SerializeToString(), so,
                                 providers=[("HetprocNpuExecutionProvider", SPREAD)])
    ro = hort.RunOptions()
    ro.logid = "frame-17"
    sess.run(None, {"x": _x()}, ro)
    path = sess.end_profiling()
    assert path.startswith(str(tmp_path / "prof_")) and path.endswith(".json")
    with open(path) as fh:
        doc = json.load(fh)
    assert hetproc.trace.validate(doc) == []
    assert any(e.get("name") == "EXEC" for e in doc["traceEvents"])
    assert [r["tag"] for r in doc["otherData"]["ort_runs"]] == ["frame-17"]
    assert sess.get_profiling_start_time_ns() <= doc["otherData"]["ort_runs"][0]["start_ns"]


def test_run_async_calls_back_with_results_or_the_error():
    import threading
    sess = hort.InferenceSession(mobilenet_like().SerializeToString(),
                                 providers=[("HetprocNpuExecutionProvider", SPREAD)])
    want = sess.run(["prob"], {"x": _x()})[0]
    done = threading.Event()
    seen = {}

    def callback(results, user_data, err):
        seen.update(results=results, user_data=user_data, err=err)
        done.set()

    sess.run_async(["prob"], {"x": _x()}, callback, "ud")
    assert done.wait(30)
    assert seen["err"] == "" and seen["user_data"] == "ud"
    np.testing.assert_array_equal(seen["results"][0], want)


# -- ORT's error codes: what an application sees of hetproc's drills ------------------------


@contextlib.contextmanager
def _ort_on(plat: hetproc.Platform):
    """``plat`` as the platform ORT sessions run on, for the ``with`` block."""
    with plat:
        before = hort.use_platform(plat)
        try:
            yield plat
        finally:
            hort.shutdown()
            hort.use_platform(before)


@pytest.fixture
def own_platform():
    """A platform of the test's own: a drill restarts devices (new processes of it)."""
    with _ort_on(hetproc.Platform(time_scale=1.0)) as plat:
        yield plat


def test_a_device_crash_mid_run_is_device_reset_and_a_new_session_recovers(own_platform):
    model = mobilenet_like().SerializeToString()
    x = _x()
    ref = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    want = ref.run(None, {"x": x})
    crashing = hort.InferenceSession(model, providers=[
        ("HetprocNpuExecutionProvider", {**SPREAD, "fault": "crash"})])
    with pytest.raises(hort.DeviceReset) as exc:
        crashing.run(None, {"x": x})
    assert exc.value.code == 15 and ": DEVICE_RESET : " in str(exc.value)
    cause = exc.value.__cause__
    assert isinstance(cause, (hetproc.DeviceCrashed, hetproc.ContextLost)), cause
    assert cause.scope in ("device", "context")
    # The session's contexts died with the device: it keeps failing, as ORT's would...
    with pytest.raises((hort.DeviceReset, hort.RuntimeException)):
        crashing.run(None, {"x": x})
    crashing.close()
    # ...and recreating it recovers, on the restarted device, with the right answer.
    again = hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)])
    got = again.run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-7)
    assert "npu0" in {p.device for p in again._live_model().placement.partitions}


def test_every_hetproc_error_has_its_ort_code_and_stays_the_cause():
    """The table in hetproc.ort._errors, class by class (a hang caught by the watchdog
    is a DeviceTimeout: the device was stopped under the run, so DEVICE_RESET)."""
    table = {hetproc.DeviceCrashed: "DEVICE_RESET", hetproc.ContextLost: "DEVICE_RESET",
             hetproc.DeviceTimeout: "DEVICE_RESET", hetproc.CancelledByReset: "ENGINE_ERROR",
             hetproc.CompileTimeout: "EP_FAIL", hetproc.UnsupportedOp: "NOT_IMPLEMENTED",
             hetproc.ShapeError: "INVALID_ARGUMENT", hetproc.DtypeError: "INVALID_ARGUMENT",
             hetproc.InvalidRequest: "INVALID_ARGUMENT", hetproc.WrongOutput: "RUNTIME_EXCEPTION",
             hetproc.DependencyFailed: "RUNTIME_EXCEPTION", hetproc.SupervisorLost:
             "RUNTIME_EXCEPTION", hetproc.OutOfMemory: "FAIL", hetproc.FenceTimeout: "FAIL",
             hetproc.Cancelled: "FAIL"}
    from hetproc.ort._errors import translate
    for cls, code in table.items():
        err = cls("boom")
        out = translate(err)
        assert out.code_name == code, cls
        assert out.__cause__ is err and isinstance(out, hort.OrtError)
        assert str(out) == f"[ONNXRuntimeError] : {out.code} : {code} : {cls.__name__}: boom"


def test_a_partition_that_fails_to_compile_is_ep_fail():
    model = mobilenet_like().SerializeToString()
    with pytest.raises(hort.EPFail, match=r"HetprocNpuExecutionProvider: partition \d+ .*"
                                          r"npu0") as exc:
        hort.InferenceSession(model, providers=[
            ("HetprocNpuExecutionProvider", {**SPREAD, "fault": "compile_timeout"})])
    assert exc.value.code == 11
    assert isinstance(exc.value.__cause__, hetproc.CompileTimeout) or exc.value.__cause__ is None
    # Without the fault, the same session compiles.
    hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)]).close()


@pytest.mark.parametrize("fault, cause", [("alloc_fail", "AllocationFailed"),
                                          ("map_fail", "MapFailed")])
def test_platform_faults_at_creation_are_fail_with_the_cause(fault, cause):
    model = mobilenet_like().SerializeToString()
    with pytest.raises(hort.Fail) as exc:
        hort.InferenceSession(model, providers=[
            ("HetprocNpuExecutionProvider", {**SPREAD, "fault": fault})])
    assert type(exc.value.__cause__).__name__ == cause and exc.value.code == 1
    hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)]).close()


def test_a_lost_supervisor_is_runtime_exception(own_platform):
    sess = hort.InferenceSession(mobilenet_like().SerializeToString(),
                                 providers=[("HetprocNpuExecutionProvider", SPREAD)])
    own_platform.kill_supervisor()
    with pytest.raises(hort.RuntimeException) as exc:
        sess.run(None, {"x": _x()})
    assert isinstance(exc.value.__cause__, hetproc.PlatformError)


@pytest.fixture
def eager_platform():
    """``own_platform`` with npu0 committing its scheduling decisions 10 s ahead: the
    command queued behind a long one is in the device's ring at once (with the default
    lead it waits in the supervisor until just before it runs, out of a reset's reach)."""
    spec = hetproc.load_platform()
    devices = tuple(dataclasses.replace(d, scheduler=dataclasses.replace(
        d.scheduler, commit_lead_ms=10_000.0)) if d.name == "npu0" else d
        for d in spec.devices)
    with _ort_on(hetproc.Platform(spec=dataclasses.replace(spec, devices=devices),
                                  time_scale=1.0)) as plat:
        yield plat


def test_work_cancelled_by_another_clients_reset_is_engine_error(eager_platform):
    """Another application's long command holds the NPU; ours is on the NPU's ring behind
    it; the NPU dies under theirs: theirs is DeviceCrashed, ours was only caught in the
    reset."""
    import signal
    import threading

    from tests.helpers import wait_for
    own_platform = eager_platform
    model = mobilenet_like().SerializeToString()
    s = hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)])
    s.run(None, {"x": _x()})  # warm: the next run's first command goes straight to npu0
    other = own_platform.connect("camera")
    try:
        ctx = other.context("npu0")
        theirs = ctx.submit_nowait("work", ms=3000)  # still running when the NPU dies
        owner = own_platform.client
        assert wait_for(lambda: owner.metrics()["devices"]["npu0"]["state"] == "busy", 5)
        done, seen = threading.Event(), {}
        s.run_async(None, {"x": _x()}, lambda r, u, err: (seen.update(err=err), done.set()), None)
        def npu():
            return owner.metrics()["devices"]["npu0"]
        assert wait_for(lambda: npu()["queue_depth"] + npu()["in_flight"] >= 2, 10)
        assert not theirs.done()
        os.kill(owner.metrics()["devices"]["npu0"]["pid"], signal.SIGKILL)
        with pytest.raises(hetproc.DeviceCrashed):
            theirs.wait(10)
        assert done.wait(30)
        assert ": ENGINE_ERROR : CancelledByReset" in seen["err"], seen["err"]
    finally:
        other.close()
    s.close()
    again = hort.InferenceSession(model, providers=[("HetprocNpuExecutionProvider", SPREAD)])
    assert again.run(["prob"], {"x": _x()})[0].shape == (1, 10)


# -- IO binding and OrtValue -----------------------------------------------------------------


def io_binding_application(ort, model_bytes, x):
    """ORT code with OrtValues and preallocated outputs; nothing hetproc in it."""
    sess = ort.InferenceSession(model_bytes, providers=ort.get_available_providers())
    value = ort.OrtValue.ortvalue_from_numpy(x)
    prob = ort.OrtValue.ortvalue_from_shape_and_type([1, 10], np.float32)
    label_mem = np.zeros(1, np.int64)
    binding = sess.io_binding()
    again = sess.run_with_ort_values(["prob"], {"x": value})[0].numpy()
    binding.bind_ortvalue_input("x", value)
    binding.bind_ortvalue_output("prob", prob)
    binding.bind_output("label", "cpu", 0, np.int64, [1], label_mem.ctypes.data)
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    outs = binding.get_outputs()
    return (value.data_type(), value.shape(), prob.numpy().copy(), label_mem.copy(),
            [o.shape() for o in outs], again)


def test_io_binding_code_gives_onnxruntimes_results():
    model, x = mobilenet_like().SerializeToString(), _x()
    want = io_binding_application(onnxruntime, model, x)
    got = io_binding_application(hort, model, x)
    assert got[0] == want[0] == "tensor(float)" and got[1] == want[1]
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-7)
    assert got[3].tolist() == want[3].tolist() and got[4] == want[4]
    np.testing.assert_allclose(got[5], want[5], rtol=1e-4, atol=1e-7)


def test_orts_error_module_path_is_there_too():
    from onnxruntime.capi import onnxruntime_pybind11_state as theirs

    from hetproc.ort.capi.onnxruntime_pybind11_state import DeviceReset, InvalidArgument
    assert DeviceReset is hort.DeviceReset and InvalidArgument is hort.InvalidArgument
    from hetproc.ort.capi import onnxruntime_pybind11_state as ours
    assert set(ours.__all__) <= set(dir(theirs))


def test_device_values_are_shared_memory_and_bound_outputs_are_read_in_place():
    sess = hort.InferenceSession(mobilenet_like().SerializeToString(),
                                 providers=[("HetprocNpuExecutionProvider", SPREAD)])
    x = _x()
    value = hort.OrtValue.ortvalue_from_numpy(x, "npu")
    assert value.device_name() == "npu" and isinstance(value.buffer, hetproc.Buffer)
    assert value.data_ptr() == value.buffer.array().ctypes.data  # the value IS the buffer
    np.testing.assert_array_equal(value.numpy(), x)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_output("prob", "npu")  # no buffer given: the partition's own, in place
    sess.run_with_iobinding(binding)
    first = binding.get_outputs()[0]
    in_place = sess._live_model().output_view("prob")
    assert first.data_ptr() == in_place.ctypes.data and first.device_name() == "npu"
    want = sess.run(["prob"], {"x": x})[0]
    np.testing.assert_array_equal(first.numpy(), want)
    # A new input written into the same OrtValue: same output memory, new contents.
    value.update_inplace(x * 3)
    sess.run_with_iobinding(binding)
    second = binding.get_outputs()[0]
    assert second.data_ptr() == first.data_ptr()
    np.testing.assert_array_equal(second.numpy(), sess.run(["prob"], {"x": x * 3})[0])
    assert not np.array_equal(second.numpy(), want)
    with pytest.raises(hort.InvalidArgument, match="does not match"):
        value.update_inplace(np.zeros((2, 2), np.float32))
    with pytest.raises(hort.InvalidArgument, match="device type"):
        hort.OrtValue.ortvalue_from_shape_and_type([2], np.float32, "cuda")


# -- crash-isolated validation ---------------------------------------------------------------


def _quantize_model():
    """One QuantizeLinear: uint8 outputs, so a flipped bit on the device is a wrong value."""
    from onnx import TensorProto, helper
    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, [1, 16])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
         helper.make_tensor("z", TensorProto.UINT8, [], [10])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_validate_tells_apart_pass_wrong_output_crash_and_bail_out():
    npu = "HetprocNpuExecutionProvider"
    table_in = [(npu, {**SPREAD, "fault": "wrong_output"}),  # the device flips bits
                (npu, {**SPREAD, "fault": "abort"}),         # the application process dies
                (npu, {**SPREAD, "fault": "exit0"}),         # it exits 0 mid-run
                (npu, SPREAD)]
    best, table = hort.validate(_quantize_model(), table_in, timeout=90, jobs=2)
    assert [r.verdict for r in table] == ["wrong output", "crash", "bail-out", "passed"], table
    assert table[0].max_abs_diff >= 1 and "CPU reference" in table[0].detail
    assert table[1].exit_status == -6 and "signal 6" in table[1].detail  # SIGABRT
    assert table[2].exit_status == 0 and table[3].exit_status == 0
    assert table[3].max_abs_diff == 0 and table[3].modeled_us > 0
    assert best == npu and table[3].options == SPREAD


def test_validate_kills_a_stalled_run_at_its_deadline_and_leaves_nothing():
    best, table = hort.validate(mobilenet_like(), [("HetprocNpuExecutionProvider",
                                                    {"fault": "stall"})], timeout=5)
    assert best is None and table[0].verdict == "timeout" and table[0].exit_status is None
    assert table[0].seconds < 30
    from hetproc.drills import leftovers
    if table[0].platform:  # killed after its platform started: nothing of it remains
        assert not leftovers(table[0].platform)["objects"]


# -- EP context models -------------------------------------------------------------------------

EPS = [("HetprocNpuExecutionProvider", SPREAD), ("HetprocGpuExecutionProvider", SPREAD)]
V = hort.OrtCompiledModelCompatibility


def _compile_context(tmp_path, embed="1", providers=EPS):
    src = tmp_path / "m.onnx"
    onnx.save(mobilenet_like(), src)
    so = hort.SessionOptions()
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_embed_mode", embed)
    sess = hort.InferenceSession(str(src), so, providers=providers)
    want = sess.run(None, {"x": _x()})
    sess.close()
    return tmp_path / "m_ctx.onnx", want


@pytest.mark.parametrize("embed", ["1", "0"])
def test_ep_context_model_round_trip_loads_without_compiling(tmp_path, embed):
    ctx_path, want = _compile_context(tmp_path, embed)
    proto = onnx.load(str(ctx_path))
    ctx_nodes = [n for n in proto.graph.node if n.op_type == "EPContext"]
    assert ctx_nodes and all(n.domain == "com.microsoft" for n in ctx_nodes)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ctx_nodes[0].attribute}
    assert attrs["main_context"] == 1 and attrs["embed_mode"] == int(embed)
    assert attrs["source"] == b"HetprocNpuExecutionProvider"
    assert attrs["hardware_architecture"] == b"npu"
    # Nodes no accelerator took stay ordinary nodes (ArgMax: only the CPU has it).
    assert "ArgMax" in {n.op_type for n in proto.graph.node}
    if embed == "0":
        assert (tmp_path / attrs["ep_cache_context"].decode()).is_file()
    sess = hort.InferenceSession(str(ctx_path), providers=EPS)
    model = sess._live_model()
    delegated = [i for i, p in enumerate(model.placement.partitions) if p.device != "cpu0"]
    assert [model.load_info["cache"][i] for i in delegated] == ["hit"] * len(delegated)
    status = sess.get_ep_context_status()
    assert set(status["verdicts"].values()) == {V.EP_SUPPORTED_OPTIMAL}
    assert status["using"] == "stored" and set(status["partitions"].values()) == {"stored"}
    got = sess.run(None, {"x": _x()})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert [str(a) for a in sess.get_inputs()] == ["NodeArg(name='x', type='tensor(float)', "
                                                   "shape=[1, 3, 32, 32])"]


def test_model_compiler_writes_the_context_model_ahead_of_time(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(mobilenet_like(), src)
    so = hort.SessionOptions()
    for name, opts in EPS:
        so.add_provider(name, opts)
    hort.ModelCompiler(so, str(src), embed_compiled_data_into_model=True).compile_to_file(
        str(tmp_path / "compiled.onnx"))
    assert not so._config  # the caller's options are not changed
    data = hort.ModelCompiler(so, src.read_bytes()).compile_to_bytes()
    for model in (str(tmp_path / "compiled.onnx"), data):
        sess = hort.InferenceSession(model, so)  # providers from the options
        assert sess.get_providers() == [n for n, _ in EPS] + ["CPUExecutionProvider"]
        assert set(sess.get_ep_context_status()["verdicts"].values()) == {V.EP_SUPPORTED_OPTIMAL}
        assert "hit" in sess._live_model().load_info["cache"]
        sess.close()


def test_ep_context_verdict_not_applicable_when_its_provider_is_not_listed(tmp_path):
    ctx_path, want = _compile_context(tmp_path)
    sess = hort.InferenceSession(str(ctx_path), providers=[EPS[1]])  # the GPU alone
    status = sess.get_ep_context_status()
    npu_nodes = [k for k in status["verdicts"] if k.startswith("HetprocNpu")]
    assert npu_nodes and all(status["verdicts"][k] == V.EP_NOT_APPLICABLE for k in npu_nodes)
    np.testing.assert_allclose(sess.run(None, {"x": _x()})[0], want[0], rtol=1e-5)


def test_ep_context_prefer_recompilation_runs_then_recompiles_beside_it(tmp_path):
    ctx_path, want = _compile_context(tmp_path)
    from hetproc.platforms import __file__ as platforms_init
    default = (os.path.dirname(platforms_init) + "/default.toml")
    text = open(default).read()
    old = 'name = "npu0"\nkind = "npu"'
    assert old in text and "sram_kib = 4096" in text
    head, tail = text.split(old, 1)
    newer = tmp_path / "newer_firmware.toml"  # the npu's entry changed: its firmware digest
    newer.write_text(head + old + tail.replace("sram_kib = 4096", "sram_kib = 2048", 1))
    eps = [(n, {**o, "platform_file": str(newer), "time_scale": "1.0"}) for n, o in EPS]
    sess = hort.InferenceSession(str(ctx_path), providers=eps)
    status = sess.get_ep_context_status()
    npu = [k for k in status["verdicts"] if k.startswith("HetprocNpu")]
    gpu = [k for k in status["verdicts"] if k.startswith("HetprocGpu")]
    assert all(status["verdicts"][k] == V.EP_SUPPORTED_PREFER_RECOMPILATION for k in npu)
    assert "firmware" in status["reasons"][npu[0]]
    assert all(status["verdicts"][k] == V.EP_SUPPORTED_OPTIMAL for k in gpu)
    np.testing.assert_array_equal(sess.run(None, {"x": _x()})[0], want[0])  # runs at once
    assert sess.wait_for_recompilation(60)
    assert sess.get_ep_context_status()["using"] == "recompiled"
    assert "hit" not in sess._live_model().load_info["cache"]  # the rebuilt one compiled
    np.testing.assert_array_equal(sess.run(None, {"x": _x()})[0], want[0])


def test_ep_context_unsupported_and_tampered_models_are_refused(tmp_path):
    ctx_path, _ = _compile_context(tmp_path)
    data = ctx_path.read_bytes()
    older = tmp_path / "other_compiler.onnx"
    older.write_bytes(data.replace(b'"hetproc-graph-compiler/1"', b'"hetproc-graph-compiler/2"'))
    with pytest.raises(hort.EPFail, match=r"EP_UNSUPPORTED .*hetproc-graph-compiler/2"):
        hort.InferenceSession(str(older), providers=EPS)
    proto = onnx.load(str(ctx_path))
    node = next(n for n in proto.graph.node if n.op_type == "EPContext")
    attr = next(a for a in node.attribute if a.name == "ep_cache_context")
    attr.s = attr.s[:-1] + bytes([attr.s[-1] ^ 1])  # one bit of the compiled asset
    with pytest.raises(hort.InvalidGraph, match="corrupt"):
        hort.InferenceSession(proto.SerializeToString(), providers=EPS)
    for a in node.attribute:
        if a.name == "embed_mode":
            a.i = 0
    attr.s = b"../../etc/passwd"
    with pytest.raises(hort.InvalidGraph, match="not beside the model"):
        hort.InferenceSession(proto.SerializeToString(), providers=EPS)

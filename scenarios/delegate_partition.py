"""Delegates on a real topology (seed §2, §13): an ONNX model partitioned across the NPU,
GPU and CPU, compiled into cached assets, run one command per partition.

* placement: a real topology the ``onnx`` package ships (SqueezeNet; its constant fills
  replaced by seeded weights, ``with_seeded_weights``: constant weights blow its
  activations up to ~1e10, where rounding alone decides the softmax) with the default
  cost-weighed options, and a MobileNet-like network with seeded
  weights spread over every device that takes its ops (npu0, gpu0, dsp0, cpu0); the
  placement log and the TFLite-style summary lines go in the notes;
* asset cache: a cold load compiles every partition (its modeled compile time held on the
  device), a warm load finds every asset ("hit");
* numerics: the partitioned run matches the CPU reference (1e-5 relative) and, when
  installed, ONNX Runtime (float32 within 1e-4 relative);
* timeline: each device's busy time; one ``graph`` command per partition per run.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

import numpy as np

from hetproc.delegate import (
    AssetCache,
    DelegatedModel,
    Options,
    light_model_path,
    load_model,
    mobilenet_like,
    run_reference,
    with_seeded_weights,
)
from hetproc.drills import Option, Scenario

TOPOLOGIES = ("squeezenet", "shufflenet", "resnet50", "densenet121", "inception_v1",
              "inception_v2", "bvlc_alexnet", "vgg19", "zfnet512", "none")
OPTIONS = {
    "topology": Option("squeezenet", "the real topology onnx ships (light_<name>.onnx), or "
                       "none for the MobileNet-like case alone", choices=TOPOLOGIES),
    "cache_dir": Option("", "keep the compiled assets in this directory (default: a "
                        "temporary one, cold then warm)"),
}
QUICK = {"topology": "none"}

SPREAD = Options(min_nodes_per_partition=1, weigh_costs=False)


def _ort(model, feeds):
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    data = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _case(s: Scenario, label: str, model, options: Options, cache: AssetCache) -> None:
    graph = load_model(model)
    rng = np.random.default_rng(3)
    feeds = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in graph.inputs}
    c = s.client
    t0 = time.perf_counter()
    with DelegatedModel.load(c, graph, options=options, cache=cache) as cold:
        cold_ms = (time.perf_counter() - t0) * 1000
        cold_outcomes = list(cold.load_info["cache"])
        cold_compile = sum(cold.load_info["compile_ms"].values())
    t0 = time.perf_counter()
    with DelegatedModel.load(c, graph, options=options, cache=cache) as dm:
        warm_ms = (time.perf_counter() - t0) * 1000
        warm_compile = sum(dm.load_info["compile_ms"].values())
        pl = dm.placement
        for line in pl.summary:
            s.note(f"{label}: {line}")
        s.note(f"{label}: partitions " + ", ".join(
            f"{p.device}[#{p.nodes[0]}..#{p.nodes[-1]}]" for p in pl.partitions))
        submitted = c.metrics()["submitted"]
        out = dm.run(feeds)
        s.metric(f"{label}_commands_per_run", c.metrics()["submitted"] - submitted)
        s.metric(f"{label}_run_ms", dm.last_run["wall_s"] * 1000)
        s.metric(f"{label}_modeled_us", dm.last_run["modeled_us"])
        s.check(f"{label}: one command per partition",
                s.metrics[f"{label}_commands_per_run"] == len(pl.partitions))
        warm_outcomes = list(dm.load_info["cache"])
    s.metric(f"{label}_partitions", len(pl.partitions))
    s.metric(f"{label}_devices", sorted({p.device for p in pl.partitions}))
    s.metric(f"{label}_cold_load_ms", cold_ms)
    s.metric(f"{label}_warm_load_ms", warm_ms)
    s.metric(f"{label}_cold_modeled_compile_ms", cold_compile)
    s.metric(f"{label}_warm_modeled_load_ms", warm_compile)
    s.check(f"{label}: cold load compiles every asset", set(cold_outcomes) == {"compiled"},
            str(cold_outcomes))
    s.check(f"{label}: warm load hits every asset", set(warm_outcomes) == {"hit"},
            str(warm_outcomes))
    ref = run_reference(graph, feeds)
    for name, want in ref.items():
        # 1e-5: a partition's kernels may group a sum otherwise than the reference
        # (SqueezeNet's npu0 run differs by up to 1.3e-6 relative)
        s.check(f"{label}: {name} matches the CPU reference",
                bool(np.allclose(out[name], want, rtol=1e-5, atol=0)))
    theirs = _ort(model, feeds)
    if theirs is None:
        s.note("onnxruntime is not installed: no ONNX Runtime comparison")
        return
    for name, want in theirs.items():
        if want.dtype.kind == "f":
            err = float(np.max(np.abs(out[name] - want) / np.maximum(np.abs(want), 1e-30)))
            s.metric(f"{label}_{name}_max_rel_err_vs_ort", err)
        s.check(f"{label}: {name} matches ONNX Runtime",
                bool(np.allclose(out[name], want, rtol=1e-4, atol=1e-7)))


def run(s: Scenario) -> None:
    if importlib.util.find_spec("onnx") is None:
        s.note("skipped: ONNX models need the 'onnx' extra (pip install -e '.[onnx]')")
        return
    cache_dir = s.option("cache_dir")
    if cache_dir:
        _run(s, AssetCache(cache_dir))
        return
    with tempfile.TemporaryDirectory(prefix="hetproc-assets-") as tmp:  # cold, then warm
        _run(s, AssetCache(tmp))


def _run(s: Scenario, cache: AssetCache) -> None:
    before = {d: v["busy_ms"] for d, v in s.client.metrics()["devices"].items()}
    topology = s.option("topology")
    real = None if topology == "none" else light_model_path(topology)
    if real is None:
        s.note("onnx ships no light model here: the real-topology case is skipped")
    else:
        _case(s, "squeezenet", with_seeded_weights(real, seed=1), Options(), cache)
    _case(s, "mobilenet", mobilenet_like(), SPREAD, cache)
    after = s.client.metrics()["devices"]
    for d, v in after.items():
        s.metric(f"busy_ms_{d}", v["busy_ms"] - before.get(d, 0.0))
    used = [d for d in ("npu0", "gpu0", "cpu0") if s.metrics[f"busy_ms_{d}"] > 0]
    s.check("the NPU, the GPU and the CPU all ran partitions", len(used) == 3, str(used))

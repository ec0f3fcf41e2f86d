"""A subsystem restart: the NPU process dies, a new instance starts, and every handle bound
to the old one fails with DeviceRestarted; a delegated model recovers once, not twice."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import hetproc
from hetproc._config import parse_platform, to_raw


def restart_spec(**recovery):
    spec = hetproc.load_platform(None)
    return dataclasses.replace(spec, recovery={**spec.recovery, "subsystem_restart": ["npu0"],
                                               **recovery})


@pytest.fixture
def restarting():
    with hetproc.Platform(spec=restart_spec(), time_scale=1.0) as plat:
        yield plat


def test_every_handle_bound_to_the_old_instance_fails_with_device_restarted(restarting):
    c = restarting.client
    other = restarting.connect("other")
    mine, gpu = c.context("npu0"), c.context("gpu0")
    theirs = other.context("npu0")
    q = theirs.queue(slots=16)
    c.inject("crash", device="npu0", step="in_kernel")
    running = mine.submit("work", ms=20)
    queued = theirs.submit("work", ms=1)  # an innocent command behind it
    with pytest.raises(hetproc.DeviceRestarted) as info:
        running.wait(5)
    err = info.value
    assert err.scope == "device" and err.retryable and err.detail.get("device") == "npu0"
    with pytest.raises(hetproc.DeviceRestarted) as info:
        queued.wait(5)  # not replayed: nothing of the old instance survives
    assert info.value.retryable
    for submit in (lambda: mine.submit("work", ms=1), lambda: theirs.submit("work", ms=1),
                   lambda: q.submit_nowait(0.1)):
        with pytest.raises(hetproc.DeviceRestarted):
            submit()
    gpu.submit("work", ms=1).wait(5)           # another device's context is untouched
    c.context("npu0").submit("work", ms=1).wait(5)  # and the new instance serves
    assert c.metrics()["devices"]["npu0"]["epoch"] == 2
    steps = [s["step"] for s in c.incidents()["history"][-1]["steps"]]
    assert steps.index("restart") < steps.index("contexts_lost") < steps.index("probe")
    q.close()
    other.close()


def test_without_the_policy_a_crash_keeps_the_other_contexts(platform):
    """The restart is the policy's: by default a crash resets the device and the
    contexts on it that did not run the crashing command keep working."""
    c = platform.client
    mine, innocent = c.context("npu0"), c.context("npu0")
    c.inject("crash", device="npu0", step="in_kernel")
    with pytest.raises(hetproc.DeviceCrashed):
        mine.submit("work", ms=20).wait(5)
    time.sleep(0.05)
    innocent.submit("work", ms=1).wait(5)


def test_a_platform_file_naming_no_such_device_is_refused():
    raw = to_raw(hetproc.load_platform(None))
    raw["recovery"] = {"subsystem_restart": ["npu9"]}
    with pytest.raises(hetproc.InvalidRequest, match="subsystem_restart: no device 'npu9'"):
        parse_platform(raw, "test")
    raw["recovery"] = {"subsystem_restart": ["npu0"]}
    assert parse_platform(raw, "test").recovery["subsystem_restart"] == ["npu0"]


def test_a_delegated_model_reloads_from_its_cache_and_a_double_restart_is_not_retryable(
        restarting, tmp_path):
    pytest.importorskip("onnx")
    from hetproc.delegate import (
        AssetCache,
        DelegatedModel,
        Options,
        load_model,
        mobilenet_like,
        run_reference,
    )
    model = mobilenet_like()
    x = np.random.default_rng(3).random((1, 3, 32, 32), dtype=np.float32)
    want = run_reference(load_model(model), {"x": x})["prob"]
    c = restarting.client
    spread = Options(min_nodes_per_partition=1, weigh_costs=False)
    with DelegatedModel.load(c, model, options=spread, cache=AssetCache(tmp_path)) as dm:
        assert "npu0" in {p.device for p in dm.placement.partitions}
        c.inject("crash", device="npu0", step="in_kernel")
        out = dm.run({"x": x}, timeout=10)["prob"]
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)  # the retry is exact
        assert dm.load_info["restarts"] == 1
        assert set(dm.load_info["reloaded"]) == {"reloaded"}   # every asset from the cache
        c.inject("crash", device="npu0", step="in_kernel", every=1, count=0)
        t0 = time.monotonic()
        with pytest.raises(hetproc.DeviceRestarted) as info:
            dm.run({"x": x}, timeout=10)
        assert not info.value.retryable and "again" in info.value.message
        assert time.monotonic() - t0 < 10  # ended, never hung
        c.clear_faults()
        np.testing.assert_allclose(dm.run({"x": x})["prob"], want, rtol=1e-6, atol=0)

"""The pipeline API (hetproc.Pipeline): policies decide exactly which frames run.

Eight frames arrive 10 ms apart at a one-buffer stage that takes 100 ms: every arrival
after the first lands while the first frame still runs (the host cannot see it finish
before its modeled end), so which frames are dropped, delayed or late is exact.
"""

from __future__ import annotations

import numpy as np
import pytest

import hetproc

from .test_modeled_time import warm


def _run(client, policy, **kw):
    npu = client.context("npu0")
    warm(client, "npu0")
    p = hetproc.Pipeline(client, [hetproc.PipelineStage(npu, "work", ms=100)], buffers=1,
                         max_queue=2, policy=policy, **kw)
    try:
        return p.run(8, interval_ms=10)
    finally:
        p.close()


def test_drop_newest_keeps_the_first_frames(client):
    r = _run(client, "drop_newest", deadline_ms=150)
    assert r.dropped_frames == [3, 4, 5, 6, 7] and r.completed == 3 and r.delayed == 0
    # Modeled latencies: 100; then each waits for the buffer: 200 - 10, 300 - 20.
    assert np.allclose(r.latency_ms, [100, 190, 280], atol=0.02)  # + modeled cache upkeep (us)
    assert r.deadline_misses == 2
    assert max(d for _, d in r.queue_depth) == 3  # one running, two queued


def test_drop_oldest_keeps_the_freshest_frames(client):
    r = _run(client, "drop_oldest")
    assert r.dropped_frames == [1, 2, 3, 4, 5] and r.completed == 3
    assert np.allclose(r.latency_ms, [100, 200 - 60, 300 - 70],
                       atol=0.02)  # + modeled cache upkeep (us)


def test_backpressure_drops_nothing_and_delays_the_source(client):
    r = _run(client, "backpressure")
    assert r.dropped == 0 and r.completed == 8 and r.delayed == 5
    # Every frame waits for the one before it: latency grows by 90 ms a frame.
    assert np.allclose(np.diff(r.latency_ms), 90, atol=0.02)  # + modeled cache upkeep (us)


def test_a_two_stage_pipeline_chains_devices_and_reports_each_stage(client):
    cpu, gpu = client.context("cpu0"), client.context("gpu0")
    warm(client, "cpu0", "gpu0")
    seen = []
    p = hetproc.Pipeline(client, [hetproc.PipelineStage(cpu, "scale", ms=2, params={"factor": 2.0},
                                                        handoff_ms=1),
                                  hetproc.PipelineStage(gpu, "scale", ms=4,
                                                        params={"factor": 3.0})],
                         shape=(1, 8, 8, 3), buffers=2, max_queue=4,
                         fill=lambda i, a: (a.fill(i), seen.append(i)))
    try:
        r = p.run(6, interval_ms=20)
        assert r.completed == 6 and r.dropped == 0 and seen == list(range(6))
        assert np.allclose(r.latency_ms, 7.0, atol=0.01)  # 2 + 1 + 4, every frame
        assert np.allclose(p.sets[5 % 2][2].array(), 30.0)  # frame 5 went 5 -> 10 -> 30
        assert all(len(d) == 2 for _, d in r.stage_depth)
    finally:
        p.close()


def test_bad_pipelines_are_refused(client):
    npu = client.context("npu0")
    with pytest.raises(hetproc.InvalidRequest):
        hetproc.Pipeline(client, [hetproc.PipelineStage(npu)], policy="drop_random")
    with pytest.raises(hetproc.InvalidRequest):
        hetproc.Pipeline(client, [])


def test_a_failed_frame_fails_only_itself_not_the_later_frames_on_its_buffers(platform):
    """A frame whose command fails (the context lives on) frees its buffer set like any
    other: the next frame there must not wait on its failed fence and fail with it."""
    a = platform.client
    tenant = platform.connect("pipe")
    try:
        a.inject("kernel_bug", client="pipe", at=2, count=1)  # frame 1's only command
        cpu = tenant.context("cpu0")
        p = hetproc.Pipeline(tenant, [hetproc.PipelineStage(cpu, "scale", ms=1,
                                                            params={"factor": 2.0})],
                             shape=(16,), buffers=2, max_queue=8,
                             fill=lambda i, arr: arr.fill(i))
        try:
            r = p.run(8, interval_ms=2)
            assert r.failed == 1 and r.completed == 7 and r.dropped == 0, r.summary()
            assert np.array_equal(p.sets[1][1].array(), np.full(16, 14.0, np.float32))  # frame 7
        finally:
            p.close()
    finally:
        tenant.close()

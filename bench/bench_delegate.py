"""Delegate benchmarks: the op rate inside one partition, and what a partition costs.

``delegate_ops``
    One ``graph`` command on cpu0 running a chain of N ``Identity`` nodes (no-op ops):
    ops/s = (N_big - N_small) / (t_big - t_small), so the command's fixed cost cancels.
    Target >= 100,000 no-op ops/s inside one partition.
``delegate_overhead``
    ``DelegatedModel.run`` of a one-node model (one partition: input staging, one
    ``graph`` command with its asset, fence wait, output read) vs one no-op submit
    (``submit_nowait("work", ms=0)`` then ``wait()``, as ``submit_noop`` measures it) on
    the same device, alternating in rounds, medians of pooled samples. Target <= 1.5x.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ._registry import benchmark, make_row


def _chain(n: int):
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Identity", ["x" if i == 0 else f"t{i}"], [f"t{i + 1}"])
             for i in range(n)]
    g = helper.make_graph(nodes, f"chain{n}",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [4])])
    return helper.make_model(g)


def _platform():
    import hetproc
    return hetproc.Platform(time_scale=1.0)


def _on_cpu():
    from hetproc.delegate import Options
    return Options(accelerators=(), min_nodes_per_partition=1, weigh_costs=False)


@benchmark("delegate_ops")
def bench_delegate_ops(quick: bool) -> dict:
    from hetproc.delegate import DelegatedModel
    small, big = 10, (5_000 if quick else 50_000)
    feeds = {"x": np.ones(4, np.float32)}
    times: dict[int, list[float]] = {small: [], big: []}
    with _platform() as plat:
        models = {n: DelegatedModel.load(plat.client, _chain(n), options=_on_cpu())
                  for n in (small, big)}
        try:
            for _ in range(2 if quick else 5):
                for n, m in models.items():
                    t0 = time.perf_counter()
                    m.run(feeds)
                    times[n].append(time.perf_counter() - t0)
        finally:
            for m in models.values():
                m.close()
    dt = min(times[big]) - min(times[small])
    rate = (big - small) / dt if dt > 0 else float("inf")
    return {"rows": [make_row("no-op ops/s inside one partition", None, target=">= 100000",
                              ok=rate >= 100_000, value=round(rate), unit="ops/s")],
            "seconds": {str(k): v for k, v in times.items()}}


@benchmark("delegate_overhead")
def bench_delegate_overhead(quick: bool) -> dict:
    from hetproc.delegate import DelegatedModel
    rounds, n = (3, 100) if quick else (8, 400)
    feeds = {"x": np.ones(4, np.float32)}
    part, noop, copy = [], [], []
    with _platform() as plat:
        ctx = plat.client.context("cpu0")
        src, dst = plat.client.alloc((64,), "uint8"), plat.client.alloc((64,), "uint8")
        ctx.map(src, "r")
        ctx.map(dst, "rw")
        with DelegatedModel.load(plat.client, _chain(1), options=_on_cpu()) as m:
            for _ in range(20):  # warm both paths
                m.run(feeds)
                ctx.submit_nowait("work", ms=0).wait()
            for r in range(rounds):
                order = ("part", "noop", "copy")
                for which in (order if r % 2 == 0 else order[::-1]):
                    for _ in range(n):
                        t0 = time.perf_counter()
                        if which == "part":
                            m.run(feeds)
                            part.append(time.perf_counter() - t0)
                        elif which == "noop":
                            ctx.submit_nowait("work", ms=0).wait()
                            noop.append(time.perf_counter() - t0)
                        else:
                            ctx.submit_nowait("copy", [src], [dst]).wait()
                            copy.append(time.perf_counter() - t0)
        ctx.close()
    p_us, n_us = statistics.median(part) * 1e6, statistics.median(noop) * 1e6
    c_us = statistics.median(copy) * 1e6
    return {"rows": [make_row("one-partition run vs one no-op submit, p50", p_us, n_us,
                              target="<= 1.5x"),
                     make_row("one-partition run vs one 'copy' submit (1 in, 1 out), p50",
                              p_us, c_us)],
            "samples": {"partition": len(part), "noop": len(noop)}}

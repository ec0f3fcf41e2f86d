"""Frequency votes, the thermal model and the DDR quota (seed §7, §9), in modeled time.

Each changes a command's modeled duration or start by an exact amount, so the tests
compare fence signal times; every platform here is real (devices, supervisor, clients).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import hetproc
from device_workers._power import Thermal
from hetproc import PowerSpec, load_platform

from .helpers import wait_for
from .test_modeled_time import warm

MS = 1_000_000


def platform_with_power(power: PowerSpec | None = None, **top) -> hetproc.Platform:
    spec = load_platform()
    devices = tuple(dataclasses.replace(d, power=power) if power and d.name == "npu0" else d
                    for d in spec.devices)
    return hetproc.Platform(spec=dataclasses.replace(spec, devices=devices, **top),
                            time_scale=1.0)


def _durations(ctx, n: int, ms: float) -> list[float]:
    t0 = time.monotonic_ns()
    fences = [ctx.submit_nowait("work", ms=ms, at_ns=t0) for _ in range(n)]
    fences[-1].wait(10)
    ends = [t0] + [f.signal_time() for f in fences]
    return [round((b - a) / MS, 3) for a, b in zip(ends, ends[1:])]


def test_the_highest_vote_sets_the_speed_and_switches_are_counted():
    with platform_with_power(PowerSpec(levels=(0.25, 0.5, 1.0))) as plat:
        c = plat.client
        a, b = c.context("npu0"), c.context("npu0")
        warm(c, "npu0")
        assert a.vote(0.3) == 0.5                   # snapped up to a level; the only vote
        assert _durations(a, 2, 4.0) == [8.0, 8.0]  # a kernel at half speed takes twice
        assert b.vote(1.0) == 1.0                   # the highest vote wins
        assert _durations(a, 2, 4.0) == [4.0, 4.0]
        b.close()                                   # its vote goes with it
        assert _durations(a, 1, 4.0) == [8.0]
        # The device posts its record just after the signal that woke us: wait for it.
        def power():
            return c.metrics()["devices"]["npu0"]["modeled_time"]["power"]
        assert wait_for(lambda: power()["frequency_switches"] == 3), power()
        assert power()["speed"] == 0.5
        with pytest.raises(hetproc.InvalidRequest):
            a.vote(float("nan"))


def test_sustained_load_throttles_and_idling_cools_the_device():
    hot = PowerSpec(heat_c_per_ms=1.0, tau_ms=100.0, ambient_c=35.0, throttle_c=60.0,
                    hysteresis_c=5.0, throttle_speed=0.5)
    with platform_with_power(hot) as plat:
        c = plat.client
        npu = c.context("npu0")
        warm(c, "npu0")
        d = _durations(npu, 12, 10.0)
        # Heating toward 35 + 100: 60 C is passed after ~35 ms of work, then it throttles.
        assert d[:3] == [10.0] * 3 and d[-1] == 20.0
        first = d.index(20.0)
        assert all(x == 10.0 for x in d[:first]) and all(x in (10.0, 20.0) for x in d)
        def power():
            return c.metrics()["devices"]["npu0"]["modeled_time"]["power"]
        assert wait_for(lambda: power()["throttled_commands"] >= 1), power()
        assert power()["temperature_c"] > 55.0
        time.sleep(0.5)  # five time constants of idle: back near ambient
        assert _durations(npu, 1, 10.0) == [10.0]


def test_the_thermal_model_by_itself():
    th = Thermal(heat_c_per_ms=1.0, tau_ms=100.0, ambient_c=35.0, throttle_c=60.0,
                 hysteresis_c=5.0, throttle_speed=0.5)
    assert th.speed(1, 1.0) == 1.0
    th.ran(1 + 50 * MS, 50 * MS, 1.0)  # toward 135 C: 35 + 100 (1 - e^-0.5) = 74 C
    assert th.temp == pytest.approx(35 + 100 * (1 - 2.718281828 ** -0.5), rel=1e-6)
    assert th.speed(1 + 50 * MS, 1.0) == 0.5 and th.throttled
    assert th.speed(1 + 100 * MS, 1.0) == 0.5       # 35 + 39 e^-0.5 = 58.7: not below 55
    assert th.speed(1 + 200 * MS, 1.0) == 1.0       # cooled below 55: full speed again


def test_a_ddr_quota_spaces_a_clients_commands_and_spares_the_others():
    # 1 MB/s for "tenant": a 4 KiB command moves 8 KiB (in + out) = 8.192 ms of quota.
    with platform_with_power(ddr_quota_mbps={"tenant": 1.0}, ddr_burst_kib=0) as plat:
        t = plat.connect("tenant")
        try:
            npu = t.context("npu0")
            x, y = t.alloc(1024), t.alloc(1024)
            npu.submit("work", [x], [y], ms=0).wait(5)
            t0 = time.monotonic_ns() + 20 * MS
            fs = [npu.submit_nowait("work", [x], [y], ms=1, at_ns=t0) for _ in range(3)]
            fs[-1].wait(5)
            starts = [f.signal_time() - 1 * MS for f in fs]
            gaps = [b - a for a, b in zip(starts, starts[1:])]
            assert all(abs(g - 8_192_000) < 50_000 for g in gaps), gaps  # + cache upkeep
            other = plat.client.context("npu0")
            u0 = time.monotonic_ns()
            g = [other.submit_nowait("work", [plat.client.alloc(1024)],
                                     [plat.client.alloc(1024)], ms=1, at_ns=u0)
                 for _ in range(2)]
            g[-1].wait(5)
            q = plat.client.metrics()["ddr_quota"]["delayed"]
            assert q["tenant"]["commands"] == 2 and "owner" not in q  # the first had room
        finally:
            t.close()


def test_a_second_connection_of_a_process_shares_its_ddr_clock():
    """The quota is the process's, as every quota is: commands spread over two
    connections of one process are spaced as if they came over one (a clock per
    connection would let each connection's first command through at once)."""
    with platform_with_power(ddr_quota_mbps={"tenant": 1.0}, ddr_burst_kib=0) as plat:
        a, b = plat.connect("tenant"), plat.connect("tenant")
        try:
            ctxs = [a.context("npu0"), b.context("npu0")]
            bufs = [(c.alloc(1024), c.alloc(1024)) for c in (a, b)]
            for ctx, (x, y) in zip(ctxs, bufs):
                ctx.submit("work", [x], [y], ms=0).wait(5)
            time.sleep(0.05)  # the warm-ups' quota is spent: the clock is in the past

            def delayed() -> int:
                q = plat.client.metrics()["ddr_quota"]["delayed"]
                return q.get("tenant", {}).get("commands", 0)

            before, t0 = delayed(), time.monotonic_ns()
            fs = [f for ctx, (x, y) in zip(ctxs, bufs)  # all four arrive at t0
                  for f in ctx.submit_many([hetproc.command("work", [x], [y], ms=1)
                                            for _ in range(2)], nowait=True, at_ns=t0)]
            for f in fs:
                f.wait(5)
            assert delayed() - before == 3  # one clock: all but the first wait their turn
            starts = sorted(f.signal_time() - 1 * MS for f in fs)
            gaps = [b - a for a, b in zip(starts, starts[1:])]
            assert all(g > 8_192_000 - 50_000 for g in gaps), gaps
        finally:
            a.close()
            b.close()

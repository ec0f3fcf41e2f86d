"""Conformance case of timeslicing (IGT ``gem_exec_schedule@thriceslice``): three contexts
of one priority on one engine take turns, none waits for another to finish.

Registered with ``_conformance_cases.case`` on import (``_conformance`` imports this
module). It runs on the ``timeslice`` group's platform: the one given, with i915's
timeslice (1 ms) on npu0 where the platform file leaves npu0's ``timeslice_ms`` and the
platform-wide one unset (``timesliced``); a platform file that sets it to 0 fails the
case, as i915 with ``timeslice_duration_ms = 0`` fails the IGT one.
"""

from __future__ import annotations

import dataclasses

from .. import _refsched
from .._config import PlatformSpec
from ..client import command
from ._conformance_cases import CaseRun, case

MS = 1_000_000
I915_TIMESLICE_MS = 1.0  # i915's default ``timeslice_duration_ms``
_DURATION_MS = 10.0      # each context's one long command (modeled, before the time scale)


def timesliced(spec: PlatformSpec) -> PlatformSpec:
    """``spec`` with i915's timeslice on npu0 where nothing in the file set one."""
    npu = spec.device("npu0")
    if npu.scheduler.timeslice_ms is not None or spec.timeslice_ms:
        return spec
    sched = dataclasses.replace(npu.scheduler, timeslice_ms=I915_TIMESLICE_MS)
    devices = tuple(dataclasses.replace(d, scheduler=sched) if d is npu else d
                    for d in spec.devices)
    return dataclasses.replace(spec, devices=devices)


@case("gem_exec_schedule/thriceslice", "IGT gem_exec_schedule", group="timeslice", checks=(
      "three contexts of one priority each submit a long command to npu0 at once: they take "
      "turns at chunk boundaries every timeslice_ms (i915's 1 ms), so none finishes before "
      "all three ran, and every end is the reference simulator's to the ns, switches "
      "counted the same"))
def _thriceslice(c: CaseRun) -> None:
    spec = c.plat.spec
    scale = spec.time_scale
    names = ("first", "second", "third")
    ctxs = [c.client.context("npu0", name=n, priority=1) for n in names]
    for ctx in ctxs:
        ctx.submit("work", ms=0).wait(5)
    before = c.client.metrics()["devices"]["npu0"]["preemptions"]
    t0 = c.plat.now() + 50 * MS  # the platform's clock (modeled, on the virtual one)
    fences = [ctx.submit_many([command("work", ms=_DURATION_MS, timeout_ms=50 * _DURATION_MS)],
                              nowait=True, at_ns=t0)[0] for ctx in ctxs]
    done = [c.check_completes(f"the {n} context's command completes", f, 10)
            for n, f in zip(names, fences)]
    if all(done):
        ends = [f.signal_time() - t0 for f in fences]
        duration = round(_DURATION_MS * scale * MS)
        c.s.check("they took turns: the first end comes after every command ran",
                  min(ends) > 2 * duration, f"ends {[e / 1e6 for e in ends]} ms")
        dp = _refsched.DevicePolicy.from_spec(spec.device("npu0").scheduler, scale,
                                              spec.engine("npu0").timeslice_ms)
        ref = _refsched.simulate_schedule(
            [dict(name=n, context=n, priority=1, duration_ns=duration) for n in names],
            devices={"npu0": dp}, dispatch_ns=round(spec.dispatch_us * scale * 1000))
        c.s.check("every end is the reference simulator's", ends == [o.end_ns for o in ref.jobs],
                  f"ends {ends}, reference {[o.end_ns for o in ref.jobs]}")
        switched = c.client.metrics()["devices"]["npu0"]["preemptions"] - before
        c.s.check("the turns are the reference's", switched == ref.timeslices["npu0"],
                  f"{switched} turns, reference {ref.timeslices['npu0']}")
    for f in fences:
        f.release()
    for ctx in ctxs:
        ctx.close()

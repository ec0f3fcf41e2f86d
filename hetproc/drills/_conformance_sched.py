"""Conformance cases of scheduling under pressure: preemption that a command refuses.

Registered with ``_conformance_cases.case`` on import (``_conformance`` imports this
module); each runs on its group's shared platform, the built-in one, whose devices keep
i915's default ``preempt_timeout_ms`` of 640.
"""

from __future__ import annotations

from ipc import errors

from ..client import command
from ._conformance_cases import CaseRun, case

MS = 1_000_000


@case("sysfs_preempt_timeout/timeout", "IGT sysfs_preempt_timeout",
      "a request that cannot be preempted, blocking a more urgent one, is reset after the "
      "device's preempt_timeout_ms (i915's 640): it alone is guilty (PreemptTimeout), the "
      "urgent request then completes, long before the blocker would have ended")
def _preempt_timeout(c: CaseRun) -> None:
    low = c.client.context("npu0", name="blocker", priority=1)
    high = c.client.context("npu0", name="urgent", priority=9)
    for ctx in (low, high):
        ctx.submit("work", ms=0).wait(5)
    limit_ms = c.plat.spec.engine("npu0").preempt_timeout_ms
    t0 = c.plat.now() + 20 * MS  # the platform's clock (modeled, on the virtual one)
    blocker = low.submit_many([command("work", ms=5 * limit_ms, preemptible=False,
                                       timeout_ms=20 * limit_ms)], nowait=True, at_ns=t0)[0]
    urgent = high.submit_nowait("work", ms=1, at_ns=t0 + 5 * MS)
    c.expect_failure("the blocker is reset (PreemptTimeout)", blocker, errors.PreemptTimeout,
                     timeout=10 * limit_ms / 1000)
    blocker.release()  # now, not when collected: the next case counts the live fences
    if c.check_completes("the urgent request completes after the reset", urgent, 10):
        waited_ms = (urgent.signal_time() - t0) / 1e6 - 5
        c.s.check("it waited the preempt timeout, not the blocker's length",
                  limit_ms <= waited_ms < 2 * limit_ms, f"{waited_ms:.1f} ms")
    for ctx in (low, high):
        ctx.close()

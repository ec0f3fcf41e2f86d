"""A probe that answered (its fence signalled) but whose completion record died with its
device still counts for its incident. Found by the chaos campaign (seed 1784): a device
SIGKILLed while a probe's success record sat in its outbox (successes are batched while
more commands wait in the ring) left the probe's incident open forever, so
``incidents.active`` never went back to 0.

Pure logic around ``Recovery.fail_innocent`` with a stand-in supervisor; the reset it is
part of runs across real processes in ``test_chaos`` and ``test_recovery``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from hetproc.supervisor._recovery import Incident, Policy, Recovery

DONE = 1


class _Registry:
    """Just what ``fail_innocent`` reads: fences that say done."""

    def __init__(self) -> None:
        self.fence_recs = {7: object(), 8: object()}
        self.fences = SimpleNamespace(poll=lambda h: (DONE, 0))

    def signalled(self, cmd) -> bool:
        return True


class _Commands:
    """Just what ``fail_innocent`` asks of the command engine: retire, fail_command."""

    def __init__(self) -> None:
        self.retired, self.failed = [], []

    def retire(self, cmd) -> None:
        cmd.state = "done"
        self.retired.append(cmd)

    def fail_command(self, cmd, exc) -> None:  # not expected: the probe finished
        self.failed.append(cmd)


def test_a_probe_whose_record_died_with_its_device_still_closes_its_incident():
    sup = _Commands()
    rec = Recovery(Policy(), _Registry(), sup, evidence=None, spawn=None)
    earlier = Incident(1, "death", "npu0", None, time.monotonic_ns())
    earlier.probes = 2
    rec.probing[earlier.id] = earlier
    probes = [SimpleNamespace(state="pushed", probe_of=earlier, signal=[h], outs=[],
                              device=SimpleNamespace(name=name), ctx=SimpleNamespace(lost=None))
              for h, name in ((7, "gpu0"), (8, "gpu0"))]
    reset = Incident(2, "death", "gpu0", None, time.monotonic_ns())  # gpu0 was SIGKILLed

    rec.fail_innocent(reset, probes)

    assert sup.retired == probes and not sup.failed  # finished work is retired, not failed
    assert earlier.probes == 0
    assert earlier.id not in rec.probing, "the incident waits for probes that answered"
    assert [h["id"] for h in rec.history] == [1]
    assert [s["step"] for s in earlier.steps] == ["probe_done", "probe_done", "done"]

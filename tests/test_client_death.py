"""A client that dies leaves nobody waiting: its fences fail with a cause."""

from __future__ import annotations

import pytest

import hetproc


def test_a_dead_producers_pending_fence_wakes_its_importers_with_a_cause(platform):
    a, b = platform.connect("producer"), platform.connect("consumer")
    acq = a.fence()
    f = b.import_fence(acq.export())
    npu = b.context("npu0")
    x = b.alloc(64)
    done = npu.submit("relu", [x], [x], wait=[f])
    a.close()  # the producer goes away without signalling
    with pytest.raises(hetproc.DependencyFailed):
        done.wait(5)
    with pytest.raises(hetproc.Cancelled):
        f.wait(5)
    b.close()


def test_a_dead_producers_released_but_imported_fence_still_wakes_its_importers(platform):
    """Found by the chaos test's probes: a producer that exported a user fence, dropped its
    own Fence (release) and then died left the importers' copy pending forever (their
    wait timed out, a dependant failed only by the dependency timeout)."""
    a, b = platform.connect("producer"), platform.connect("consumer")
    try:
        acq = a.fence()
        f = b.import_fence(acq.export())
        acq.release()  # the importer's reference keeps the slot alive
        a.ping()       # the release travels with the next request
        x = b.alloc(64)
        done = b.context("npu0").submit("relu", [x], [x], wait=[f])
        a.close()
        with pytest.raises(hetproc.Cancelled):
            f.wait(10)  # was: FenceTimeout, nobody ever failed it
        with pytest.raises(hetproc.DependencyFailed):
            done.wait(10)  # was: DependencyTimeout, not the producer's death
    finally:
        a.close()
        b.close()

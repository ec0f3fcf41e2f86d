"""When the supervisor's loop may skip its timers at a jump's instant (``ClockOwner.
timers_seen``): only when they would repeat the jump's own look at the same platform.

The loop runs its timers (the watchdog's first sight of a command, a stall watch, a
queue watch, a decision dated ahead) before each turn, and once more right after a jump.
A quiet turn at the jump's instant with nobody having entered or left a wait since would
run them again on exactly what they saw: that pass is skipped. Anything they could see
differently -- a waiter that ran, the clock moved, an incident, a user-mode queue (a
client writes records without a slot's ``gen`` moving), a loop that was woken or has a
backlog -- must make them run. Each case below fails if the skip is made more eager.

Pure logic on a real clock segment: the owner is built bare, with the parts the method
reads (the whole protocol runs across processes in ``test_clock_lease`` and the
determinism tests).
"""

from __future__ import annotations

import types

import pytest

from hetproc.supervisor._clock import ClockOwner
from ipc import Segment, cleanup_prefix, clock, entries_with_prefix, new_prefix

DEVICES, CLIENTS = 2, 2


@pytest.fixture
def owner():
    prefix = new_prefix()
    seg = Segment.create(prefix + "clock", clock.segment_bytes(DEVICES, CLIENTS))
    vc = clock.VirtualClock(seg, create=True)
    own = ClockOwner.__new__(ClockOwner)
    own.clock = vc
    own._slots = DEVICES + CLIENTS
    own._marked = None
    own.jump_view = None
    own.queues = types.SimpleNamespace(open_queues={})
    own.recovery = types.SimpleNamespace(active={}, probing={})
    yield own
    vc.close()
    seg.close()
    seg.unlink()
    cleanup_prefix(prefix)
    assert entries_with_prefix(prefix) == []


def _jumped(own: ClockOwner) -> None:
    """As the loop does after a jump whose timers ran with every device blocked after."""
    own.jump_view = own.view()


def test_a_quiet_turn_at_the_jumps_instant_with_nobody_moved_skips_the_timers(owner):
    _jumped(owner)
    assert owner.timers_seen(quiet=True)


def test_the_view_of_a_jump_serves_one_turn_only(owner):
    _jumped(owner)
    assert owner.timers_seen(quiet=True)
    assert not owner.timers_seen(quiet=True)  # no jump since: the timers run


def test_a_waiter_that_entered_or_left_a_wait_makes_the_timers_run(owner):
    for slot in range(DEVICES + CLIENTS):
        _jumped(owner)
        waiter = owner.clock.waiter(slot)
        waiter.block(owner.clock.now_ns() + 5)  # (a device's first sight: it ran since)
        assert not owner.timers_seen(quiet=True), slot
        _jumped(owner)
        waiter.clear()
        assert not owner.timers_seen(quiet=True), slot


def test_a_clock_that_moved_makes_the_timers_run(owner):
    _jumped(owner)
    owner.clock.advance(owner.clock.now_ns() + 1)
    assert not owner.timers_seen(quiet=True)


def test_a_loop_woken_or_busy_runs_its_timers(owner):
    _jumped(owner)
    assert not owner.timers_seen(quiet=False)


def test_an_incident_or_a_probe_in_progress_makes_the_timers_run(owner):
    owner.recovery.active = {"npu0": object()}
    _jumped(owner)
    assert not owner.timers_seen(quiet=True)
    owner.recovery.active, owner.recovery.probing = {}, {1: object()}
    _jumped(owner)
    assert not owner.timers_seen(quiet=True)


def test_an_open_user_mode_queue_makes_the_timers_run(owner):
    owner.queues.open_queues = {1: object()}  # its records move no slot's gen
    _jumped(owner)
    assert not owner.timers_seen(quiet=True)


def test_every_look_marks_the_generations_the_next_turn_compares(owner):
    owner.timers_seen(quiet=False)
    assert owner._marked == owner.clock.generations(DEVICES + CLIENTS)

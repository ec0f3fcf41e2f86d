"""The virtual clock's held doorbell posts (``hetproc.supervisor._doorbell``), on real
POSIX semaphores: held while the loop serves a request, rung in device order, and never
held once the platform stops (a device must hear its stop at once, not by its own slice).
What a held post changes across processes is in ``test_virtual_clock``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import posix_ipc

from hetproc.supervisor._doorbell import HeldPosts, PokingDoorbell, ring_all
from ipc import Segment, clock


def _bells(n: int) -> list[PokingDoorbell]:
    tag = f"/hptest.bell.{os.getpid()}."
    bells = []
    for i in range(n):
        bell = PokingDoorbell(tag + str(i), posix_ipc.O_CREX)
        bell.unlink()  # named only while made: nothing to leave in /dev/shm
        bell.index = i
        bells.append(bell)
    return bells


def _held(bells: list[PokingDoorbell]) -> HeldPosts:
    held = HeldPosts(10**12, {}, [], lambda: False)  # no client: only ``serving`` holds
    for bell in bells:
        bell.held = held
    return held


def test_a_post_made_while_serving_is_held_and_rung_once_the_loop_is_done():
    (bell,) = bells = _bells(1)
    held = _held(bells)
    with held:
        bell.release()
        assert bell.value == 0 and held
    bell.release()  # not serving, no client running: at once
    assert bell.value == 1
    held.ring()
    assert bell.value == 2 and not held
    bell.close()


def test_held_posts_ring_in_device_order_whatever_order_they_were_made_in():
    bells = _bells(3)
    held = _held(bells)
    rung = []
    for bell in bells:
        bell.post = (lambda b: lambda: rung.append(b.index))(bell)  # type: ignore[method-assign]
    with held:
        for i in (2, 0, 1, 2):
            bells[i].release()
    held.ring()
    assert rung == [0, 1, 2]
    for bell in bells:
        bell.close()


def test_devices_rung_together_are_all_poked_before_the_first_is_woken():
    """A jump or the held posts wake several devices at one instant: every slot says
    "news" before any semaphore is posted. Poked one by one, the first device woken ran,
    blocked again, found the others blocked with no news and woke the loop for nothing
    (a loop turn per frame of a three-stage pipeline)."""
    seg = Segment.create(f"hpt.{os.getpid()}.bells", clock.segment_bytes(3, 0))
    try:
        vclock = clock.VirtualClock(seg, create=True)
        bells = _bells(3)
        for i, bell in enumerate(bells):
            bell.waiter = vclock.waiter(i)
        poked_at_post = []
        for bell in bells:
            post = bell.post
            bell.post = (lambda p: lambda: (poked_at_post.append(  # type: ignore[method-assign]
                [b.waiter.poked() for b in bells]), p()))(post)
        ring_all(bells)
        assert poked_at_post == [[1, 1, 1]] * 3
        assert [b.value for b in bells] == [1, 1, 1]
        for bell in bells:
            bell.waiter = None
            bell.close()
        vclock.close()
    finally:
        seg.close()
        seg.unlink()


def test_once_the_platform_stops_nothing_is_held():
    a, b = bells = _bells(2)
    held = _held(bells)
    with held:
        a.release()
        held.stop_holding()  # what was held rings, and a stop posted now is heard now
        assert a.value == 1
        b.release()
        assert b.value == 1 and not held
    for bell in bells:
        bell.close()


def _conn(pid: int, slot: int, pending: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, clock_slot=slot, pending=list(pending),
                           reader=SimpleNamespace(buffered=0))


def test_a_process_waiting_on_one_of_its_connections_brings_nothing_more_at_this_instant():
    """Who may still bring more at this instant, by process: a slot says blocked only when
    every thread of its process waits, so one blocked slot is the whole process waiting,
    though its other connections' slots say running (judged by connection, a process
    waiting on one of three held every post a device's progress made: a loop turn and
    a hand-off each). A request read and not served, or bytes not read, still hold."""
    seg = Segment.create(f"hpt.{os.getpid()}.clock", clock.segment_bytes(0, 4))
    try:
        vclock = clock.VirtualClock(seg, create=True)
        slots = [vclock.waiter(i) for i in range(4)]
        unread = [False]
        conns = {"camera": _conn(7, 0), "voice": _conn(7, 1), "llm": _conn(7, 2)}
        held = HeldPosts(10**12, conns, slots, lambda: unread[0])
        assert held.clients_running()  # nobody waits yet
        slots[2].block(clock.NO_WAKE, 5)  # the process waits on the llm's fence
        assert not held.clients_running()
        unread[0] = True  # the voice's request is in its socket, not read yet
        assert held.clients_running()
        unread[0] = False
        conns["voice"].pending.append({"op": "submit"})  # read, not served yet
        assert held.clients_running()
        conns["voice"].pending.clear()
        conns["other"] = _conn(8, 3)  # another process, running
        assert held.clients_running()
        slots[3].block(clock.NO_WAKE)
        assert not held.clients_running()
        vclock.close()
    finally:
        seg.close()
        seg.unlink()

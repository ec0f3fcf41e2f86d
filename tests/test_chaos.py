"""Seeded chaos (the program and its invariants are in ``tests/chaos.py``), and what the
command waiting on a SIGKILLed client's fence may end with.

``HETPROC_CHAOS_SEEDS=1,7,42`` picks the seeds; ``python -m bench.chaos_campaign`` runs
hundreds, each in its own process with a hard deadline.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import hetproc
from tests.chaos import (
    DEVICES,
    POLICIES,
    ChaosFailure,
    Phases,
    _Run,
    draw_clock,
    draw_engines,
    draw_mix,
    draw_queue,
    draw_resets,
    draw_restart,
    engines_rng,
    faults_on,
    judge_child_dependent,
    queue_rng,
    read_only_writer_drawn,
    resets_rng,
    restart_rng,
    run,
)
from tests.helpers import wait_for

# The default seeds: together their mixes draw every scheduling policy and every part
# of the mix, with and without (test_the_default_seeds_cover_the_whole_mix).
DEFAULT_SEEDS = "1,5,7,12,42"
SEEDS = [int(s) for s in os.environ.get("HETPROC_CHAOS_SEEDS", DEFAULT_SEEDS).split(",")]


@pytest.mark.parametrize("seed", SEEDS)
def test_chaos(seed):
    try:
        tally = run(seed)
    except ChaosFailure as exc:
        pytest.fail(str(exc))
    print(f"chaos seed {seed}: {tally}")


# Seeds that found a product bug on the virtual clock, kept as regressions: each failed
# every run before its fix. 192: an urgent command that failed before it mapped anything
# dropped the suspended command's output ("successful commands were wrong"). 648: a plain
# command more urgent than its producer, marked and pending on the same device, ran first
# and waited for it until its dependency deadline; every command behind waited as long.
REGRESSION_SEEDS = (192, 648)


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_a_seed_that_found_a_bug_passes_on_the_virtual_clock(seed):
    try:
        run(seed, clock="virtual")
    except ChaosFailure as exc:
        pytest.fail(str(exc))


def test_the_default_seeds_cover_the_whole_mix():
    """Pure logic: the suite's few seeds still meet every policy and every feature of the
    mix, each present in one seed and absent in another (a seed's mix is its first draws)."""
    mixes = [draw_mix(random.Random(int(s))) for s in DEFAULT_SEEDS.split(",")]
    assert {m.policy for m in mixes} == set(POLICIES)
    for feature in ("sched_cmds", "hostile", "pipeline", "model", "signal_rights", "role"):
        assert {bool(getattr(m, feature)) for m in mixes} == {True, False}, feature
    assert any(c > 0 for m in mixes for c in m.chunk_ms)  # preemption somewhere
    restarts = {draw_restart(restart_rng(int(s))) for s in DEFAULT_SEEDS.split(",")}
    assert restarts == {True, False}  # npu0 restarts as a subsystem in some seeds
    queues = {draw_queue(queue_rng(int(s))) for s in DEFAULT_SEEDS.split(",")}
    assert "" in queues and len(queues) > 1  # a queue in some seeds, not in others
    wedges = {draw_resets(resets_rng(int(s)), draw_queue(queue_rng(int(s))))[2]
              for s in DEFAULT_SEEDS.split(",")}
    assert "" in wedges and len(wedges) > 1  # a device wedged in some seeds, not in others
    sliced = {any(m.policy in ("priority", "edf", "mixed") and chunk > 0
                  and draw_engines(engines_rng(int(s)))[d].get("timeslice_ms")
                  for d, chunk in zip(DEVICES, m.chunk_ms))
              for m, s in zip(mixes, DEFAULT_SEEDS.split(","))}
    assert sliced == {True, False}  # devices taking turns in some seeds, not in others
    clocks = {draw_clock(int(s)) for s in DEFAULT_SEEDS.split(",")}
    assert clocks == {"real", "virtual"}  # some seeds on the virtual clock
    writers = {read_only_writer_drawn(int(s)) for s in DEFAULT_SEEDS.split(",")}
    assert writers == {True, False}  # a read-only importer writing, in some seeds
    assert all(m == draw_mix(random.Random(int(s)))
               for m, s in zip(mixes, DEFAULT_SEEDS.split(",")))  # a seed fixes its mix


# -- the command that waits on a killed client's fence ----------------------------------------

PRODUCER = textwrap.dedent("""
    import sys, time, hetproc
    c = hetproc.connect(sys.argv[1], "producer")
    user = c.fence()
    print("fence", user.export(), flush=True)
    if sys.stdin.readline().strip() == "signal":
        user.signal()
        print("signalled", flush=True)
    time.sleep(60)                                   # until SIGKILLed
""")


@pytest.fixture
def producer(platform):
    """A client in its own process holding a user fence the test imports; SIGKILLed by
    the test (or at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, platform.prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "fence", line
        yield proc, platform.client.import_fence(int(line[1]))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_a_command_waiting_on_a_killed_clients_fence_is_failed_by_the_death_not_the_watchdog(
        platform, producer):
    """§14/§20: a device waiting on an input fence is not hung. The command waits far
    past its 40 ms watchdog, with a timeout fault riding on it (which acts only once it
    runs); the producer's SIGKILL resolves it as DependencyFailed, nobody times out."""
    proc, fence = producer
    a = platform.client
    a.inject("timeout", device="cpu0", at=1, count=1)
    x, y = a.alloc(64), a.alloc(64)
    f = a.context("cpu0").submit("copy", [x], [y], wait=[fence], timeout_ms=40)
    with pytest.raises(hetproc.FenceTimeout):
        f.wait(0.4)  # ten watchdogs long: still waiting, not timed out
    assert a.incidents()["verdicts"].get("timed_out", 0) == 0
    _kill(proc)
    with pytest.raises(hetproc.DependencyFailed) as err:
        f.wait(10)
    assert faults_on(a, f.cid) == ["timeout"]  # the fault was on it; it never ran
    assert judge_child_dependent(err.value, False, ["timeout"]) is None
    assert a.incidents()["verdicts"].get("timed_out", 0) == 0
    assert wait_for(lambda: a.metrics()["in_flight"] == 0)


def test_a_timeout_of_the_command_after_the_killed_child_signalled_is_its_injected_fault(
        platform, producer):
    """Issue 13's seeds (1182, 1210, 1854, 2099): the child signalled its fence, then died;
    the command waiting on it ran and an injected overrun fault (timeout, hang,
    late_writer: every-N and at-N rules count every client's commands) landed on it,
    as the fault plan's record shows. Its DeviceTimeout is then the truth, not a
    misattribution -- but only with that record and that signal."""
    proc, fence = producer
    a = platform.client
    a.inject("timeout", device="cpu0", at=1, count=1)
    x, y = a.alloc(64), a.alloc(64)
    f = a.context("cpu0").submit("copy", [x], [y], wait=[fence], timeout_ms=40)
    proc.stdin.write("signal\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "signalled"
    _kill(proc)
    fence.wait(10)  # the child's signal stands after its death
    with pytest.raises(hetproc.DeviceTimeout) as err:
        f.wait(10)
    kinds = faults_on(a, f.cid)
    assert kinds == ["timeout"]
    assert judge_child_dependent(err.value, True, kinds) is None
    # ...and the same outcome without the fault's record, or without the signal, is not
    assert judge_child_dependent(err.value, True, []) is not None
    assert judge_child_dependent(err.value, True, ["wrong_output"]) is not None
    assert judge_child_dependent(err.value, False, kinds) is not None


def test_the_judge_of_the_child_dependent_refuses_hangs_and_dependency_timeouts():
    """Pure logic: never resolved, or resolved by the dependency deadline instead of the
    child's death, is a failure whatever the faults; a plain DependencyFailed is fine."""
    hang = hetproc.FenceTimeout("pending")
    late = hetproc.DependencyTimeout("input fence did not signal in time")
    assert judge_child_dependent(hang, True, ["timeout"]) is not None
    assert judge_child_dependent(late, False, ["hang"]) is not None
    assert judge_child_dependent(hetproc.DependencyFailed("dead"), False, []) is None
    assert judge_child_dependent(None, False, []) is not None  # a failed input never succeeds
    assert judge_child_dependent(None, True, []) is None
    # A DeviceTimeout of a command that started on a device stopped (SIGSTOP) while it
    # was outstanding is the truth; one that never started (no signal) is not.
    overrun = hetproc.DeviceTimeout("ran past its watchdog")
    assert judge_child_dependent(overrun, True, [], device_stopped=True) is None
    assert judge_child_dependent(overrun, False, [], device_stopped=True) is not None
    assert judge_child_dependent(overrun, True, [], device_stopped=False) is not None


# -- the queue's destination, replaced in the middle of a batch ----------------------------


def test_a_queue_destination_replaced_within_a_batch_is_freed_after_the_batch(platform):
    """Seed 21: a batch's copy named the queue's destination, then a later copy of the
    same batch replaced it, and the program freed it right there: the batch's submit
    then bound a freed buffer, StaleHandle (the program's fault, not the platform's).
    The replaced destination is freed once the batch is in. Each round's queue is new
    (as after a reset lost the last one), so every batch binds its buffers afresh."""
    with _queue_rounds(21, platform) as chaos:
        for rnd in range(10):
            chaos.queue_verdict(rnd, chaos.queue_round())  # StaleHandle, before the fix
            chaos.queue.close()
            chaos.queue = None
        queue = chaos.tally["queue"]
        assert queue["replaced_in_batch"] >= 1, queue  # the case was met
        assert queue["ok"] > 0, queue


@contextlib.contextmanager
def _queue_rounds(seed: int, platform: hetproc.Platform) -> Iterator[_Run]:
    """Seed ``seed``'s chaos program on ``platform``, for its queue rounds alone; its queue
    and buffers are let go of at the end."""
    chaos = _Run(seed, platform, Phases(seed), random.Random(seed),
                 draw_mix(random.Random(seed)))
    chaos.by = platform.client
    try:
        yield chaos
    finally:
        if chaos.queue is not None:
            chaos.queue.close()
        for buf in (chaos.q_src, chaos.q_dst):
            if buf is not None:
                buf.free()


# -- a queue lost as the batch goes in -------------------------------------------------------


def test_a_batch_refused_by_a_lost_queue_copied_nothing(platform, monkeypatch):
    """Seed 19: the round's queue was lost in a reset as its batch went in (the submit
    raised CancelledByReset, ``lost_at_submit``), but the batch's copy had already been
    noted as made: the verdict, with no fence and so no failed copy, compared the fresh
    destination with the source and called the copy wrong. A batch refused whole copied
    nothing."""
    real = hetproc.Queue.submit_many
    with _queue_rounds(19, platform) as chaos:

        def lost_first(q, cmds, **kw):  # the device dies as a batch with a copy goes in
            if (any(type(c) is dict for c in cmds)
                    and not chaos.tally["queue"]["lost_at_submit"]):
                dev = platform.client.metrics()["devices"][q.ctx.device]
                os.kill(dev["pid"], signal.SIGKILL)
                assert wait_for(lambda: q._ring.state != 0, timeout=10)
            return real(q, cmds, **kw)

        monkeypatch.setattr(hetproc.Queue, "submit_many", lost_first)
        for rnd in range(10):
            chaos.queue_verdict(rnd, chaos.queue_round())  # "a queue copy was wrong", before
            if chaos.tally["queue"]["lost_at_submit"]:
                break
        assert chaos.tally["queue"]["lost_at_submit"] == 1, chaos.tally["queue"]

"""The device schedulers (hetproc.supervisor._scheduler): exact order on scripted arrivals.

Pure logic: commands here are plain records with the attributes the scheduler reads. The
real-platform tests in tests/test_modeled_time.py run the same policies across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hetproc._config import SchedSpec, parse_platform
from hetproc.supervisor._scheduler import POLICY_CLASSES, make_scheduler
from ipc import errors

MS = 1_000_000


@dataclass
class Cmd:
    seq: int
    client: int
    priority: int = 0
    hold_ns: int = MS
    deadline_ns: int = 0
    weight: float = 1.0
    tag: str = ""
    ctx: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.ctx = SimpleNamespace(client=SimpleNamespace(id=self.client), weight=self.weight)
        self.tag = self.tag or f"c{self.client}#{self.seq}"


class Script:
    """Arrivals numbered in order; ``run`` picks and accounts like a device would."""

    def __init__(self, policy: str, **spec) -> None:
        self.s = make_scheduler(SchedSpec(policy=policy, **spec))
        self.seq = 0

    def add(self, client: int, n: int = 1, **kw) -> list[Cmd]:
        out = []
        for _ in range(n):
            self.seq += 1
            c = Cmd(self.seq, client, **kw)
            self.s.add(c)
            out.append(c)
        return out

    def run(self, n: int | None = None, now: int = 0) -> list[str]:
        order = []
        while self.s and (n is None or len(order) < n):
            c = self.s.pick(now)
            self.s.account(c, c.hold_ns)
            order.append(c.tag)
        return order


def test_fifo_runs_in_submission_order_whatever_the_priority():
    sc = Script("fifo")
    sc.add(1, tag="a")
    sc.add(2, priority=50, tag="b")
    sc.add(1, tag="c")
    assert sc.run() == ["a", "b", "c"]
    assert not sc.s.preempts(Cmd(9, 3, priority=99), Cmd(1, 1))


def test_priority_highest_first_then_clients_share_a_level_fairly():
    sc = Script("priority")
    sc.add(1, n=4, tag="A")           # client 1's backlog, arriving first
    sc.add(2, n=2, tag="B")           # client 2 arrives behind it at the same level
    sc.add(3, priority=5, tag="HI")
    order = sc.run()
    assert order[0] == "HI"
    # Not A A A A B B: client 2 is served in turn, its backlog cannot wait for client 1's.
    assert order[1:] == ["A", "B", "A", "B", "A", "A"]
    assert sc.s.preempts(Cmd(9, 3, priority=5), Cmd(1, 1, priority=0))
    assert not sc.s.preempts(Cmd(9, 3, priority=0), Cmd(1, 1, priority=0))


def test_a_client_that_was_idle_gets_no_burst_of_credit():
    sc = Script("priority")
    sc.add(1, n=6, tag="A")
    assert sc.run(4) == ["A"] * 4          # client 1 alone: its vtime grows to 4 ms
    sc.add(2, n=4, tag="B")                # client 2 joins at the current virtual time
    # ...so it alternates with client 1 instead of running its four first.
    assert sc.run() == ["B", "A", "B", "A", "B", "B"]


def test_priority_keeps_each_clients_own_order():
    sc = Script("priority")
    a = sc.add(1, n=3)
    assert [c.tag for c in (sc.s.pick(), sc.s.pick(), sc.s.pick())] == [c.tag for c in a]


def test_edf_earliest_deadline_first_and_no_deadline_last_in_order():
    sc = Script("edf")
    sc.add(1, tag="none1")
    sc.add(1, deadline_ns=30 * MS, tag="d30")
    sc.add(2, deadline_ns=10 * MS, tag="d10")
    sc.add(2, tag="none2")
    sc.add(3, deadline_ns=20 * MS, tag="d20")
    assert sc.run() == ["d10", "d20", "d30", "none1", "none2"]
    assert sc.s.preempts(Cmd(9, 1, deadline_ns=5), Cmd(1, 2, deadline_ns=9))
    assert not sc.s.preempts(Cmd(9, 1), Cmd(1, 2, deadline_ns=9))


def test_fair_share_follows_weights_not_arrival():
    sc = Script("fair")
    sc.add(1, n=6, weight=2.0, tag="W2")   # twice the share of client 2
    sc.add(2, n=6, weight=1.0, tag="W1")
    first9 = sc.run(9)
    assert first9.count("W2") == 6 and first9.count("W1") == 3
    assert not sc.s.preempts(Cmd(9, 3, priority=99), Cmd(1, 1))


def test_fair_share_charges_what_ran_not_how_many():
    sc = Script("fair")
    sc.add(1, n=2, hold_ns=10 * MS, tag="long")
    sc.add(2, n=10, hold_ns=1 * MS, tag="short")
    order = sc.run()
    # One long job is worth ten short ones: the second long job waits for them all.
    assert order == ["long"] + ["short"] * 10 + ["long"]


def test_mixed_camera_first_voice_before_llm_and_llm_shares_fairly():
    sc = Script("mixed", realtime_priority=10, min_share=0.0)
    sc.add(7, n=2, priority=0, hold_ns=50 * MS, tag="llm7")
    sc.add(8, n=2, priority=0, hold_ns=50 * MS, tag="llm8")
    sc.add(2, priority=1, tag="voice")
    sc.add(1, priority=10, deadline_ns=33 * MS, tag="cam")
    assert sc.run() == ["cam", "voice", "llm7", "llm8", "llm7", "llm8"]
    llm, voice, cam = Cmd(1, 7, priority=0), Cmd(2, 2, priority=1), Cmd(3, 1, priority=10)
    assert sc.s.preempts(cam, llm) and sc.s.preempts(voice, llm) and sc.s.preempts(cam, voice)
    assert not sc.s.preempts(llm, voice) and not sc.s.preempts(Cmd(4, 8, priority=0), llm)


def test_mixed_always_on_keeps_its_minimum_share_when_camera_has_slack():
    sc = Script("mixed", realtime_priority=10, min_share=0.25)
    order = []
    for frame in range(8):  # the camera alone would take every turn
        sc.add(1, priority=10, deadline_ns=(frame + 100) * MS, hold_ns=MS, tag="cam")
        sc.add(2, priority=1, hold_ns=MS, tag="voice")
        order += sc.run(1)
    order += sc.run()
    first8 = order[:8]
    assert first8.count("voice") >= 2  # at least its 25 % while both wait
    assert order.count("cam") == 8 and order.count("voice") == 8


def test_mixed_camera_without_slack_is_never_delayed_by_the_minimum_share():
    sc = Script("mixed", realtime_priority=10, min_share=0.9)
    sc.add(2, priority=1, hold_ns=MS, tag="voice")
    sc.run()                      # the voice share is now 100 %... then the camera runs
    sc.add(1, priority=10, deadline_ns=1 * MS, hold_ns=MS, tag="cam")
    sc.add(2, priority=1, hold_ns=MS, tag="voice")
    sc.s.account(Cmd(0, 1, priority=10), 100 * MS)  # camera used the device a lot lately
    assert sc.run(now=0) == ["cam", "voice"]  # no slack: the deadline wins over the share


def test_remove_if_keeps_the_rest_in_policy_order():
    for name in POLICY_CLASSES:
        sc = Script(name)
        a = sc.add(1, n=3, priority=1)
        b = sc.add(2, n=2, priority=1)
        gone = sc.s.remove_if(lambda c, a=a: c.client == 1 and c.seq != a[2].seq)
        assert [c.seq for c in gone] == [a[0].seq, a[1].seq], name
        assert sorted(c.seq for c in sc.s) == sorted([a[2].seq] + [c.seq for c in b]), name
        assert len(sc.run()) == 3, name


def test_platform_file_chooses_the_policy_and_refuses_bad_ones():
    base = {"device": [{"name": "npu0", "kind": "npu", "ops": ["work"],
                        "scheduler": {"policy": "edf", "chunk_ms": 1, "switch_us": 30}}]}
    spec = parse_platform(base)
    assert spec.devices[0].scheduler == SchedSpec(policy="edf", chunk_ms=1.0, switch_us=30.0)
    for bad in ({"policy": "lottery"}, {"chunk_ms": -1}, {"min_share": 2.0},
                {"chunk_ms": float("nan")}, {"quantum": 1}):
        raw = {"device": [{**base["device"][0], "scheduler": bad}]}
        with pytest.raises(errors.InvalidRequest):
            parse_platform(raw)

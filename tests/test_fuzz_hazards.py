"""The hazard check against a reference, on seeded random programs: commands on six
contexts over three devices touch four shared buffers, each waiting on a random few of
the fences before it. A reference computes, for each command, what it is ordered after
(the producers of the fences it waits on and the commands before it on its context,
transitively) and which earlier commands it conflicts with; then

* no false positive: a command ordered after every conflicting one is always served;
* every hazard caught: a command served although it conflicts, unordered, with another
  must find that other finished (a command still unfinished once the submit returned was
  unfinished when the supervisor checked it);
* a refusal names a command the reference finds conflicting and unordered.

Each device first runs a long command of another context, so that most commands are
still unfinished while the program is submitted (a slow host only makes fewer cases
conclusive, never a wrong verdict)."""

from __future__ import annotations

import random

import pytest

import hetproc

DEVICES = ("cpu0", "gpu0", "npu0")
SEEDS = range(4)


@pytest.fixture(scope="module")
def plat():
    with hetproc.Platform(time_scale=1.0) as p:
        yield p


class Reference:
    """What each accepted command is ordered after, and what it touched."""

    def __init__(self) -> None:
        self.accepted: list[dict] = []
        self.by_fence: dict[int, dict] = {}

    def before(self, ctx: int, waits: list) -> set[int]:
        """Indices of the accepted commands a new command on ``ctx`` waiting on ``waits``
        is ordered after."""
        out: set[int] = set()
        for cmd in self.accepted:
            if cmd["ctx"] == ctx:  # one priority everywhere: a context runs in order
                out |= {cmd["i"]} | cmd["after"]
        for f in waits:
            cmd = self.by_fence[f.handle]
            out |= {cmd["i"]} | cmd["after"]
        return out

    def conflicts(self, reads: set[int], writes: set[int]) -> list[dict]:
        return [c for c in self.accepted
                if reads & c["writes"] or writes & (c["reads"] | c["writes"])]


def _program(c: hetproc.Client, rng: random.Random, bufs: list, ctxs: list, n: int) -> dict:
    ref, tally = Reference(), {"served": 0, "refused": 0, "unconclusive": 0, "caught": 0}
    fences = []
    for _ in range(n):
        ctx = rng.randrange(len(ctxs))
        reads = set(rng.sample(range(len(bufs)), rng.randint(0, 2)))
        writes = set(rng.sample(range(len(bufs)), rng.randint(0, 1)))
        recent = [f for f, _ in fences[-6:]]
        waits = rng.sample(recent, min(len(recent), rng.choice([0, 0, 1, 1, 2])))
        after = ref.before(ctx, waits)
        unordered = [t for t in ref.conflicts(reads, writes) if t["i"] not in after]
        try:
            fence = ctxs[ctx].submit("work", [bufs[i] for i in sorted(reads)],
                                     [bufs[i] for i in sorted(writes)], wait=waits, ms=1)
        except hetproc.SyncHazard as exc:
            tally["refused"] += 1
            assert unordered, f"a false positive: {exc} (ordered after {sorted(after)})"
            assert exc.detail["other_cid"] in {t["fence"].cid for t in unordered}, exc
            continue
        running = [t for t in unordered if not t["fence"].done()]
        assert not running, (f"command {len(ref.accepted)} was served unordered with "
                             f"{[t['fence'].cid for t in running]}, still unfinished")
        tally["served"] += 1
        tally["unconclusive"] += bool(unordered)
        cmd = {"i": len(ref.accepted), "ctx": ctx, "reads": reads, "writes": writes,
               "after": after, "fence": fence}
        ref.accepted.append(cmd)
        ref.by_fence[fence.handle] = cmd
        fences.append((fence, cmd))
    for fence, _ in fences:
        fence.wait(10)
        fence.release()
    return tally


@pytest.mark.parametrize("seed", SEEDS)
def test_random_programs_are_judged_as_the_reference_judges_them(plat, seed):
    c, rng = plat.client, random.Random(seed)
    bufs = [c.alloc(64) for _ in range(4)]
    ctxs = [c.context(d) for d in DEVICES for _ in range(2)]
    holders = [c.context(d) for d in DEVICES]
    blockers = [h.submit("work", ms=300) for h in holders]
    before = c.metrics()["hazards"]
    tally = _program(c, rng, bufs, ctxs, 40)
    for f in blockers:
        f.wait(10)
    after = c.metrics()["hazards"]
    assert tally["refused"] == after["refused"] - before["refused"] > 0, tally
    assert tally["served"] > 10, tally
    for ctx in ctxs + holders:
        ctx.close()
    for b in bufs:
        b.free()

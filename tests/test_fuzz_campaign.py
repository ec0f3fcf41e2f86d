"""The fuzz campaign (``python -m bench.fuzz_campaign``) end to end, small: a real
platform, an attacker process sending every kind of hostile packet over many
connections, a bystander whose outputs and canaries are checked, every process alive
at the end and nothing left after stop. The long run (100,000+ packets) is a bench."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fuzz_campaign as fc


def test_a_short_campaign_leaves_every_process_alive_and_the_bystander_correct():
    r = fc.run_campaign(packets=1500, seed=7)
    assert r["ok"], r["problems"]
    assert r["packets"] == 1500
    assert set(r["sent_by_kind"]) >= {"mutated", "valid", "random_msgpack", "random_bytes",
                                      "truncated", "huge"}
    outcomes = r["replies_by_outcome"]
    assert outcomes.get("BadPacket", 0) > 0 and outcomes.get("InvalidRequest", 0) > 0, outcomes
    assert "InternalError" not in outcomes, "a handler raised where a check should answer"
    assert r["bystander"]["correct_outputs"] >= 5  # one round on every device at least
    hoarded = r["hoarded"]  # then the shared resources: taken, refused cleanly, let go
    assert hoarded["segments"] >= 16 and hoarded["read_only_imports"] == 1, hoarded
    assert hoarded["queues"] >= 1 and hoarded.get("refused: QuotaExceeded", 0) >= 1, hoarded


def test_each_packet_is_a_function_of_seed_and_index():
    """What makes a finding reproducible from its seed and index alone."""
    h = {k: 1 << 32 | 5 for k in ("ctx", "ctx2", "buf", "buf2", "buf3", "buf4", "fence",
                                  "fence2")}
    first = [fc.packet(3, i, h, 10) for i in range(300)]
    again = [fc.packet(3, i, h, 10) for i in reversed(range(300))][::-1]
    assert first == again
    assert first != [fc.packet(4, i, h, 10) for i in range(300)]
    assert len({kind for kind, _ in first}) == 6


def test_mutations_reach_every_field_kind():
    rng = random.Random(0)
    base = {"v": 1, "op": "submit", "id": 1, "ctx": 5, "cmds": [{"kernel": "work", "ms": 0}]}
    seen = {fc.encode(fc.mutate(base, rng)) for _ in range(400)}
    assert len(seen) > 200, "mutations are varied"


def test_every_request_of_the_protocol_has_a_template_that_passes_its_schema():
    """A new request op is fuzzed from the day it exists (the campaign picks ops from the
    protocol's list, so a missing template would stop it at the first draw)."""
    from hetproc import _protocol
    from ipc import VERSION, decode, encode

    h = {k: 5 for k in ("ctx", "ctx2", "buf", "buf2", "buf3", "buf4", "fence", "fence2")}
    for seed in range(20):
        templates = fc.templates(h, random.Random(seed))
        assert set(templates) == set(_protocol.REQUESTS)
        for op, fields in templates.items():
            decode(encode({"v": VERSION, "op": op, "id": 1, **fields}), _protocol.REQUESTS)

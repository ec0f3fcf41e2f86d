"""The control protocol and the supervisor's request table describe the same requests."""

from hetproc import _protocol
from hetproc.supervisor._fencefds import FenceFdRequests
from hetproc.supervisor._requests import HANDLERS
from hetproc.supervisor._requests_commands import CommandRequests
from hetproc.supervisor._requests_conn import ConnectionRequests
from hetproc.supervisor._requests_memory import MemoryRequests
from hetproc.supervisor._requests_reports import ReportRequests
from hetproc.supervisor._resets import ResetRequests

GROUPS = {"connection": ConnectionRequests, "memory": MemoryRequests,
          "commands": CommandRequests, "reports": ReportRequests, "resets": ResetRequests,
          "fencefds": FenceFdRequests}


def test_every_request_of_the_protocol_has_exactly_one_handler():
    assert set(HANDLERS) == set(_protocol.REQUESTS)
    for op, (group, method) in HANDLERS.items():
        assert callable(getattr(GROUPS[group], method, None)), f"{op}: no method {group}.{method}"
    assert len(set(HANDLERS.values())) == len(HANDLERS), "one handler serves one request"
    # Every public method of a group serves a request: no handler is unreachable.
    served = set(HANDLERS.values())
    for group, cls in GROUPS.items():
        public = {name for name, value in vars(cls).items()
                  if not name.startswith("_") and callable(value)}
        assert {(group, name) for name in public} <= served, group


def test_every_request_schema_carries_an_id():
    for op, schema in _protocol.REQUESTS.items():
        assert schema.get("id") is int, op


def test_a_command_shape_test_accepts_exactly_what_the_field_checks_accept(monkeypatch):
    """``check_command`` tests a command of a known shape (its fields, in order) in one
    straight line; on random commands, valid and not, it must say what the field-by-field
    checks say, error for error."""
    import random

    from hetproc._config import load_platform
    from hetproc.supervisor import _validation as v
    from ipc import errors

    limits = load_platform().limits
    values = {
        "kernel": ["work", "", "w" * 64, "w" * 65, "a\x00", 5],
        "ins": [[], [1, 2], [-1], [1 << 63], [True], "x", [1.0], list(range(17))],
        "outs": [[], [3], list(range(17))], "wait": [[], [5], list(range(65))],
        "ms": [0.0, 1, -1.0, float("nan"), float("inf"), 1e30, True, "1"],
        "cid": [0, -1, 1 << 64, (1 << 64) - 1, True, 1.0],
        "signal": [7, 1 << 63, None], "checked": [True, 1, None],
        "priority": [0, -(1 << 31), 1 << 31, (1 << 31) + 1, True],
        "deadline_ms": [1.0, float("-inf")], "params": [{}, None], "bogus": [1]}

    def verdict(c: dict) -> str:
        try:
            v.check_command(c, limits)
            return "ok"
        except errors.HetprocError as exc:
            return f"{exc.name}: {exc.message}"

    rng = random.Random(7)
    cases = []
    for _ in range(3000):
        keys = ["kernel"] + rng.sample(list(values)[1:], rng.randint(0, 6))
        c = {k: values[k][0] if rng.random() < 0.8 else rng.choice(values[k]) for k in keys}
        cases.append(c)
    with monkeypatch.context() as m:  # the field-by-field checks alone
        m.setattr(v, "_SHAPES", {})
        m.setattr(v, "_learn_shape", lambda shape: None)
        expected = [verdict(c) for c in cases]
    got = [verdict(c) for c in cases]
    assert got == expected
    assert expected.count("ok") > 500 and len(set(expected)) > 10
    assert v._SHAPES, "the shapes seen were learnt"

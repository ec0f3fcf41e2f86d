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

    limits = load_platform().limits
    values = {
        "kernel": ["work", "", "w" * 64, "w" * 65, "a\x00", 5],
        "ins": [[], [1, 2], [-1], [1 << 63], [True], "x", [1.0], list(range(17))],
        "outs": [[], [3], list(range(17))], "wait": [[], [5], list(range(65))],
        "ms": [0.0, 1, -1.0, float("nan"), float("inf"), 1e30, True, "1"],
        "cid": [0, -1, 1 << 64, (1 << 64) - 1, True, 1.0],
        "signal": [7, 1 << 63, None], "checked": [True, 1, None],
        "priority": [0, -(1 << 31), 1 << 31, (1 << 31) + 1, True],
        "deadline_ms": [1.0, float("-inf")], "bogus": [1],
        "params": [{}, None, {"factor": 2.0}, {"a": [[[[1]]]]}, {3: 1}, {"b": "x" * 2000},
                   {"c": float("nan")}, {"d": 1 << 64}, [1]]}

    def verdict(c: dict) -> str:
        return _verdict(v.check_command, c, limits)

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


def test_a_request_shape_test_accepts_exactly_what_the_field_checks_accept(monkeypatch):
    """``check_request`` tests a request of a known shape in one straight line, then the
    fields it has no inline test for (a submit's commands) by their own checks; on random
    requests, valid and not, it must say what the field-by-field checks say."""
    import random

    from hetproc._config import load_platform
    from hetproc.supervisor import _validation as v

    limits = load_platform().limits
    ops = {
        "submit": {"id": [1, 0, -1, 1 << 64, True], "ctx": [5, -5, 1.0],
                   "cmds": [[{"kernel": "work"}], [], [{"kernel": 5}], [1], "x",
                            [{"kernel": "work"}] * 4097],
                   "t_ns": [0, -1, 1 << 63]},
        "context_create": {"id": [1], "device": ["npu0", "n" * 65, 3], "priority": [0, 1 << 40],
                           "name": ["a", "a\x00", "n" * 300], "period_ms": [1.0, -1.0, 1e30],
                           "weight": [1.0, float("nan")], "cache_maintenance": [True, "x", 1],
                           "recoverable": [True, 1]},
        "fence_release": {"id": [2], "fences": [[1, 2], [], [-1], [True], list(range(4097))]},
        "grant_role": {"id": [3], "scope": ["all", "nope", 1]},
    }

    def verdict(msg: dict) -> str:
        return _verdict(v.check_request, msg, limits)

    rng = random.Random(11)
    cases = []
    for _ in range(3000):
        op = rng.choice(sorted(ops))
        keys = rng.sample(list(ops[op]), rng.randint(1, len(ops[op])))
        msg = {"v": 1, "op": op, **{k: ops[op][k][0] if rng.random() < 0.7
                                    else rng.choice(ops[op][k]) for k in keys}}
        cases.append(msg)
    with monkeypatch.context() as m:  # the field-by-field checks alone
        m.setattr(v, "_REQUEST_SHAPES", {})
        m.setattr(v, "_learn_request", lambda op, shape: v._none)
        expected = [verdict(c) for c in cases]
    got = [verdict(c) for c in cases]
    assert got == expected
    assert expected.count("ok") > 300 and len(set(expected)) > 10
    assert v._REQUEST_SHAPES, "the shapes seen were learnt"


def _verdict(check, case: dict, limits) -> str:
    """What ``check`` says of ``case``: "ok", or the error's name and message."""
    from ipc import errors
    try:
        check(case, limits)
        return "ok"
    except errors.HetprocError as exc:
        return f"{exc.name}: {exc.message}"

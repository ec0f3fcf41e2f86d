"""The control protocol and the supervisor's request table describe the same requests."""

from hetproc import _protocol
from hetproc.supervisor._requests import HANDLERS, Requests


def test_every_request_of_the_protocol_has_exactly_one_handler():
    assert set(HANDLERS) == set(_protocol.REQUESTS)
    for op, method in HANDLERS.items():
        assert callable(getattr(Requests, method, None)), f"{op}: no method {method}"
    assert len(set(HANDLERS.values())) == len(HANDLERS), "one handler serves one request"


def test_every_request_schema_carries_an_id():
    for op, schema in _protocol.REQUESTS.items():
        assert schema.get("id") is int, op

"""The error hierarchy: stable codes, scopes, wire round trip, one export per name."""

import pytest

import hetproc
import ipc.errors as E


def all_error_classes():
    return [getattr(E, n) for n in E.__all__ if isinstance(getattr(E, n), type)]


def test_codes_are_unique_and_stable():
    codes = [c.code for c in all_error_classes()]
    assert len(codes) == len(set(codes))
    assert E.DeviceTimeout.code == 22 and E.StaleHandle.code == 13  # wire-visible: never renumber


@pytest.mark.parametrize("cls", all_error_classes())
def test_every_error_answers_the_runtime_questions(cls):
    exc = cls("boom", correlation_id=42)
    d = exc.to_dict()
    assert d["scope"] in E.SCOPES
    assert isinstance(d["retryable"], bool) and isinstance(d["buffers_trusted"], bool)
    back = E.HetprocError.from_dict(d)
    assert type(back) is cls and back.correlation_id == 42 and str(back) == "boom"


def test_unknown_code_maps_to_base_class():
    assert E.error_class(9999) is E.HetprocError


def test_branches_say_what_a_caller_catches():
    assert issubclass(E.StaleHandle, E.InvalidRequest)
    assert issubclass(E.DeviceTimeout, E.Timeout)
    assert issubclass(E.DeviceCrashed, E.DeviceFault)
    assert E.DeviceTimeout.scope == "context" and not E.DeviceTimeout.buffers_trusted
    assert E.InvalidRequest.buffers_trusted and not E.InvalidRequest.retryable


def test_public_api_exports_each_name_once():
    names = hetproc.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(hetproc, name) is not None
    for name in E.__all__:
        assert name in names or name in ("error_class", "error_from_code", "SCOPES")

"""The error hierarchy: stable codes, the seed's six questions on every error object, the
branches a caller catches, and errors that explain themselves across real processes."""

import os
import signal
import subprocess
import sys
import traceback

import pytest

import hetproc
import ipc.errors as E
from hetproc import Client, errors
from tests.helpers import wait_for


def all_error_classes():
    return [getattr(E, n) for n in E.__all__
            if isinstance(getattr(E, n), type) and issubclass(getattr(E, n), E.HetprocError)]


def test_codes_are_unique_and_stable():
    codes = [c.code for c in all_error_classes()]
    assert len(codes) == len(set(codes))
    assert E.DeviceTimeout.code == 22 and E.StaleHandle.code == 13  # wire-visible: never renumber
    assert E.Cancelled.code == 31 and E.InternalError.code == 53


@pytest.mark.parametrize("cls", all_error_classes())
def test_every_error_answers_the_runtime_questions(cls):
    exc = cls("boom", correlation_id=42, detail={"trace_window": 3, "incident": 7})
    d = exc.to_dict()
    assert d["scope"] in E.SCOPES
    for field in ("retryable", "buffers_trusted", "fallback_possible", "others_affected"):
        assert isinstance(d[field], bool), field
    assert exc.evidence == {"trace_window": 3, "incident": 7}
    back = E.HetprocError.from_dict(d)
    assert type(back) is cls and back.correlation_id == 42 and str(back) == "boom"
    assert back.evidence == exc.evidence and back.fallback_possible == exc.fallback_possible


@pytest.mark.parametrize("cls", all_error_classes())
def test_every_class_says_when_it_is_raised(cls):
    assert cls.__doc__ and len(cls.__doc__.strip()) > 20


def test_an_error_without_a_message_is_built_when_docstrings_are_stripped():
    # ``python -OO`` drops every docstring, the one a message-less error reads its default
    # message from: building one (a record whose message is empty) must not crash.
    code = ("import ipc.errors as E\n"
            "print(E.FenceTimeout().message)\n"
            "print(E.HetprocError.from_dict({'code': E.DeviceTimeout.code}).message)\n")
    done = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FenceTimeout", "DeviceTimeout"]
    assert E.FenceTimeout().message == E.FenceTimeout.__doc__.strip().splitlines()[0]


def test_unknown_code_maps_to_base_class():
    assert E.error_class(9999) is E.HetprocError


def test_branches_say_what_a_caller_catches():
    assert issubclass(E.StaleHandle, E.InvalidRequest)
    assert issubclass(E.DeviceTimeout, E.Timeout)
    assert issubclass(E.DeviceCrashed, E.DeviceFault)
    assert E.DeviceTimeout.scope == "context" and not E.DeviceTimeout.buffers_trusted
    assert E.InvalidRequest.buffers_trusted and not E.InvalidRequest.retryable


def test_every_timeout_is_a_timeout():
    for cls in (E.FenceTimeout, E.DeviceTimeout, E.DependencyTimeout, E.RequestTimeout,
                E.CompileTimeout):
        assert issubclass(cls, hetproc.Timeout), cls


def test_a_clients_own_cancel_is_not_a_device_fault_but_a_reset_is():
    assert not issubclass(E.Cancelled, E.DeviceFault)
    assert issubclass(E.CancelledByReset, E.Cancelled)
    assert issubclass(E.CancelledByReset, E.DeviceFault)
    assert E.CancelledByReset("x").others_affected and not E.Cancelled("x").others_affected


def test_internal_errors_are_their_own_class():
    assert issubclass(E.InternalError, E.PlatformError) and E.InternalError.scope == "request"


def test_classes_show_as_hetproc_names():
    assert hetproc.errors.DeviceTimeout is E.DeviceTimeout
    assert E.DeviceTimeout.__module__ == "hetproc"
    line = traceback.format_exception_only(hetproc.DeviceTimeout("late"))[-1]
    assert line.startswith("hetproc.DeviceTimeout: late")


def test_errors_module_and_package_export_the_same_hierarchy():
    assert set(errors.__all__) <= set(hetproc.__all__)


def test_a_device_side_exception_arrives_with_its_remote_traceback(client):
    npu = client.context("npu0")
    client.inject("kernel_bug", device="npu0", at=1)
    x = client.alloc(16, "float32")
    with pytest.raises(hetproc.DeviceFault) as info:
        npu.submit("relu", [x], [x]).wait(5)
    cause = info.value.__cause__
    assert isinstance(cause, E.RemoteTraceback)
    assert "KeyError" in str(cause) and "_vendor_kernel_with_a_bug" in str(cause)
    assert info.value.evidence.get("trace_window"), "the error says where its window is"
    npu.submit("relu", [x], [x]).wait(5)  # the device serves on


def test_a_timeout_names_its_incident_and_window(client):
    client.inject("timeout", device="npu0", at=1)
    with pytest.raises(hetproc.DeviceTimeout) as info:
        client.context("npu0").submit("work", ms=5, timeout_ms=20).wait(5)
    assert info.value.evidence.get("incident") and info.value.fallback_possible


def test_a_crash_is_explained_by_the_record_sent_ahead_of_the_wake(platform, monkeypatch):
    """While the supervisor resets the device, the woken waiter already holds the record
    that explains its failure: it is sent to the fence's owner and importers before the
    wake, so explaining asks the busy supervisor nothing. Nobody else receives it."""
    owner = platform.client
    importer, bystander = platform.connect("importer"), platform.connect("bystander")
    fence = owner.context("npu0").submit("work", ms=5000)
    theirs = importer.import_fence(fence.export())
    assert wait_for(lambda: owner.metrics()["devices"]["npu0"]["state"] == "busy")
    asked: list[str] = []
    request = Client._request

    def counted(self, op, **fields):
        asked.append(op)
        return request(self, op, **fields)

    monkeypatch.setattr(Client, "_request", counted)
    os.kill(owner.metrics()["devices"]["npu0"]["pid"], signal.SIGKILL)
    asked.clear()
    with pytest.raises(hetproc.DeviceCrashed) as info:
        fence.wait(5)
    assert asked == [], "the failure was explained without a request"
    assert "npu0" in str(info.value) and "died" in str(info.value)
    assert info.value.evidence.get("incident")
    assert importer.failure_record(theirs.handle)["message"] == info.value.message
    assert bystander.failure_record(fence.handle) is None
    assert asked == []
    importer.close()
    bystander.close()

"""The one error hierarchy of hetproc.

It lives in the lowest layer on purpose: error *codes* cross process boundaries (a device
writes one into a fence's state word, the supervisor puts one into a reply packet), so every
layer -- ``ipc``, ``device_workers`` and ``hetproc`` -- must speak the same vocabulary.
``hetproc`` re-exports every class here.

Every error answers the questions a runtime must answer after a failure (seed §8, §20):

``code``
    a stable small integer (and ``name``), the same in every process and in reports.
``scope``
    how far the damage goes: ``request`` (only this command failed), ``context`` (the
    context is lost, later submits on it fail at once), ``process`` (a client or the
    supervisor is gone), ``device`` (the device was reset; every context on it was touched).
``retryable``
    whether submitting the same request again may succeed.
``buffers_trusted``
    whether the buffers the request touched still hold what they held before (inputs) or
    valid results (outputs). ``False`` means: do not read them, reallocate or rewrite.
``fallback_possible``
    whether the same request may succeed on another device (a CPU fallback, say): a
    device failure or an op the device lacks, yes; a malformed request, no.
``evidence``
    where to look: ``trace_window`` (the frozen window's id, ``hetproc trace frozen``)
    and ``incident`` (the recovery's dump, ``Client.dumps()``), when the supervisor made
    them; filled in from the supervisor's record of the failure.
``others_affected``
    whether other clients may have been touched: a device-scope failure reset the device
    under every context on it; a process-scope one lost a process they may share.
``correlation_id``
    the request's id, to find it in the trace; 0 when there is no request.

The tree is small and flat on purpose: callers catch a branch (``InvalidRequest``,
``DeviceFault``, ``ResourceError``, ``Timeout``, ``PlatformError``) or one leaf. Every
timeout, whatever its cause, is a ``Timeout``. ``Cancelled`` (the client's own cancel)
is not a device fault; ``CancelledByReset`` (someone's failure reset the device) is.
A failure that began as a Python exception inside a device process carries that
process's traceback: ``RemoteTraceback`` is chained as the error's ``__cause__``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HetprocError",
    "InvalidRequest",
    "BadPacket",
    "InvalidHandle",
    "StaleHandle",
    "ForeignHandle",
    "ShapeError",
    "DtypeError",
    "UnsupportedOp",
    "IommuFault",
    "ForeignBuffer",
    "NotPermitted",
    "SyncHazard",
    "Timeout",
    "FenceTimeout",
    "DeviceTimeout",
    "DependencyTimeout",
    "PreemptTimeout",
    "RequestTimeout",
    "DeviceFault",
    "Cancelled",
    "CancelledByReset",
    "DependencyFailed",
    "DeviceCrashed",
    "WrongOutput",
    "ContextLost",
    "ContextBanned",
    "DeviceWedged",
    "DeviceRestarted",
    "ResourceError",
    "OutOfMemory",
    "QuotaExceeded",
    "DescriptorsExhausted",
    "AllocationFailed",
    "MapFailed",
    "CompileTimeout",
    "PlatformError",
    "PlatformClosed",
    "SupervisorLost",
    "InternalError",
    "RemoteTraceback",
    "error_class",
    "error_from_code",
    "error_from_word",
    "SCOPES",
]

SCOPES = ("request", "context", "process", "device")

_BY_CODE: dict[int, type[HetprocError]] = {}


class HetprocError(Exception):
    """Base of every error hetproc raises on purpose.

    Subclasses set the class-level defaults; an instance may override any of them (a
    cancelled command on a reset device has scope ``device``, one cancelled by its own
    client has scope ``request``).
    """

    code = 1
    scope = "request"
    retryable = False
    buffers_trusted = True
    fallback_possible = False

    def __init__(
        self,
        message: str = "",
        *,
        scope: str | None = None,
        retryable: bool | None = None,
        buffers_trusted: bool | None = None,
        correlation_id: int = 0,
        fallback_possible: bool | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message or _summary(type(self)))
        if scope is not None:
            if scope not in SCOPES:
                raise ValueError(f"unknown error scope {scope!r}")
            self.scope = scope
        if retryable is not None:
            self.retryable = retryable
        if buffers_trusted is not None:
            self.buffers_trusted = buffers_trusted
        if fallback_possible is not None:
            self.fallback_possible = fallback_possible
        self.correlation_id = correlation_id
        self.detail = detail or {}
        tb = self.detail.get("remote_traceback")
        if tb:
            self.__cause__ = RemoteTraceback(str(tb))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            return  # a refinement for one API (onnx's backend): it travels as its parent
        if cls.code in _BY_CODE and _BY_CODE[cls.code] is not cls:
            raise TypeError(f"error code {cls.code} used twice")
        _BY_CODE[cls.code] = cls

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def evidence(self) -> dict[str, Any]:
        """``{"trace_window": id, "incident": id}``, the parts the supervisor made."""
        return {k: self.detail[k] for k in ("trace_window", "incident") if self.detail.get(k)}

    @property
    def others_affected(self) -> bool:
        return self.scope in ("device", "process")

    @property
    def wire(self) -> int:
        """The 32-bit word a failed fence carries: code plus scope and flags."""
        return _pack(self)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def to_dict(self) -> dict[str, Any]:
        """The wire and report form; ``error_from_dict`` reverses it."""
        return {
            "code": self.code,
            "name": self.name,
            "message": self.message,
            "scope": self.scope,
            "retryable": self.retryable,
            "buffers_trusted": self.buffers_trusted,
            "correlation_id": self.correlation_id,
            "fallback_possible": self.fallback_possible,
            "others_affected": self.others_affected,
            "detail": self.detail,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> HetprocError:
        cls = error_class(int(d.get("code", 1)))
        return cls(
            str(d.get("message", "")),
            scope=d.get("scope"),
            retryable=d.get("retryable"),
            buffers_trusted=d.get("buffers_trusted"),
            correlation_id=int(d.get("correlation_id") or 0),
            fallback_possible=d.get("fallback_possible"),
            detail=d.get("detail") or {},
        )


_BY_CODE[HetprocError.code] = HetprocError


def _summary(cls: type) -> str:
    """A message-less error says what its class is for: the first line of its docstring,
    or its name where there is none (a subclass without one, or ``python -OO``, which
    strips them all)."""
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else cls.__name__


class RemoteTraceback(Exception):
    """The traceback of the exception that failed a command inside a device process,
    chained as the ``__cause__`` of the error the client sees (its text is the remote
    traceback, as ``concurrent.futures`` does for worker processes)."""

    def __str__(self) -> str:
        return "\n\n" + str(self.args[0]) if self.args else ""


def error_class(code: int) -> type[HetprocError]:
    """The class for a wire code; unknown codes map to the base class, never raise."""
    return _BY_CODE.get(code, HetprocError)


def error_from_code(code: int, message: str = "", **kw: Any) -> HetprocError:
    """The error a wire or fence code stands for, built with ``message`` (an unknown code:
    the base class, never a failure to build one)."""
    return error_class(code)(message, **kw)


# A fence's 32-bit error word carries the code and the answers a waiter needs first, so
# that it can raise the right error the moment it wakes, with no round trip:
#   bits 0-15 code | 16-17 scope | 18 retryable | 19 buffers trusted | 20 flags present
_FLAGS = 1 << 20


def _pack(exc: HetprocError) -> int:
    return (exc.code | SCOPES.index(exc.scope) << 16 | int(exc.retryable) << 18
            | int(exc.buffers_trusted) << 19 | _FLAGS)


def error_from_word(word: int, message: str = "", correlation_id: int = 0) -> HetprocError:
    """The error a fence's error word describes (see ``HetprocError.wire``)."""
    cls = error_class(word & 0xFFFF)
    if not word & _FLAGS:
        return cls(message, correlation_id=correlation_id)
    return cls(message, scope=SCOPES[word >> 16 & 3], retryable=bool(word >> 18 & 1),
               buffers_trusted=bool(word >> 19 & 1), correlation_id=correlation_id)


# -- the request was wrong: fix the caller, retrying the same thing cannot help ----------


class InvalidRequest(HetprocError):
    """The request was malformed or not allowed; nothing was executed, buffers untouched."""

    code = 10


class BadPacket(InvalidRequest):
    """A packet failed its version, length or schema check; it was dropped, the reader lives."""

    code = 11


class InvalidHandle(InvalidRequest):
    """A handle names no live object."""

    code = 12


class StaleHandle(InvalidHandle):
    """A handle's generation is old: the object it named was released and its slot reused."""

    code = 13


class ForeignHandle(InvalidHandle):
    """A handle belongs to another context, client or platform."""

    code = 14


class ShapeError(InvalidRequest):
    """A shape, stride or size is out of range for the op, the buffer or the device."""

    code = 15


class DtypeError(InvalidRequest):
    """A dtype is not the one the op or the device accepts."""

    code = 16


class UnsupportedOp(InvalidRequest):
    """The device does not implement the op (the delegate should not have picked it).

    Raised at submit or compile time, before anything runs; another device may have it."""

    code = 17
    fallback_possible = True


class IommuFault(InvalidRequest):
    """An access outside the context's mappings or against their permissions; refused.

    Raised by the supervisor at submit (nothing runs) or by the device when a descriptor's
    permission does not cover the access (the command fails, its buffers are untouched).
    Not raised for a stale or malformed handle: that is ``InvalidHandle``.
    """

    code = 18


class ForeignBuffer(IommuFault, ForeignHandle):
    """A buffer of another client (or released by this one) used without an import.

    Both an IOMMU fault (the access is refused, nothing is read or written) and a foreign
    handle, so callers catching either branch see it.
    """

    code = 19


class NotPermitted(InvalidRequest):
    """The client's role or grants do not allow this (another tenant's faults, metrics,
    trace; signalling a fence it may only wait on; a priority above its role's maximum)."""

    code = 9


class SyncHazard(InvalidRequest):
    """A command would touch a buffer another unfinished command uses, unordered (seed
    §4, §5): it reads what a command still writes and does not wait for (read after
    write), or writes what one still reads (write after read) or writes (write after
    write), neither directly nor through the fences it waits on, nor in order on the
    same context. Refused at submit, nothing ran; ``detail`` names the ``hazard`` kind,
    the ``buffer``, the other command (``other_cid``) and the ``missing_fence`` to wait
    on. Retrying the same command cannot help; waiting on that fence does. Raised only
    where the platform's ``hazards`` is "error" (its default); "warn" serves and counts.
    """

    code = 8


# -- a deadline passed ------------------------------------------------------------------


class Timeout(HetprocError):
    """A deadline passed: a wait's, a device's watchdog, a dependency's, a compile's or a
    request's. Catch this to handle every timeout; each subclass says what kept going."""

    code = 20
    retryable = True


class FenceTimeout(Timeout):
    """A wait's own deadline passed; the fence itself is still pending (nothing failed)."""

    code = 21


class DeviceTimeout(Timeout):
    """The watchdog fired on a running command; its context is lost, its outputs untrusted.

    The watchdog runs from the moment the command started executing on the device, not
    while it waited for its input fences (that is ``DependencyTimeout``)."""

    code = 22
    scope = "context"
    buffers_trusted = False
    fallback_possible = True


class PreemptTimeout(DeviceTimeout):
    """A command that cannot be preempted held its device past the device's
    ``preempt_timeout_ms`` while a more urgent command waited to preempt it (i915's
    ``preempt_timeout``): it was reset, and only it is guilty; the urgent command runs
    after the reset. Not raised for a command that yields at its chunk boundaries, nor
    while nothing more urgent waits."""

    code = 70


class DependencyTimeout(Timeout):
    """An input fence did not signal before the command's dependency deadline."""

    code = 23
    buffers_trusted = False


class RequestTimeout(Timeout):
    """The supervisor did not answer a request in time. ``detail["may_take_effect"]`` says
    whether it may still be carried out (it was sent whole, so it may); ``retry()`` on the
    exception resends it under the same request id, which the supervisor answers at most
    once, so a retry never runs it twice."""

    code = 24
    scope = "process"
    resend: Any = None  # set by the client that raised it: sends the same request again

    def retry(self) -> Any:
        """Resend the timed-out request under its id; returns its reply."""
        if self.resend is None:
            raise InvalidRequest("this timeout carries no request to retry")
        return self.resend()


# -- the device or an upstream command failed --------------------------------------------


class DeviceFault(HetprocError):
    """Execution failed on the device."""

    code = 30
    buffers_trusted = False
    fallback_possible = True


class Cancelled(HetprocError):
    """The command was cancelled before it finished by its own client (``Context.cancel``,
    the context destroyed, the client gone). Not a device fault: nothing failed. A
    command cancelled because a device was reset raises ``CancelledByReset``."""

    code = 31
    retryable = True
    buffers_trusted = False


class DependencyFailed(DeviceFault):
    """An input fence failed, so this command never ran; its outputs were not written."""

    code = 32
    retryable = True


class DeviceCrashed(DeviceFault):
    """The device process died while the command was queued or running."""

    code = 33
    scope = "device"
    retryable = True


class WrongOutput(DeviceFault):
    """The output failed its integrity check (bit flips)."""

    code = 34
    retryable = True


class ContextLost(DeviceFault):
    """The context was invalidated by an earlier failure; make a new one."""

    code = 35
    scope = "context"


class CancelledByReset(Cancelled, DeviceFault):
    """An innocent command caught in the reset of its device (another request hung or
    crashed it). Retry it: the device serves again once the reset is done."""

    code = 36
    scope = "device"
    retryable = True
    buffers_trusted = False


class ContextBanned(ContextLost):
    """The context hung its device too often (``[recovery]`` ``ban_hangs`` within
    ``ban_window_ms``) and is banned: every later submit on it is refused at once, nothing
    runs, and retrying it there cannot help. A new context may work; the process's other
    contexts and every other tenant keep working. With scope ``process``, the process
    itself is banned (``ban_contexts`` of its contexts were): it may create no more
    contexts until its last connection closes. Never raised for a context lost by a
    single hang of its own (that is ``ContextLost``), nor for an innocent one."""

    code = 38
    scope = "context"
    buffers_trusted = True
    fallback_possible = False


class DeviceWedged(DeviceFault):
    """The device is wedged: resetting it failed (``[recovery]`` ``reset_attempts`` in a
    row), so it runs nothing until an explicit unwedge (``Platform.unwedge``, ``hetproc
    device unwedge``). Work that needs it fails fast with this error, and every command it
    held or that waited for it, in flight or queued behind a fence, ends with it (never
    hangs); buffers stay readable, other devices keep serving. Not retryable until the
    device is unwedged; another device may run the request."""

    code = 37
    scope = "device"
    retryable = False
class DeviceRestarted(DeviceFault):
    """The device's subsystem restarted: its process died and a new instance serves now
    (a platform whose ``[recovery] subsystem_restart`` names the device). Every handle
    bound to the old instance is gone -- its contexts (a submit on one raises this), the
    commands it held, its queues, the assets prepared or resident on it -- while the
    device itself serves again. Scope device: every context on it was lost, other
    tenants' included. Retryable: make new contexts, load the assets again, submit
    again (``hetproc.delegate``'s models do it once by themselves). Not raised for a
    reset that keeps contexts (``DeviceCrashed``, ``CancelledByReset``). A restart
    during that recovery is raised with ``retryable`` False."""

    code = 39
    scope = "device"
    retryable = True


# -- memory and assets -------------------------------------------------------------------


class ResourceError(HetprocError):
    """A resource could not be obtained; nothing was executed."""

    code = 40
    retryable = True


class OutOfMemory(ResourceError):
    """The device or the platform's memory budget is exhausted."""

    code = 41


class QuotaExceeded(OutOfMemory):
    """A per-client limit of the platform file's ``[limits]`` table would be exceeded;
    ``detail["limit"]`` names it."""

    code = 45


class DescriptorsExhausted(ResourceError):
    """The platform's descriptor budget (derived from the supervisor's own limit) has no
    room for another segment or descriptor: other tenants hold them, within their
    quotas. Nothing changed; retry once buffers or connections are let go.
    ``detail["limit"]`` is ``"descriptors"``. Never raised for one client's own quota
    (that is ``QuotaExceeded``)."""

    code = 46


class AllocationFailed(ResourceError):
    """An allocation failed (injected or real)."""

    code = 42


class MapFailed(ResourceError):
    """A buffer could not be mapped into a context."""

    code = 43


class CompileTimeout(ResourceError, Timeout):
    """Preparing the device asset took longer than its deadline (also a ``Timeout``)."""

    code = 44
    fallback_possible = True


# -- the platform itself ------------------------------------------------------------------


class PlatformError(HetprocError):
    """The platform cannot serve this client any more."""

    code = 50
    scope = "process"


class PlatformClosed(PlatformError):
    """The platform was stopped, or this client closed its connection."""

    code = 51


class SupervisorLost(PlatformError):
    """The supervisor process died; every pending wait fails with this."""

    code = 52
    buffers_trusted = False


class InternalError(PlatformError):
    """A bug in hetproc itself, caught where it happened: the one request it hit failed,
    the platform serves on. Report it with the message (it names the exception). Never
    raised for anything a client did wrong: that is an ``InvalidRequest``."""

    code = 53
    scope = "request"
    retryable = True

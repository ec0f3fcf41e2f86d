"""The one ordered failure path: how a fence fails, and what an error kind does on it.

Every failure of a fence or a command goes through ``Failures.fail``, in this order::

    1 note    the error becomes the platform's last error; a runtime failure freezes a
              trace window around now, and its id comes back (the exception is not
              changed: the id goes into the record)
    2 record  the fence's record: the error as its readers get it, naming the window
    3 tell    that record, as a notice, into the socket of the fence's owner and of each
              importer (nobody else: seed §20)
    4 signal  only now the fence completes with the error's word, and its waiters wake

A woken waiter therefore finds the record in its own socket and explains its failure
without a round trip to a supervisor that may be busy resetting the device (invariant 2:
every waiter wakes *and sees why*). One case comes in at step 1 with step 4 done
already: a device that failed a command signals its fences itself, so their record
follows the wake (``signalled=True``).

What a kind of error does on this path is one entry of ``KINDS``; its class in
``hetproc.errors`` says the rest (scope, retryable, are the buffers trusted). A new kind
whose failure is a consequence of an earlier one (it must not freeze a second window) or
a caller's mistake adds its entry here; one that is a runtime failure like any other
needs none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipc import PENDING, errors

from .. import _protocol

if TYPE_CHECKING:
    from ._records import ClientRec, FenceRec, Registry

SUPERVISOR = 0       # the signaller id of a fence the supervisor failed for a device
CLIENT = 0xFFFF      # ... and of one failed on a client's word (its own user fence)


@dataclass(frozen=True, slots=True)
class Kind:
    """What a kind of error does on the failure path."""

    freeze: bool = True  # a runtime failure: keep a trace window around it
    quiet_scopes: frozenset[str] = frozenset()  # ...except at these scopes

    def freezes(self, exc: errors.HetprocError) -> bool:
        return self.freeze and exc.scope not in self.quiet_scopes


# By class; the nearest entry in an error's class hierarchy applies.
KINDS: dict[type[errors.HetprocError], Kind] = {
    errors.HetprocError: Kind(),
    # The sender's mistake, answered at once: no window (an IOMMU fault is one too, but
    # it happens on the device: it freezes).
    errors.InvalidRequest: Kind(freeze=False),
    errors.IommuFault: Kind(),
    # An unordered buffer access refused at submit: a caller's mistake, yet the evidence
    # that matters is what the other command was doing then, so it freezes a window.
    errors.SyncHazard: Kind(),
    # A command its own client cancelled is no failure; one a reset cancelled is.
    errors.Cancelled: Kind(quiet_scopes=frozenset({"request"})),
    # A consequence: the failure that lost the context froze its window already.
    errors.ContextLost: Kind(freeze=False),
    # A ban is the consequence of hangs that froze their windows; a wedged device's
    # commands fail as the consequence of the failed reset its incident recorded.
    errors.ContextBanned: Kind(freeze=False),
    errors.DeviceWedged: Kind(freeze=False),
    # A consequence too: the death that restarted the device froze its window already.
    errors.DeviceRestarted: Kind(freeze=False),
    errors.PlatformError: Kind(freeze=False),
    # A refusal at the door (the platform's descriptors are in use): nothing ran.
    errors.DescriptorsExhausted: Kind(freeze=False),
}
_kind_cache: dict[type, Kind] = {}


def kind_of(exc: errors.HetprocError) -> Kind:
    cls = type(exc)
    kind = _kind_cache.get(cls)
    if kind is None:
        kind = _kind_cache[cls] = next(KINDS[c] for c in cls.__mro__ if c in KINDS)
    return kind


def record_of(exc: errors.HetprocError, window: int) -> dict:
    """The error as a fence's readers get it: its dict, naming its frozen window (a
    copy: the exception itself is left as it was)."""
    record = exc.to_dict()
    detail = record["detail"]
    record["detail"] = {**detail, "trace_window": window} if window else dict(detail)
    return record


class Failures:
    """The failure path over the tables (``reg``), ``note`` (step 1: the evidence's
    ``note_error``, which answers the frozen window's id, 0 if none) and ``tell`` (the
    I/O seam that puts a notice into a client's socket: ``_outbox``)."""

    def __init__(self, reg: Registry, note: Callable[[errors.HetprocError], int],
                 tell: Callable[[ClientRec, dict], None]) -> None:
        self.reg = reg
        self.note = note
        self.tell = tell

    def fail(self, exc: errors.HetprocError, fences: Iterable[int], *,
             noted: int | None = None, signalled: bool = False,
             signaller: int = SUPERVISOR) -> tuple[dict, int]:
        """Fail ``fences`` with ``exc``, in the order of the module's docstring.

        ``noted``: the window of an error noted already (0: none, or a failure that is
        no runtime event of the platform's, such as a client failing its own fence);
        None notes it now. ``signalled``: the device signalled them itself. A fence that
        completed already keeps its result: a failure never overwrites it. Returns the
        record and how many fences this failure completed."""
        window = self.note(exc) if noted is None else noted
        record = record_of(exc, window)
        recs, table = self.reg.fence_recs, self.reg.fences
        completed = 0
        for handle in fences:
            rec = recs.get(handle)
            if signalled:
                if rec is not None:
                    rec.error = record
                    self.tell_readers(rec, record)
                continue
            if table.poll(handle)[0] != PENDING:
                continue
            if rec is not None:
                rec.error = record
                self.tell_readers(rec, record)
            # (A fence with no record left: its owner released it; its slot's waiters
            # still wake, and nobody is left to read a record.)
            completed += table.signal(handle, exc.wire, signaller=signaller)
        return record, completed

    def tell_readers(self, rec: FenceRec, record: dict) -> None:
        """Step 3: ``rec``'s record (just set) to its owner and importers, nobody else."""
        readers = [client for client in self.reg.clients.values()
                   if client is rec.client or client.id in rec.importers]
        if not readers:
            return  # (a leaving client's pool: its owner is gone, nobody imported them)
        notice = _protocol.notice(record, fence=rec.handle)
        for client in readers:
            self.tell(client, notice)

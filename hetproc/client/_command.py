"""``command``: one entry of a batch, as ``Context.submit_many`` and ``Queue.submit_many``
take it (the two paths mean the same by it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._buffer import Buffer
    from ._fence import Fence


def command(kernel: str, ins: Iterable[Buffer] = (), outs: Iterable[Buffer] = (), *,
            wait: Iterable[Fence] = (), params: dict | None = None, ms: float | None = None,
            handoff_ms: float = 0.0, timeout_ms: float | None = None,
            checked: bool = False, priority: int | None = None,
            deadline_ms: float | None = None, preemptible: bool = True) -> dict[str, Any]:
    """One command for ``Context.submit_many``: ``kernel`` reads ``ins`` and writes
    ``outs`` after the fences in ``wait``. ``ms`` is its modeled duration (for kernels
    that take one), ``handoff_ms`` the modeled time its consumers pay to take its output.
    ``timeout_ms`` overrides the watchdog; ``checked`` re-executes the kernel and
    compares, so corrupt output fails the request. ``priority`` overrides the context's
    (up to the client's maximum); ``deadline_ms`` (after the submit) is what the ``edf``
    and ``mixed`` schedulers order by. ``preemptible=False``: the device never suspends it
    at a chunk boundary (a kernel without preemption points); holding the device past its
    ``preempt_timeout_ms`` while a more urgent command waits gets it reset
    (``PreemptTimeout``). ``StaleHandle`` for a freed buffer; everything else is checked
    by the supervisor at submit."""
    c: dict[str, Any] = {"kernel": kernel, "ins": [b.live_handle() for b in ins],
                         "outs": [b.live_handle() for b in outs],
                         "wait": [f.handle for f in wait]}
    if params:
        c["params"] = params
    if ms is not None:
        c["ms"] = float(ms)
    if handoff_ms:
        c["handoff_ms"] = float(handoff_ms)
    if timeout_ms is not None:
        c["timeout_ms"] = float(timeout_ms)
    if checked:
        c["checked"] = True
    if priority is not None:
        c["priority"] = int(priority)
    if deadline_ms is not None:
        c["deadline_ms"] = float(deadline_ms)
    if not preemptible:
        c["preemptible"] = False
    return c

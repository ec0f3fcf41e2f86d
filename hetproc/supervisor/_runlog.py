"""The run's command log: every command the supervisor scheduled, as the trace digest
(``hetproc.trace.trace_digest``) hashes it.

One entry per command, written when the command retires (``Commands.retire``: the one
place every committed command passes exactly once, whether it ran, failed, was cancelled
or was retired by recovery): its device, its context's stable name
(``ContextRec.label``), its kernel, the modeled start and end its completion record
carried (none when it never ran) and how it ended. Records of user-mode queues never
reach the supervisor, so their commands are not in the log.

Only ``Commands`` appends. The log is bounded (``KEEP`` entries, ~20 MB at most); past
it, entries are counted as dropped and the digest covers the first ``KEEP``. The digest
is computed in the supervisor's loop when asked (once per report): ~5 us per entry on a
loaded 2-core machine, 20 ms for a default ``video_pipeline``, under a second at the bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..trace import canonical_rows, modeled_span, trace_digest

if TYPE_CHECKING:
    from ._devices import Command

KEEP = 1 << 17
ROWS_PAGE = 4096  # canonical rows per reply (``rows``): well under a packet's bound


class CommandLog:
    def __init__(self) -> None:
        self.entries: list[tuple] = []  # (CommandEntry's fields)
        self.dropped = 0
        # The run's modeled epoch, when the platform has one (a virtual clock sets it);
        # None: the earliest modeled start of the logged commands.
        self.origin_ns: int | None = None
        self._cached: tuple[tuple, dict[str, Any]] | None = None

    def note(self, cmd: Command) -> None:
        """``cmd`` retired: its entry (status "ok" when no failure was recorded for it)."""
        if len(self.entries) >= KEEP:
            self.dropped += 1
            return
        ctx = cmd.ctx
        m, status = cmd.outcome or (None, "")
        # A plain tuple in CommandEntry's field order: this runs per command.
        self.entries.append((
            cmd.device.name, ctx.label or f"{ctx.client.name}/{ctx.name}", cmd.kernel,
            m[0] if m is not None else None, m[1] if m is not None else None,
            status or "ok"))

    def summary(self) -> dict[str, Any]:
        """The digest and the modeled span of the commands logged so far (computed once
        per new entry count: the log only grows)."""
        n = len(self.entries)
        key = (n, self.dropped, self.origin_ns)
        if self._cached is not None and self._cached[0] == key:
            return dict(self._cached[1])
        origin, end = modeled_span(self.entries, self.origin_ns)
        out = {"trace_digest": trace_digest(self.entries, origin),
               "commands": n, "dropped": self.dropped, "origin_ns": origin, "end_ns": end,
               "modeled_s": None if origin is None or end is None else (end - origin) / 1e9}
        self._cached = (key, out)
        return dict(out)

    def rows(self, start: int) -> dict[str, Any]:
        """A page of the canonical rows the digest hashes (``canonical_rows``), from
        ``start``: what tells two runs' schedules apart where their digests differ.
        ``{"rows", "rows_total"}``; a page past the end is empty."""
        rows = canonical_rows(self.entries, modeled_span(self.entries, self.origin_ns)[0])
        return {"rows": [list(r) for r in rows[start:start + ROWS_PAGE]],
                "rows_total": len(rows)}

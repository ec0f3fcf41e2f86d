"""The state of one running command, which its execution frame (``DeviceWorker.execute``)
opens and closes.

A command preempted at a chunk boundary keeps its frame while the urgent commands run in
frames of their own (``_preempt``), so nothing of it has to be copied out and back but
what lives outside the frame: the state-table words, the memory and trace state, the
speed (``_preempt.Suspended``).
"""

from __future__ import annotations

from typing import Any


class Frame:
    """One command from the moment it is taken to the moment it is finished."""

    __slots__ = ("cmd", "pidx", "t_start", "shift", "m_origin", "preemptible", "modeled",
                 "signal", "t_end", "loop_flushes")

    def __init__(self, cmd: dict[str, Any], pidx: int, t_start: int) -> None:
        self.cmd = cmd
        self.pidx = pidx          # its ring position, the key of the cancel check (0: never)
        # When it was taken; the body moves it to when it really started (after its input
        # waits and its dispatch latency), so a failure counts the host time it was busy.
        self.t_start = t_start
        self.shift = 0            # modeled time spent preempted: only a resume adds to it
        self.m_origin = 0         # its modeled start: its chunk boundaries count from here
        # True only while its kernel and hold run, and never under a suspended command:
        # where a preemption may suspend it (``DeviceWorker.maybe_preempt``).
        self.preemptible = False
        # Set by the body once the command ran to its end, as its last steps:
        self.modeled: tuple[int, int, int] | None = None  # (modeled start, end, lag)
        self.signal = True        # False: it completes without signalling (a lost fence)
        self.t_end = 0            # the host's end when the body measured it (0: at finish)
        # True: its record waits for the loop to find the ring dry, checked once per
        # wake-up (the hold-only path), not once per record (``Outbox.put``).
        self.loop_flushes = False


# The frame of no command: nothing to cancel, nothing to preempt, no time shifted.
IDLE = Frame({}, 0, 0)

"""The state of one running command, which its execution frame (``DeviceWorker.execute``)
opens and closes.

A command preempted at a chunk boundary keeps its frame while the urgent commands run in
frames of their own, one level deeper (``_preempt``), so nothing of it has to be copied
out and back but what lives outside the frame: the state-table words, the memory and
trace state, the speed (``_preempt.Suspended``). A frame is reused by the next command
run at its depth once its own finished: an object made per command costs more than the
rest of a no-op command's frame.
"""

from __future__ import annotations

from typing import Any


class Frame:
    """One command from the moment it is taken to the moment it is finished."""

    __slots__ = ("cmd", "pidx", "t_start", "shift", "m_origin", "preemptible", "modeled",
                 "signal", "t_end", "loop_flushes", "holds_to", "since", "parkable")
    # The outcome, which the body sets as its last steps once the command ran to its end
    # (until then unset or the previous command's: ``finish`` reads them only after the
    # body returned):
    modeled: tuple[int, int, int]  # (modeled start, modeled end, lag)
    signal: bool         # False: it completes without signalling (an injected lost fence)
    t_end: int           # the host's end, when the body measured it (0: ``finish`` does)
    # True: its record waits for the loop to find the ring dry, checked once per wake-up
    # (the hold-only path), not once per record (``Outbox.put``).
    loop_flushes: bool

    def __init__(self) -> None:
        # ``DeviceWorker.execute`` sets these four and ``preemptible`` as it opens the
        # frame for a command:
        self.cmd: dict[str, Any] = {}
        self.pidx = 0             # its ring position, the key of the cancel check (0: never)
        # When it was taken; the body moves it to when it really started (after its input
        # waits and its dispatch latency), so a failure counts the host time it was busy.
        self.t_start = 0
        self.shift = 0            # modeled time spent preempted: only a resume adds to it
        self.m_origin = 0         # its modeled start: its chunk boundaries count from here
        # True only while its kernel and hold run: where a preemption may suspend it
        # (``DeviceWorker.maybe_preempt``).
        self.preemptible = False
        # The modeled end of the stretch it holds now, before its shift (``hold_model``): a
        # chunk boundary is where work is left, so none at or past its end.
        self.holds_to = 0
        # The modeled instant it last began to run (its start, or a resume): its timeslice
        # counts from here (``_preempt``).
        self.since = 0
        # True: it only holds modeled time (``execute_hold``), so a timeslice may park it
        # off the device, its frame kept, and take it up again later (``_preempt``).
        self.parkable = False


# The frame of no command: nothing to cancel, nothing to preempt, no time shifted.
IDLE = Frame()

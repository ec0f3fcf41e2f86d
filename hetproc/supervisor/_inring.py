"""The commands pushed to one device and not yet completed, with the sums ``pump`` reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._devices import Command


class InRing(dict):
    """The commands pushed to a device and not yet completed (seq -> command, in push
    order), keeping as they come and go what ``pump`` reads on every call: the modeled
    work of those that are no preemptor, and how many of them are longer than a chunk.
    (Summed over a full ring on each call, this was most of a one-command submit.)
    Slotted: a dict subclass's own attributes cost twice as much through an instance
    dict, and these change twice per command."""

    __slots__ = ("chunk_ns", "work_ns", "plain", "long")

    def __init__(self, chunk_ns: int = 0) -> None:
        super().__init__()
        self.chunk_ns = chunk_ns
        self.work_ns = 0   # hold_ns of every pushed command that is no preemptor
        self.plain = 0     # how many there are
        self.long = 0      # how many of them hold longer than a chunk

    def _count(self, cmd: Command, sign: int) -> None:
        if not cmd.preemptor:
            self.work_ns += sign * cmd.hold_ns
            self.plain += sign
            if cmd.hold_ns > self.chunk_ns:
                self.long += sign

    def __setitem__(self, seq: int, cmd: Command) -> None:
        if seq in self:
            self._count(dict.__getitem__(self, seq), -1)
        dict.__setitem__(self, seq, cmd)
        if not cmd.preemptor:  # _count(cmd, 1), inline: this runs per command
            self.work_ns += cmd.hold_ns
            self.plain += 1
            if cmd.hold_ns > self.chunk_ns:
                self.long += 1

    def pop(self, seq: int, *default: Any) -> Any:
        cmd = dict.pop(self, seq, None)
        if cmd is None:
            return dict.pop(self, seq, *default)  # (a command is never None)
        if not cmd.preemptor:  # _count(cmd, -1)
            self.work_ns -= cmd.hold_ns
            self.plain -= 1
            if cmd.hold_ns > self.chunk_ns:
                self.long -= 1
        return cmd

    def __delitem__(self, seq: int) -> None:
        self.pop(seq)

    def clear(self) -> None:
        dict.clear(self)
        self.work_ns = self.plain = self.long = 0

    def first_plain_hold(self) -> int:
        """hold_ns of the oldest pushed command that is no preemptor (0: none)."""
        for c in self.values():
            if not c.preemptor:
                return c.hold_ns
        return 0

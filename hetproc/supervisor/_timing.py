"""How well a device kept to its modeled timeline (invariant 8), from completion records.

Each record of a command that ran carries its modeled start and end (``m0``, ``m1``),
the host's own start (``t_start``) and its lag (how far past the modeled end the host
finished; 0 when absorbed). The start error, host start minus modeled start, is the host
latency the model absorbed: it stays invisible in modeled time as long as the command
still ends on time, and a lag says when it did not.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

KEEP = 4096  # the most recent commands summarised


class ModeledTiming:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Every count back to none (a new run of the same platform)."""
        self.start_error_ns: collections.deque = collections.deque(maxlen=KEEP)
        self.commands = 0
        self.lags = 0
        self.lag_ns_max = 0
        self.speed = 1.0          # what the last command ran at
        self.freq_switches = 0    # changes of that speed (votes, throttling)
        self.throttled = 0        # commands run throttled
        self.temp_c: float | None = None

    def note(self, rec: dict[str, Any]) -> None:
        self.note_many((rec,))

    def note_many(self, recs: Any) -> None:
        """Count each completion record that carries modeled times (``m0``), in order.
        (Decoded records hold ints and a float speed: that case goes straight through;
        any other value is converted, or costs its record's evidence.)"""
        errs = self.start_error_ns
        for rec in recs:
            m0 = rec.get("m0")
            if m0 is None:
                continue
            t0, lag = rec.get("t_start"), rec.get("lag", 0)
            if type(t0) is int and type(m0) is int and type(lag) is int:
                err = t0 - m0
            else:
                try:
                    err, lag = int(rec["t_start"]) - int(m0), int(lag)
                except (TypeError, ValueError, KeyError):
                    continue  # a malformed record costs its evidence, never the supervisor
            self.commands += 1
            errs.append(err)
            if lag > 0:
                self.lags += 1
                self.lag_ns_max = max(self.lag_ns_max, lag)
            speed = rec.get("spd", 1.0)
            if speed != self.speed and isinstance(speed, (int, float)):
                self.freq_switches += 1
                self.speed = float(speed)
            if "thr" in rec or "temp" in rec:
                if rec.get("thr"):
                    self.throttled += 1
                temp = rec.get("temp")
                if isinstance(temp, (int, float)):
                    self.temp_c = float(temp)

    def summary(self) -> dict[str, Any]:
        errs = np.fromiter(self.start_error_ns, np.int64, len(self.start_error_ns))
        out: dict[str, Any] = {"commands": self.commands, "lags": self.lags,
                               "lag_ms_max": self.lag_ns_max / 1e6}
        out["power"] = {"speed": self.speed, "frequency_switches": self.freq_switches,
                        "throttled_commands": self.throttled, "temperature_c": self.temp_c}
        if errs.size:
            p50, p99 = np.percentile(errs, [50, 99])  # (one pass; the same values)
            out["start_error_us_p50"] = float(p50) / 1e3
            out["start_error_us_p99"] = float(p99) / 1e3
        return out

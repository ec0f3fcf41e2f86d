"""A device's frequency and temperature, in modeled time (seed §7, §9).

The supervisor sends each command the speed its clients voted for (``spd``, a fraction of
the top frequency); this model may cap it. Heat follows a first-order model: while busy at
speed ``s`` the device tends to ``ambient + heat * s² * tau`` with time constant ``tau``,
while idle it relaxes to ambient. At ``throttle_c`` the device drops to
``throttle_speed`` until it has cooled ``hysteresis_c`` below; a kernel's modeled time is
its nominal time divided by the speed it ran at. Decisions are taken when a command starts,
from modeled times only, so the same arrivals always throttle the same commands.
"""

from __future__ import annotations

import math


class Thermal:
    def __init__(self, heat_c_per_ms: float, tau_ms: float, ambient_c: float,
                 throttle_c: float, hysteresis_c: float, throttle_speed: float) -> None:
        self.heat = heat_c_per_ms
        self.tau = max(tau_ms, 1e-3)
        self.ambient = ambient_c
        self.limit = throttle_c
        self.hysteresis = hysteresis_c
        self.throttle_speed = throttle_speed
        self.temp = ambient_c
        self.t = 0            # modeled time of ``temp``
        self.throttled = False

    def _relax(self, t: int) -> None:
        if self.t and t > self.t:
            k = math.exp(-(t - self.t) / 1e6 / self.tau)
            self.temp = self.ambient + (self.temp - self.ambient) * k
        self.t = max(self.t, t)

    def speed(self, t: int, vote: float) -> float:
        """The speed a command starting at modeled ``t`` runs at, given the clients' vote."""
        self._relax(t)
        if self.throttled and self.temp < self.limit - self.hysteresis:
            self.throttled = False
        elif not self.throttled and self.temp >= self.limit:
            self.throttled = True
        return min(vote, self.throttle_speed) if self.throttled else vote

    def ran(self, t_end: int, busy_ns: int, speed: float) -> None:
        """``busy_ns`` of work at ``speed`` ending at modeled ``t_end``."""
        self._relax(t_end - busy_ns)
        eq = self.ambient + self.heat * speed * speed * self.tau
        k = math.exp(-busy_ns / 1e6 / self.tau)
        self.temp = eq + (self.temp - eq) * k
        self.t = max(self.t, t_end)

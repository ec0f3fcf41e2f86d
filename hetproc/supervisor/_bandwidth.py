"""DDR bandwidth quota per client (seed §7, §11), in modeled time.

A client with a quota of ``r`` MB/s may move ``ddr_burst_kib`` at once; beyond that, its
commands' modeled arrivals are pushed back so that the bytes they touch (inputs and
outputs) never exceed ``r`` on average: a generic cell rate algorithm whose theoretical
arrival time advances by ``bytes / r`` per command. One clock per client across every
device, so a client cannot dodge its quota by spreading work. The quota comes from the
platform file by client name (``ddr_quota_mbps``, ``"*"`` for everyone else) through
``quota_mbps`` alone. The clock is the process's (the kernel's pid, as for every quota of
``[limits]``): a second connection does not start a fresh budget. A name is a class of
service the client declares, not an identity: a client that renames itself gets that
name's rate (on its one clock); what a client may not choose is bounded by its role.
"""

from __future__ import annotations

from typing import Any

from device_workers import admit

from .._config import PlatformSpec


def quota_mbps(spec: PlatformSpec, client: Any) -> float | None:
    """The client's DDR quota in MB/s, None when unlimited."""
    table = spec.ddr_quota_mbps
    return table.get(client.name, table.get("*"))


class DdrQuota:
    def __init__(self, spec: PlatformSpec) -> None:
        self.spec = spec
        self.tat: dict[int, float] = {}       # client pid -> theoretical arrival time (ns)
        self.delayed: dict[str, list] = {}    # client name -> [commands delayed, ns delayed]

    def limited(self, client: Any) -> bool:
        """Whether ``client`` has a quota at all (``admit`` changes nothing otherwise).
        Asked per submit: a platform without quotas answers without a look-up."""
        if not self.spec.ddr_quota_mbps:
            return False
        return quota_mbps(self.spec, client) is not None

    def admit(self, client: Any, t_arrive: int, nbytes: int) -> int:
        """The modeled arrival of a command of ``nbytes`` from ``client`` at ``t_arrive``."""
        mbps = quota_mbps(self.spec, client)
        if mbps is None or nbytes <= 0:
            return t_arrive
        per_byte_ns = 1e3 / mbps  # 1 MB/s = 1 byte/us
        tolerance = self.spec.ddr_burst_kib * 1024 * per_byte_ns
        start, self.tat[client.pid] = admit(self.tat.get(client.pid, 0.0), t_arrive, nbytes,
                                            per_byte_ns, tolerance)
        if start > t_arrive:
            rec = self.delayed.setdefault(client.name, [0, 0])
            rec[0] += 1
            rec[1] += int(start - t_arrive)
        return start

    def forget(self, pid: int) -> None:
        """The process's last connection is gone."""
        self.tat.pop(pid, None)

    def metrics(self) -> dict[str, Any]:
        return {"quota_mbps": dict(self.spec.ddr_quota_mbps),
                "delayed": {n: {"commands": c, "delay_ms": ns / 1e6}
                            for n, (c, ns) in self.delayed.items()}}

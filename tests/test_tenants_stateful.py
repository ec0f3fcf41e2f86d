"""Two tenants making random valid and invalid calls on one real platform (hypothesis).

A ``RuleBasedStateMachine`` drives two clients -- alloc, free, export, import, map,
submit (valid and not), wait, cancel, signal, raw requests with random fields, close and
reconnect -- while a bystander holds canary buffers nobody else can reach. After every
step: the supervisor and every device are alive, the canaries are intact; at the end of a
run every fence it got completed or failed (none left pending), and a close leaks nothing
(the autouse guard checks the named objects). Seeded and bounded (about a minute).
"""

from __future__ import annotations

import psutil
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import hetproc
from hetproc.client import Fence

_PLAT: hetproc.Platform | None = None
_OPS = ["ping", "alloc", "free", "fence_create", "fence_release", "fence_error", "submit",
        "cancel", "map", "unmap", "export", "import", "mem_events", "metrics", "prepare",
        "context_create", "context_destroy", "fence_signal", "free_many", "hello",
        "trace_info", "incidents", "dumps", "grant_role", "run_digest"]
_FIELDS = ["ctx", "buf", "fence", "fences", "token", "kind", "cmds", "shape", "dtype",
           "count", "device", "priority", "name", "kernel", "perm", "since", "limit", "cids",
           "error", "bufs", "signal", "read_only"]
_scalars = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True),
                     st.text(max_size=20), st.booleans(), st.none())
_values = st.one_of(_scalars, st.lists(_scalars, max_size=5),
                    st.dictionaries(st.text(max_size=5), _scalars, max_size=4))
_durations = st.one_of(st.floats(0, 3), st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(-5, 1 << 62))


class TwoTenants(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        assert _PLAT is not None
        self.plat = _PLAT
        self.clients = [self.plat.connect("t0"), self.plat.connect("t1")]
        self.ctxs = [c.context("cpu0") for c in self.clients]
        self.bufs: list[list[hetproc.Buffer]] = [[], []]
        self.fences: list[list[Fence]] = [[], []]
        self.user: list[list[Fence]] = [[], []]
        self.tokens: list[tuple[str, int]] = []

    # -- valid and invalid calls -----------------------------------------------------------

    @rule(who=st.integers(0, 1), n=st.integers(1, 2048))
    def alloc(self, who: int, n: int) -> None:
        try:
            buf = self.clients[who].alloc(n, "float32", exportable=n % 2 == 0)
        except hetproc.ResourceError:
            return
        buf.array()[:] = who + 1
        self.bufs[who].append(buf)

    @rule(who=st.integers(0, 1), i=st.integers(0, 50))
    def free(self, who: int, i: int) -> None:
        if self.bufs[who]:
            buf = self.bufs[who][i % len(self.bufs[who])]
            # An import of the same token twice is the same handle: once freed, it is gone
            # for this client whichever entry named it.
            self.bufs[who] = [b for b in self.bufs[who] if b.handle != buf.handle]
            buf.free()

    @rule(who=st.integers(0, 1), i=st.integers(0, 50))
    def free_the_others(self, who: int, i: int) -> None:
        mine = {b.handle for b in self.bufs[who]}
        other = [b for b in self.bufs[1 - who] if b.handle not in mine]  # not its own import
        if other:
            with pytest.raises(hetproc.InvalidRequest):
                self.clients[who]._request("free", buf=other[i % len(other)].handle)

    @rule(who=st.integers(0, 1), i=st.integers(0, 50), ro=st.booleans())
    def export_buffer(self, who: int, i: int, ro: bool) -> None:
        if self.bufs[who]:
            buf = self.bufs[who][i % len(self.bufs[who])]
            if not buf.exportable:  # its segment holds its owner's other buffers
                with pytest.raises(hetproc.NotPermitted):
                    buf.export(ro)
                return
            self.tokens.append(("buffer", buf.export(ro)))

    @rule(who=st.integers(0, 1), sig=st.booleans())
    def export_user_fence(self, who: int, sig: bool) -> None:
        f = self.clients[who].fence()
        self.user[who].append(f)
        self.tokens.append(("fence", f.export(signal=sig)))

    @rule(who=st.integers(0, 1), i=st.integers(0, 50))
    def import_something(self, who: int, i: int) -> None:
        if not self.tokens:
            return
        kind, token = self.tokens[i % len(self.tokens)]
        try:
            if kind == "buffer":
                self.bufs[who].append(self.clients[who].import_buffer(token))
            else:
                self.user[who].append(self.clients[who].import_fence(token))
        except hetproc.InvalidRequest:
            pass  # its owner freed or released it meanwhile, or it is its own

    @rule(who=st.integers(0, 1), i=st.integers(0, 50))
    def signal(self, who: int, i: int) -> None:
        """Any user fence this client knows of, its own or not: refused unless granted."""
        known = self.user[who] + self.user[1 - who]
        if not known:
            return
        f = known[i % len(known)]
        try:
            Fence(self.clients[who], f.handle).signal()
        except hetproc.InvalidRequest:
            pass

    @rule(who=st.integers(0, 1), kernel=st.sampled_from(["work", "relu", "add", "bogus"]),
          ms=_durations, n_in=st.integers(0, 2), n_out=st.integers(0, 2),
          foreign=st.booleans(), nowait=st.booleans(), wait_user=st.booleans())
    def submit(self, who, kernel, ms, n_in, n_out, foreign, nowait, wait_user) -> None:
        pool = self.bufs[1 - who] if foreign else self.bufs[who]
        ins, outs = pool[:n_in], pool[n_in:n_in + n_out]
        wait = self.user[who][-1:] if wait_user else []
        cmd = hetproc.command(kernel, ins, outs, wait=wait)
        cmd["ms"] = ms
        ctx = self.ctxs[who]
        try:
            fences = ctx.submit_many([cmd], nowait=nowait)
        except hetproc.HetprocError as exc:
            assert not isinstance(exc, hetproc.PlatformError), exc
            self._renew_if_lost(who, exc)
            return
        self.fences[who] += fences

    @rule(who=st.integers(0, 1))
    def wait_oldest(self, who: int) -> None:
        if self.fences[who]:
            _settle(self.fences[who].pop(0), self.user)

    @rule(who=st.integers(0, 1))
    def cancel(self, who: int) -> None:
        self.ctxs[who].cancel()

    def _renew_if_lost(self, who: int, exc: hetproc.HetprocError) -> None:
        """A long command the watchdog stopped loses its context (that is the rule, seed
        §7): the tenant opens a new one."""
        if isinstance(exc, hetproc.ContextLost):
            self.ctxs[who].close()
            self.ctxs[who] = self.clients[who].context("cpu0")

    @rule(who=st.integers(0, 1), i=st.integers(0, 50), perm=st.sampled_from(["r", "w", "rw", "x"]))
    def map(self, who: int, i: int, perm: str) -> None:
        pool = self.bufs[0] + self.bufs[1]
        if pool:
            try:
                self.ctxs[who].map(pool[i % len(pool)], perm)
            except (hetproc.InvalidRequest, hetproc.ContextLost) as exc:
                self._renew_if_lost(who, exc)

    @rule(who=st.integers(0, 1), op=st.sampled_from(_OPS),
          fields=st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=4))
    def raw_request(self, who: int, op: str, fields: dict) -> None:
        """Whatever the fields, an answer comes, and an error is one of ours."""
        try:
            self.clients[who]._request(op, **fields)
        except hetproc.HetprocError as exc:
            assert not isinstance(exc, (hetproc.PlatformError, hetproc.Timeout)), exc

    @rule(who=st.integers(0, 1))
    def reconnect(self, who: int) -> None:
        """A tenant closes (everything it held goes) and comes back."""
        for f in self.fences[who]:
            _settle(f, self.user)
        self.clients[who].close()
        self.clients[who] = self.plat.connect(f"t{who}")
        self.ctxs[who] = self.clients[who].context("cpu0")
        self.bufs[who], self.fences[who], self.user[who] = [], [], []

    # -- what must hold after every step -----------------------------------------------------

    @invariant()
    def everyone_alive(self) -> None:
        assert self.plat.proc.poll() is None, "the supervisor died"
        for name, dev in _BYSTANDER.metrics()["devices"].items():
            assert dev["pid"] and psutil.pid_exists(dev["pid"]), f"{name} is gone"

    @invariant()
    def canaries_intact(self) -> None:
        for buf, value in _CANARIES:
            assert (buf.array() == value).all(), "a bystander's buffer changed"

    def teardown(self) -> None:
        for who in (0, 1):
            for f in self.user[who]:  # unblock waits on user fences, then settle all
                if f.client is self.clients[who] and not f.done():
                    try:
                        f.signal()
                    except hetproc.InvalidRequest:
                        pass
        for who in (0, 1):
            for f in self.fences[who]:
                _settle(f, self.user)
            self.clients[who].close()


def _settle(f: Fence, user: list[list[Fence]]) -> None:
    """Every fence completes or fails: none stays pending past the platform's deadlines."""
    try:
        f.wait(10)
    except hetproc.FenceTimeout:
        raise AssertionError(f"{f} still pending") from None
    except hetproc.HetprocError:
        pass


_BYSTANDER: hetproc.Client
_CANARIES: list[tuple[hetproc.Buffer, float]] = []


def test_two_tenants_random_calls_never_hurt_the_platform_or_a_bystander():
    global _PLAT, _BYSTANDER
    with hetproc.Platform(time_scale=0.2, limits={"client_mib": 64}) as plat:
        _PLAT = plat
        _BYSTANDER = plat.connect("bystander")
        _CANARIES[:] = []
        for value in (3.0, -7.5):
            buf = _BYSTANDER.alloc(1024)
            buf.array()[:] = value
            _CANARIES.append((buf, value))
        try:
            run_state_machine_as_test(TwoTenants, settings=settings(
                max_examples=300, stateful_step_count=30, deadline=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate],  # bounded: no shrinking in CI
                suppress_health_check=list(HealthCheck)))
        finally:
            _PLAT = None
            _BYSTANDER.close()

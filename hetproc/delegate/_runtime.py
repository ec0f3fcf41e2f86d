"""A model loaded onto a running platform: one graph command per partition per run.

``DelegatedModel.load(client, model)`` places and compiles the graph, writes each
partition's asset into a shared buffer allocated through the client (weights in shared
memory, read-only for the device), holds each partition's modeled compile time on its
device's timeline, and keeps one byte buffer for the model inputs and one per partition
for the tensors it hands on. ``run(inputs)`` writes the inputs, submits every partition as
ONE ``graph`` command on its device's context, waiting only on the fences of the
partitions it reads from (fences only at partition boundaries), then reads the outputs.
A partition whose producers may compute (really, in numpy) longer than half the
platform's dependency timeout is submitted once they are done, so no device waits past
that timeout on a fence. A command holds its device for the partition's modeled device
time (roofline time of its ops plus cache maintenance and reformats at its boundaries);
dispatch and fence hops are not added to it, since the emulator really performs them.

A device that restarts as a subsystem (``DeviceRestarted``) takes the model's context on
it with it: ``run`` reloads what was bound to that device and runs once more; a second
restart during that recovery is not retried (``_restart``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ipc import errors

from ._cache import AssetCache
from ._compile import Compiled, compile_placement, known_shape, tensor_specs
from ._model import Graph, fold_constants, load_model
from ._partition import Options, Placement, place
from ._reference import check_inputs
from ._residency import residency_of
from ._restart import run_recovering
from ._targets import Device, devices_of

RUN_TIMEOUT_S = 60.0
# A tool-specific trace stage (200-255 are free): one instant per partition asset load,
# cid = partition index, a0 = asset bytes, a1 = what happened (LOAD_OUTCOMES index).
ASSET_LOAD_STAGE = 200
LOAD_OUTCOMES = ("compiled", "hit", "corrupt asset, recompiled", "shared")
# The emulator computes every op with numpy on this machine's CPUs: real compute may be
# this many times the CPU roofline's estimate (im2col copies, a loaded shared machine).
HOST_SLOWDOWN = 8.0
HOST_FIXED_S = 0.005  # submit, dispatch and wake-up of one command on a loaded machine
CALLBACK_THREADS = 2   # the client's bounded pool for run_async and its callbacks
MAX_PENDING = 16


def _wait(fence: Any, timeout: float) -> None:
    """Wait for a partition; on failure raise its class with the supervisor's message."""
    try:
        fence.wait(timeout)
    except errors.HetprocError as exc:
        try:
            detail = fence.error_detail()
        except errors.HetprocError:
            detail = None
        if detail and detail.get("message"):
            raise type(exc)(detail["message"], detail=detail.get("detail") or {}) from None
        raise


class DelegatedModel:
    """A graph placed, compiled and loaded on a platform: its partitions' assets in shared
    buffers, a context per device, buffers for the tensors at partition boundaries. Built
    by ``load``; ``run`` (or ``run_async``) once per request; ``close`` gives it all back."""

    def __init__(self, client: Any, graph: Graph, compiled: Compiled, devices: list[Device],
                 options: Options, cache: AssetCache | None, shared_assets: list[int]) -> None:
        """``load`` builds one; see there."""
        self.client = client
        self.graph = graph
        self.compiled = compiled
        self._devices = {d.name: d for d in devices}
        self._options, self._cache = options, cache
        self._shared = shared_assets
        self.placement: Placement = compiled.placement
        self._lock = threading.Lock()
        self._closed = False
        self._buffers: list[Any] = []
        self._contexts: dict[str, Any] = {}
        self.load_info: dict[str, Any] = {}
        self.last_run: dict[str, Any] = {}
        self._closing = False  # no new run; queued runs still go unless cancelled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def load(cls, client: Any, model: Any, *, options: Options | None = None,
             input_shapes: dict[str, Any] | None = None,
             cache: AssetCache | None = None,
             shared_assets: list[int] | None = None) -> DelegatedModel:
        """Place, compile and upload ``model`` (a path, bytes, ModelProto or ``Graph``).
        With ``cache``, each partition's asset is looked up first (``load_info["cache"]``
        says "hit", "compiled" or "corrupt asset, recompiled" per partition).
        ``shared_assets``: the tokens another client's ``export_assets()`` gave for the
        same model; each is imported read-only instead of allocating a copy (seed §19: two
        clients of one model share one weights segment), once its bytes are verified
        equal to what this client would compile ("shared"; a mismatch gets its own copy)."""
        t0 = time.perf_counter()
        graph = model if isinstance(model, Graph) else load_model(model, input_shapes)
        graph = fold_constants(graph)
        specs = tensor_specs(graph)
        options = options or Options()
        devices = devices_of(client.info["spec"])
        placement = place(graph, specs, devices, options)
        compiled = compile_placement(placement, specs)
        self = cls(client, graph, compiled, devices, options, cache, list(shared_assets or []))
        try:
            self._upload()
        except BaseException:
            self.close()
            raise
        if graph is not model:  # a Graph the caller passed keeps what the caller gave it
            self._drop_host_weights()
        self.load_info["load_s"] = time.perf_counter() - t0
        return self

    def _drop_host_weights(self) -> None:
        """Once uploaded, the weights live in the assets' shared memory alone: this
        process keeps no private copy (two applications sharing one asset would otherwise
        still hold a copy each, and sharing would save nothing; seed §19)."""
        for cp in self.compiled.partitions:
            cp.weights = []
        self.graph.initializers = {}  # the placement's and the specs' graph: one object

    def _upload(self) -> None:
        c = self.compiled
        self._input_buf = self._alloc(c.input_layout.size)
        self._out_bufs = [self._alloc(lay.size) for lay in c.output_layouts]
        self._assets = []
        outcomes = []
        compile_ms: dict[str, float] = {}
        bucket = [[v.name, list(c.specs.shape(v.name) or ())] for v in self.graph.inputs]
        for k, cp in enumerate(c.partitions):
            p = cp.partition
            buf = self._import(self._shared[k], cp) if k < len(self._shared) else None
            if buf is not None:
                outcome = "shared"
            else:
                buf = self._alloc(cp.nbytes)
                outcome = self._fill(cp, buf, bucket)
            outcomes.append(outcome)
            self._assets.append(buf)
            self.client.trace.instant(ASSET_LOAD_STAGE, p.index, cp.nbytes,
                                      LOAD_OUTCOMES.index(outcome))
            self._context(p.device)
            # A hit only loads the asset (modeled at DDR speed); a miss compiles it.
            ms = (p.compile_us / 1000 if outcome not in ("hit", "shared")
                  else cp.nbytes / (self._devices[p.device].target.bandwidth_gbs * 1e6))
            compile_ms[p.device] = compile_ms.get(p.device, 0.0) + ms
            self.placement.log.append(f"asset of partition {p.index} on {p.device}: {outcome} "
                                      f"({cp.nbytes} B, modeled {ms:.2f} ms)")
        self.load_info["cache"] = outcomes
        self._map_operands()
        self._staging = self._input_buf.array()
        self._out_views = [b.array() for b in self._out_bufs]
        # The modeled compile time occupies each device, visible on the timeline.
        fences = [self._contexts[d].submit("work", ms=ms) for d, ms in compile_ms.items() if ms]
        for f in fences:
            f.wait(RUN_TIMEOUT_S)
        self.load_info.update(compile_ms=compile_ms,
                              asset_bytes=sum(cp.nbytes for cp in c.partitions))

    def _map_operands(self, devices: set[str] | None = None) -> None:
        """Map every operand into the contexts that use it once, at load: runs then pay
        no transient IOMMU map per command (seed §4: mapping is a counted step). A buffer
        one partition writes and another on the same device reads gets "rw".
        ``devices``: only into the contexts of these (new ones, after a restart)."""
        need: dict[tuple[str, int], tuple[Any, set[str]]] = {}

        def want(device: str, buf: Any, perm: str) -> None:
            need.setdefault((device, buf.handle), (buf, set()))[1].update(perm)

        for cp in self.compiled.partitions:
            p = cp.partition
            want(p.device, self._assets[p.index], "r")
            want(p.device, self._out_bufs[p.index], "rw")
            for src in cp.sources:
                buf = self._input_buf if src == "input" else self._out_bufs[int(src[1:])]
                want(p.device, buf, "r")
        for (device, _), (buf, perms) in need.items():
            if devices is None or device in devices:
                self._contexts[device].map(buf, "rw" if "w" in perms else "r")

    def _import(self, token: int, cp: Any) -> Any:
        """Another client's asset, read-only, if it is byte for byte what we compiled."""
        try:
            buf = self.client.import_buffer(token)
        except errors.HetprocError:
            return None
        self._buffers.append(buf)
        mine = np.empty(cp.nbytes, np.uint8)
        cp.write(mine)
        theirs = buf.array()
        if buf.nbytes != cp.nbytes or not np.array_equal(theirs, mine):
            return None
        return buf

    def export_assets(self) -> list[int]:
        """Read-only tokens of this model's assets, for ``load(shared_assets=...)``."""
        return [b.export(read_only=True) for b in self._assets]

    def _fill(self, cp: Any, buf: Any, bucket: list) -> str:
        """Write the partition's asset into its buffer: from the cache when it holds a
        valid one, else compiled (and stored). Returns what happened."""
        dest = buf.array()
        if self._cache is None:
            cp.write(dest)
            return "compiled"
        p = cp.partition
        parts = self._cache.key_parts(self.graph.fingerprint, self._devices[p.device], bucket,
                                      self._options.key(), (p.nodes[0], p.nodes[-1]))
        payload, outcome = self._cache.load(parts)
        if payload is not None and len(payload) == cp.nbytes:
            dest[:] = np.frombuffer(payload, np.uint8)
            self._cache.record("hit")
            return "hit"
        cp.write(dest)
        self._cache.store(parts, dest.tobytes())
        recompiled = outcome != "miss" or payload is not None
        outcome = "corrupt asset, recompiled" if recompiled else "compiled"
        self._cache.record(outcome)
        return outcome

    def _alloc(self, nbytes: int) -> Any:
        buf = self.client.alloc((int(nbytes),), "uint8", exportable=True)  # shared assets
        self._buffers.append(buf)
        return buf

    def _context(self, device: str) -> Any:
        if device not in self._contexts:
            self._contexts[device] = self.client.context(device,
                                                         name=_context_name(self.graph.name))
        return self._contexts[device]

    # -- running ------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, Any], *,
            timeout: float = RUN_TIMEOUT_S) -> dict[str, np.ndarray]:
        """Every model output by name. Bad inputs are refused before anything is submitted."""
        if self._closing:
            raise errors.InvalidRequest("this model is closing")
        return run_recovering(self, inputs, timeout)

    def _run(self, inputs: Mapping[str, Any],
             timeout: float = RUN_TIMEOUT_S) -> dict[str, np.ndarray]:
        arrays = check_inputs(self.graph, inputs)
        c = self.compiled
        with self._lock:
            if self._closed:
                raise errors.InvalidRequest("this model was closed")
            staging = self._staging
            for name, arr in arrays.items():
                off = c.input_layout.offsets[name]
                raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                staging[off:off + raw.nbytes] = raw
            t0 = time.perf_counter()
            fences: list[Any] = []
            failure: errors.HetprocError | None = None
            try:
                self._submit_all(timeout, fences)
            except errors.HetprocError as exc:
                failure = exc
            # Every submitted command is waited for, even after a failure: the next run
            # rewrites these buffers, and no command of this run may still touch them.
            for f in fences:
                try:
                    _wait(f, timeout)
                except errors.HetprocError as exc:
                    # A restart explains its dependants' failures: it is the one to report.
                    if failure is None or (isinstance(exc, errors.DeviceRestarted)
                                           and not isinstance(failure, errors.DeviceRestarted)):
                        failure = exc
            if failure is not None:
                raise failure
            self.last_run.update(wall_s=time.perf_counter() - t0, commands=len(fences),
                                 modeled_us=sum(p.modeled_us for p in self.placement.partitions))
            return self._read_outputs(arrays)

    def _dependency_budget_s(self) -> float:
        """Half the platform's dependency timeout, in real seconds."""
        spec = self.client.info["spec"]
        return 0.5 * spec.get("dependency_timeout_ms", 2000.0) * spec.get("time_scale", 1.0) / 1000

    def _max_duration_ms(self) -> float:
        """The longest duration a command may name on this platform (``[limits]``)."""
        return float(self.client.info["spec"].get("limits", {}).get("max_duration_ms", 600000.0))

    def _weights_us(self, cp: Any) -> tuple[str, float]:
        """SRAM residency of this partition's weights and the fetch cost of this run."""
        p = cp.partition
        dev = self._devices[p.device]
        if dev.sram_bytes <= 0 or dev.kind == "cpu":
            return "n/a", 0.0
        res = residency_of(self.client, p.device, dev.sram_bytes)
        load_us = cp.nbytes / (dev.target.bandwidth_gbs * 1e3)
        return res.touch((id(self), p.index), cp.nbytes, load_us)

    def _submit_all(self, timeout: float, fences: list[Any]) -> None:
        """Submit every partition in order, appending each command's fence to ``fences``
        as it goes (a failure part-way leaves the ones already submitted there)."""
        c = self.compiled
        scale = max(self.client.time_scale, 1e-6)
        residency = []
        budget = self._dependency_budget_s()
        eta: list[float] = []  # estimated real seconds from now until partition k is done
        for cp in c.partitions:
            p = cp.partition
            state, fetch_us = self._weights_us(cp)
            residency.append(state)
            producers = [int(src[1:]) for src in cp.sources if src != "input"]
            start = max((eta[j] for j in producers), default=0.0)
            if start > budget:
                # The device would wait on these fences longer than the platform's
                # dependency timeout allows: wait for them here instead, then go on.
                for j in producers:
                    _wait(fences[j], timeout)
                eta = [0.0] * len(eta)
                start = 0.0
            eta.append(start + HOST_FIXED_S + p.host_us * HOST_SLOWDOWN / 1e6)
            ins = [self._assets[p.index]]
            wait = []
            for src in cp.sources:
                if src == "input":
                    ins.append(self._input_buf)
                else:
                    k = int(src[1:])
                    ins.append(self._out_bufs[k])
                    wait.append(fences[k])
            # Fire and forget: no reply round trip per partition; a refused command fails
            # its fence, and _wait turns that into the supervisor's full message.
            fences.append(self._contexts[p.device].submit_nowait(
                "graph", ins, [self._out_bufs[p.index]], wait=wait,
                ms=(p.device_us + fetch_us) / 1000,
                timeout_ms=min(timeout * 1000 / scale, self._max_duration_ms())))
        self.last_run["residency"] = residency

    def _read_outputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        c = self.compiled
        where = {t: p.index for p in self.placement.partitions for t in p.outputs}
        out = {}
        for v in self.graph.outputs:
            if v.name in c.constant_outputs:
                out[v.name] = np.array(c.constant_outputs[v.name])
            elif v.name in inputs:
                out[v.name] = np.array(inputs[v.name])
            else:
                out[v.name] = self._output_in_place(v.name, where[v.name]).copy()
        return out

    def _output_in_place(self, name: str, k: int) -> np.ndarray:
        c = self.compiled
        off = c.output_layouts[k].offsets[name]
        dt, shape = np.dtype(c.specs.dtype(name)), known_shape(c.specs, name)
        n = math.prod(shape) * dt.itemsize
        return self._out_views[k][off:off + n].view(dt).reshape(shape)

    def output_view(self, name: str) -> np.ndarray | None:
        """Model output ``name`` in place, in its partition's shared output buffer (what
        the device wrote; valid until the next run overwrites it), or None for an output
        no partition computes (a constant, an input passed through)."""
        where = {t: p.index for p in self.placement.partitions for t in p.outputs}
        if name not in where or name in self.compiled.constant_outputs:
            return None
        return self._output_in_place(name, where[name])

    # -- asynchronous runs (seed §18) -----------------------------------------------------

    def run_async(self, inputs: Mapping[str, Any],
                  callback: Callable[[dict[str, np.ndarray] | None, BaseException | None], None]
                  | None = None) -> Future:
        """Queue a run on this model's bounded pool of client threads; returns a Future of
        the outputs. ``callback(outputs, error)`` runs on a pool thread when the run ends
        (traced as a CALLBACK span); an exception it raises is kept on the Future, never
        lost and never fatal. At most ``MAX_PENDING`` runs wait: one more is refused with
        ``ResourceError`` (backpressure, not an unbounded queue)."""
        with self._pending_lock:
            if self._closing:
                raise errors.InvalidRequest("this model is closed or closing")
            if len(self._pending) >= MAX_PENDING:
                raise errors.ResourceError(f"{MAX_PENDING} runs already pending on this model")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=CALLBACK_THREADS,
                                                thread_name_prefix="hetproc-delegate")
            fut = self._pool.submit(self._run_then_call, inputs, callback)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: Future) -> None:
        with self._pending_lock:
            self._pending.discard(fut)

    def _run_then_call(self, inputs: Mapping[str, Any], callback: Any) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] | None = None
        error: BaseException | None = None
        try:
            out = run_recovering(self, inputs, RUN_TIMEOUT_S)
        except errors.HetprocError as exc:
            error = exc
        if callback is not None:
            with self.client.trace.span("CALLBACK"):
                callback(out, error)
        if error is not None:
            raise error
        assert out is not None
        return out

    # -- teardown -----------------------------------------------------------------------

    def close(self, *, cancel: bool = False, timeout: float = RUN_TIMEOUT_S) -> None:
        """Release the model. Runs in flight finish first (their callbacks too); with
        ``cancel``, runs not started yet are cancelled instead (their Futures say so).
        Never waits longer than ``timeout``."""
        with self._pending_lock:
            if self._closing:
                return
            self._closing = True
            pending = list(self._pending)
        if cancel:
            for fut in pending:
                fut.cancel()  # only runs not started yet: their Futures raise CancelledError
        _, not_done = wait(pending, timeout=timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=not not_done, cancel_futures=True)
        with self._lock:  # a run still inside (timed out above) fails with "closed"
            self._closed = True
        for p in self.placement.partitions:
            dev = self._devices.get(p.device)
            if dev is not None and dev.sram_bytes > 0:
                residency_of(self.client, p.device, dev.sram_bytes).forget([(id(self), p.index)])
        for ctx in self._contexts.values():
            try:
                ctx.close()
            except errors.HetprocError:
                pass
        for buf in self._buffers:
            try:
                buf.free()
            except errors.HetprocError:
                pass

    def __enter__(self) -> DelegatedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _context_name(graph_name: str) -> str:
    """A context name the platform accepts (printable, at most 64 characters)."""
    name = "".join(ch if ch.isprintable() else "?" for ch in f"delegate:{graph_name}")
    return name if len(name) <= 64 else name[:61] + "..."

"""Placement: which device runs each node, grouped into partitions (seed §2).

Like a TFLite delegate (``GetSupportedNodes`` -> ``PreviewDelegatePartitioning`` ->
``ReplaceNodeSubsetsWithDelegateKernels``) or an ONNX Runtime ``GetCapability``:

1. Support query per node and device: op, variant, dtype, rank and dims, window size
   (``_targets.refusal``); an unsupported node says why.
2. Each supported node goes to the accelerator with the lowest modeled time.
3. Partitions: a topological order that keeps a device's nodes together as long as the
   graph allows, cut into runs of one device, each run split into connected components.
   Contracting contiguous runs of a topological order cannot form a cycle, so partitions
   are connected and acyclic by construction.
4. Weighing: a delegated partition whose modeled time plus boundary cost (fence hop,
   cache clean / invalidate of non-coherent devices, NCHW<->NHWC reformat) is not below
   the CPU's time for the same nodes falls back, as does one smaller than
   ``min_nodes_per_partition``; beyond ``max_partitions`` the smallest gains fall back.
   Steps 3-4 repeat until nothing moves.

Strict mode refuses a model the accelerators cannot fully take (``UnsupportedOp`` listing
every refused node); fallback mode logs what fell back and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ipc import errors

from ._model import Graph
from ._targets import Device, nbytes_of, refusal

FENCE_HOP_US = 25.0  # a semaphore wake across processes (measured ~21-28 us)


@dataclass(frozen=True)
class Options:
    strict: bool = False
    accelerators: tuple[str, ...] | None = None  # device names, preferred first; None: all
    fallback: str | None = None                  # generic device; None: the first cpu
    max_partitions: int = 8                      # delegated (non-fallback) partitions
    min_nodes_per_partition: int = 2
    weigh_costs: bool = True
    # True: a node goes to the first of ``accelerators`` that takes it (ONNX Runtime's
    # provider priority) instead of the one with the lowest modeled time.
    in_order: bool = False

    def key(self) -> str:
        """The options as one string: part of an asset's cache key (other options, other
        partitions, so another asset)."""
        return (f"strict={int(self.strict)},acc={','.join(self.accelerators or ())},"
                f"fb={self.fallback},maxp={self.max_partitions},"
                f"minn={self.min_nodes_per_partition},w={int(self.weigh_costs)}"
                + (",ordered" if self.in_order else ""))


@dataclass
class Partition:
    index: int
    device: str
    nodes: list[int]
    inputs: list[str] = field(default_factory=list)    # activations read from outside
    outputs: list[str] = field(default_factory=list)   # activations used outside / model outputs
    weights: list[str] = field(default_factory=list)   # initializers it reads
    modeled_us: float = 0.0                            # dispatch + nodes + boundary work
    device_us: float = 0.0    # what the device is held for: nodes + cache/reformat work
    host_us: float = 0.0      # the same nodes on the generic CPU: a bound on real compute
    compile_us: float = 0.0


@dataclass
class Boundary:
    tensor: str
    src: str          # device name, or "host" for a model input
    dst: str          # device name, or "host" for a model output
    nbytes: int
    steps: list[str]
    cost_us: float


@dataclass
class Placement:
    graph: Graph
    fallback: str
    accelerators: list[str]
    assignment: dict[int, str]
    partitions: list[Partition]
    boundaries: list[Boundary]
    log: list[str]
    fell_back: list[tuple[int, str]]
    summary: list[str]

    def text(self) -> str:
        """The placement as ``hetproc model inspect`` prints it: the decisions, then each
        partition and each boundary with its bytes and conversions."""
        lines = list(self.log)
        lines.append("")
        for p in self.partitions:
            first, last = p.nodes[0], p.nodes[-1]
            lines.append(f"partition {p.index} on {p.device}: {len(p.nodes)} node(s) "
                         f"[#{first}..#{last}], in {p.inputs}, out {p.outputs}, "
                         f"modeled {p.modeled_us:.1f} us, compile {p.compile_us / 1000:.2f} ms")
        for b in self.boundaries:
            lines.append(f"boundary {b.tensor!r} {b.src} -> {b.dst}: {b.nbytes} B, "
                         f"{' + '.join(b.steps) or 'zero-copy'}, {b.cost_us:.1f} us")
        if self.fell_back:
            lines.append(f"fell back to {self.fallback}: {len(self.fell_back)} node(s)")
        lines.extend(self.summary)
        return "\n".join(lines)


class Specs:
    """dtype and static shape of every tensor name (from shape inference or a probe)."""

    def __init__(self, graph: Graph, specs: dict[str, tuple[str, tuple[int, ...] | None]]):
        self.graph = graph
        self.map = specs
        # Placement asks for a node's inputs and outputs, and its modeled time per device,
        # several times per node (support, cost, weighing, the final table): each is
        # computed once here, so placing a graph stays linear in its nodes.
        self.io: dict[int, tuple] = {}
        self.us: dict[tuple[int, str], float] = {}

    def dtype(self, name: str) -> str:
        return self.map.get(name, ("", None))[0]

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.map.get(name, ("", None))[1]

    def nbytes(self, name: str) -> int:
        return nbytes_of(self.dtype(name), self.shape(name))


def _node_io(graph: Graph, specs: Specs, idx: int):
    got = specs.io.get(idx)
    if got is None:
        got = specs.io[idx] = _compute_node_io(graph, specs, idx)
    return got


def _compute_node_io(graph: Graph, specs: Specs, idx: int):
    n = graph.nodes[idx]
    # "?": a value that is there but is not a tensor of known element type (a sequence,
    # an optional); "": an omitted optional input.
    ins = [(specs.dtype(i) or "?", specs.shape(i), i in graph.initializers) if i
           else ("", None, True) for i in n.inputs]
    used = graph.used_values()
    outs = [(specs.dtype(o) or "?", specs.shape(o)) for o in n.outputs if o and o in used]
    return n, ins, outs


def node_us(graph: Graph, specs: Specs, idx: int, dev: Device) -> float:
    got = specs.us.get((idx, dev.name))
    if got is None:
        got = specs.us[(idx, dev.name)] = _compute_node_us(graph, specs, idx, dev)
    return got


def _compute_node_us(graph: Graph, specs: Specs, idx: int, dev: Device) -> float:
    n, ins, outs = _node_io(graph, specs, idx)
    nbytes = sum(nbytes_of(d, s) for d, s, _ in ins) + sum(nbytes_of(d, s) for d, s in outs)
    dtype = ins[0][0] if ins and ins[0][0] else (outs[0][0] if outs else "float32")
    return dev.target.node_us(n.op, dtype, [s or () for _, s, _ in ins],
                              [s or () for _, s in outs], nbytes, n.attrs)


def transfer(src: Device | None, dst: Device | None, nbytes: int,
             rank: int) -> tuple[list[str], float]:
    """Work at one boundary edge: what happens and its modeled cost (us)."""
    if src is not None and dst is not None and src.name == dst.name:
        return [], 0.0
    steps, cost = ["fence"], FENCE_HOP_US
    if src is not None and not src.coherent:
        steps.append(f"clean({src.name})")
        cost += src.maintenance_us("clean", nbytes)
    if dst is not None and not dst.coherent:
        steps.append(f"invalidate({dst.name})")
        cost += dst.maintenance_us("invalidate", nbytes)
    for dev, (a, b) in ((src, ("NHWC", "NCHW")), (dst, ("NCHW", "NHWC"))):
        if dev is not None and rank == 4 and "NCHW" not in dev.layouts:
            steps.append(f"reformat {a}->{b} on {dev.name}")
            cost += 2 * nbytes / (dev.target.bandwidth_gbs * 1e3)
    return steps, cost


def place(graph: Graph, specs: Specs, devices: Sequence[Device], options: Options) -> Placement:
    by_name = {d.name: d for d in devices}
    fallback = options.fallback or next((d.name for d in devices
                                         if d.kind == "cpu" and d.runs_graph), None)
    if fallback is None or fallback not in by_name or not by_name[fallback].runs_graph:
        raise errors.UnsupportedOp("no fallback device: the platform has no cpu running graphs")
    if options.accelerators is not None:
        unknown = [a for a in options.accelerators if a not in by_name]
        if unknown:
            raise errors.InvalidRequest(f"unknown accelerator(s) {unknown}; "
                                        f"devices: {list(by_name)}")
        accels = [a for a in options.accelerators if a != fallback]
    else:
        accels = [d.name for d in devices if d.name != fallback and d.runs_graph]
    if options.max_partitions < 0 or options.min_nodes_per_partition < 1:
        raise errors.InvalidRequest("max_partitions must be >= 0, min_nodes_per_partition >= 1")
    fb = by_name[fallback]
    log: list[str] = []
    cpu_us = {i: node_us(graph, specs, i, fb) for i in range(len(graph.nodes))}
    assignment: dict[int, str] = {}
    why: dict[int, str] = {}
    for i in range(len(graph.nodes)):
        n, ins, outs = _node_io(graph, specs, i)
        refusals, best = [], None
        for a in accels:
            r = refusal(by_name[a], n.op, n.attrs, ins, outs)
            if r:
                refusals.append(f"{a}: {r}")
                continue
            t = node_us(graph, specs, i, by_name[a])
            if best is None or (t < best[1] and not options.in_order):
                best = (a, t)
        r_fb = refusal(fb, n.op, n.attrs, ins, outs)
        if best is None:
            if r_fb:
                raise errors.UnsupportedOp(f"node #{i} {n.op} {n.name!r}: no device runs it "
                                           f"({'; '.join(refusals + [f'{fallback}: {r_fb}'])})")
            assignment[i] = fallback
            why[i] = "unsupported: " + ("; ".join(refusals) or "no accelerator")
        else:
            assignment[i] = best[0]
            why[i] = f"{best[1]:.1f} us on {best[0]} vs {cpu_us[i]:.1f} us on {fallback}" + (
                f" (refused by {'; '.join(refusals)})" if refusals else "")
    if options.strict:
        refused = [f"#{i} {graph.nodes[i].op} ({why[i]})" for i, d in assignment.items()
                   if d == fallback]
        if refused and accels:
            raise errors.UnsupportedOp(f"strict placement: {len(refused)} node(s) would fall "
                                       f"back to {fallback}: {'; '.join(refused[:8])}")
    moved: list[tuple[int, str]] = [(i, why[i]) for i, d in assignment.items()
                                    if d == fallback and accels]
    for _ in range(16):
        parts = _partitions(graph, assignment)
        changes = [] if options.strict else _weigh(graph, specs, parts, by_name, fb, cpu_us,
                                                   options)
        if not changes:
            break
        for nodes, reason in changes:
            for i in nodes:
                assignment[i] = fallback
                why[i] = reason
                moved.append((i, reason))
    parts = _partitions(graph, assignment)
    boundaries = _finish(graph, specs, parts, by_name)
    for p in parts:
        p.host_us = sum(cpu_us[i] for i in p.nodes)
    for i, node in enumerate(graph.nodes):
        log.append(f"#{i:<4d}{node.op:<19s}{node.name[:28]:<29s}-> {assignment[i]:<6s}"
                   f" {why[i]}")
    total = len(graph.nodes)
    summary = []
    for a in accels:
        n_nodes = sum(1 for d in assignment.values() if d == a)
        k = sum(1 for p in parts if p.device == a)
        summary.append(f"Replacing {n_nodes} out of {total} node(s) with delegate ({a}), "
                       f"yielding {k} partitions")
    fell = sorted({i: r for i, r in moved if assignment[i] == fallback}.items())
    return Placement(graph, fallback, accels, assignment, parts, boundaries, log, fell, summary)


def _edges(graph: Graph) -> tuple[list[list[int]], list[list[int]]]:
    prod = graph.producers()
    succ: list[list[int]] = [[] for _ in graph.nodes]
    pred: list[list[int]] = [[] for _ in graph.nodes]
    for n in graph.nodes:
        for t in n.inputs:
            p = prod.get(t) if t else None
            if p is not None and n.index not in succ[p]:
                succ[p].append(n.index)
                pred[n.index].append(p)
    return succ, pred


def _partitions(graph: Graph, assignment: dict[int, str]) -> list[Partition]:
    succ, pred = _edges(graph)
    indeg = [len(p) for p in pred]
    ready = sorted(i for i, d in enumerate(indeg) if d == 0)
    order, cur = [], None
    while ready:
        pick = next((i for i in ready if assignment[i] == cur), ready[0])
        ready.remove(pick)
        order.append(pick)
        cur = assignment[pick]
        for s in succ[pick]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
        ready.sort()
    runs: list[list[int]] = []
    for i in order:
        if runs and assignment[runs[-1][-1]] == assignment[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts: list[Partition] = []
    for run in runs:
        for comp in _components(run, succ):
            parts.append(Partition(len(parts), assignment[comp[0]], comp))
    return parts


def _components(run: list[int], succ: list[list[int]]) -> list[list[int]]:
    members = set(run)
    parent = {i: i for i in run}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in run:
        for s in succ[i]:
            if s in members:
                parent[find(s)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in run:  # run order is topological: each component keeps it
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _io(graph: Graph, parts: list[Partition]) -> None:
    where = {i: p.index for p in parts for i in p.nodes}
    prod = graph.producers()
    cons = graph.consumers()
    outs = {v.name for v in graph.outputs}
    for p in parts:
        p.inputs, p.outputs, p.weights = [], [], []
        for i in p.nodes:
            for t in graph.nodes[i].inputs:
                if not t:
                    continue
                if t in graph.initializers:
                    if t not in p.weights:
                        p.weights.append(t)
                elif (prod.get(t) is None or where[prod[t]] != p.index) and t not in p.inputs:
                    p.inputs.append(t)
            for t in graph.nodes[i].outputs:
                if t and (t in outs or any(where[c] != p.index for c in cons.get(t, []))):
                    p.outputs.append(t)


def _boundary_cost(graph: Graph, specs: Specs, p: Partition, parts: list[Partition],
                   by_name: dict[str, Device], dev: Device) -> float:
    prod = graph.producers()
    where = {i: q.device for q in parts for i in q.nodes}
    cons = graph.consumers()
    cost = 0.0
    for t in p.inputs:
        src = by_name.get(where[prod[t]]) if t in prod else None
        cost += transfer(src, dev, specs.nbytes(t), len(specs.shape(t) or ()))[1]
    for t in p.outputs:
        dsts = {where[c] for c in cons.get(t, []) if where[c] != p.device} or {"host"}
        for d in dsts:
            cost += transfer(dev, by_name.get(d), specs.nbytes(t), len(specs.shape(t) or ()))[1]
    return cost


def _weigh(graph: Graph, specs: Specs, parts: list[Partition], by_name: dict[str, Device],
           fb: Device, cpu_us: dict[int, float], options: Options) -> list[tuple[list[int], str]]:
    _io(graph, parts)
    gains: list[tuple[float, Partition]] = []
    changes: list[tuple[list[int], str]] = []
    for p in parts:
        if p.device == fb.name:
            continue
        dev = by_name[p.device]
        if len(p.nodes) < options.min_nodes_per_partition:
            changes.append((p.nodes, f"partition of {len(p.nodes)} node(s) on {p.device} is "
                                     "below min_nodes_per_partition="
                                     f"{options.min_nodes_per_partition}"))
            continue
        if not options.weigh_costs:
            gains.append((0.0, p))
            continue
        accel = dev.target.dispatch_us + sum(node_us(graph, specs, i, dev) for i in p.nodes)
        boundary = _boundary_cost(graph, specs, p, parts, by_name, dev)
        on_cpu = sum(cpu_us[i] for i in p.nodes)
        gain = on_cpu - accel - boundary
        if gain <= 0:
            changes.append((p.nodes, f"offload to {p.device} loses: {accel:.1f} us + boundary "
                                     f"{boundary:.1f} us >= {on_cpu:.1f} us on {fb.name}"))
        else:
            gains.append((gain, p))
    if changes:  # re-partition before judging the partition count
        return changes
    if len(gains) > options.max_partitions:
        gains.sort(key=lambda gp: -gp[0])
        for gain, p in gains[options.max_partitions:]:
            changes.append((p.nodes, f"beyond max_partitions={options.max_partitions} "
                                     f"(gain {gain:.1f} us is among the smallest)"))
    return changes


def _finish(graph: Graph, specs: Specs, parts: list[Partition],
            by_name: dict[str, Device]) -> list[Boundary]:
    _io(graph, parts)
    prod = graph.producers()
    where = {i: q.device for q in parts for i in q.nodes}
    boundaries: list[Boundary] = []
    model_outs = {v.name for v in graph.outputs}
    for p in parts:
        dev = by_name[p.device]
        p.device_us = sum(node_us(graph, specs, i, dev) for i in p.nodes)
        p.modeled_us = dev.target.dispatch_us + p.device_us
        p.compile_us = dev.target.compile_us_per_node * len(p.nodes)
        for t in p.inputs:
            src = by_name.get(where[prod[t]]) if t in prod else None
            steps, cost = transfer(src, dev, specs.nbytes(t), len(specs.shape(t) or ()))
            p.modeled_us += cost
            p.device_us += cost - (FENCE_HOP_US if "fence" in steps else 0.0)
            boundaries.append(Boundary(t, src.name if src else "host", p.device,
                                       specs.nbytes(t), steps, cost))
        for t in p.outputs:
            if t in model_outs:
                steps, cost = transfer(dev, None, specs.nbytes(t), len(specs.shape(t) or ()))
                p.modeled_us += cost
                p.device_us += cost - (FENCE_HOP_US if "fence" in steps else 0.0)
                boundaries.append(Boundary(t, p.device, "host", specs.nbytes(t), steps, cost))
    return boundaries

"""``hetproc model ...``: inspect, run and diff the placement of an ONNX model.

    hetproc model inspect MODEL.onnx [--platform F] [--strict] [--max-partitions N] ...
    hetproc model run MODEL.onnx [--inputs F.npz] [--output F.npz] [--platform F] [--trace F]
    hetproc model diff MODEL.onnx [--platform A] [--against B] [--against-max-partitions N]
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._argtypes import positive_int, time_scale
from .._config import TIME_SCALE_RANGE
from ._npz import save_npz


def add_model_commands(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``model inspect|run|diff`` on the top-level subparsers; ``command(sub,
    name, summary, prose, func)`` is the CLI's own way of adding a command, so these read
    like every other one."""
    model = command(sub, "model", "ONNX models on the platform: inspect, run, diff", """
        ONNX models partitioned across the emulated devices (seed §2, §6, §13; needs the
        'onnx' extra). inspect prints where each node would run and why, run runs the
        model on a fresh platform, diff compares two placements of one model.""", None)
    msub = model.add_subparsers(title="commands", metavar="COMMAND")
    ins = command(msub, "inspect", "print the placement log and partitions", """
        Place the model on the platform's devices without starting it: which device
        takes each node and why, the partitions, the work at their boundaries, and per
        accelerator the line "Replacing N out of M node(s) with delegate (npu0),
        yielding K partitions".""", cmd_inspect)
    _common(ins)
    ins.add_argument("--json", action="store_true", help="print the placement as JSON on stdout")
    run = command(msub, "run", "run a model partitioned across the devices", """
        Start a platform, compile the model's partitions into assets, run it (one graph
        command per partition, fences only at partition boundaries) and print the
        timings and the outputs' shapes. The output and trace paths are checked before
        anything starts.""", cmd_run)
    _common(run)
    run.add_argument("--inputs", metavar="F.npz", help="inputs by name (default: seeded random)")
    run.add_argument("--output", metavar="F.npz", help="write the outputs by tensor name")
    run.add_argument("--trace", metavar="F.json", help="write the timeline (Chrome Trace JSON)")
    run.add_argument("--time-scale", type=time_scale, default=1.0, metavar="X",
                     help="multiply every modeled duration "
                          f"({TIME_SCALE_RANGE[0]} .. {TIME_SCALE_RANGE[1]})")
    run.add_argument("--runs", type=positive_int, default=1, metavar="N",
                     help="how many times to run it (the best time is printed)")
    run.add_argument("--cache-dir", metavar="DIR",
                     help="asset cache directory (a second run with it loads warm)")
    run.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    diff = command(msub, "diff", "compare two placements of one model (upgrade check)", """
        Place the model twice -- on two platform files, or with two sets of partition
        limits -- and compare the delegated nodes, partitions, boundary tensors and
        modeled end-to-end time (seed §16). Exit status 1 when the placements differ.""",
                cmd_diff)
    _common(diff)
    diff.add_argument("--against", metavar="FILE", help="the other platform file (default: same)")
    diff.add_argument("--against-max-partitions", type=positive_int, metavar="N",
                      help="max_partitions of the other")
    diff.add_argument("--against-min-nodes", type=positive_int, metavar="N",
                      help="min_nodes_per_partition of the other")
    diff.add_argument("--json", action="store_true", help="print both placements as JSON")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--platform", metavar="FILE", help="platform TOML (default: built-in)")
    p.add_argument("--strict", action="store_true", help="refuse if any node would fall back")
    p.add_argument("--max-partitions", type=positive_int, default=8, metavar="N",
                   help="at most this many partitions (default 8)")
    p.add_argument("--min-nodes", type=positive_int, default=2, metavar="N",
                   help="min_nodes_per_partition (default 2)")
    p.add_argument("--ignore-costs", action="store_true",
                   help="offload every supported node (no copy-vs-gain weighing)")
    p.add_argument("--accelerators", help="comma-separated device names, preferred first")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D,D,..",
                   help="bind a symbolic input shape (a shape bucket)")


def _check_path(path: str | None, flag: str) -> None:
    """An output path whose directory exists: checked before anything runs, never created."""
    from hetproc.errors import InvalidRequest
    if path and not Path(path).resolve().parent.is_dir():
        raise InvalidRequest(f"{flag} {path}: the directory {Path(path).parent} does not exist")


def _options(args: argparse.Namespace, **over: Any) -> Any:
    from . import Options
    acc = tuple(a for a in args.accelerators.split(",") if a) if args.accelerators else None
    kw = dict(strict=args.strict, accelerators=acc, max_partitions=args.max_partitions,
              min_nodes_per_partition=args.min_nodes, weigh_costs=not args.ignore_costs)
    kw.update({k: v for k, v in over.items() if v is not None})
    return Options(**kw)


def _shapes(args: argparse.Namespace) -> dict[str, list[int]] | None:
    from hetproc.errors import InvalidRequest
    out = {}
    for item in args.input_shape:
        name, _, dims = item.partition("=")
        try:
            out[name] = [int(d) for d in dims.split(",") if d]
        except ValueError:
            raise InvalidRequest(f"--input-shape {item!r}: expected NAME=D,D,...") from None
    return out or None


def _spec(path: str | None) -> Any:
    from hetproc import load_platform
    return load_platform(path)


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import plan
    pl = plan(args.model, _spec(args.platform), _options(args), _shapes(args))
    if args.json:
        print(json.dumps(placement_dict(pl), indent=2))
    else:
        print(pl.text())
    return 0


def placement_dict(pl: Any) -> dict[str, Any]:
    return {
        "nodes": len(pl.graph.nodes),
        "summary": pl.summary,
        "partitions": [{"index": p.index, "device": p.device, "nodes": [p.nodes[0], p.nodes[-1]],
                        "count": len(p.nodes), "inputs": p.inputs, "outputs": p.outputs,
                        "modeled_us": round(p.modeled_us, 1)} for p in pl.partitions],
        "boundaries": [{"tensor": b.tensor, "src": b.src, "dst": b.dst, "bytes": b.nbytes,
                        "steps": b.steps, "cost_us": round(b.cost_us, 1)} for b in pl.boundaries],
        "fell_back": [{"node": i, "reason": r} for i, r in pl.fell_back],
        "modeled_us": round(sum(p.modeled_us for p in pl.partitions), 1),
    }


def _feeds(graph: Any, path: str | None) -> dict[str, np.ndarray]:
    return _read_npz(path) if path else graph.sample_inputs()


_NPZ_HINT = "an .npz archive, one array per input name (numpy.savez)"


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """The inputs of ``--inputs``: a zip of plain arrays. Anything else (a pickle, a lone
    .npy, text) is refused by what it is, and nothing is ever unpickled."""
    from hetproc.errors import InvalidRequest
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
            raise InvalidRequest(f"--inputs {path}: not a regular file; it must be {_NPZ_HINT}")
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InvalidRequest(f"--inputs {path}: cannot read it: {exc.strerror}") from None
    if magic != b"PK\x03\x04":
        raise InvalidRequest(f"--inputs {path}: not {_NPZ_HINT}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except ValueError as exc:
        if "pickle" in str(exc):  # an object array inside: it would need unpickling
            raise InvalidRequest(f"--inputs {path}: holds an array of Python objects; it "
                                 f"must be {_NPZ_HINT}, of numbers") from None
        raise InvalidRequest(f"--inputs {path}: not {_NPZ_HINT} ({exc})") from None
    except (OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise InvalidRequest(f"--inputs {path}: not {_NPZ_HINT} ({exc})") from None


def cmd_run(args: argparse.Namespace) -> int:
    import hetproc

    from . import AssetCache, DelegatedModel, load_model
    _check_path(args.output, "--output")
    _check_path(args.trace, "--trace")
    graph = load_model(args.model, _shapes(args))
    feeds = _feeds(graph, args.inputs)
    cache = AssetCache(args.cache_dir) if args.cache_dir else None
    lines: list[str] = []
    result: dict[str, Any] = {}
    with hetproc.Platform(args.platform, time_scale=args.time_scale) as plat:
        t0 = time.perf_counter()
        with DelegatedModel.load(plat.client, graph, options=_options(args), cache=cache) as dm:
            t_load = time.perf_counter() - t0
            if cache is not None:
                lines.append(f"assets: {', '.join(dm.load_info['cache'])}; modeled "
                             f"compile/load {sum(dm.load_info['compile_ms'].values()):.2f} ms")
            lines += list(dm.placement.summary)
            for p in dm.placement.partitions:
                lines.append(f"partition {p.index} on {p.device}: {len(p.nodes)} node(s), "
                             f"modeled {p.modeled_us:.1f} us")
            walls = []
            for _ in range(args.runs):
                out = dm.run(feeds)
                walls.append(dm.last_run["wall_s"])
            lines.append(f"load {t_load * 1000:.1f} ms; run {min(walls) * 1000:.2f} ms "
                         f"(best of {len(walls)}), {dm.last_run['commands']} command(s), "
                         f"modeled {dm.last_run['modeled_us']:.1f} us")
            result = {"placement": placement_dict(dm.placement),
                      "cache": list(dm.load_info["cache"]) if cache is not None else None,
                      "load_ms": round(t_load * 1000, 3),
                      "run_ms_best": round(min(walls) * 1000, 3), "runs": len(walls),
                      "commands": dm.last_run["commands"],
                      "modeled_us": round(dm.last_run["modeled_us"], 1)}
        lines += [f"output {name}: {arr.dtype} {list(arr.shape)}" for name, arr in out.items()]
        result["outputs"] = {name: {"dtype": str(arr.dtype), "shape": list(arr.shape)}
                             for name, arr in out.items()}
        if args.output:
            save_npz(args.output, out)
            lines.append(f"outputs written to {args.output}")
        if args.trace:
            plat.export_trace(args.trace)
            lines.append(f"trace written to {args.trace}")
    result.update(output=args.output, trace=args.trace)
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from . import load_model, plan
    graph = load_model(args.model, _shapes(args))
    a = placement_dict(plan(graph, _spec(args.platform), _options(args)))
    b = placement_dict(plan(graph, _spec(args.against or args.platform), _options(
        args, max_partitions=args.against_max_partitions,
        min_nodes_per_partition=args.against_min_nodes)))
    same = a["partitions"] == b["partitions"]
    if args.json:
        print(json.dumps({"a": a, "b": b, "identical": same}, indent=2))
        return 0 if same else 1
    for label, d in (("A", a), ("B", b)):
        print(f"[{label}] " + "; ".join(d["summary"]))
        print(f"[{label}] {len(d['partitions'])} partitions: " + ", ".join(
            f"{p['device']}#{p['nodes'][0]}..{p['nodes'][1]}" for p in d["partitions"]))
        print(f"[{label}] boundary tensors: {sorted({x['tensor'] for x in d['boundaries']})}")
        print(f"[{label}] modeled end-to-end: {d['modeled_us']:.1f} us")
    print("placement identical" if same else
          f"placement differs: modeled {a['modeled_us']:.1f} -> {b['modeled_us']:.1f} us")
    return 0 if same else 1

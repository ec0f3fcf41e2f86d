"""An explained request as people and scripts read it (``hetproc trace explain``): a table
of its stages, the same as data, and a trace's summary; the explaining is ``_explain``'s."""

from __future__ import annotations

from typing import Any

from ._explain import IMPLICATIONS, Request, Trace, requests


def format_request(trace: Trace, req: Request) -> str:
    """An explained request as the table ``hetproc trace explain`` prints: one row per
    stage (when, how long, its share, where and the evidence), the dominant stage starred
    and what it implies."""
    dom = req.dominant
    lines = [f"request {req.cid:#x} on {trace.device_of(req)}: {req.total:.3f} ms from "
             f"{req.stages[0].name if req.stages else '?'} start to "
             f"{req.stages[-1].name if req.stages else '?'} end"
             + (" (unfinished at the end of the trace)" if req.unfinished else "")]
    lines.append(f"  {'stage':10s} {'at ms':>10s} {'ms':>10s} {'share':>6s}  where / evidence")
    for s in req.stages:
        share = 100.0 * s.dur / req.total if req.total > 0 else 0.0
        mark = "*" if s is dom else " "
        lines.append(f"{mark} {s.name:10s} {s.t0 - req.start:10.3f} {s.dur:10.3f} {share:5.1f}%  "
                     f"{s.where}" + (f": {s.detail}" if s.detail else ""))
    if dom is not None:
        share = 100.0 * dom.dur / req.total if req.total > 0 else 0.0
        lines.append(f"  dominant: {dom.name} ({dom.dur:.3f} ms, {share:.0f}%) -> "
                     f"{IMPLICATIONS[dom.name]}")
    return "\n".join(lines)


def as_dict(trace: Trace, req: Request) -> dict[str, Any]:
    """An explained request as JSON-ready data (``--json``): the table's rows and the
    dominant stage with its implication."""
    dom = req.dominant
    return {"cid": req.cid, "device": trace.device_of(req), "total_ms": req.total,
            "unfinished": req.unfinished,
            "stages": [{"stage": s.name, "at_ms": s.t0 - req.start, "ms": s.dur,
                        "where": s.where, "detail": s.detail} for s in req.stages],
            "dominant": dom.name if dom else None,
            "implication": IMPLICATIONS[dom.name] if dom else None}


def summary_lines(trace: Trace) -> list[str]:
    """What a trace holds, in a line or two: the frozen window it is (reason, errors,
    cids) and its requests' p50, p99 and max latency."""
    reqs = requests(trace)
    lines = []
    frozen = trace.other.get("frozen")
    if frozen:
        lines.append(f"frozen window {frozen.get('id')}: {frozen.get('reason')} "
                     f"({len(frozen.get('errors', []))} error(s), "
                     f"cids {', '.join(f'{c:#x}' for c in frozen.get('cids', [])) or '-'})")
    if reqs:
        totals = sorted(r.total for r in reqs)
        p50 = totals[len(totals) // 2]
        p99 = totals[min(len(totals) - 1, int(len(totals) * 0.99))]
        lines.append(f"{len(reqs)} requests: p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
                     f"max {totals[-1]:.3f} ms")
    else:
        lines.append("no requests in this trace")
    return lines


def parse_cid(text: str) -> int:
    """A correlation id as printed (``0x...``) or in decimal."""
    return int(text, 0)

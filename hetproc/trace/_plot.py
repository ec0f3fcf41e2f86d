"""A static timeline picture of a trace: a lane per client, queue and device, a bar per
stage of each command, and the fences as arrows (producer's signal -> the consumer that
waited on it; device's signal -> the client it woke).

A long trace drawn whole is a smear: without a ``window`` a trace longer than
``AUTO_SPAN_MS`` is drawn around its slowest request (and says so), where bars and arrows
can be read. Bars are drawn one call per stage and lane, so the cost grows with the lanes,
not with the slices.

matplotlib is the optional extra ``plot`` (``pip install -e '.[plot]'``); it is imported
only when a picture is asked for, so the rest of hetproc never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ipc import errors

from ._explain import Trace, load_trace

# Stage -> (colour, lane height fraction): the command's own work is solid and full
# height; waiting is pale, so a stall reads as "long and pale" at a glance.
_STYLE = {
    "EXEC": ("#1f77b4", 0.8), "MAP": ("#17becf", 0.4), "ACQUIRE_WAIT": ("#ffbb78", 0.5),
    "QUEUED": ("#c7c7c7", 0.5), "ENQUEUE": ("#7f7f7f", 0.7), "SUBMIT": ("#2ca02c", 0.6),
    "WAKE": ("#d9f0d3", 0.5), "CALLBACK": ("#9467bd", 0.8),
}
_MAX_ARROWS = 400
AUTO_SPAN_MS = 250.0   # longer traces get a window of their own unless one is given
AUTO_MIN_MS = 60.0     # the automatic window is at least this wide...
AUTO_REQUESTS = 6.0    # ...and this many times the slowest request


def require_matplotlib():
    """matplotlib's figure classes, or a clear error naming the ``plot`` extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise errors.InvalidRequest(
            "plotting needs matplotlib, the optional extra 'plot': "
            "pip install -e '.[plot]' (or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def plot_timeline(trace: Trace | Mapping[str, Any] | str | os.PathLike[str],
                  path: str | os.PathLike[str], *, window: tuple[float, float] | None = None,
                  title: str = "") -> dict[str, Any]:
    """Draw ``trace`` (a parsed ``Trace``, a Chrome trace dict or a file) into a PNG at
    ``path``. ``window`` = (start, end) in ms from the trace origin. Returns counts."""
    Figure, FigureCanvasAgg = require_matplotlib()
    tr = trace if isinstance(trace, Trace) else load_trace(trace)
    slices = [s for req in tr.by_cid.values() for group in req.slices.values() for s in group]
    note = ""
    if window is None:
        window, note = _auto_window(tr, slices)
    if window is not None:
        lo, hi = window
        slices = [s for s in slices if s.t1 >= lo and s.t0 <= hi]
    # Lanes, top to bottom: clients, then each device's queue and the device itself.
    lanes: dict[tuple[int, int], str] = {}
    for s in sorted(slices,
                    key=lambda s: (_lane_rank(tr.threads.get((s.pid, s.tid), "")), s.pid, s.tid)):
        key = (s.pid, s.tid)
        if key not in lanes:
            lanes[key] = tr.where(s)
    order = sorted(lanes, key=lambda k: (_lane_rank(tr.threads.get(k, "")),
                                         _base_row(tr.threads.get(k, "")), tr.threads.get(k, ""),
                                         k))
    y_of = {k: len(order) - 1 - i for i, k in enumerate(order)}

    fig = Figure(figsize=(14, 1.0 + 0.55 * max(1, len(order))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    by_style: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for s in slices:
        if s.name in _STYLE:
            lane = by_style.setdefault(s.name, {}).setdefault(y_of[(s.pid, s.tid)], [])
            lane.append((s.t0, max(s.dur, 1e-3)))
    for name, (colour, height) in _STYLE.items():
        for y, bars in by_style.get(name, {}).items():
            ax.broken_barh(bars, (y - height / 2, height), facecolors=colour, edgecolors="none")
    arrows = _fence_arrows(tr, y_of, window)
    for (x0, y0), (x1, y1) in arrows[-_MAX_ARROWS:]:
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "#d62728", "lw": 0.7, "alpha": 0.7})
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([lanes[k] for k in reversed(order)], fontsize=8)
    ax.set_xlabel("ms")
    if window is not None:
        ax.set_xlim(*window)
    handles = [_patch(name, colour) for name, (colour, _) in _STYLE.items() if name in by_style]
    if arrows:
        from matplotlib.lines import Line2D
        handles.append(Line2D([0], [0], color="#d62728", lw=1, label="fence signal -> waiter"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    ax.set_title(title or "hetproc timeline", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    return {"path": os.fspath(path), "lanes": len(order), "slices": len(slices),
            "arrows": min(len(arrows), _MAX_ARROWS), "window": list(window) if window else None,
            "note": note}


def _auto_window(tr: Trace, slices: list) -> tuple[tuple[float, float] | None, str]:
    """A readable part of a long trace: around its slowest request. None: draw it all."""
    if not slices:
        return None, ""
    t_lo = min(s.t0 for s in slices)
    t_hi = max(s.t1 for s in slices)
    if t_hi - t_lo <= AUTO_SPAN_MS:
        return None, ""
    from ._explain import slowest
    top = slowest(tr, 1)
    if top:
        req = top[0]
        width = max(AUTO_MIN_MS, AUTO_REQUESTS * req.total)
        mid = (req.start + req.end) / 2
        what = f"around the slowest request {req.cid:#x} ({req.total:.1f} ms)"
    else:
        width, mid, what = AUTO_MIN_MS, (t_lo + t_hi) / 2, "its middle"
    lo = max(t_lo, mid - width / 2)
    hi = min(t_hi, lo + width)
    return (lo, hi), (f"drew {what}, ms {lo:.1f}..{hi:.1f} of a {t_hi - t_lo:.0f} ms trace; "
                      f"--window A:B draws another part")


def _lane_rank(row: str) -> int:
    row = _base_row(row)
    if row.startswith("client"):
        return 0
    if row.endswith(" queue"):
        return 1
    if row == "supervisor":
        return 3
    return 2


def _base_row(row: str) -> str:
    """``"npu0 queue #1"`` -> ``"npu0 queue"``: overflow rows stay with their track."""
    head, sep, tail = row.rpartition(" #")
    return head if sep and tail.isdigit() else row


def _patch(name: str, colour: str):
    from matplotlib.patches import Patch
    return Patch(facecolor=colour, label=name)


def _fence_arrows(tr: Trace, y_of: dict, window: tuple[float, float] | None) -> list:
    """(from, to) points: the producer's SIGNAL to the end of the consumer's wait on that
    fence, and a device's SIGNAL to the WAKE it ended in a client."""
    out = []
    for req in tr.by_cid.values():
        sig = req.instants.get("SIGNAL")
        if not sig:
            continue
        s = sig[0]
        src = (s.t0, y_of.get((s.pid, s.tid)))
        for wake in req.slices.get("WAKE", ()):
            if not wake.args.get("unfinished"):
                out.append((src, (wake.t1, y_of.get((wake.pid, wake.tid)))))
    for req in tr.by_cid.values():
        for w in req.slices.get("ACQUIRE_WAIT", ()):
            producer = tr.by_cid.get(int(w.args.get("end_a1") or 0))
            sig = producer.instants.get("SIGNAL") if producer else None
            if sig:
                s = sig[0]
                out.append(((s.t0, y_of.get((s.pid, s.tid))), (w.t1, y_of.get((w.pid, w.tid)))))
    lo, hi = window if window is not None else (float("-inf"), float("inf"))
    keep = [(a, b) for a, b in out
            if a[1] is not None and b[1] is not None and lo <= a[0] <= hi and lo <= b[0] <= hi]
    keep.sort(key=lambda ab: ab[0][0])
    return keep

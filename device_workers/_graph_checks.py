"""What every graph op checks of its operands (``_graph_ops``, ``_graph_spatial``).

Malformed operands raise ``ShapeError`` / ``DtypeError`` / ``InvalidRequest`` from
``ipc.errors``, naming the op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ipc.errors import DtypeError, InvalidRequest, ShapeError

Arrays = Sequence["np.ndarray | None"]
Attrs = Mapping[str, Any]

# Ops whose output size comes from data (a shape tensor, scales) are capped: a hostile
# model must not make a device process allocate gigabytes.
MAX_CREATED_ELEMENTS = 1 << 28  # VGG19 folds a 4096 x 25088 weight

FLOAT_TYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64"))


def need(inputs: Arrays, n: int, op: str) -> list[np.ndarray]:
    """The first ``n`` inputs, each of them required (an omitted one is refused)."""
    present = [a for a in inputs[:n] if a is not None]
    if len(present) < n:
        raise InvalidRequest(f"{op}: expected at least {n} inputs, got {len(inputs)}")
    return present


def opt(inputs: Arrays, i: int) -> np.ndarray | None:
    return inputs[i] if len(inputs) > i else None


def axis_index(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def require_float(x: np.ndarray, op: str) -> None:
    if x.dtype not in FLOAT_TYPES:
        raise DtypeError(f"{op}: input has dtype {x.dtype}, expected a float dtype")


def int_list(a: np.ndarray | None, op: str, what: str) -> list[int]:
    if a is None:
        return []
    if a.dtype.kind not in "iu" or a.ndim > 1:
        raise DtypeError(f"{op}: {what} must be a 1-D integer tensor, got {a.dtype} {a.shape}")
    return [int(v) for v in a.reshape(-1)]


def as_text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

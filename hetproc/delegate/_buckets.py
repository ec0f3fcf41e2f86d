"""Dynamic shapes (seed §6): precompiled shape buckets, compile on a miss, a clear error
outside the declared range, CPU fallback when allowed, and a warm-up.

A model with symbolic input dims cannot be compiled once: every partition's plan, buffer
offsets and modeled times depend on the shapes. ``BucketedModel`` keeps one compiled
``DelegatedModel`` per input-shape bucket:

* ``warm_up()`` compiles the declared buckets ahead of time (their compile time lands on
  the device timeline before the first request, not inside it);
* a request whose shapes match a bucket runs on it ("hit");
* a miss inside the declared range compiles a new bucket then runs ("compiled on miss":
  the compile cost is on that request's timeline), unless ``compile_on_miss`` is off;
* a miss that may not compile runs on the CPU when ``cpu_fallback`` allows ("fell back");
* a shape outside ``[min_shape, max_shape]`` is refused with ``ShapeError``.

``events`` records what each request did.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ipc import errors

from ._partition import Options
from ._runtime import DelegatedModel


class BucketedModel:
    """A model with symbolic input dims, compiled once per input-shape bucket (see the
    module's docstring for what a request does on a hit, a miss and out of range)."""

    def __init__(self, client: Any, model: Any, buckets: Sequence[Mapping[str, Sequence[int]]],
                 *, max_shape: Mapping[str, Sequence[int]] | None = None,
                 min_shape: Mapping[str, Sequence[int]] | None = None,
                 options: Options | None = None, cache: Any = None,
                 compile_on_miss: bool = True, cpu_fallback: bool = True,
                 max_buckets: int = 8) -> None:
        self.client = client
        self.source = model
        self.buckets = [self._key(b) for b in buckets]
        self.max_shape = {k: tuple(v) for k, v in (max_shape or {}).items()}
        self.min_shape = {k: tuple(v) for k, v in (min_shape or {}).items()}
        self.options, self.cache = options, cache
        self.compile_on_miss, self.cpu_fallback = compile_on_miss, cpu_fallback
        self.max_buckets = max_buckets
        self.loaded: dict[tuple, DelegatedModel] = {}
        self.events: list[tuple[tuple, str]] = []
        self._lock = threading.Lock()
        self._cpu: dict[tuple, DelegatedModel] = {}

    @staticmethod
    def _key(shapes: Mapping[str, Sequence[int]]) -> tuple:
        return tuple(sorted((k, tuple(int(d) for d in v)) for k, v in shapes.items()))

    def warm_up(self) -> list[str]:
        """Compile every declared bucket now; returns what happened per bucket."""
        return [self._load(b, "warm-up") for b in self.buckets]

    def _load(self, key: tuple, why: str) -> str:
        if key in self.loaded:
            return "loaded"
        if len(self.loaded) >= self.max_buckets:  # the oldest bucket goes first
            self.loaded.pop(next(iter(self.loaded))).close()
        self.loaded[key] = DelegatedModel.load(self.client, self.source, options=self.options,
                                               cache=self.cache, input_shapes=dict(key))
        return f"compiled ({why})"

    def _check_range(self, key: tuple) -> None:
        for name, shape in key:
            hi, lo = self.max_shape.get(name), self.min_shape.get(name)
            if hi is not None and (len(hi) != len(shape) or any(s > h for s, h in zip(shape, hi))):
                raise errors.ShapeError(f"input {name!r} shape {shape} is outside the declared "
                                        f"range (max {hi}): no bucket can take it")
            if lo is not None and (len(lo) != len(shape) or any(s < m for s, m in zip(shape, lo))):
                raise errors.ShapeError(f"input {name!r} shape {shape} is outside the declared "
                                        f"range (min {lo}): no bucket can take it")

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run on the bucket of these input shapes (compiled on a miss, or on the CPU,
        as the model was told); ``ShapeError`` outside the declared range."""
        key = self._key({k: np.shape(v) for k, v in inputs.items()})
        with self._lock:
            model = self.loaded.get(key)
            if model is not None:
                self.events.append((key, "hit"))
            else:
                self._check_range(key)
                if self.compile_on_miss:
                    self._load(key, "miss")
                    self.events.append((key, "compiled on miss"))
                    model = self.loaded[key]
                elif self.cpu_fallback:
                    model = self._cpu.get(key)
                    if model is None:
                        model = DelegatedModel.load(
                            self.client, self.source, input_shapes=dict(key),
                            options=Options(accelerators=(), min_nodes_per_partition=1))
                        self._cpu[key] = model
                    self.events.append((key, "fell back to the CPU (no bucket, no compile)"))
                else:
                    raise errors.ShapeError(f"input shapes {dict(key)} match no precompiled "
                                            "bucket, and compiling on a miss is off")
        return model.run(inputs)

    def close(self) -> None:
        """Close every bucket's model (and the CPU fallbacks): assets, buffers, contexts."""
        with self._lock:
            for m in list(self.loaded.values()) + list(self._cpu.values()):
                m.close()
            self.loaded.clear()
            self._cpu.clear()

    def __enter__(self) -> BucketedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

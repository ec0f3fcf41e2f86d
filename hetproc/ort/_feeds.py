"""A model's signature and ONNX Runtime's checks of a run against it: the feeds (names,
element types, shapes) and the output names asked for, refused with ORT's classes and
messages word for word, before anything reaches the platform."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import InvalidArgument
from ._types import NodeArg, numpy_dtype_of, onnx_type_name
from ._values import OrtValue


class Signature:
    """The inputs, outputs and overridable initializers of a model, as ``NodeArg``s."""

    def __init__(self, inputs: list[NodeArg], outputs: list[NodeArg],
                 overridable: list[NodeArg]) -> None:
        self.inputs, self.outputs, self.overridable = inputs, outputs, overridable

    def symbolic(self) -> bool:
        """Whether an input has a dim that is not a number (or no shape at all): such a
        model is compiled once per input shape met."""
        return any(a.shape is None or any(not isinstance(d, int) for d in a.shape)
                   for a in self.inputs)

    def check_required(self, names: list[str]) -> None:
        """Every input of the model is fed (ORT's ValueError otherwise)."""
        missing = [a.name for a in self.inputs if a.name not in names]
        if missing:
            raise ValueError(f"Required inputs ({missing}) are missing from input feed "
                             f"({names}).")

    def arrays(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feeds as arrays, checked as ORT checks them (its messages)."""
        known = {a.name: a for a in self.inputs}
        over = {a.name for a in self.overridable}
        out: dict[str, np.ndarray] = {}
        for name, value in feeds.items():
            if name in over:
                raise InvalidArgument(f"Overriding initializer {name} is not supported: it is "
                                      "compiled into its partition's asset")
            if name not in known:
                raise InvalidArgument(f"Invalid input name: {name}")
            out[name] = _array(name, value, known[name])
        return out

    def output_names(self, output_names: Sequence[str] | None) -> list[str]:
        """The outputs a run returns, in the order asked (all of them for None)."""
        names = list(output_names) if output_names else [a.name for a in self.outputs]
        known = {a.name for a in self.outputs}
        for n in names:
            if n not in known:
                raise InvalidArgument(f"Invalid output name:{n}")
        return names


def _array(name: str, value: Any, want: NodeArg) -> np.ndarray:
    if isinstance(value, OrtValue):
        arr = value.numpy_view()
    elif isinstance(value, np.ndarray):
        arr = value
    else:  # a list or scalar takes the input's element type, as in ORT
        arr = np.asarray(value, dtype=numpy_dtype_of(want.type))
    got_type = onnx_type_name(arr.dtype)
    if got_type != want.type:
        raise InvalidArgument(f"Unexpected input data type. Actual: ({got_type}) , "
                              f"expected: ({want.type})")
    _check_shape(name, arr.shape, want.shape)
    return arr


def _check_shape(name: str, got: tuple[int, ...], declared: list[Any] | None) -> None:
    if declared is None:  # rank unknown: nothing to check
        return
    if len(got) != len(declared):
        raise InvalidArgument(f"Invalid rank for input: {name} Got: {len(got)} Expected: "
                              f"{len(declared)} Please fix either the inputs/outputs or the "
                              "model.")
    bad = [(i, g, d) for i, (g, d) in enumerate(zip(got, declared, strict=True))
           if isinstance(d, int) and g != d]
    if bad:
        lines = "".join(f"\n index: {i} Got: {g} Expected: {d}" for i, g, d in bad)
        raise InvalidArgument(f"Got invalid dimensions for input: {name} for the following "
                              f"indices{lines}\n Please fix either the inputs/outputs or the "
                              "model.")

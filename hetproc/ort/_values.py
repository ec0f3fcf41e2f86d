"""``OrtValue`` over hetproc's shared buffers, and ``IOBinding``.

An ``OrtValue`` on "cpu" wraps the caller's numpy array (no copy, as ORT does); on a
hetproc device kind ("npu", "gpu", "dsp") it is a hetproc ``Buffer`` in shared memory,
and ``data_ptr()`` is that memory. With IO binding:

* an output bound to a device without a buffer (``bind_output(name, "npu")``) comes back
  as an ``OrtValue`` over the partition's own output buffer, in place: what the device
  wrote, never copied (valid until the next run of the session overwrites it);
* an output bound to "cpu" or to an ``OrtValue`` of the caller is copied there once;
* an input is written once into the model's shared input buffer, from the bound array
  or ``OrtValue`` memory (every input of a model shares one buffer, at fixed offsets).

The run behind ``run_with_iobinding`` waits for each partition's fence before any output
is read; ``synchronize_outputs`` waits for a run still in flight (none, after a
synchronous run), so an output is never read before its fence.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Any

import numpy as np

from ipc import errors

from ._errors import InvalidArgument, translate
from ._options import RunOptions
from ._types import NUMPY_TO_ONNX, ONNX_TO_NUMPY, onnx_type_name

DEVICE_KINDS = ("npu", "gpu", "dsp")
_clients: dict[Any, Any] = {}
_clients_lock = threading.Lock()


def _values_client() -> Any:
    """One client per default platform (``use_platform`` changes it) that owns device
    OrtValues' buffers."""
    from ._providers import connect, default_identity
    key = default_identity()
    with _clients_lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = connect(("", "", ""), "ort:values")
        return c


def free_values() -> None:
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        try:
            c.close()  # its buffers go with it
        except errors.HetprocError:
            pass


def _dtype(element_type: Any) -> np.dtype:
    if isinstance(element_type, int) and not isinstance(element_type, bool):
        if element_type not in ONNX_TO_NUMPY:
            raise InvalidArgument(f"element type {element_type} is not supported")
        return np.dtype(ONNX_TO_NUMPY[element_type])
    return np.dtype(element_type)


def _free(buf: Any) -> None:
    try:
        buf.free()
    except errors.HetprocError:
        pass  # its client is already closed: the buffer went with it


class OrtValue:
    """A tensor: a numpy array on "cpu", a hetproc shared buffer on a device kind."""

    def __init__(self, array: np.ndarray, device: str = "cpu", device_id: int = 0,
                 buffer: Any = None) -> None:
        self._array, self._device, self._device_id, self._buffer = array, device, device_id, buffer

    @classmethod
    def ortvalue_from_numpy(cls, numpy_obj: Any, device_type: str = "cpu",
                            device_id: int = 0) -> OrtValue:
        """The array itself on "cpu" (no copy); on a device kind, a new shared buffer
        holding a copy of it."""
        arr = np.asarray(numpy_obj)
        if device_type == "cpu":
            return cls(arr)
        value = cls.ortvalue_from_shape_and_type(arr.shape, arr.dtype, device_type, device_id)
        value._array[...] = arr
        return value

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape: Any, element_type: Any,
                                     device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """A zeroed value (``element_type``: a numpy dtype or ONNX's number); on a device
        kind, a shared buffer of the platform, freed when the value is collected."""
        dt = _dtype(element_type)
        shape = tuple(int(d) for d in shape)
        if device_type == "cpu":
            return cls(np.zeros(shape, dt))
        if device_type not in DEVICE_KINDS:
            raise InvalidArgument(f"device type {device_type!r}: hetproc values live on "
                                  f"'cpu' or one of {DEVICE_KINDS}")
        try:
            buf = _values_client().alloc(shape if shape else (1,), dt.name)
        except errors.HetprocError as exc:
            raise translate(exc) from exc
        view = buf.array().reshape(shape)
        value = cls(view, device_type, device_id, buf)
        weakref.finalize(value, _free, buf)
        return value

    @classmethod
    def _in_place(cls, view: np.ndarray, device: str) -> OrtValue:
        return cls(view, device)

    def data_ptr(self) -> int:
        """The address of the value's memory (a device value's: its shared buffer)."""
        return int(self._array.ctypes.data)

    def device_name(self) -> str:
        """"cpu", or the device kind the value lives on."""
        return self._device

    def shape(self) -> list[int]:
        """The tensor's dims."""
        return list(self._array.shape)

    def data_type(self) -> str:
        """Its type as ORT writes it (``tensor(float)``)."""
        return onnx_type_name(self._array.dtype)

    def element_type(self) -> int:
        """ONNX's element type number (1 for float32; 0 for one ONNX has no number for)."""
        return NUMPY_TO_ONNX.get(self._array.dtype.name, 0)

    def tensor_size_in_bytes(self) -> int:
        """Bytes of its data."""
        return int(self._array.nbytes)

    def has_value(self) -> bool:
        """Always true: hetproc's values are never empty (ORT's optional types are not
        supported)."""
        return True

    def is_tensor(self) -> bool:
        """Always true: a value is a dense tensor."""
        return True

    def is_sparse_tensor(self) -> bool:
        """Always false (no sparse tensors)."""
        return False

    def is_tensor_sequence(self) -> bool:
        """Always false (no sequences)."""
        return False

    def numpy(self) -> np.ndarray:
        """A copy for a device value (as ORT copies device memory to the host)."""
        return self._array if self._device == "cpu" else self._array.copy()

    def numpy_view(self) -> np.ndarray:
        """(hetproc) The value's memory itself, shared memory for a device value."""
        return self._array

    @property
    def buffer(self) -> Any:
        """(hetproc) The ``hetproc.Buffer`` behind a device value (None on "cpu")."""
        return self._buffer

    def update_inplace(self, np_arr: Any) -> None:
        """Write new contents into the value's own memory (same shape and dtype, else
        INVALID_ARGUMENT): a bound input sees them at its next run, with no new binding."""
        arr = np.asarray(np_arr)
        if arr.shape != self._array.shape or arr.dtype != self._array.dtype:
            raise InvalidArgument(f"update_inplace: {arr.dtype}{list(arr.shape)} does not match "
                                  f"{self._array.dtype}{list(self._array.shape)}")
        self._array[...] = arr


def _from_pointer(ptr: int, element_type: Any, shape: Any) -> np.ndarray:
    dt = _dtype(element_type)
    shape = tuple(int(d) for d in shape)
    nbytes = math.prod(shape) * dt.itemsize
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(int(ptr))
    return np.frombuffer(raw, dt, count=math.prod(shape)).reshape(shape)


class IOBinding:
    """A session's inputs and outputs bound ahead of a run (``session.io_binding()``);
    see the module docstring for where each kind of binding's data lives."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, tuple[str, Any]] = {}  # name -> (how, target)
        self._results: list[OrtValue] = []

    # -- inputs -------------------------------------------------------------------------

    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        """Bind an input to a host array (read when the run starts)."""
        self._inputs[name] = np.asarray(arr_on_cpu)

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Any, buffer_ptr: int) -> None:
        """Bind an input to memory at ``buffer_ptr`` of that element type and shape (the
        caller keeps it alive until the run)."""
        self._inputs[name] = _from_pointer(buffer_ptr, element_type, shape)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        """Bind an input to an OrtValue (its memory as it is when the run starts)."""
        self._inputs[name] = ortvalue

    def synchronize_inputs(self) -> None:
        """Inputs are written when the run starts: nothing earlier is in flight."""

    def clear_binding_inputs(self) -> None:
        """Forget every bound input."""
        self._inputs.clear()

    # -- outputs ------------------------------------------------------------------------

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Any = None,
                    buffer_ptr: int | None = None) -> None:
        """Bind an output: into memory at ``buffer_ptr`` (element type and shape then
        needed), to the host ("cpu": a new array per run), or to a device kind: the
        partition's own output buffer, read in place."""
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise ValueError("`element_type` and `shape` are to be provided if "
                                 "pre-allocated memory is provided")
            self._outputs[name] = ("into", _from_pointer(buffer_ptr, element_type, shape))
        elif device_type == "cpu":
            self._outputs[name] = ("cpu", None)
        elif device_type in DEVICE_KINDS:
            self._outputs[name] = ("in place", device_type)
        else:
            raise InvalidArgument(f"device type {device_type!r}: bind to 'cpu' or one of "
                                  f"{DEVICE_KINDS}")

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Bind an output to an OrtValue of the caller: each run copies the result into it."""
        self._outputs[name] = ("value", ortvalue)

    def synchronize_outputs(self) -> None:
        """Every output's fence was waited for before ``run_with_iobinding`` returned."""

    def clear_binding_outputs(self) -> None:
        """Forget every bound output and the last run's results."""
        self._outputs.clear()
        self._results = []

    def get_outputs(self) -> list[OrtValue]:
        """The last run's outputs as OrtValues, in the order bound."""
        return list(self._results)

    def get_outputs_as_ortvaluevector(self) -> list[OrtValue]:
        """The same as ``get_outputs`` (ORT's vector type is a list here)."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """The last run's outputs as host arrays, copied (never a view of a buffer the
        next run overwrites)."""
        return [v.numpy_view().copy() for v in self._results]

    # -- the run ------------------------------------------------------------------------

    def _run(self, run_options: RunOptions | None) -> None:
        s = self._session
        s._signature.check_required(list(self._inputs))
        names = s._signature.output_names(list(self._outputs) or None)
        out = s._run(s._signature.arrays(self._inputs), run_options)
        model = s._last_model()
        results = []
        for name in names:
            how, target = self._outputs.get(name, ("cpu", None))
            if how == "in place":
                view = model.output_view(name)
                results.append(OrtValue._in_place(view, target) if view is not None
                               else OrtValue(out[name]))
            elif how == "value":
                _copy_into(name, target.numpy_view(), out[name])
                results.append(target)
            elif how == "into":
                _copy_into(name, target, out[name])
                results.append(OrtValue(target))
            else:
                results.append(OrtValue(out[name]))
        self._results = results


def _copy_into(name: str, dest: np.ndarray, src: np.ndarray) -> None:
    if dest.shape != src.shape or dest.dtype != src.dtype:
        raise InvalidArgument(f"output {name}: the bound buffer is {dest.dtype}"
                              f"{list(dest.shape)}, the output is {src.dtype}{list(src.shape)}")
    dest[...] = src

"""Where ONNX Runtime's applications import its error classes from
(``onnxruntime.capi.onnxruntime_pybind11_state``), so such an import changes with the
package name alone."""

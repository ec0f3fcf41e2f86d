"""The public API is deliberate (as trio checks its own): each public namespace lists its
names in ``__all__``; a name is exported by exactly one of them (``hetproc.errors`` is the
documented home of the error classes, which ``hetproc`` also carries); nothing private
or borrowed leaks; every exported object is ours."""

from __future__ import annotations

import importlib
import types

import pytest

PUBLIC = ["hetproc", "hetproc.trace", "hetproc.drills", "hetproc.delegate", "hetproc.ort",
          "hetproc.testing", "ipc",
          "device_workers"]


def _module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_namespace_lists_what_it_exports(name):
    mod = _module(name)
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    assert len(mod.__all__) == len(set(mod.__all__)), f"{name} lists a name twice"
    for attr in mod.__all__:
        assert not attr.startswith("_"), f"{name}.{attr} is private"
        obj = getattr(mod, attr)  # every listed name resolves
        owner = getattr(obj, "__module__", None) or ""
        if isinstance(obj, (type, types.FunctionType)):
            assert owner.split(".")[0] in ("hetproc", "ipc", "device_workers"), \
                f"{name}.{attr} is borrowed from {owner}"


@pytest.mark.parametrize("name", [n for n in PUBLIC if n != "hetproc.testing"])
def test_nothing_public_is_left_unlisted(name):
    """A namespace package imports only what it exports (a module with code of its own,
    like ``hetproc.testing``, may import helpers)."""
    mod = _module(name)
    stray = [a for a in vars(mod) if not a.startswith("_") and a not in mod.__all__
             and not isinstance(getattr(mod, a), types.ModuleType)
             and a not in ("annotations",)]
    assert not stray, f"{name} exposes names it does not list: {stray}"


def test_each_name_is_exported_by_exactly_one_public_namespace():
    import hetproc
    errors = set(hetproc.errors.__all__)
    homes: dict[int, list[str]] = {}
    for name in PUBLIC:
        mod = _module(name)
        for attr in mod.__all__:
            if name == "hetproc" and attr in errors:
                continue  # hetproc.errors is their home; hetproc carries them for convenience
            obj = getattr(mod, attr)
            if isinstance(obj, (type, types.FunctionType)):
                homes.setdefault(id(obj), []).append(f"{name}.{attr}")
    twice = [h for h in homes.values()
             if len(h) > 1 and not all(x.startswith(("ipc.", "device_workers.")) for x in h)]
    # ipc and device_workers are layers of their own: hetproc re-exports none of them.
    assert not twice, f"exported from more than one public namespace: {twice}"

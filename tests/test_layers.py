"""The layout's arrows, read from the source with ``ast`` (imports under
``if TYPE_CHECKING:`` are for type checkers only and do not count)::

    ort ─▶ delegate ─▶ client (and core, trace, ipc)
    cli ─▶ drills ─▶ client ─▶ core (_config, _schema, _protocol, _argtypes, _refsched,
                                     _startup, errors) ─▶ ipc
                 └─▶ trace ◀─┘                                  device_workers ─▶ ipc
    supervisor ─▶ core, device_workers, ipc, trace (to write the windows it dumps)

- ``ipc`` imports nothing of ours; ``device_workers`` imports ``ipc`` only;
- the client and the supervisor never import each other (they speak over the socket);
- nobody imports another package's private module (``a.b._c`` only from inside ``a.b``):
  what others need is exported on purpose;
- the units form no cycle.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ipc", "device_workers", "hetproc", "scenarios", "bench")
# What each unit may import at run time (besides itself and the standard library).
ALLOWED = {
    "ipc": set(),
    "device_workers": {"ipc"},
    "hetproc.core": {"ipc"},
    "hetproc.trace": {"ipc", "device_workers", "hetproc.core"},
    "hetproc.client": {"ipc", "hetproc.core", "hetproc.trace"},
    "hetproc.supervisor": {"ipc", "device_workers", "hetproc.core", "hetproc.trace"},
    "hetproc.delegate": {"ipc", "device_workers", "hetproc.core", "hetproc.client", "hetproc",
                         "hetproc.trace"},
    # ONNX Runtime's API over the delegate: above it, below nothing but applications
    "hetproc.ort": {"ipc", "hetproc.core", "hetproc.client", "hetproc", "hetproc.trace",
                    "hetproc.delegate"},
    "hetproc.drills": {"ipc", "device_workers", "hetproc.core", "hetproc.client",
                       "hetproc.trace", "hetproc", "hetproc.delegate"},
    "hetproc.cli": {"ipc", "device_workers", "hetproc.core", "hetproc.client", "hetproc.trace",
                    "hetproc.drills", "hetproc", "hetproc.delegate"},
    "hetproc": {"ipc", "hetproc.core", "hetproc.client", "hetproc.trace"},
    "hetproc.testing": {"ipc", "hetproc.core", "hetproc.client", "hetproc.drills", "hetproc"},
    "scenarios": {"ipc", "device_workers", "hetproc", "hetproc.core", "hetproc.client",
                  "hetproc.trace", "hetproc.drills", "hetproc.delegate"},
    # bench measures internals on purpose (like the tests): it may reach any unit
    "bench": {"ipc", "device_workers", "hetproc", "hetproc.core", "hetproc.client",
              "hetproc.trace", "hetproc.drills", "hetproc.delegate", "scenarios",
              "hetproc.supervisor"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "hetproc":
        return parts[0]
    if len(parts) == 1:
        return "hetproc"
    if parts[1] in ("_config", "_schema", "_protocol", "_argtypes", "_refsched", "_startup",
                    "errors", "platforms", "__main__"):
        return "hetproc.core" if parts[1] != "__main__" else "hetproc.cli"
    return "hetproc." + parts[1].lstrip("_")


def _runtime_imports(path: Path) -> list[str]:
    """Absolute names of what ``path`` imports when it runs."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):  # imports only a type checker runs
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # ``from pkg import mod`` imports pkg.mod
                sub = ROOT / base.replace(".", "/") / alias.name
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                out.append(f"{base}.{alias.name}" if is_module else base)
    return [m for m in out if m.split(".")[0] in PACKAGES]


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


EDGES = {(_module_name(p), imp) for p in _sources() for imp in _runtime_imports(p)}


def test_the_scan_sees_the_tree():
    assert len(_sources()) > 50 and len(EDGES) > 100
    assert ("hetproc.supervisor._server", "hetproc.supervisor._commands") in EDGES


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_each_unit_imports_only_what_its_layer_allows(unit):
    bad = sorted(f"{src} -> {dst}" for src, dst in EDGES
                 if _unit(src) == unit and _unit(dst) != unit and _unit(dst) not in ALLOWED[unit])
    assert not bad, "imports against the layout's arrows:\n" + "\n".join(bad)


def test_every_unit_is_known():
    assert {_unit(_module_name(p)) for p in _sources()} <= set(ALLOWED)


def test_no_module_imports_another_packages_private_module():
    bad = []
    for src, dst in EDGES:
        if src.startswith("bench."):
            continue  # benchmarks time internals on purpose, as tests do
        parts = dst.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                owner = ".".join(parts[:i])
                if not (src == owner or src.startswith(owner + ".")):
                    bad.append(f"{src} -> {dst}")
                break
    assert not bad, "private modules reached from outside their package:\n" + "\n".join(sorted(bad))


def test_the_units_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst in EDGES:
        a, b = _unit(src), _unit(dst)
        if a != b:
            graph.setdefault(a, set()).add(b)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ()))

    cycles = [(a, b) for a, b in itertools.permutations(graph, 2)
              if b in graph[a] and reaches(b, a, {b})]
    assert not cycles, f"import cycles between units: {cycles}"

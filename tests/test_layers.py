"""The layout's arrows, read from the source with ``ast``::

    ort ─▶ delegate ─▶ client (and core, trace, ipc)
    cli ─▶ drills ─▶ delegate ─▶ client ─▶ core (_config, _schema, _protocol, _argtypes,
                 │                         │       _refsched, _startup, errors) ─▶ ipc
                 └─▶ trace ◀───────────────┘                   device_workers ─▶ ipc
    supervisor ─▶ core, device_workers, ipc, trace (to write the windows it dumps)

``ALLOWED`` states these arrows as data, unit by unit (the layout document's "arrows point
down", with ``hetproc``'s own ``__init__`` as the client's public face); ``EXCEPTIONS``
names, edge by edge, the arrows the code has that the layout does not draw, and why. A
listed exception the code no longer needs fails too, so the list only shrinks.

What counts as an import: every ``import`` statement of a module, wherever it is written:
at module level, inside a function (it runs when the function is called) and under
``if TYPE_CHECKING:`` (only a type checker runs it, but it is still a dependency a reader
follows). The checks:

- each unit imports only what its layer allows (type-only imports included): ``ipc``
  imports nothing of ours, ``device_workers`` ``ipc`` only, the client and the supervisor
  never each other;
- nobody imports another package's private module (``a.b._c`` only from inside ``a.b``),
  type-only imports included: what others need is exported on purpose;
- the units form no cycle, and neither do the modules (inside a package too): run-time
  imports, those inside functions included. A type-only import is left out of the cycle
  checks: it never runs, and it is how an object names the parent that made it
  (``Fence`` annotates its ``Client``) without depending on it at run time;
- no object reaches into another unit's private attributes (``client._request`` in
  ``hetproc.trace``). This one is a heuristic over the syntax, with no type inference.
  It knows an object belongs to another unit when it is a name imported from that unit
  (a module, a class), a parameter or variable annotated with such a class (string and
  ``TYPE_CHECKING`` annotations included), a call of such a class, ``self.x`` assigned
  from one of those in the same class, or an attribute reached through any of them. It
  does not see objects typed only by inference (what a function returns, items of a
  container, unannotated parameters), ``getattr`` with a string, or an object passed
  through ``Any``. ``bench`` is exempt: it times internals on purpose, as tests do.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ipc", "device_workers", "hetproc", "scenarios", "bench")
_APP = {"ipc", "hetproc.core", "hetproc.client", "hetproc", "hetproc.trace"}
# What each unit may import (besides itself and the standard library): the layout's arrows.
ALLOWED: dict[str, set[str]] = {
    "ipc": set(),
    "device_workers": {"ipc"},
    "hetproc.core": {"ipc"},
    "hetproc.trace": {"ipc", "hetproc.core"},  # reads records; never drives a platform
    "hetproc.client": {"ipc", "hetproc.core", "hetproc.trace"},
    "hetproc.supervisor": {"ipc", "device_workers", "hetproc.core", "hetproc.trace"},
    "hetproc": {"ipc", "hetproc.core", "hetproc.client", "hetproc.trace"},  # the public API
    "hetproc.delegate": _APP,
    # ONNX Runtime's API over the delegate: above it, below nothing but applications
    "hetproc.ort": _APP | {"hetproc.delegate"},
    "hetproc.drills": _APP | {"hetproc.delegate"},
    "hetproc.cli": _APP | {"hetproc.delegate", "hetproc.drills"},
    "hetproc.testing": _APP | {"hetproc.drills"},
    # scenarios are what the drills run: the same layer as the drills
    "scenarios": _APP | {"hetproc.delegate", "hetproc.drills"},
    # bench measures internals on purpose (like the tests): it may reach any unit
    "bench": {"ipc", "device_workers", "hetproc", "hetproc.core", "hetproc.client",
              "hetproc.trace", "hetproc.drills", "hetproc.delegate", "scenarios",
              "hetproc.supervisor"},
}
# Arrows the code has and the layout does not draw: (importing module, imported module).
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("hetproc.trace._export", "device_workers"):
        "SIGNALLED_AT_END, the device's fence stamp convention, to draw a signal's slice",
    ("hetproc.delegate._targets", "device_workers"):
        "the graph ops a device runs and their cost, to place a model's nodes",
    ("hetproc.delegate._compile", "device_workers"):
        "the device's asset layout, to write a compiled model's weights",
    ("hetproc.delegate._reference", "device_workers"):
        "the device's own op code, as the reference a delegated run is compared with",
    ("hetproc.delegate._model", "device_workers"):
        "the same ops, to run on the CPU what no device supports",
    ("hetproc.delegate.backend", "device_workers"): "the graph ops, to say what is supported",
    ("scenarios.camera_lifecycle", "device_workers"): "read_checksum, to verify a frame",
    ("scenarios.zero_copy_evidence", "device_workers"): "read_checksum, to verify a frame",
}
# Run-time import cycles between modules, each a known debt (module, module).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {
    ("hetproc.delegate", "hetproc.delegate._cli"):
        "the package imports its command-line part, whose commands import the package's "
        "names inside functions",
    ("hetproc.ort._feeds", "hetproc.ort._providers", "hetproc.ort._session",
     "hetproc.ort._values"):
        "shutdown() closes every session and frees every value, whose modules import the "
        "providers; the session's runs (through the feed checks, which read OrtValues) and "
        "the values' client import the others inside functions",
    ("hetproc.ort", "hetproc.ort._validate"):
        "the validation child runs the model through the package's own API, imported "
        "inside its function",
}
# Private by name only: the public API of named tuples.
_CONVENTIONAL = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


# -- reading the source ---------------------------------------------------------------


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


def _exists(module: str) -> bool:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


class Imports:
    """What one module imports, from its ``ast``: ``runtime`` (module level or inside a
    function) and ``typing`` (under ``if TYPE_CHECKING:``), each as (name bound, absolute
    module) pairs, only the modules of ``PACKAGES``."""

    def __init__(self, tree: ast.Module, module: str, is_package: bool) -> None:
        self.module = module
        self._package = module if is_package else module.rpartition(".")[0]
        typing_nodes = {id(n) for node in ast.walk(tree)
                        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                        for n in ast.walk(node)}
        self.runtime: list[tuple[str, str]] = []
        self.typing: list[tuple[str, str]] = []
        for node in ast.walk(tree):
            pairs = self._pairs(node)
            (self.typing if id(node) in typing_nodes else self.runtime).extend(
                (name, m) for name, m in pairs if m.split(".")[0] in PACKAGES)

    def _pairs(self, node: ast.AST) -> list[tuple[str, str]]:
        if isinstance(node, ast.Import):
            return [(a.asname or a.name.split(".")[0], a.name) for a in node.names]
        if not isinstance(node, ast.ImportFrom):
            return []
        base = node.module or ""
        if node.level:
            anchor = self._package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        # ``from pkg import mod`` imports pkg.mod; ``from pkg import Name``, pkg itself
        return [(a.asname or a.name,
                 f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base)
                for a in node.names]

    def bound(self) -> dict[str, str]:
        """Names this module binds to what it imports (either kind) -> that module
        (``import a.b`` binds ``a``, the package)."""
        return {name: name if module.startswith(name + ".") else module
                for name, module in self.runtime + self.typing}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _parse(path: Path) -> tuple[ast.Module, Imports]:
    tree = ast.parse(path.read_text(), str(path))
    return tree, Imports(tree, _module_name(path), path.name == "__init__.py")


SOURCES = {_module_name(p): _parse(p) for p in _sources()}
RUNTIME = {(src, dst) for src, (_, imp) in SOURCES.items() for _, dst in imp.runtime}
TYPING = {(src, dst) for src, (_, imp) in SOURCES.items() for _, dst in imp.typing}
EDGES = RUNTIME | TYPING


def _cycles(edges: Iterable[tuple[str, str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


_Function = (ast.FunctionDef, ast.AsyncFunctionDef)


def _private_reaches(tree: ast.Module, imports: Imports) -> list[str]:
    """``obj._name`` where ``obj`` is (by the module docstring's heuristic) an object of
    another unit: "module:line: expression (its unit)" for each, in line order."""
    mine = _unit(imports.module)
    foreign = {n: _unit(m) for n, m in imports.bound().items() if _unit(m) != mine}
    hits = []
    for scope, names, attrs in _scopes(tree, foreign):
        for node in _own_nodes(scope):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in _CONVENTIONAL):
                unit = _owner(node.value, names, attrs)
                if unit is not None and unit != mine:
                    hits.append((node.lineno, f"{imports.module}:{node.lineno}: "
                                              f"{ast.unparse(node)} ({unit})"))
    return [text for _, text in sorted(hits)]


def _scopes(tree: ast.Module, foreign: dict[str, str]):
    """The module, then each function, with the names it knows belong to another unit
    and, for a method, the ``self`` attributes of its class that do."""
    yield tree, foreign, {}
    class_attrs: dict[int, dict[str, str]] = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        methods = [f for f in cls.body if isinstance(f, _Function)]
        attrs = _self_attributes(methods, foreign)
        class_attrs.update((id(f), attrs) for f in methods)
    for f in ast.walk(tree):
        if isinstance(f, _Function):
            yield f, _typed_names(f, foreign), class_attrs.get(id(f), {})


def _self_attributes(methods: list, foreign: dict[str, str]) -> dict[str, str]:
    """``self.x`` known to hold another unit's object: assigned from one, or annotated."""
    attrs: dict[str, str] = {}
    for f in methods:
        names = _typed_names(f, foreign)
        for node in ast.walk(f):
            if isinstance(node, ast.Assign):
                unit = _owner(node.value, names, {})
                attrs.update((t.attr, unit) for t in node.targets
                             if unit and isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                unit = _annotation_unit(node.annotation, foreign)
                if unit:
                    attrs[node.target.attr] = unit
    return attrs


def _own_nodes(scope: ast.AST):
    """A scope's nodes, not those of the functions defined in it (scopes of their own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if not isinstance(node, _Function):
            yield node
            todo.extend(ast.iter_child_nodes(node))


def _typed_names(f: ast.FunctionDef | ast.AsyncFunctionDef,
                 foreign: dict[str, str]) -> dict[str, str]:
    """The names a function knows hold another unit's object: the imported ones, its
    annotated parameters and variables, the variables assigned a call of one."""
    names = dict(foreign)
    args = f.args
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        unit = _annotation_unit(a.annotation, foreign) if a is not None else None
        if unit:
            names[a.arg] = unit
    for node in ast.walk(f):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            unit = _annotation_unit(node.annotation, foreign)
            if unit:
                names[node.target.id] = unit
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            unit = _owner(node.value, names, {})
            names.update((t.id, unit) for t in node.targets if unit and isinstance(t, ast.Name))
    return names


def _annotation_unit(annotation: ast.AST | None, foreign: dict[str, str]) -> str | None:
    """The unit of the first name of another unit an annotation mentions (a string
    annotation is parsed)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Name) and node.id in foreign:
            return foreign[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node is not annotation:
            unit = _annotation_unit(node, foreign)
            if unit:
                return unit
    return None


def _owner(expr: ast.AST, names: dict[str, str], attrs: dict[str, str]) -> str | None:
    """The unit ``expr``'s object belongs to, if the heuristic knows it."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return attrs.get(expr.attr)
        return _owner(expr.value, names, attrs)
    if isinstance(expr, ast.Call):
        return _owner(expr.func, names, attrs)
    return None


# -- the checks -----------------------------------------------------------------------


def test_the_scan_sees_the_tree():
    assert len(SOURCES) > 50 and len(RUNTIME) > 100
    assert ("hetproc.supervisor._server", "hetproc.supervisor._commands") in RUNTIME
    assert ("hetproc.delegate._cli", "hetproc.delegate") in RUNTIME  # inside a function
    assert ("hetproc.client._fence", "hetproc.client._client") in TYPING  # TYPE_CHECKING


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_each_unit_imports_only_what_its_layer_allows(unit):
    bad = sorted(f"{src} -> {dst}" for src, dst in EDGES
                 if _unit(src) == unit and _unit(dst) != unit
                 and _unit(dst) not in ALLOWED[unit] and (src, dst) not in EXCEPTIONS)
    assert not bad, "imports against the layout's arrows:\n" + "\n".join(bad)


def test_every_listed_exception_is_still_needed():
    stale = [f"{src} -> {dst}" for src, dst in EXCEPTIONS
             if (src, dst) not in EDGES or _unit(dst) in ALLOWED[_unit(src)]]
    assert not stale, "exceptions the code no longer needs (drop them):\n" + "\n".join(stale)


def test_every_unit_is_known():
    assert {_unit(m) for m in SOURCES} <= set(ALLOWED)


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
    for src, dst in RUNTIME:
        a, b = _unit(src), _unit(dst)
        if a != b:
            graph.setdefault(a, set()).add(b)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n}))
                   for n in graph.get(a, ()))

    cycles = [(a, b) for a, b in itertools.permutations(graph, 2)
              if b in graph[a] and reaches(b, a, {b})]
    assert not cycles, f"import cycles between units: {cycles}"


def test_the_modules_form_no_cycle():
    """Inside a package too, with the imports written inside functions."""
    cycles = [c for c in _cycles(RUNTIME) if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles between modules:\n" + "\n".join(map(" <-> ".join, cycles))
    stale = [c for c in KNOWN_CYCLES if c not in _cycles(RUNTIME)]
    assert not stale, f"known cycles that are gone (drop them): {stale}"


def test_no_object_reaches_into_another_units_private_attributes():
    bad = [hit for module, (tree, imports) in sorted(SOURCES.items())
           if _unit(module) != "bench" for hit in _private_reaches(tree, imports)]
    assert not bad, "private attributes of another unit's objects:\n" + "\n".join(bad)


# -- the checks can fail ------------------------------------------------------------------


def _imports_of(source: str, module: str) -> tuple[ast.Module, Imports]:
    tree = ast.parse(source)
    return tree, Imports(tree, module, is_package=False)


def test_a_private_reach_is_seen_through_each_kind_of_name():
    tree, imports = _imports_of(
        "from typing import TYPE_CHECKING\n"
        "from ipc import Channel\n"
        "import ipc\n"
        "if TYPE_CHECKING:\n"
        "    from ..client import Client\n"
        "def info(client: 'Client', other) -> None:\n"
        "    client._request('trace_info')\n"          # annotated parameter (a string)
        "    other._request('fine')\n"                 # unknown: not seen
        "    ipc._secret\n"                            # an imported module
        "    ch = Channel(0)\n"
        "    ch._pending\n"                            # a call of an imported class
        "class Reader:\n"
        "    def __init__(self, client: Client) -> None:\n"
        "        self.client = client\n"
        "    def read(self) -> None:\n"
        "        self.client.connection._lock\n"       # self.x from a typed parameter
        "        self._mine\n",                        # its own: fine
        "hetproc.trace._probe")
    hits = [h.split(": ", 1)[1] for h in _private_reaches(tree, imports)]
    assert hits == ["client._request (hetproc.client)", "ipc._secret (ipc)",
                    "ch._pending (ipc)", "self.client.connection._lock (hetproc.client)"]


def test_type_only_and_function_level_imports_count():
    _, imports = _imports_of(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from hetproc.client._client import Client\n"
        "def late():\n"
        "    from hetproc.supervisor import _server\n",
        "hetproc.trace._probe")
    assert imports.typing == [("Client", "hetproc.client._client")]
    assert imports.runtime == [("_server", "hetproc.supervisor._server")]


def test_a_cycle_is_found_however_long():
    edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "d")]
    assert _cycles(edges) == [("a", "b", "c")]
    assert _cycles([("a", "b"), ("b", "c")]) == []

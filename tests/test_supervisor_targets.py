"""Size as a smell, checked: inside the supervisor no module past 600 lines, no class past
25 methods, no function past 80 lines (LAYOUT: such a unit usually holds two ideas)."""

from __future__ import annotations

import ast
from pathlib import Path

import hetproc.supervisor

ROOT = Path(hetproc.supervisor.__file__).parent
MAX_MODULE_LINES, MAX_METHODS, MAX_FUNCTION_LINES = 600, 25, 80
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _units() -> list[tuple[str, str, int, str]]:
    """(module, name, size, what) for every module, class and function."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        out.append((path.name, path.name, len(text.splitlines()), "module lines"))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, FUNCTIONS)]
                out.append((path.name, node.name, len(methods), "methods"))
            elif isinstance(node, FUNCTIONS):
                lines = node.end_lineno - node.lineno + 1
                out.append((path.name, node.name, lines, "function lines"))
    return out


LIMITS = {"module lines": MAX_MODULE_LINES, "methods": MAX_METHODS,
          "function lines": MAX_FUNCTION_LINES}


def test_no_supervisor_unit_is_past_its_size():
    units = _units()
    assert len(units) > 300, "the scan sees the package"
    over = [f"{mod}: {name} has {size} {what} (limit {LIMITS[what]})"
            for mod, name, size, what in units if size > LIMITS[what]]
    assert not over, "\n".join(over)

"""Plain-text stand-ins for the few ``rich`` classes the CLI prints with.

``rich`` is an optional extra (``pip install 'hetproc[rich]'``): without it the same
reports and tables come out as aligned plain text, and no spinner is drawn. Only what
``_show`` uses is here: ``Text``, ``Table`` (columns, rows, a title, ``grid``) and a
``Console`` that prints them.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Text:
    def __init__(self, text: str = "", style: str | None = None) -> None:
        self.plain = str(text)

    def __str__(self) -> str:
        return self.plain


class Table:
    def __init__(self, title: str | None = None, *, show_header: bool = True,
                 **_ignored: Any) -> None:
        self.title = title
        self.show_header = show_header
        self.columns: list[tuple[str, str]] = []  # (header, justify)
        self.rows: list[list[str]] = []

    @classmethod
    def grid(cls) -> Table:
        return cls(show_header=False)

    def add_column(self, header: str = "", *, justify: str = "left", **_ignored: Any) -> None:
        self.columns.append((header, justify))

    def add_row(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def lines(self) -> list[str]:
        width = max([len(self.columns)] + [len(r) for r in self.rows])
        cols = self.columns + [("", "left")] * (width - len(self.columns))
        table = ([[h for h, _ in cols]] if self.show_header and self.columns else []) + [
            r + [""] * (width - len(r)) for r in self.rows]
        sizes = [max((len(line) for row in table for line in [row[i]]), default=0)
                 for i in range(width)]
        out = [self.title] if self.title else []
        for row in table:
            cells = [c.rjust(sizes[i]) if cols[i][1] == "right" else c.ljust(sizes[i])
                     for i, c in enumerate(row)]
            out.append(" ".join(cells).rstrip())
        return out


class Console:
    def __init__(self, file: TextIO | None = None, *, stderr: bool = False,
                 **_ignored: Any) -> None:
        self.file = file or (sys.stderr if stderr else sys.stdout)

    @property
    def is_terminal(self) -> bool:
        return self.file.isatty()

    def print(self, thing: Any = "") -> None:
        text = "\n".join(thing.lines()) if isinstance(thing, Table) else str(thing)
        print(text, file=self.file)

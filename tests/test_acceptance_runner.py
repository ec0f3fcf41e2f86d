"""The acceptance runner's own bookkeeping between cells (the cells themselves are the
scenarios' and drills' tests)."""

from __future__ import annotations

import gc
import weakref

from hetproc.drills import _acceptance


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_between_cells_what_a_cell_dropped_is_collected_and_what_outlived_it_is_frozen(
        monkeypatch):
    """A drill's full collection (``Drill.start``) walks only what its cell made: what
    earlier cells left (imports, caches) is frozen out of the collector between cells,
    their garbage collected first, and everything goes back to it after the matrix."""
    seen: list[dict] = []
    dropped: list[weakref.ref] = []

    def fake_cell(kind, name, options, platform_file, time_scale, clock=None):
        seen.append({"frozen": gc.get_freeze_count(),
                     "earlier_garbage_alive": [r() is not None for r in dropped]})
        dropped.append(weakref.ref(_Cycle()))  # garbage only the collector finds
        return {"kind": kind, "name": name, "ok": True}

    monkeypatch.setattr(_acceptance, "cells",
                        lambda quick: [("drill", "a", {}), ("drill", "b", {})])
    monkeypatch.setattr(_acceptance, "run_cell", fake_cell)
    gc.collect()
    assert gc.get_freeze_count() == 0
    try:
        result = _acceptance.run_matrix(quick=True)
        assert result["ok"]
        assert seen[0]["frozen"] == 0
        assert seen[1]["frozen"] > 0, "the first cell's survivors are frozen"
        assert seen[1]["earlier_garbage_alive"] == [False], "its garbage was collected"
        assert gc.get_freeze_count() == 0, "after the matrix, all back to the collector"
    finally:
        gc.unfreeze()

"""Arrays by name into an ``.npz`` archive, whatever the names are.

``numpy.savez(path, **arrays)`` passes the names as keyword arguments: a tensor named
``file`` collides with savez's first parameter (TypeError) and one named ``allow_pickle``
is taken as that flag and silently left out of the archive. ONNX names are the model
author's choice, so the archive is written here, one ``NAME.npy`` member per array, in
the layout ``numpy.load`` reads.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping

import numpy as np


def save_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` (as given: no suffix is added), no pickled objects."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)

"""The asset cache (seed §13): compiled partitions on disk, keyed so a stale one is never
loaded.

Key = sha256 over: model fingerprint (sha256 of the model bytes), compiler version,
runtime version (asset format and hetproc version), device kind and "firmware" (the
device's platform-file entry), shape bucket (bound input shapes), placement options and
the partition's node range. Change any part and the key changes: a model edit, a compiler
or SDK upgrade, another device or another bucket can only miss, never hit a wrong asset.

File = ``HPCACHE1`` + u32 meta length + meta JSON (the key's parts) + sha256 of the
payload + payload (the asset bytes). Every load re-hashes the payload; a truncated or
corrupt file is deleted and recompiled ("corrupt asset, recompiled"), never loaded.
Capacity in bytes with LRU eviction (a hit refreshes the file's mtime).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

COMPILER_VERSION = "hetproc-graph-compiler/1"
_MAGIC = b"HPCACHE1"
_LEN = struct.Struct("<I")
DEFAULT_CAPACITY = 512 << 20


def runtime_version() -> str:
    try:
        from importlib.metadata import version
        return f"hetproc/{version('hetproc')}+HPGRAPH1"
    except Exception:
        return "hetproc/unknown+HPGRAPH1"


def default_dir() -> Path:
    env = os.environ.get("HETPROC_ASSET_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hetproc" / "assets"


class AssetCache:
    """A directory of compiled assets with a byte capacity (LRU)."""

    def __init__(self, path: str | Path | None = None, capacity_bytes: int = DEFAULT_CAPACITY):
        self.path = Path(path) if path is not None else default_dir()
        self.capacity = int(capacity_bytes)
        self.path.mkdir(parents=True, exist_ok=True)
        self.stats = {"hit": 0, "compiled": 0, "corrupt asset, recompiled": 0, "evicted": 0}

    @staticmethod
    def key_parts(fingerprint: str, device: Any, bucket: Any, options: str,
                  node_range: tuple[int, int]) -> dict[str, Any]:
        """What an asset depends on (seed §13): model, compiler, runtime, device kind and
        firmware, shape bucket, options, node range. Any change is another asset."""
        return {"model": fingerprint, "compiler": COMPILER_VERSION, "runtime": runtime_version(),
                "device_kind": device.kind, "firmware": device.firmware, "bucket": bucket,
                "options": options, "nodes": list(node_range)}

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        """The file name of the asset for ``key_parts``: a digest of them."""
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.hpa"

    def load(self, parts: dict[str, Any]) -> tuple[bytes | None, str]:
        """(payload, "hit") or (None, "miss" / "corrupt asset, recompiled")."""
        f = self._file(self.key(parts))
        try:
            data = f.read_bytes()
        except FileNotFoundError:
            return None, "miss"
        except OSError:
            return None, "corrupt asset, recompiled"
        payload = self._check(data, parts)
        if payload is None:
            f.unlink(missing_ok=True)
            return None, "corrupt asset, recompiled"
        os.utime(f)  # LRU: a hit is a use
        return payload, "hit"

    @staticmethod
    def _check(data: bytes, parts: dict[str, Any]) -> bytes | None:
        if len(data) < len(_MAGIC) + _LEN.size or not data.startswith(_MAGIC):
            return None
        (n,) = _LEN.unpack_from(data, len(_MAGIC))
        start = len(_MAGIC) + _LEN.size
        if start + n + 32 > len(data):
            return None
        try:
            meta = json.loads(data[start:start + n])
        except ValueError:
            return None
        digest, payload = data[start + n:start + n + 32], data[start + n + 32:]
        if meta != json.loads(json.dumps(parts, sort_keys=True)):
            return None  # another version's file under a colliding name: never load it
        if hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def store(self, parts: dict[str, Any], payload: bytes) -> None:
        """Write an asset with its parts and checksum (readers see the old file or the
        new, never half), then evict down to capacity; a write that fails stores nothing."""
        meta = json.dumps(parts, sort_keys=True).encode()
        blob = _MAGIC + _LEN.pack(len(meta)) + meta + hashlib.sha256(payload).digest() + payload
        fd, tmp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, self._file(self.key(parts)))  # atomic: readers see old or new
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return
        self.evict()

    def entries(self) -> list[tuple[Path, int, float]]:
        """(file, bytes, last use) of every asset in the directory."""
        out = []
        for f in self.path.glob("*.hpa"):
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((f, st.st_size, st.st_mtime))
        return out

    def evict(self) -> None:
        """Remove the least recently used assets until the directory fits its capacity."""
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(e[1] for e in entries)
        for f, size, _ in entries:
            if total <= self.capacity:
                break
            f.unlink(missing_ok=True)
            total -= size
            self.stats["evicted"] += 1

    def record(self, outcome: str) -> None:
        """Count one lookup's outcome ("hit", "compiled", "corrupt asset, recompiled")."""
        self.stats[outcome] = self.stats.get(outcome, 0) + 1

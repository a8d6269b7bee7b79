"""The versioned on-disk metadata of a store and the small files it names.

``manifest.json`` is the commit point: it is written to a temp file and renamed
into place only after every file it names is complete, so a reader sees either
the previous generation or the new one. It holds the spec, cursors, RNG state
and, for each small ``.npy`` file (step blocks, RAM tail), its crc32. It never
touches frame bytes.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidStoreError
from .frame_store import fsync_dir, write_atomic

MANIFEST = "manifest.json"
FORMAT = "mmreplay"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
REQUIRED = {
    "format": str, "format_version": int, "generation": int, "spec": dict,
    "written": list, "kept_from": list, "running": list, "next_id": int,
    "next_episode": int, "rng": dict, "blocks": list, "tail": str, "files": dict,
}


def write_manifest(root: Path, manifest: dict[str, Any], tmp_dir: Path, *,
                   durable: bool) -> None:
    """Atomically replace ``manifest.json`` (then fsync the directory if durable)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_atomic(root / MANIFEST, data, tmp_dir, durable=durable)
    if durable:
        fsync_dir(root)


def read_manifest(root: Path) -> dict[str, Any]:
    """Load and type-check ``manifest.json``; every problem is an `InvalidStoreError`."""
    path = root / MANIFEST
    if not path.is_file():
        raise InvalidStoreError(f"{root} is not an mmreplay store (no {MANIFEST})")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InvalidStoreError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidStoreError(f"{path} is not valid JSON: {exc}") from None
    check_fields(manifest, path)
    return manifest


def check_fields(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise InvalidStoreError(f"{path} must hold a JSON object")
    if manifest.get("format") != FORMAT:
        raise InvalidStoreError(f"{path} is not an mmreplay manifest")
    for key, kind in REQUIRED.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidStoreError(
                f"{path}: field {key!r} must be {kind.__name__}, got {type(value).__name__}")
    if manifest["format_version"] > FORMAT_VERSION:
        raise InvalidStoreError(
            f"{path} has format version {manifest['format_version']}, newer than this "
            f"mmreplay supports ({FORMAT_VERSION}); upgrade mmreplay")
    if manifest["format_version"] < 1:
        raise InvalidStoreError(f"{path} has invalid format version {manifest['format_version']}")


def save_npy(root: Path, name: str, array: np.ndarray, tmp_dir: Path, *, durable: bool) -> int:
    """Write `array` as ``root/name`` (.npy, no pickle); returns its crc32."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    data = buf.getvalue()
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, tmp_dir, durable=durable)
    return zlib.crc32(data)


def load_npy(root: Path, name: str, crc: Any, *, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
    """Read a small file the manifest names, checking crc32, dtype and shape."""
    path = safe_path(root, name)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidStoreError(f"{name} named by the manifest cannot be read: {exc}") from None
    if zlib.crc32(data) != crc:
        raise InvalidStoreError(f"{name} fails its crc32 checksum (damaged or replaced)")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidStoreError(f"{name} is not a valid .npy file: {exc}") from None
    if array.dtype != dtype or array.shape != shape:
        raise InvalidStoreError(f"{name} holds {array.dtype}{array.shape}, "
                                f"expected {dtype}{shape}")
    return array


def safe_path(root: Path, name: Any) -> Path:
    """`root/name` for a manifest-named file; refuses absolute, `..` and odd names."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise InvalidStoreError(f"manifest names an invalid file {name!r}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidStoreError(f"manifest names an invalid file {name!r}")
    path = root.joinpath(*parts)
    if path.is_symlink():
        raise InvalidStoreError(f"{name} is a symlink; stores never contain symlinks")
    return path

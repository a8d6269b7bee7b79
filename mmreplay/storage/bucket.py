"""A store in object storage: its keys, and its manifest as push and pull read it.

The bucket holds the same keys as the directory (``zarr.json``, ``frames/...``, ``steps/``,
``tail/``, ``prio/``, ``manifest.json``), so a bucket store is also a plain zarr v3 group,
plus two objects of its own: ``lease.json`` (which writer may push: `lease`) and
``pushed.json`` (the md5 of every frame file as last pushed: `push`). Which objects change:

    zarr.json, frames/zarr.json    written once at create (frames/zarr.json again, with
                                   zstd.dict, once a "zstd-dict" store trains its dictionary)
    steps/ prio/ tail/ *.gNNN.npy  immutable: a name is never rewritten (copy-on-write)
    frames/c.<env>.<shard>...      rewritten in place as the ring fills and wraps
    manifest.json                  the commit point: uploaded last

A reader of the bucket sees one generation: `push` re-publishes the manifest with frames
given up before it overwrites them, and `pull` (or a reader's local copy, `follow_bucket`)
raises its kept_from to the bucket's newest, so frames a writer gave up since are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidStoreError, ObjectStoreError
from mmreplay.storage.frame_store import FRAMES
from mmreplay.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    check_manifest,
    parse_manifest,
    parse_spec,
    read_manifest,
    write_manifest,
)
from mmreplay.storage.objects import ObjectMissingError, Objects
from mmreplay.storage.safe_io import TMP_DIR

FRAME_KEY_PREFIX = f"{FRAMES}/c."


def raised_kept(manifest: dict[str, Any], kept_now: list[int]) -> list[int]:
    """`manifest`'s kept_from raised to `kept_now` (frames given up since), at most written."""
    return [min(w, max(k, n)) for w, k, n in zip(manifest["written"], manifest["kept_from"],
                                                  kept_now, strict=True)]


def read_bucket_manifest(objects: Objects) -> dict[str, Any]:
    """The bucket's manifest, parsed and checked as a local open would."""
    try:
        data = objects.get(MANIFEST)
    except ObjectMissingError:
        raise InvalidStoreError(f"{objects.url} is not an mmreplay store (no {MANIFEST})") \
            from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidStoreError(f"{objects.url}/{MANIFEST} is {len(data)} bytes, more than "
                                f"the {MAX_MANIFEST_BYTES} allowed")
    manifest = parse_manifest(data, f"{objects.url}/{MANIFEST}")
    check_manifest(manifest, parse_spec(manifest))
    return manifest


def kept_now(objects: Objects, manifest: dict[str, Any]) -> list[int]:
    """The bucket's kept_from now (its manifest may have moved on), or `manifest`'s."""
    try:
        newer = read_bucket_manifest(objects)
    except (InvalidStoreError, ObjectStoreError):
        return list(manifest["kept_from"])
    if len(newer["kept_from"]) != len(manifest["kept_from"]):
        return list(manifest["kept_from"])
    return list(newer["kept_from"])


def follow_bucket(objects: Objects, root: Path) -> None:
    """Raise the kept_from of `root`'s manifest (a bucket store's local copy) to the
    bucket's: frames a writer gave up since are then dropped by the reader."""
    local = read_manifest(root)
    kept = raised_kept(local, kept_now(objects, local))
    if kept != local["kept_from"]:
        write_manifest(root, {**local, "kept_from": kept}, root / TMP_DIR, durable=False)

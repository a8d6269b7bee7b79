"""Pulling a store's newest complete generation out of object storage into a directory.

Every downloaded file is checked (its size, the crc32 the manifest names, a shard file's
index) and the pulled manifest's kept_from is raised to the bucket's newest (`bucket`), so a
push racing the pull cannot hand the directory frames its writer gave up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidStoreError, StoreLockedError
from mmreplay.storage.bucket import (
    FRAME_KEY_PREFIX,
    follow_bucket,
    kept_now,
    raised_kept,
    read_bucket_manifest,
)
from mmreplay.storage.codec import max_chunk_bytes
from mmreplay.storage.frame_store import FRAMES, max_file_bytes
from mmreplay.storage.layout import ZARR_JSON, check_store_files
from mmreplay.storage.lease import Lease
from mmreplay.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    parse_spec,
    read_manifest,
    write_manifest,
)
from mmreplay.storage.objects import ObjectMissingError, Objects
from mmreplay.storage.safe_io import TMP_DIR, write_atomic
from mmreplay.storage.shards import index_size, parse_index
from mmreplay.storage.zstd_dict import DICT_FILE

FETCH_CONCURRENCY = 32  # downloads in flight (an open from a bucket: ~250 step blocks per 1M steps)
PULL_RETRIES = 8


def pull(objects: Objects, dest: Path, *, frames: bool = True,
         progress: Callable[[int], None] | None = None, check: bool = True) -> dict[str, Any]:
    """Download the bucket's newest complete generation into `dest` (which must not exist
    or be empty) and check it as an open would (``check=False``: the caller opens it next,
    which checks it); returns its manifest.

    A push racing the pull can delete step files of the manifest read first: then the pull
    starts again from the new manifest. Frame files newer than the manifest only hold
    frames that its re-read gives up, which the written manifest does.
    """
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidStoreError(f"{dest} already exists and is not an empty directory")
    for attempt in range(PULL_RETRIES):
        manifest = read_bucket_manifest(objects)
        try:
            return _pull_once(objects, dest, manifest, frames=frames, progress=progress,
                              check=check)
        except ObjectMissingError:
            if attempt + 1 == PULL_RETRIES or read_bucket_manifest(objects) == manifest:
                raise InvalidStoreError(
                    f"{objects.url}: its manifest names objects that are missing") from None
    raise AssertionError("unreachable")


def working_copy(objects: Objects, local: Path, *, take_over: bool = False) -> None:
    """Make `local` the working copy of the bucket store, for a writer that goes on
    mirroring into the bucket: an absent or empty `local` gets the newest complete
    generation (pulled into a sibling temp directory, then renamed, so an interrupted pull
    leaves nothing behind); a `local` that already holds a store is kept, unless the bucket
    holds a newer generation (another machine wrote there since), which is refused. A
    prefix another writer holds is refused before anything is pulled (unless `take_over`;
    the mirror then takes the lease)."""
    if not take_over:
        Lease(objects).check_free()
    if (local / MANIFEST).exists():
        if objects.head(MANIFEST) is None:
            return  # an empty prefix: the first push fills it
        bucket, mine = read_bucket_manifest(objects)["generation"], \
            read_manifest(local)["generation"]
        if bucket > mine:
            raise StoreLockedError(
                f"{objects.url} holds generation {bucket}, newer than the {mine} of {local}: "
                f"another machine wrote there since; resume into an empty directory to bring "
                f"the bucket's generation down")
        return
    if local.exists() and (not local.is_dir() or any(local.iterdir())):
        raise InvalidStoreError(f"{local} holds files but no store; give an empty or new "
                                f"directory for the working copy of {objects.url}")
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{local.name}.", dir=local.parent))
    try:
        pull(objects, partial)
        if local.exists():
            local.rmdir()
        os.rename(partial, local)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _pull_once(objects: Objects, dest: Path, manifest: dict[str, Any], *, frames: bool,
               progress: Callable[[int], None] | None, check: bool) -> dict[str, Any]:
    spec = parse_spec(manifest)
    (dest / FRAMES).mkdir(parents=True, exist_ok=True)
    (dest / TMP_DIR).mkdir(exist_ok=True)
    keys = [ZARR_JSON, f"{FRAMES}/{ZARR_JSON}", *manifest["files"]]
    if "dictionary" in manifest:  # a "zstd-dict" store's dictionary (checked by the open)
        keys.append(DICT_FILE)
    if frames:
        keys += [k for k in objects.list(FRAME_KEY_PREFIX)]
    _fetch_all(objects, dest, manifest, keys, progress)
    final = {**manifest, "kept_from": raised_kept(manifest, kept_now(objects, manifest))}
    write_manifest(dest, final, dest / TMP_DIR, durable=False)
    if check:
        check_store_files(dest, final, spec)
    return final


def pull_frames(objects: Objects, root: Path, manifest: dict[str, Any]) -> None:
    """Every frame file of the bucket into `root`, pulled with ``frames=False`` from
    `manifest`; `root`'s manifest then gives up the frames newer files overwrote."""
    _fetch_all(objects, root, manifest, list(objects.list(FRAME_KEY_PREFIX)), None)
    follow_bucket(objects, root)


def _fetch_all(objects: Objects, dest: Path, manifest: dict[str, Any], keys: list[str],
               progress: Callable[[int], None] | None) -> None:
    """Download `keys` into `dest`, each checked: its size, the crc32 the manifest names,
    a shard file's index."""
    spec = parse_spec(manifest)
    limit = max(max_file_bytes(spec), MAX_MANIFEST_BYTES * 64)

    def fetch(key: str) -> int:
        data = objects.get(key)
        if len(data) > limit:
            raise InvalidStoreError(f"{objects.url}/{key} is {len(data)} bytes, more than "
                                    f"a store's file can be")
        if key in manifest["files"] and zlib.crc32(data) != manifest["files"][key]:
            raise InvalidStoreError(f"{objects.url}/{key} fails its crc32 checksum "
                                    f"(truncated or replaced)")
        if key.startswith(FRAME_KEY_PREFIX) and spec.shard_chunks > 1:
            n = index_size(spec.shard_chunks)
            parse_index(data[-n:], len(data), spec.shard_chunks, max_chunk_bytes(spec),
                        f"{objects.url}/{key}")
        (dest / key).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest / key, data, dest / TMP_DIR, durable=False)
        if progress is not None:
            progress(len(data))
        return len(data)

    with ThreadPoolExecutor(min(FETCH_CONCURRENCY, max(1, len(keys)))) as pool:
        list(pool.map(fetch, keys))

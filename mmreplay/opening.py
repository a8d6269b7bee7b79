"""Opening a store: the argument checks, the untrusted directory's checks, the read-only
retry beside a live writer, and stores read from a bucket or pulled into a working copy.

`open_store` is what ``ReplayStore.open`` does; it calls the class (``cls``) with a checked
spec and manifest and knows nothing of the store's parts. ``device=`` is checked against the
device's memory here, before the store allocates anything (`device_frames.check_fits`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmreplay import lifecycle, validate
from mmreplay.device_frames import check_fits
from mmreplay.errors import InvalidInputError, InvalidStoreError, ReadOnlyError
from mmreplay.rate_limit import RateLimiter
from mmreplay.spec import StoreSpec
from mmreplay.storage.commit import readers_shared, release_lock, take_lock
from mmreplay.storage.layout import check_store_files
from mmreplay.storage.manifest import (
    MAX_RAM_BYTES,
    check_manifest,
    check_ram,
    check_root,
    parse_spec,
    read_manifest,
)
from mmreplay.storage.objects import is_url, open_objects
from mmreplay.storage.pull import working_copy
from mmreplay.storage.remote_frames import RemoteChunks
from mmreplay.storage.remote_open import open_remote
from mmreplay.validate import CacheBytes

OPEN_RETRIES = 32  # read-only opens raced by commits; only a live writer makes one retry


def open_store(cls: Any, path: str | os.PathLike[str], mode: str = "r+", *,
               durable: bool = False, cache_bytes: int | str | None = None,
               max_ram_bytes: int = MAX_RAM_BYTES, mirror: str | None = None,
               storage_options: dict[str, str] | None = None,
               cache_dir: str | os.PathLike[str] | None = None, take_over: bool = False,
               rate_limiter: RateLimiter | None = None, local: Any = None,
               cache_fill: Any = None, device: Any = None) -> Any:
    """``ReplayStore.open`` (see there) of the store class `cls`."""
    cache_bytes = validate.cache_bytes(cache_bytes)
    path, mirror = _working_copy(path, mode, mirror, local, storage_options, take_over)
    _check_open_args(path, mode, rate_limiter, cache_fill)
    if is_url(path):
        if device is not None:
            raise InvalidInputError(
                f"device= needs a local store: {path} is read from a bucket, chunk by chunk "
                f"on demand; open a local working copy (mode='r+', local=DIR) with device=")
        return _open_url(cls, str(path), mode, cache_dir, cache_bytes, storage_options,
                         max_ram_bytes, cache_fill)
    store = _open_path(cls, Path(path), mode, durable, cache_bytes, max_ram_bytes,
                       device=device)
    if rate_limiter is not None:
        store.set_rate_limiter(rate_limiter)
    return store.attach_mirror(mirror, storage_options, take_over)


def _check_cache_all(spec: StoreSpec, cache_bytes: CacheBytes,
                     max_ram_bytes: int) -> None:
    """``cache_bytes="all"`` takes what the (untrusted) spec says: at most `max_ram_bytes`."""
    if cache_bytes == validate.CACHE_ALL and spec.decoded_bytes > max_ram_bytes:
        raise InvalidInputError(
            f"cache_bytes={validate.CACHE_ALL!r} would keep {spec.decoded_bytes / 2**30:.1f} GiB "
            f"of decoded frames in RAM, more than max_ram_bytes "
            f"({max_ram_bytes / 2**30:.1f} GiB); pass a larger max_ram_bytes or an int "
            f"cache_bytes")


def _working_copy(path: Any, mode: str, mirror: str | None, local: Any,
                  storage_options: dict[str, str] | None, take_over: bool) -> tuple[Any, Any]:
    """(path, mirror) to open: a URL opened for writing with `local` becomes the working
    copy `local` (the bucket's newest generation pulled there unless it holds it) mirrored
    back to the URL; anything else is returned as it came."""
    if local is None:
        return path, mirror
    if not (is_url(path) and mode == "r+" and mirror is None):
        raise InvalidInputError("local= is the working copy of a URL opened with mode='r+' "
                                "(which mirrors back to that URL)")
    working_copy(open_objects(str(path), storage_options), Path(local), take_over=take_over)
    return Path(local), str(path)


def _check_open_args(path: Any, mode: str, rate_limiter: RateLimiter | None,
                     cache_fill: Any = None) -> None:
    if mode not in ("r", "r+"):
        raise InvalidInputError(f"mode must be 'r' or 'r+', got {mode!r}")
    if rate_limiter is not None and (mode == "r" or is_url(path)):
        raise ReadOnlyError("a rate limiter needs a writable store (mode='r+')")
    if cache_fill is not None and not isinstance(cache_fill, bool):
        raise InvalidInputError(f"cache_fill is True, False or None, got {cache_fill!r:.60}")
    if cache_fill is not None and not is_url(path):
        raise InvalidInputError("cache_fill is for a store read from a bucket (a URL path, "
                                "mode='r')")


def _checked_spec(root: Path, manifest: dict[str, Any], max_ram_bytes: int) -> StoreSpec:
    """The spec of an untrusted store, after every open-time check (see `manifest`)."""
    spec = parse_spec(manifest)
    check_ram(spec, max_ram_bytes)
    check_manifest(manifest, spec)
    check_store_files(root, manifest, spec)
    return spec


def _open_read_only(root: Path, opened: Callable[[dict[str, Any]], Any]
                    ) -> Any:
    """Open read-only beside a possibly live writer.

    A writer deletes the files of the generation it replaced after it commits, but not
    while a reader holds the shared lock on ``root/readers`` (see `readers_shared`).
    Without that lock a reader that read the old manifest may find a file missing. That is
    only damage if the manifest is still the one the reader read: otherwise a commit raced
    the open, and the open starts again. "Still the one" compares contents, not (inode,
    mtime, size), which a writer committing within one clock tick can repeat.
    """
    with readers_shared(root):
        for attempt in range(OPEN_RETRIES):
            manifest = read_manifest(root)
            try:
                return opened(manifest)
            except InvalidStoreError:
                if attempt + 1 == OPEN_RETRIES or read_manifest(root) == manifest:
                    raise
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _open_url(cls: Any, url: str, mode: str,
              cache_dir: str | os.PathLike[str] | None, cache_bytes: CacheBytes,
              storage_options: dict[str, str] | None, max_ram_bytes: int,
              cache_fill: bool | None = None) -> Any:
    """Read-only from a bucket: small files now, frame chunks on demand (`RemoteChunks`)."""
    if mode != "r":
        raise InvalidInputError(
            f"a URL opens read-only (mode='r'); to write, give a local working copy: "
            f"ReplayStore.open({url!r}, 'r+', local=DIR)")
    if isinstance(cache_bytes, str):  # CACHE_ALL, the one word `validate` lets through
        raise InvalidInputError(
            f"cache_bytes={validate.CACHE_ALL!r} keeps a local store's frames decoded in RAM; "
            f"for a URL, cache_bytes bounds the files fetched into cache_dir: give an int or "
            f"None")
    objects = open_objects(url, storage_options)
    root = Path(tempfile.mkdtemp(prefix="mmreplay-", dir=cache_dir))
    remote: RemoteChunks | None = None
    try:
        remote = open_remote(objects, root, budget_bytes=cache_bytes, fill=cache_fill)
        store = _open_path(cls, root, "r", False, None, max_ram_bytes, remote=remote)
        if remote is not None and cache_fill:
            remote.start_filling()
    except BaseException:
        if remote is not None:
            remote.close()
        shutil.rmtree(root, ignore_errors=True)
        raise
    store.remote = remote
    weakref.finalize(store, shutil.rmtree, root, ignore_errors=True)
    return store


def _open_path(cls: Any, root: Path, mode: str, durable: bool,
               cache_bytes: CacheBytes, max_ram_bytes: int,
               remote: RemoteChunks | None = None, device: Any = None) -> Any:
    check_root(root)

    def opened(manifest: dict[str, Any], lock_fd: int | None) -> Any:
        spec = _checked_spec(root, manifest, max_ram_bytes)  # before any allocation
        _check_cache_all(spec, cache_bytes, max_ram_bytes)
        if device is not None:
            check_fits(spec, device)
        return cls(root, spec, writable=lock_fd is not None, durable=durable,
                   cache_bytes=cache_bytes, lock_fd=lock_fd, manifest=manifest, remote=remote,
                   device=device)

    if mode == "r":
        return _open_read_only(root, lambda manifest: opened(manifest, None))
    lock_fd = take_lock(root)
    try:
        return lifecycle.track(opened(read_manifest(root), lock_fd))  # flushed at exit
    except BaseException:
        release_lock(lock_fd)
        raise

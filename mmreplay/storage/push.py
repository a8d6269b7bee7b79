"""Pushing a store directory's committed generation into a prefix of object storage.

A push uploads what the bucket lacks or what changed (frame files whose md5 differs),
concurrently, then the manifest, then deletes the step files the new manifest no longer
names (the keys: `bucket`). A reader of the bucket therefore sees the old generation or the
new one: before a frame file that overwrites frames is uploaded, the bucket's manifest is
first re-published with those frames given up (*bridge*), exactly as a local writer gives
frames up before it overwrites a chunk. An interrupted push leaves the previous manifest and
everything it names; the next push uploads what is still missing. Only one writer pushes into
a prefix (`lease.Lease`).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidStoreError, StoreLockedError
from mmreplay.storage.bucket import FRAME_KEY_PREFIX, raised_kept, read_bucket_manifest
from mmreplay.storage.commit import readers_shared
from mmreplay.storage.frame_store import FRAMES, max_file_bytes
from mmreplay.storage.layout import ZARR_JSON
from mmreplay.storage.lease import LEASE, Lease
from mmreplay.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    parse_spec,
    read_manifest,
    write_manifest,
)
from mmreplay.storage.objects import ObjectMissingError, Objects, md5_hex
from mmreplay.storage.safe_io import read_small
from mmreplay.storage.zstd_dict import DICT_FILE, read_dictionary

PUSHED = "pushed.json"
CONCURRENCY = 8  # uploads in flight
BATCH_BYTES = 64 << 20  # frame files read into RAM, then uploaded, per round


@dataclass(frozen=True)
class PushReport:
    """What one push did."""

    generation: int
    uploaded_objects: int
    uploaded_bytes: int
    skipped_objects: int
    deleted_objects: int
    seconds: float


class Pusher:
    """Pushes one local store directory into one prefix, generation after generation.

    It remembers between pushes what the bucket holds (keys, and the md5 of each frame
    file), so a mirror's push lists nothing and reads only the frame files that changed.
    """

    def __init__(self, root: Path, objects: Objects, *, lease: Lease | None = None,
                 concurrency: int = CONCURRENCY) -> None:
        self.root, self.objects = root, objects
        self.lease = lease or Lease(objects)
        self.concurrency = concurrency
        self._known: dict[str, str | None] | None = None  # key -> md5 (frames) or None
        self._md5: dict[str, tuple[tuple[int, int, int], str]] = {}  # local stat -> md5
        self._bucket_manifest: dict[str, Any] | None = None
        self._kept_seen: list[int] = []  # the directory's kept_from after frame files were read
        self._pool: ThreadPoolExecutor | None = None  # kept between a mirror's pushes
        self.stats = _Counter()

    def push(self, *, take_over: bool = False) -> PushReport:
        """Upload the directory's committed generation (see the module docstring)."""
        start, self.stats = time.monotonic(), _Counter()
        self.lease.acquire(take_over=take_over)
        if self._known is None:
            self._known = self._load_known()
        with readers_shared(self.root):  # the writer keeps the files this manifest names
            manifest = read_manifest(self.root)
            self._kept_seen = list(manifest["kept_from"])
            self._check_lineage(manifest)
            self._upload_named(manifest)
        self._upload_meta(manifest)
        self._upload_frames(manifest)
        deleted = self._publish(manifest)
        return PushReport(manifest["generation"], self.stats.objects, self.stats.bytes,
                          self.stats.skipped, deleted, time.monotonic() - start)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.lease.release()

    # -- what the bucket holds ------------------------------------------------------------
    def _load_known(self) -> dict[str, str | None]:
        listing = self.objects.list()
        known: dict[str, str | None] = {k: None for k in listing}
        try:
            pushed = json.loads(self.objects.get(PUSHED))
        except (ObjectMissingError, ValueError):
            pushed = {}
        for key, info in listing.items():  # a frame file's md5: the record, else its etag
            if key.startswith(FRAME_KEY_PREFIX):
                known[key] = pushed.get(key) if isinstance(pushed, dict) and isinstance(
                    pushed.get(key), str) else info.etag
        if MANIFEST in listing:
            self._bucket_manifest = read_bucket_manifest(self.objects)
        elif any(not k.startswith((LEASE, PUSHED)) for k in listing):
            raise InvalidStoreError(f"{self.objects.url} holds objects but no {MANIFEST}: it "
                                    f"is not an mmreplay store; push into an empty prefix")
        return known

    def _check_lineage(self, manifest: dict[str, Any]) -> None:
        old = self._bucket_manifest
        if old is not None and old["generation"] > manifest["generation"]:
            raise StoreLockedError(
                f"{self.objects.url} holds generation {old['generation']}, newer than this "
                f"store's {manifest['generation']}: another writer pushed there; pull it or "
                f"push into another prefix")

    # -- uploads -----------------------------------------------------------------------------
    def _upload_named(self, manifest: dict[str, Any]) -> None:
        """The step, priority and tail files the manifest names (immutable names)."""
        assert self._known is not None
        todo = [n for n in manifest["files"] if n not in self._known]
        self.stats.skipped += len(manifest["files"]) - len(todo)

        def load(name: str) -> bytes:
            data = read_small(self.root / name, name, MAX_MANIFEST_BYTES * 64)
            if zlib.crc32(data) != manifest["files"][name]:
                raise InvalidStoreError(f"{name} fails its crc32 checksum; not pushed")
            return data

        self._put_all(((n, load(n)) for n in todo), md5=False)

    def _upload_meta(self, manifest: dict[str, Any]) -> None:
        """The zarr metadata, and a "zstd-dict" store's dictionary once it has one (its
        training rewrote frames/zarr.json, which then goes again)."""
        assert self._known is not None
        keys = [k for k in (ZARR_JSON, f"{FRAMES}/{ZARR_JSON}") if k not in self._known]
        if "dictionary" in manifest and DICT_FILE not in self._known:
            read_dictionary(self.root, manifest["dictionary"])  # checked before it goes
            keys = [ZARR_JSON, f"{FRAMES}/{ZARR_JSON}", DICT_FILE]
        if keys:
            self._put_all([(k, read_small(self.root / k, k, 1 << 20)) for k in keys], md5=False)

    def _upload_frames(self, manifest: dict[str, Any]) -> None:
        """Frame files whose md5 the bucket does not have, in rounds of `BATCH_BYTES`."""
        assert self._known is not None
        spec = parse_spec(manifest)
        changed = [(k, md5) for k, md5 in self._local_frames() if self._known.get(k) != md5]
        self.stats.skipped += len(self._md5) - len(changed)
        batch: list[tuple[str, bytes]] = []
        for key, _ in changed:
            batch.append((key, read_small(self.root / key, key, max_file_bytes(spec))))
            if sum(len(d) for _, d in batch) >= BATCH_BYTES:
                self._upload_frame_batch(batch)
                batch = []
        if batch:
            self._upload_frame_batch(batch)

    def _upload_frame_batch(self, batch: list[tuple[str, bytes]]) -> None:
        """Give up in the bucket what these newer files may overwrite, then upload them."""
        kept = read_manifest(self.root)["kept_from"]
        self._kept_seen = [max(a, b) for a, b in zip(self._kept_seen, kept, strict=True)]
        self._bridge(self._kept_seen)
        self._put_all(batch, md5=True)

    def _bridge(self, kept_now: list[int]) -> None:
        """Re-publish the bucket's manifest with frames below `kept_now` given up."""
        old = self._bucket_manifest
        if old is None:
            return
        kept = raised_kept(old, kept_now)
        if kept != old["kept_from"]:
            bridged = {**old, "kept_from": kept}
            self._put_manifest(bridged)

    def _local_frames(self) -> list[tuple[str, str]]:
        """(key, md5) of every frame file in the directory (md5 cached by stat)."""
        out = []
        with os.scandir(self.root / FRAMES) as entries:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                if entry.name == ZARR_JSON or not stat.S_ISREG(info.st_mode):
                    continue
                key = f"{FRAMES}/{entry.name}"
                sig = (info.st_size, info.st_mtime_ns, info.st_ino)
                cached = self._md5.get(key)
                if cached is None or cached[0] != sig:
                    cached = (sig, md5_hex(Path(entry.path).read_bytes()))
                    self._md5[key] = cached
                out.append((key, cached[1]))
        return out

    def _put_all(self, items: Iterable[tuple[str, bytes]], *, md5: bool) -> None:
        """Upload concurrently; remember each key (and its md5 for frame files)."""
        assert self._known is not None
        items = list(items)

        def put(item: tuple[str, bytes]) -> None:
            self.objects.put(*item)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mmreplay-push")
        list(self._pool.map(put, items))  # raises the first failure
        for key, data in items:
            self._known[key] = md5_hex(data) if md5 else None
            self.stats.objects += 1
            self.stats.bytes += len(data)

    # -- the commit point ------------------------------------------------------------------
    def _publish(self, manifest: dict[str, Any]) -> int:
        """Renew the lease, upload the manifest (with frames given up since it was read),
        record frame md5s, then delete step files no manifest in the bucket names."""
        assert self._known is not None
        final = {**manifest, "kept_from": raised_kept(manifest, self._kept_seen)}
        self.lease.acquire()
        self._put_manifest(final)
        frames = {k: v for k, v in self._known.items() if v is not None}
        self.objects.put(PUSHED, json.dumps(frames, sort_keys=True).encode())
        stale = [k for k in self._known if k.split("/")[0] in ("steps", "prio", "tail")
                 and k not in final["files"]]
        for key in stale:
            self.objects.delete(key)
            del self._known[key]
        return len(stale)

    def _put_manifest(self, manifest: dict[str, Any]) -> None:
        self.objects.put(MANIFEST, manifest_bytes(manifest))
        self._bucket_manifest = manifest
        assert self._known is not None
        self._known[MANIFEST] = None


class _Counter:
    def __init__(self) -> None:
        self.objects = self.bytes = self.skipped = 0


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The sealed JSON `write_manifest` writes (through a scratch directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_manifest(Path(tmp), manifest, Path(tmp), durable=False)
        return (Path(tmp) / MANIFEST).read_bytes()

"""Copying a store's committed generation to object storage and back.

The bucket holds the same keys as the directory (``zarr.json``, ``frames/...``, ``steps/``,
``tail/``, ``prio/``, ``manifest.json``), so a bucket store is also a plain zarr v3 group,
plus two objects of its own: ``lease.json`` (which writer may push) and ``pushed.json``
(the md5 of every frame file as last pushed). Which objects change:

    zarr.json, frames/zarr.json    written once at create (frames/zarr.json again, with
                                   zstd.dict, once a "zstd-dict" store trains its dictionary)
    steps/ prio/ tail/ *.gNNN.npy  immutable: a name is never rewritten (copy-on-write)
    frames/c.<env>.<shard>...      rewritten in place as the ring fills and wraps
    manifest.json                  the commit point: uploaded last

A push uploads what the bucket lacks or what changed (frame files whose md5 differs),
concurrently, then the manifest, then deletes the step files the new manifest no longer
names. A reader of the bucket therefore sees the old generation or the new one: before a
frame file that overwrites frames is uploaded, the bucket's manifest is first re-published
with those frames given up (*bridge*), exactly as a local writer gives frames up before it
overwrites a chunk. An interrupted push leaves the previous manifest and everything it
names; the next push uploads what is still missing. Only one writer pushes into a prefix:
`Lease` keeps a writer id in ``lease.json`` with conditional puts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidStoreError, ObjectStoreError, StoreLockedError
from mmreplay.storage.codec import max_chunk_bytes
from mmreplay.storage.commit import readers_shared
from mmreplay.storage.frame_store import FRAMES, max_file_bytes
from mmreplay.storage.layout import ZARR_JSON, check_store_files
from mmreplay.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    check_manifest,
    parse_manifest,
    parse_spec,
    read_manifest,
    write_manifest,
)
from mmreplay.storage.objects import ObjectMissingError, Objects, md5_hex
from mmreplay.storage.safe_io import TMP_DIR, read_small, write_atomic
from mmreplay.storage.shards import index_size, parse_index
from mmreplay.storage.zstd_dict import DICT_FILE, read_dictionary

LEASE = "lease.json"
PUSHED = "pushed.json"
LEASE_TTL_S = 120.0  # a writer that has not pushed for this long may be taken over
CONCURRENCY = 8  # uploads in flight
FETCH_CONCURRENCY = 32  # downloads in flight (an open from a bucket: ~250 step blocks per 1M steps)
BATCH_BYTES = 64 << 20  # frame files read into RAM, then uploaded, per round
FRAME_KEY_PREFIX = f"{FRAMES}/c."


@dataclass(frozen=True)
class PushReport:
    """What one push did."""

    generation: int
    uploaded_objects: int
    uploaded_bytes: int
    skipped_objects: int
    deleted_objects: int
    seconds: float


# -- the writer lease -----------------------------------------------------------------------
class Lease:
    """``lease.json``: the one writer allowed to push into a prefix, renewed by each push.

    A second writer is refused while the lease is held and fresh (`LEASE_TTL_S`);
    ``take_over=True`` takes it anyway (the other writer is known to be gone). Every change
    is a conditional put (create if absent, replace if unchanged), so two writers racing
    for a lease cannot both get it.
    """

    def __init__(self, objects: Objects, *, writer_id: str | None = None,
                 ttl_s: float = LEASE_TTL_S) -> None:
        self.objects, self.ttl_s = objects, ttl_s
        self.writer_id = writer_id or uuid.uuid4().hex
        self.held = False

    def _body(self) -> bytes:
        return json.dumps({"writer": self.writer_id, "host": socket.gethostname(),
                           "pid": os.getpid(), "expires": time.time() + self.ttl_s}).encode()

    def acquire(self, *, take_over: bool = False) -> None:
        """Take or renew the lease; `StoreLockedError` if another writer holds it."""
        for _ in range(8):
            info = self.objects.head(LEASE)
            if info is None:
                if self.objects.put_if_absent(LEASE, self._body()):
                    self.held = True
                    return
                continue
            current = self._read()
            mine = current.get("writer") == self.writer_id
            if not (mine or take_over or current.get("expires", 0) < time.time()):
                raise StoreLockedError(_locked_message(self.objects.url, current))
            if self.objects.put_if_match(LEASE, self._body(), info.etag or ""):
                self.held = True
                return
            if mine:  # our own lease changed under us: someone took it over
                break
        self.held = False
        raise StoreLockedError(f"{self.objects.url}: another writer took the lease "
                               f"({LEASE}); this one stops pushing")

    def check_free(self) -> None:
        """`StoreLockedError` if another writer holds the lease now (takes nothing)."""
        current = self._read()
        if current.get("writer") not in (None, self.writer_id) \
                and current.get("expires", 0) >= time.time():
            raise StoreLockedError(_locked_message(self.objects.url, current))

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.objects.get(LEASE)[:4096])
        except (ObjectMissingError, ValueError):  # gone, or not JSON: nobody's lease
            return {}
        return data if isinstance(data, dict) else {}

    def release(self) -> None:
        """Delete the lease if it is still this writer's (an unreachable bucket keeps it
        until it expires)."""
        try:
            if self.held and self._read().get("writer") == self.writer_id:
                self.objects.delete(LEASE)
        except ObjectStoreError:
            pass
        self.held = False


def _locked_message(url: str, lease: dict[str, Any]) -> str:
    left = float(lease.get("expires", 0)) - time.time()
    return (f"{url} is being written by another writer (id {str(lease.get('writer'))[:12]}, "
            f"host {str(lease.get('host'))[:64]}, pid {lease.get('pid')}), whose lease "
            f"expires in {left:.0f} s; if that writer is gone, push with take_over=True "
            f"(mmreplay push --take-over)")


# -- push -----------------------------------------------------------------------------------
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


def raised_kept(manifest: dict[str, Any], kept_now: list[int]) -> list[int]:
    """`manifest`'s kept_from raised to `kept_now` (frames given up since), at most written."""
    return [min(w, max(k, n)) for w, k, n in zip(manifest["written"], manifest["kept_from"],
                                                  kept_now, strict=True)]


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The sealed JSON `write_manifest` writes (through a scratch directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_manifest(Path(tmp), manifest, Path(tmp), durable=False)
        return (Path(tmp) / MANIFEST).read_bytes()


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


# -- pull -----------------------------------------------------------------------------------
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
    final = {**manifest, "kept_from": raised_kept(manifest, _kept_now(objects, manifest))}
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


def _kept_now(objects: Objects, manifest: dict[str, Any]) -> list[int]:
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
    kept = raised_kept(local, _kept_now(objects, local))
    if kept != local["kept_from"]:
        write_manifest(root, {**local, "kept_from": kept}, root / TMP_DIR, durable=False)

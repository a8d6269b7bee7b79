"""Frame chunks fetched from a bucket on demand, into a bounded local cache directory.

A store read from object storage keeps, in its cache directory, a *sparse* copy of each
shard file it has touched: the file has the object's size, its index (the last bytes,
fetched once) and exactly the chunks a read has needed, written at their offsets; the
rest is holes. `ShardFiles` maps these files as it maps local ones and asks `ensure`
first, so a batch fetches only the inner chunks it touches (one coalesced ranged request
per shard, shards concurrently)::

    bucket  frames/c.0.3.0.0  [chunk 0][chunk 1]...[chunk 511][index|crc]
    cache   frames/c.0.3.0.0  [ hole  ][chunk 1]...[  hole   ][index|crc]

Every fetched chunk is checked against its own crc32c before it is kept. A mismatch means
the object was replaced by a newer push since its index was read (or is damaged): the
shard is dropped and fetched again once, then the error is raised. After each fetch the
bucket's manifest is read again (`after_fetch`), so frames a writer gave up since the
open are dropped before a read of them is believed. When the fetched bytes exceed the
budget, whole shard files are evicted, least recently used first.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.spec import StoreSpec
from mmreplay.storage.codec import max_chunk_bytes
from mmreplay.storage.frame_store import FRAMES
from mmreplay.storage.manifest import parse_spec
from mmreplay.storage.objects import ObjectMissingError, Objects
from mmreplay.storage.shards import index_size, max_shard_bytes, parse_index
from mmreplay.storage.transfer import follow_bucket, pull

CONCURRENCY = 8
Shard = tuple[int, int]  # (env, shard)


class RemoteChunks:
    """On-demand fetch of frame chunks from `objects` into ``root/frames`` (sparse files)."""

    def __init__(self, objects: Objects, root: Path, spec: StoreSpec, *, budget_bytes: int,
                 after_fetch: Callable[[], None] | None = None) -> None:
        self.objects, self.spec, self.budget = objects, spec, budget_bytes
        self._dir = root / FRAMES
        self._suffix = ".0" * len(spec.obs_shape)
        self._num_chunks, self._k = spec.num_chunks, spec.shard_chunks
        self._max_chunk = max_chunk_bytes(spec)
        self._have = np.zeros(spec.num_envs * spec.num_chunks, bool)
        self._index: dict[Shard, np.ndarray] = {}
        self._held: OrderedDict[Shard, int] = OrderedDict()  # shard -> bytes fetched, LRU
        self._sizes: dict[str, int] = {k: i.size for k, i in objects.list(f"{FRAMES}/c.").items()}
        self._after_fetch = after_fetch
        self._forget: Callable[[int, int], None] = lambda env, shard: None
        self._lock = threading.Lock()
        self._book = threading.Lock()
        self.bytes_fetched = 0
        self.requests = 0

    def bind(self, forget: Callable[[int, int], None]) -> None:
        """`forget(env, shard)` unmaps a shard file (`ShardFiles.forget`) before it changes."""
        self._forget = forget

    @property
    def cached_bytes(self) -> int:
        return sum(self._held.values())

    def key(self, env: int, shard: int) -> str:
        return f"{FRAMES}/c.{env}.{shard}{self._suffix}"

    def ensure(self, keys: np.ndarray) -> None:
        """Make the chunks ``keys`` (``env * num_chunks + chunk``) present in their files."""
        with self._lock:
            missing = np.unique(keys[~self._have[keys]])
            if missing.size == 0:
                self._touch(keys)
                return
            env, chunk = np.divmod(missing, self._num_chunks)
            want: dict[Shard, list[int]] = {}
            for e, c in zip(env.tolist(), chunk.tolist(), strict=True):
                want.setdefault((e, c // self._k), []).append(c % self._k)
            with ThreadPoolExecutor(min(CONCURRENCY, len(want))) as pool:
                list(pool.map(lambda item: self._fetch_shard(*item), want.items()))
            self._evict(self._shards(keys))
        if self._after_fetch is not None:
            self._after_fetch()

    def _shards(self, keys: np.ndarray) -> set[Shard]:
        env, chunk = np.divmod(np.unique(keys), self._num_chunks)
        return set(zip(env.tolist(), (chunk // self._k).tolist(), strict=True))

    def _touch(self, keys: np.ndarray) -> None:
        for shard in self._shards(keys):
            if shard in self._held:
                self._held.move_to_end(shard)

    def _fetch_shard(self, shard: Shard, positions: list[int]) -> None:
        """Fetch chunks of one shard; on a checksum mismatch drop the shard and retry once."""
        try:
            self._fetch_chunks(shard, positions)
        except _Changed:
            self._drop(shard)
            self._sizes.pop(self.key(*shard), None)
            try:
                self._fetch_chunks(shard, positions)
            except _Changed as exc:
                raise InvalidStoreError(str(exc)) from None

    def _fetch_chunks(self, shard: Shard, positions: list[int]) -> None:
        index = self._index.get(shard)
        if index is None:
            index = self._fetch_index(shard)
        where = f"{self.objects.url}/{self.key(*shard)}"
        offsets, sizes = index[positions, 0], index[positions, 1]
        if (offsets < 0).any():
            j = positions[int(np.argmax(offsets < 0))]
            raise InvalidStoreError(f"frame chunk {j} of {where} is absent")
        datas = self.objects.get_ranges(self.key(*shard), offsets.tolist(),
                                        (offsets + sizes).tolist())
        self.requests += 1
        for j, data, size in zip(positions, datas, sizes.tolist(), strict=True):
            if len(data) != size or not _crc_ok(data):
                raise _Changed(f"{where}: chunk {j} fails its crc32c checksum (truncated, "
                               f"damaged or replaced while it was read)")
        fd = os.open(self._path(shard), os.O_WRONLY)
        try:
            for data, offset in zip(datas, offsets.tolist(), strict=True):
                os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        first = shard[0] * self._num_chunks + shard[1] * self._k
        self._have[[first + j for j in positions]] = True
        self._count(shard, int(sizes.sum()))

    def _count(self, shard: Shard, fetched: int) -> None:
        with self._book:  # fetch threads of one read share the counters
            self._held[shard] = self._held.get(shard, 0) + fetched
            self._held.move_to_end(shard)
            self.bytes_fetched += fetched

    def _fetch_index(self, shard: Shard) -> np.ndarray:
        """Read a shard's index (its last bytes) and create its sparse local file."""
        key = self.key(*shard)
        where = f"{self.objects.url}/{key}"
        size = self._sizes.get(key)
        if size is None:
            info = self.objects.head(key)
            if info is None:
                raise ObjectMissingError(f"{where} does not exist")
            size = self._sizes[key] = info.size
        limit = max_shard_bytes(self._k, self._max_chunk)
        if size > limit:
            raise InvalidStoreError(f"{where} is {size} bytes, more than a frame file can be "
                                    f"({limit})")
        n = index_size(self._k)
        tail = self.objects.get_ranges(key, [max(size - n, 0)], [size])[0] if size else b""
        self.requests += 1
        try:
            index = parse_index(tail, size, self._k, self._max_chunk, where)
        except InvalidStoreError as exc:
            raise _Changed(str(exc)) from None
        path = self._path(shard)
        with open(path, "wb") as f:
            f.truncate(size)
            os.pwrite(f.fileno(), tail, size - len(tail))
        self._index[shard] = index
        self._count(shard, len(tail))
        return index

    def _path(self, shard: Shard) -> Path:
        return self._dir / f"c.{shard[0]}.{shard[1]}{self._suffix}"

    def _drop(self, shard: Shard) -> None:
        """Forget a shard: unmap, delete its local file, mark its chunks absent."""
        self._forget(*shard)
        self._path(shard).unlink(missing_ok=True)
        first = shard[0] * self._num_chunks + shard[1] * self._k
        self._have[first:first + self._k] = False
        self._index.pop(shard, None)
        self._held.pop(shard, None)

    def _evict(self, keep: set[Shard]) -> None:
        """Drop least recently used shards (never those of this read) beyond the budget."""
        for shard in list(self._held):
            if self.cached_bytes <= self.budget:
                return
            if shard not in keep:
                self._drop(shard)


class _Changed(Exception):
    """Fetched bytes do not match what the index promised (replaced, or damaged)."""


def _crc_ok(data: bytes) -> bool:
    """A chunk ends with the crc32c of the bytes before it (the codec's last step)."""
    return len(data) >= 5 and google_crc32c.value(data[:-4]) == struct.unpack(
        "<I", data[-4:])[0]


REMOTE_CACHE_BYTES = 2 << 30  # fetched frame bytes a store read from a bucket keeps


def open_remote(objects: Objects, root: Path, *,
                budget_bytes: int | None = None) -> RemoteChunks:
    """Pull a bucket store's small files into `root` (an empty directory) and return the
    fetcher of its frame chunks; the manifest in `root` follows the bucket's give-ups."""
    manifest = pull(objects, root, frames=False)
    spec = parse_spec(manifest)
    if spec.shard_chunks == 1:
        raise InvalidStoreError(f"{objects.url} is a format-1 store (a file per chunk); it "
                                f"cannot be read from the bucket: mmreplay pull it first")
    return RemoteChunks(objects, root, spec, after_fetch=lambda: follow_bucket(objects, root),
                        budget_bytes=REMOTE_CACHE_BYTES if budget_bytes is None
                        else budget_bytes)

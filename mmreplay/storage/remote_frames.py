"""Frame chunks fetched from a bucket on demand, into a bounded local cache directory.

A store read from object storage keeps, in its cache directory, a *sparse* copy of each
shard file it has touched: the file has the object's size, its index (the last bytes,
fetched once) and exactly the chunks a read has needed, written at their offsets; the
rest is holes. `ShardFiles` maps these files as it maps local ones and asks `ensure`
first, so a batch fetches only the inner chunks it touches. The open lists the frame
objects (one request) and reads no index: a shard's index is read the first time a read
touches that shard (one request, kept), then a batch costs one round trip (a ranged
request per run of nearby chunks, all concurrently)::

    bucket  frames/c.0.3.0.0  [chunk 0][chunk 1]...[chunk 511][index|crc]
    cache   frames/c.0.3.0.0  [ hole  ][chunk 1]...[  hole   ][index|crc]

Chunk reads are conditional on the etag the index was read with, and every chunk is
checked against its own crc32c before it is kept. A changed object (a newer push) or a
mismatch drops the shard and fetches it again once; then the error is raised. After a
newer index is read, the bucket's manifest is checked again (`after_fetch`), so frames a
writer gave up since the open are dropped before a read of them is believed. When the
fetched bytes exceed the budget, whole shard files are evicted, least recently used first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.spec import StoreSpec
from mmreplay.storage.codec import max_chunk_bytes
from mmreplay.storage.frame_store import FRAMES
from mmreplay.storage.objects import (
    ObjectChangedError,
    ObjectInfo,
    ObjectMissingError,
    Objects,
)
from mmreplay.storage.shards import (
    checked_shard,
    chunk_crc_ok,
    index_size,
    max_shard_bytes,
    parse_index,
)

if TYPE_CHECKING:
    from mmreplay.storage.cache_fill import CacheFiller

CONCURRENCY = 64  # requests in flight (several prefetched batches share them)
MAX_GAP = 16 << 10  # chunks of one shard this close are read in one request
FILL_THREADS = 4  # whole-shard requests the cache filler keeps in flight
Shard = tuple[int, int]  # (env, shard)


class RemoteChunks:
    """On-demand fetch of frame chunks from `objects` into ``root/frames`` (sparse files)."""

    def __init__(self, objects: Objects, root: Path, spec: StoreSpec, *, budget_bytes: int,
                 after_fetch: Callable[[], None] | None = None) -> None:
        """`after_fetch` is called after a newer shard index is read and before any chunk
        of it counts as present; it must be safe to call from several threads (`Follower`)."""
        self.objects, self.spec, self.budget = objects, spec, budget_bytes
        self._dir = root / FRAMES
        self._suffix = ".0" * len(spec.obs_shape)
        self._num_chunks, self._k = spec.num_chunks, spec.shard_chunks
        self._max_chunk = max_chunk_bytes(spec)
        self._have = np.zeros(spec.num_envs * spec.num_chunks, bool)
        self._index: dict[Shard, tuple[np.ndarray, str | None]] = {}  # index, etag
        self._reading: dict[Shard, threading.Event] = {}  # indexes being read now
        self._held: OrderedDict[Shard, int] = OrderedDict()  # shard -> bytes fetched, LRU
        self.listed = objects.list(f"{FRAMES}/c.")  # sizes checked at open (`check_listing`)
        self._after_fetch = after_fetch
        self._forget: Callable[[int, int], None] = lambda env, shard: None
        self._pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="mmreplay-fetch")
        self._inflight = np.zeros(spec.num_envs * spec.num_chunks, bool)
        self._cond = threading.Condition()  # guards _have, _inflight, eviction
        self._book = threading.Lock()  # guards _index, _held and the counters
        self.bytes_fetched = 0  # chunks and shard indexes
        self.chunk_bytes = 0  # chunks only: what the reads needed
        self.index_bytes = 0  # shard indexes only (once per shard, on its first use)
        self.requests = 0
        self._whole: set[Shard] = set()  # shards the filler brought down whole
        self.filler: CacheFiller | None = None  # whole shards fetched in the background
        self.fill_bytes = 0  # the filler's, counted apart from the reads' (above)
        self.fill_requests = 0
        self.fill_mode: bool | None = None  # ``cache_fill`` (`fill_on_batches`)

    @property
    def cached_bytes(self) -> int:
        """Fetched bytes the cache directory holds now."""
        with self._book:
            return sum(self._held.values())

    def start_filling(self, threads: int = FILL_THREADS) -> None:
        """Start the cache filler (`CacheFiller`), once; `close` stops it."""
        if self.filler is None:
            self.filler = new_filler(self, threads)

    def pending_shards(self) -> list[tuple[Shard, int]]:
        """(shard, object size) of every listed frame file not yet brought down whole."""
        return [(shard, size) for shard, size in listed_shards(self.listed)
                if shard not in self._whole]

    def fill_shard(self, shard: Shard, size: int) -> bool:
        """Bring a whole frame file down in one request (what the filler does): checked as
        the reads check (index, every chunk's crc32c), kept only if it is still the version
        whose index the reads use (or none was read yet). False if it was not kept."""
        where = f"{self.objects.url}/{self.key(*shard)}"
        data, info = self.objects.get_suffix(self.key(*shard), size)
        with self._book:
            self.fill_requests += 1
            self.fill_bytes += len(data)
        if info.size != len(data):
            return False  # replaced since the listing: the reads fetch what they need
        index, present = checked_shard(data, self._k, self._max_chunk, where)
        if present is None:
            return False
        installed = self._install(shard, data, index, info.etag)
        if installed is None:
            return False
        if installed is index:
            self._follow()  # as after any newer index: frames given up since are dropped
        return self._mark_whole(shard, present, installed, len(data))

    def _install(self, shard: Shard, data: bytes, index: np.ndarray,
                 etag: str | None) -> np.ndarray | None:
        """Write a whole fetched file and install its index unless one was read; returns
        the index the reads now use (`index` if it was installed here), None if the reads
        know another version."""
        while True:  # a read reading this index now: wait for it, then look again
            with self._book:
                busy, known = self._reading.get(shard), self._index.get(shard)
                if busy is None:
                    if known is not None and known[1] != etag:
                        return None
                    done = self._reading[shard] = threading.Event()  # the reads wait for it
                    break
            busy.wait()
        try:
            with self._cond:  # no eviction unlinks the file while it is written
                write_whole(self._path(shard), data)
            with self._book:
                if known is None:
                    self._index[shard] = (index, etag)
        finally:
            with self._book:
                self._reading.pop(shard)
            done.set()
        return index if known is None else known[0]

    def _mark_whole(self, shard: Shard, present: np.ndarray, index: np.ndarray,
                    size: int) -> bool:
        """Mark a filled shard's chunks present (if `index` is still the one the reads use:
        not dropped, nor dropped and read again) and count the shard as the least recently
        used: evicted first, before shards reads used."""
        first = shard[0] * self._num_chunks + shard[1] * self._k
        with self._cond:
            known = self._index.get(shard)
            if known is None or known[0] is not index:
                return False  # dropped meanwhile
            self._have[first + present] = True
            with self._book:
                self._whole.add(shard)
                self._held[shard] = size
                self._held.move_to_end(shard, last=False)
        return True

    def key(self, env: int, shard: int) -> str:
        return f"{FRAMES}/c.{env}.{shard}{self._suffix}"

    def ensure(self, keys: np.ndarray, forget: Callable[[int, int], None] | None = None, *,
               reader_locked: bool = True) -> None:
        """Make the chunks ``keys`` (``env * num_chunks + chunk``) present in their files.

        Several threads may call it at once (prefetch workers): each fetches the chunks no
        other is fetching, without holding the lock over the network, then waits for the
        rest. Only a caller that holds the reader's lock (no decode can be running) may
        unmap files: evict, or replace a changed shard; others leave that to the next."""
        if forget is not None:  # `ShardFiles.forget`: unmap a file before it is replaced
            self._forget = forget
        keys = keys[keys < self._have.size]  # the zero chunk and RAM tails are not fetched
        with self._cond:
            missing = np.unique(keys[~self._have[keys]])
            mine = missing[~self._inflight[missing]]
            self._inflight[mine] = True
        try:
            if mine.size:
                self._fetch(mine, may_unmap=reader_locked)
        finally:
            with self._cond:
                self._inflight[mine] = False
                self._cond.notify_all()
                while (self._inflight[missing] & ~self._have[missing]).any():
                    self._cond.wait()
                if reader_locked:
                    self._evict(shards_of(keys, self._num_chunks, self._k))
                self._touch(keys)

    def prefetch(self, keys: np.ndarray) -> None:
        """`ensure` from a thread that does not hold the reader's lock (a prefetcher):
        fetches what is missing, never unmaps or evicts."""
        self.ensure(keys, reader_locked=False)

    def _fetch(self, missing: np.ndarray, *, may_unmap: bool) -> None:
        env, chunk = np.divmod(missing, self._num_chunks)
        want: dict[Shard, list[int]] = {}
        for e, c in zip(env.tolist(), chunk.tolist(), strict=True):
            want.setdefault((e, c // self._k), []).append(c % self._k)
        changed = self._fetch_shards(want)
        if changed and may_unmap:  # replaced since their index was read: read it again
            with self._cond:
                for shard in changed:
                    self._drop(shard)
            again = self._fetch_shards({shard: want[shard] for shard in changed})
            if again:
                raise InvalidStoreError(f"{self.objects.url}/{self.key(*sorted(again)[0])} "
                                        f"keeps changing or is damaged: its chunks fail their "
                                        f"crc32c checksum")

    def _fetch_shards(self, want: dict[Shard, list[int]]) -> set[Shard]:
        """Fetch indexes, then chunk runs; returns the shards found changed."""
        if self._read_indexes(list(want)):
            self._follow()  # a newer file may hold frames the bucket gave up since
        runs = [(shard, run) for shard, positions in want.items()
                for run in chunk_runs(self._index[shard][0], sorted(positions),
                                      f"{self.objects.url}/{self.key(*shard)}")]
        results = self._pool_map(lambda item: self._fetch_run(*item), runs)
        return {shard for (shard, _), ok in zip(runs, results, strict=True) if not ok}

    def _read_indexes(self, shards: list[Shard]) -> bool:
        """Read the indexes of `shards` not read yet, each by one thread (the first to
        ask; the others wait for it); True if this call read any."""
        read = False
        while True:
            with self._book:
                todo = [s for s in shards if s not in self._index and s not in self._reading]
                waits = [self._reading[s] for s in shards if s in self._reading]
                for shard in todo:
                    self._reading[shard] = threading.Event()
            if not todo and not waits:
                return read
            try:
                self._pool_map(self._fetch_index, todo)
            finally:
                with self._book:
                    for shard in todo:
                        self._reading.pop(shard).set()
            read = read or bool(todo)
            for event in waits:  # if that read failed, the next round reads it here
                event.wait()

    def _fetch_run(self, shard: Shard, run: list[int]) -> bool:
        """One ranged read of chunks `run` of a shard, each checked; False if the object
        changed (or a chunk fails its checksum)."""
        index, etag = self._index[shard]
        lo, hi = int(index[run[0], 0]), int(index[run[-1]].sum())
        try:
            data = self.objects.get_range_if(self.key(*shard), lo, hi, etag)
        except ObjectChangedError:
            return False
        self.requests += 1
        parts = [data[index[j, 0] - lo:index[j].sum() - lo] for j in run]
        if len(data) != hi - lo or not all(chunk_crc_ok(part) for part in parts):
            return False
        fd = os.open(self._path(shard), os.O_WRONLY)
        try:
            os.pwrite(fd, data, lo)
        finally:
            os.close(fd)
        first = shard[0] * self._num_chunks + shard[1] * self._k
        with self._cond:
            self._have[[first + j for j in run]] = True
        self._count(shard, hi - lo, chunks=sum(len(p) for p in parts))
        return True

    def _touch(self, keys: np.ndarray) -> None:
        with self._book:
            for shard in shards_of(keys, self._num_chunks, self._k):
                if shard in self._held:
                    self._held.move_to_end(shard)

    def _count(self, shard: Shard, fetched: int, *, chunks: int = 0) -> None:
        with self._book:  # fetch threads of one read share the counters
            self._held[shard] = self._held.get(shard, 0) + fetched
            self._held.move_to_end(shard)
            self.bytes_fetched += fetched
            self.chunk_bytes += chunks

    def _pool_map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))  # one pool: no threads started per batch

    def close(self) -> None:
        """Stop the filler and the request threads."""
        if self.filler is not None:
            self.filler.stop()
        self._pool.shutdown(wait=True)

    def _fetch_index(self, shard: Shard) -> None:
        """Read a shard's index (its last bytes, one request) and create its sparse file."""
        key, n = self.key(*shard), index_size(self._k)
        where = f"{self.objects.url}/{key}"
        try:
            tail, info = self.objects.get_suffix(key, n)
        except ObjectMissingError:
            raise InvalidStoreError(f"frame file {where} is absent from the bucket") from None
        self.requests += 1
        limit = max_shard_bytes(self._k, self._max_chunk)
        if info.size > limit:
            raise InvalidStoreError(f"{where} is {info.size} bytes, more than a frame file "
                                    f"can be ({limit})")
        index = parse_index(tail, info.size, self._k, self._max_chunk, where)
        with open(self._path(shard), "wb") as f:
            f.truncate(info.size)
            os.pwrite(f.fileno(), tail, info.size - len(tail))
        with self._book:
            self._index[shard] = (index, info.etag)
            self.index_bytes += len(tail)
        self._count(shard, len(tail))

    def _follow(self) -> None:
        if self._after_fetch is not None:
            self._after_fetch()

    def _path(self, shard: Shard) -> Path:
        return self._dir / f"c.{shard[0]}.{shard[1]}{self._suffix}"

    def _drop(self, shard: Shard) -> None:
        """Forget a shard: unmap, delete its local file, mark its chunks absent (caller
        holds the condition)."""
        self._forget(*shard)
        self._path(shard).unlink(missing_ok=True)
        first = shard[0] * self._num_chunks + shard[1] * self._k
        self._have[first:first + self._k] = False
        with self._book:
            self._index.pop(shard, None)
            self._held.pop(shard, None)
            self._whole.discard(shard)

    def _evict(self, keep: set[Shard]) -> None:
        """Drop least recently used shards (never those of this read, nor one being
        fetched) beyond the budget (caller holds the condition)."""
        for shard in list(self._held):
            if self.cached_bytes <= self.budget:
                return
            first = shard[0] * self._num_chunks + shard[1] * self._k
            if shard not in keep and not self._inflight[first:first + self._k].any():
                self._drop(shard)


def chunk_runs(index: np.ndarray, positions: list[int], where: str) -> list[list[int]]:
    """Positions (sorted) of a shard's chunks grouped so each group is one ranged request
    (gaps under MAX_GAP)."""
    runs: list[list[int]] = []
    for j in positions:
        if index[j, 0] < 0:
            raise InvalidStoreError(f"frame chunk {j} of {where} is absent")
        prev = runs[-1][-1] if runs else None
        if prev is not None and 0 <= index[j, 0] - index[prev].sum() <= MAX_GAP:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def listed_shards(listed: dict[str, ObjectInfo]) -> list[tuple[Shard, int]]:
    """((env, shard), size) of each frame object of a listing, in key order."""
    out = []
    for key, info in sorted(listed.items()):
        env, shard = (int(x) for x in key[len(FRAMES) + 3:].split(".")[:2])
        out.append(((env, shard), info.size))
    return out


def write_whole(path: Path, data: bytes) -> None:
    """Write a whole file over a sparse one (or a new one), never truncating it first: a
    reader may have it mapped, and the bytes it holds are the same."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def shards_of(keys: np.ndarray, num_chunks: int, k: int) -> set[Shard]:
    """The (env, shard) files chunk keys (``env * num_chunks + chunk``) lie in."""
    env, chunk = np.divmod(np.unique(keys), num_chunks)
    return set(zip(env.tolist(), (chunk // k).tolist(), strict=True))


def new_filler(remote: RemoteChunks, threads: int) -> CacheFiller:
    """A started `CacheFiller` of `remote` (imported here: only a filling store loads it)."""
    from mmreplay.storage.cache_fill import CacheFiller

    filler = CacheFiller(remote, threads=threads)
    filler.start()
    return filler


def fill_on_batches(remote: RemoteChunks) -> None:
    """What ``cache_fill`` asks when a `batches` iterator starts: None (the default) starts
    the filler if the whole store (every frame object listed at the open) fits in the cache
    budget; True started it at the open; False never starts it."""
    if remote.fill_mode is None and sum(i.size for i in remote.listed.values()) <= \
            remote.budget:
        remote.start_filling()

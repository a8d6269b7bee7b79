"""The cache filler: a store read from a bucket brings whole frame files down in the background.

A batch read from a bucket with an empty cache costs ~40 ranged requests (one per run of
chunks, in ~30 shard files); a server answering a few hundred requests a second then caps
the learner at a handful of cold batches a second, however deep the prefetch. When the
local cache (``cache_bytes``) can hold the store, fetching each shard file whole costs one
request per file (a 1M-frame store: ~245 requests for ~177 MB), after which every read is
warm. The filler does that beside the reads, which keep fetching exactly the chunks they
miss meanwhile::

    reads   ranged GETs of the chunks a batch misses     (RemoteChunks.ensure)
    filler  one GET per shard file, FILL_THREADS at once (RemoteChunks.fill_shard)
            while   cached bytes + the file's size <= cache_bytes

A filled file is checked as the reads check theirs (its index, every chunk's crc32c) and kept
only if it is the version whose index the reads use (a damaged file is skipped); its bytes
and requests are counted apart (``fill_bytes``, ``fill_requests``). The filler stops at the
first file that does not fit (it never evicts), at the first request that fails (the reads
then raise their own clear error), and when the store closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from mmreplay.errors import InvalidStoreError, MmreplayError

Shard = tuple[int, int]  # (env, shard)


class Fillable(Protocol):
    """What the filler needs of `RemoteChunks`."""

    budget: int

    @property
    def cached_bytes(self) -> int: ...

    def pending_shards(self) -> list[tuple[Shard, int]]: ...

    def fill_shard(self, shard: Shard, size: int) -> bool: ...


class CacheFiller:
    """Background threads that fill a bucket store's cache with whole shard files."""

    def __init__(self, chunks: Fillable, *, threads: int) -> None:
        self._chunks = chunks
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the queue and the reservations
        self._queue: Iterator[tuple[Shard, int]] = iter(())
        self._reserved = 0  # bytes of files being fetched now (not yet counted as cached)
        self._threads = [threading.Thread(target=self._run, name=f"mmreplay-fill-{k}",
                                          daemon=True) for k in range(threads)]
        self.filled = 0  # shard files kept
        self.skipped = 0  # fetched but not kept (changed meanwhile, or the reads had it)
        self.error: str | None = None  # why the filler stopped early, if a request failed
        self.stopped_full = False  # it stopped at a file the cache could not hold

    def start(self) -> None:
        self._queue = iter(self._chunks.pending_shards())
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop after the requests in flight (returns once every thread ended)."""
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every file is filled (or the filler stopped); True if it ended."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def _next(self) -> tuple[Shard, int] | None:
        """The next file to fetch, its size reserved; None when there is none or it would
        not fit in the cache."""
        with self._lock:
            if self._stop.is_set():
                return None
            item = next(self._queue, None)
            if item is None:
                return None
            if self._chunks.cached_bytes + self._reserved + item[1] > self._chunks.budget:
                self.stopped_full = True
                self._stop.set()
                return None
            self._reserved += item[1]
            return item

    def _run(self) -> None:
        while (item := self._next()) is not None:
            try:
                kept = self._chunks.fill_shard(*item)
            except InvalidStoreError:  # a damaged file: the reads raise on it, if they need it
                kept = False
            except (MmreplayError, OSError) as exc:  # the reads raise their own error
                self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                self._stop.set()
                kept = False
            finally:
                with self._lock:
                    self._reserved -= item[1]
            with self._lock:
                self.filled += kept
                self.skipped += not kept

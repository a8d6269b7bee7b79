"""Opening a store in object storage for reads: small files pulled, frames fetched on demand.

`open_remote` pulls the manifest, step blocks and metadata into a local directory and builds
the `RemoteChunks` fetcher of its frame chunks (checked first against the bucket's listing:
`check_listing`); a `Follower`, called after each newer shard index the fetcher reads, keeps
the local manifest following the frames the bucket's writer gives up (`follow_bucket`).
"""

from __future__ import annotations

import threading
from pathlib import Path

from mmreplay.errors import InvalidStoreError
from mmreplay.storage.bucket import follow_bucket
from mmreplay.storage.codec import max_chunk_bytes
from mmreplay.storage.manifest import MANIFEST, parse_spec
from mmreplay.storage.objects import Objects
from mmreplay.storage.pull import pull, pull_frames
from mmreplay.storage.remote_frames import RemoteChunks
from mmreplay.storage.shards import max_shard_bytes

REMOTE_CACHE_BYTES = 2 << 30  # fetched frame bytes a store read from a bucket keeps


def open_remote(objects: Objects, root: Path, *, budget_bytes: int | None = None,
                fill: bool | None = None) -> RemoteChunks | None:
    """Pull a bucket store's small files into `root` (an empty directory) and return the
    fetcher of its frame chunks; the manifest in `root` follows the bucket's give-ups. A
    format-1 store (a file per chunk, no shard index to read ranges through) comes down
    whole instead, and there is no fetcher (None). `fill`: ``cache_fill`` (`CacheFiller`)."""
    manifest = pull(objects, root, frames=False, check=False)  # the open checks it
    spec = parse_spec(manifest)
    if spec.shard_chunks == 1:
        pull_frames(objects, root, manifest)
        return None
    remote = RemoteChunks(objects, root, spec, after_fetch=Follower(objects, root),
                          budget_bytes=REMOTE_CACHE_BYTES if budget_bytes is None
                          else budget_bytes)
    remote.fill_mode = fill  # started by the store once it is open (`start_filling`)
    try:
        check_listing(remote)
    except BaseException:
        remote.close()
        raise
    return remote


class Follower:
    """`follow_bucket` for the reads of one store, called after each newer shard index.

    It is skipped while the bucket's manifest keeps its etag (a HEAD); it runs one at a
    time (a slower one must not write an older manifest over a newer one); and the callers
    that asked while one ran share the next: a HEAD sent after a caller asked covers it,
    so many shard files read at once (the cache filler) cost a few HEADs, not one each.
    """

    def __init__(self, objects: Objects, root: Path) -> None:
        self.objects, self.root = objects, root
        self._seen: str | None = None  # the manifest etag last followed
        self._lock = threading.Lock()  # one follow at a time
        self._count = threading.Lock()  # guards the two counters
        self.asked = self._covered = 0  # calls so far; calls the last follow covered
        self.heads = 0

    def __call__(self) -> None:
        with self._count:
            self.asked += 1
            ticket = self.asked
        with self._lock:
            if self._covered >= ticket:
                return  # a follow that started after this call asked has ended
            with self._count:
                start = self.asked
            info = self.objects.head(MANIFEST)
            self.heads += 1
            if info is None or info.etag is None or info.etag != self._seen:
                follow_bucket(self.objects, self.root)
                self._seen = None if info is None else info.etag
            self._covered = start


def check_listing(remote: RemoteChunks) -> None:
    """Refuse a bucket whose frame objects are larger than a shard file can be (from the
    listing at the open: no object is read)."""
    limit = max_shard_bytes(remote.spec.shard_chunks, max_chunk_bytes(remote.spec))
    for key, info in sorted(remote.listed.items()):
        if info.size > limit:
            raise InvalidStoreError(f"{remote.objects.url}/{key} is {info.size} bytes, more "
                                    f"than a frame file can be ({limit})")

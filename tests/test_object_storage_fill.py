"""The cache filler of a store read from a bucket (`mmreplay.storage.cache_fill`), and the
concurrent step-block fetch of the open, against a real S3 server (SeaweedFS, `s3_server`).

Each test uses its own prefix in the session's bucket.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from mmreplay import InvalidInputError, InvalidStoreError, ReplayStore
from mmreplay.storage.objects import open_objects
from mmreplay.storage.pull import pull

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import FaultProxy, S3Server  # noqa: E402
from test_object_storage import assert_same, fill, make  # noqa: E402

pytest_plugins = ["s3_server"]  # the fixtures s3, s3_proxy, s3_session


@pytest.fixture
def pushed(s3: S3Server, tmp_path: Path) -> tuple[Path, str]:
    """A prioritized store of 2,500 steps (12 shard files), pushed to a new prefix."""
    url = s3.url(f"fill-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2500)
        store.push(url)
    return tmp_path / "a", url


def frame_bytes(url: str) -> tuple[int, int]:
    """(files, bytes) of the bucket's frame objects."""
    listed = open_objects(url).list("frames/c.")
    return len(listed), sum(info.size for info in listed.values())


def same_frames(remote: ReplayStore, local: ReplayStore) -> None:
    ids = local.valid_ids()
    np.testing.assert_array_equal(remote.valid_ids(), ids)
    got, want = remote.get(ids), local.get(ids)
    np.testing.assert_array_equal(np.asarray(got.obs), np.asarray(want.obs))
    np.testing.assert_array_equal(np.asarray(got.next_obs), np.asarray(want.next_obs))


def test_filler_brings_every_file_down_in_one_request_each(pushed: tuple[Path, str],
                                                           tmp_path: Path) -> None:
    path, url = pushed
    files, size = frame_bytes(url)
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=True) as remote:
        chunks = remote.remote
        assert chunks is not None and chunks.filler is not None
        assert chunks.filler.wait(60)
        assert chunks.filler.error is None and not chunks.filler.stopped_full
        assert (chunks.filler.filled, chunks.fill_requests, chunks.fill_bytes) == (
            files, files, size)
        assert chunks.pending_shards() == [] and chunks.cached_bytes == size
        assert chunks.requests == 0 and chunks.bytes_fetched == 0  # reads fetched nothing
        with ReplayStore.open(path, "r") as local:
            same_frames(remote, local)
            remote.sample(64)
        assert chunks.requests == 0  # every read was warm: no request after the fill


def test_filler_and_reads_together_give_exact_frames(pushed: tuple[Path, str], s3: S3Server,
                                                     s3_proxy: FaultProxy,
                                                     tmp_path: Path) -> None:
    """Reads racing the filler (a 20 ms round trip: both in flight at once) fetch their
    own chunks meanwhile; the batches are those of `sample` on the local store."""
    path, url = pushed
    s3_proxy.latency_s = 0.02
    with ReplayStore.open(path, "r") as local, \
            ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=True,
                             storage_options=s3.options(s3_proxy.endpoint)) as remote:
        with remote.batches(16, prefetch=4) as it:
            got = [next(it) for _ in range(10)]
        want = [local.sample(16) for _ in range(10)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g.ids), np.asarray(w.ids))
            np.testing.assert_array_equal(np.asarray(g.obs), np.asarray(w.obs))
            np.testing.assert_array_equal(np.asarray(g.next_obs), np.asarray(w.next_obs))
        assert remote.remote is not None and remote.remote.filler is not None
        assert remote.remote.filler.wait(60)
        assert remote.remote.requests > 0  # the reads did not wait for the filler
        same_frames(remote, local)


def test_filler_stops_at_the_cache_budget(pushed: tuple[Path, str], tmp_path: Path) -> None:
    path, url = pushed
    files, size = frame_bytes(url)
    budget = size * 2 // 5
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=True,
                          cache_bytes=budget) as remote:
        chunks = remote.remote
        assert chunks is not None and chunks.filler is not None
        assert chunks.filler.wait(60) and chunks.filler.stopped_full
        assert 0 < chunks.filler.filled < files
        assert chunks.cached_bytes <= budget and chunks.fill_bytes <= budget
        with ReplayStore.open(path, "r") as local:
            same_frames(remote, local)  # the rest fetched by the reads (and evicted)
        assert chunks.requests > 0


def test_default_fills_from_batches_only_when_the_store_fits(pushed: tuple[Path, str],
                                                             tmp_path: Path) -> None:
    _, url = pushed
    _, size = frame_bytes(url)
    with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
        assert remote.remote is not None
        remote.sample(8)
        assert remote.remote.filler is None  # plain reads (info, get, sample) never fill
        with remote.batches(8) as it:
            next(it)
        assert remote.remote.filler is not None and remote.remote.filler.wait(60)
        assert remote.remote.pending_shards() == []
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_bytes=size // 2) as small:
        with small.batches(8) as it:
            next(it)
        assert small.remote is not None and small.remote.filler is None  # would not fit
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=False) as never:
        with never.batches(8) as it:
            next(it)
        assert never.remote is not None and never.remote.filler is None


def test_close_stops_the_filler(pushed: tuple[Path, str], s3: S3Server,
                                s3_proxy: FaultProxy, tmp_path: Path) -> None:
    _, url = pushed
    files, _ = frame_bytes(url)
    s3_proxy.latency_s = 0.1  # a file every ~100 ms per thread: closed long before the end
    remote = ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=True,
                              storage_options=s3.options(s3_proxy.endpoint))
    assert remote.remote is not None and remote.remote.filler is not None
    filler = remote.remote.filler
    remote.close()
    assert filler.done and filler.filled < files
    assert not list(tmp_path.glob("mmreplay-*"))  # the cache directory went with it


def test_filler_keeps_no_damaged_file(pushed: tuple[Path, str], tmp_path: Path) -> None:
    """Frame files damaged in the bucket (a chunk's bytes; an index) are not kept by the
    filler, which goes on with the others; a read of their frames then fails as without
    the filler."""
    path, url = pushed
    objects = open_objects(url)
    files, _ = frame_bytes(url)
    key, other = sorted(objects.list("frames/c."))[:2]
    data = bytearray(objects.get(key))
    data[100] ^= 0xFF  # inside chunk 0: its crc32c fails
    objects.put(key, bytes(data))
    bad_index = bytearray(objects.get(other))
    bad_index[-10] ^= 0xFF  # the index fails its checksum: skipped, the filler goes on
    objects.put(other, bytes(bad_index))
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill=True) as remote:
        chunks = remote.remote
        assert chunks is not None and chunks.filler is not None and chunks.filler.wait(60)
        assert chunks.filler.error is None
        assert (chunks.filler.skipped, chunks.filler.filled) == (2, files - 2)
        assert chunks.pending_shards() == [((0, 0), len(data)), ((0, 1), len(bad_index))]
        with ReplayStore.open(path, "r") as local:
            first = local.valid_ids()[:8]
            with pytest.raises(InvalidStoreError, match="crc32c|damaged"):
                remote.get(first)


def test_cache_fill_is_checked(pushed: tuple[Path, str], tmp_path: Path) -> None:
    path, url = pushed
    with pytest.raises(InvalidInputError, match="cache_fill is True, False or None"):
        ReplayStore.open(url, "r", cache_dir=tmp_path, cache_fill="yes")
    with pytest.raises(InvalidInputError, match="read from a bucket"):
        ReplayStore.open(path, "r", cache_fill=True)


def test_open_fetches_many_step_blocks_concurrently_into_the_same_store(
        s3: S3Server, s3_proxy: FaultProxy, tmp_path: Path) -> None:
    """A store of ~100 step blocks (more than the fetch threads), pulled through a 20 ms
    round trip, equals the local store, file for file."""
    url = s3.url(f"blocks-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a", block_slots=30) as store:
        fill(store, 2900)
        store.push(url)
    s3_proxy.latency_s = 0.02
    pull(open_objects(url, s3.options(s3_proxy.endpoint)), tmp_path / "b")
    blocks = sorted(p.name for p in (tmp_path / "a" / "steps").iterdir())
    assert len(blocks) > 64  # twice the fetch threads
    assert blocks == sorted(p.name for p in (tmp_path / "b" / "steps").iterdir())
    for name in blocks:
        assert (tmp_path / "a" / "steps" / name).read_bytes() == \
            (tmp_path / "b" / "steps" / name).read_bytes()
    with ReplayStore.open(tmp_path / "a", "r") as a, ReplayStore.open(tmp_path / "b", "r") as b:
        assert_same(a, b)


def test_follower_shares_one_head_among_the_callers_that_waited(tmp_path: Path) -> None:
    """Callers that ask while a follow runs share the next one: 1 + 1 HEADs for 6 calls."""
    import threading

    from mmreplay.storage.objects import LocalObjects
    from mmreplay.storage.remote_open import Follower

    release, entered = threading.Event(), threading.Event()

    class SlowHead(LocalObjects):
        def head(self, key: str):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(10)
            return super().head(key)

    with make(tmp_path / "a") as store:
        fill(store, 300)
        store.push(f"file://{tmp_path}/bucket")
    objects = SlowHead(tmp_path / "bucket")
    pull(objects, tmp_path / "b")
    follow = Follower(objects, tmp_path / "b")
    first = threading.Thread(target=follow)
    first.start()
    assert entered.wait(10)  # the first follow is in its HEAD
    rest = [threading.Thread(target=follow) for _ in range(5)]
    for thread in rest:
        thread.start()
    while follow.asked < 6:  # every caller asked before the HEAD returns
        time.sleep(0.001)
    release.set()
    for thread in [first, *rest]:
        thread.join(10)
    assert follow.heads == 2

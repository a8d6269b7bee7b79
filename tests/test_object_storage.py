"""Stores in object storage: push, pull, mirror, read from a bucket, faults, hostile buckets.

Most tests run against a real S3 server (SeaweedFS, `tests/s3_server.py`); the `file://`
tests need nothing. Each test uses its own prefix in the session's bucket.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from mmreplay import InvalidInputError, InvalidStoreError, ReplayStore, StoreLockedError
from mmreplay.errors import ObjectStoreError
from mmreplay.storage.lease import Lease
from mmreplay.storage.objects import (
    ObjectChangedError,
    ObjectMissingError,
    Objects,
    open_objects,
)
from mmreplay.storage.pull import pull
from mmreplay.tools.cli import main as cli

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import FaultProxy, S3Server  # noqa: E402

pytest_plugins = ["s3_server"]  # the fixtures s3, s3_proxy, s3_session

OBS = (24, 24)


def fill(store: ReplayStore, steps: int, seed: int = 0) -> None:
    """Episodes of random length with noisy frames, so chunks differ and compress."""
    rng = np.random.default_rng(seed)
    if not store._ring.running[0]:  # noqa: SLF001 -- test helper
        store.reset(rng.integers(0, 255, OBS, dtype=np.uint8))
    for i in range(steps):
        done = bool(rng.random() < 0.02)
        store.add(int(rng.integers(4)), float(rng.normal()), rng.integers(0, 8, OBS, np.uint8),
                  done, False)
        if done:
            store.reset(rng.integers(0, 255, OBS, dtype=np.uint8))
        if i % 97 == 0 and store.spec.sampler != "uniform":
            ids = store.valid_ids()[-8:]
            store.update_priorities(ids, rng.random(ids.size) + 0.1)



def put_tree(objects: Objects, root: Path) -> None:
    """Upload every plain file under `root` (a store directory, hostile or not) as it is,
    leaving out the local lock files a bucket never holds."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name not in ("lock", "readers"):
            objects.put(path.relative_to(root).as_posix(), path.read_bytes())

def make(path: Path, **kw: object) -> ReplayStore:
    return ReplayStore.create(path, capacity=3000, obs_shape=OBS, frame_stack=4, n_step=3,
                              seed=7, sampler="prioritized", chunk_frames=8, shard_chunks=16,
                              **kw)


def assert_same(a: ReplayStore, b: ReplayStore) -> None:
    """`get` of every id, priorities, RNG state and counters are equal."""
    ids = a.valid_ids()
    np.testing.assert_array_equal(ids, b.valid_ids())
    ba, bb = a.get(ids), b.get(ids)
    for field in ("obs", "next_obs", "action", "reward", "discount", "terminated"):
        np.testing.assert_array_equal(np.asarray(getattr(ba, field)),
                                      np.asarray(getattr(bb, field)), err_msg=field)
    assert a.counts == b.counts
    assert a._batches.rng.bit_generator.state == b._batches.rng.bit_generator.state  # noqa: SLF001
    np.testing.assert_array_equal(a._sampler.priorities(), b._sampler.priorities())  # noqa: SLF001


def continue_run(store: ReplayStore) -> np.ndarray:
    """What a resumed run does next: more steps, then a prioritized sample."""
    fill(store, 300, seed=99)
    return np.asarray(store.sample(64).ids)


# -- file:// needs no server ------------------------------------------------------------
def test_file_url_round_trip_and_no_obstore_import(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    with make(tmp_path / "a") as store:
        fill(store, 1200)
        store.push(url)
    pull(open_objects(url), tmp_path / "b")
    with ReplayStore.open(tmp_path / "a", "r") as a, ReplayStore.open(tmp_path / "b", "r") as b:
        assert_same(a, b)
    code = ("import sys, mmreplay; from mmreplay import ReplayStore; "
            f"s = ReplayStore.open({str(tmp_path / 'b')!r}, 'r'); len(s); "
            "print('obstore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_local_objects_conditional_operations(tmp_path: Path) -> None:
    objects = open_objects(f"file://{tmp_path}/b")
    assert objects.put_if_absent("a/x", b"one")
    assert not objects.put_if_absent("a/x", b"two")
    info = objects.head("a/x")
    assert info is not None and info.size == 3
    assert not objects.put_if_match("a/x", b"three", "stale-etag")
    assert objects.put_if_match("a/x", b"four", info.etag or "")
    tail, now = objects.get_suffix("a/x", 2)
    assert tail == b"ur" and now.size == 4
    assert objects.get_range_if("a/x", 1, 3, now.etag) == b"ou"
    objects.put("a/x", b"fives")
    with pytest.raises(ObjectChangedError):
        objects.get_range_if("a/x", 1, 3, now.etag)
    for bad in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(InvalidInputError, match="invalid object key"):
            objects.get(bad)
    with pytest.raises(ObjectMissingError):
        objects.get("nothing")
    with pytest.raises(InvalidInputError, match="s3:// or file://"):
        open_objects("gs://bucket/x")


def test_lease_refuses_a_second_writer_until_it_expires(tmp_path: Path) -> None:
    objects = open_objects(f"file://{tmp_path}/b")
    first, second = Lease(objects, ttl_s=0.3), Lease(objects)
    first.acquire()
    with pytest.raises(StoreLockedError, match="another writer"):
        second.acquire()
    time.sleep(0.4)  # the first writer stopped renewing: its lease expired
    second.acquire()
    with pytest.raises(StoreLockedError):
        first.acquire()  # and the first learns it lost the prefix
    second.release()
    assert objects.head("lease.json") is None


# -- push / pull / resume --------------------------------------------------------------
def test_push_pull_resume_equals_local_resume(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"resume-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2000)
        report = store.push(url)
        assert report.uploaded_objects > 0
    assert cli(["pull", url, str(tmp_path / "b")]) == 0
    with ReplayStore.open(tmp_path / "a", "r+") as local, \
            ReplayStore.open(tmp_path / "b", "r+") as remote:
        assert_same(local, remote)
        np.testing.assert_array_equal(continue_run(local), continue_run(remote))
        assert_same(local, remote)


def test_incremental_push_uploads_new_data_only(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"incr-{uuid.uuid4().hex[:8]}")
    with ReplayStore.create(tmp_path / "a", capacity=20000, obs_shape=OBS, seed=1,
                            chunk_frames=8, shard_chunks=16) as store:
        fill(store, 12000)
        first = store.push(url)
        again = store.push(url)
        fill(store, 500, seed=3)
        new = store.push(url)
    assert again.uploaded_bytes < 20_000  # the tail and a step block at most, no frames
    # 500 new steps touch at most 5 shard files of 128 frames (plus step files); the store
    # holds ~94 shard files
    assert new.uploaded_bytes < first.uploaded_bytes * 0.1, (new, first)
    assert new.uploaded_objects < 16


def test_second_writer_is_refused_then_can_take_over(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"lease-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a", mirror=url) as first:
        fill(first, 100)
        first.flush(wait_mirror=True)
        with make(tmp_path / "b") as second:
            with pytest.raises(StoreLockedError, match="another writer"):
                second.push(url)
            assert cli(["push", str(tmp_path / "b"), url]) == 2
    # the first writer released its lease at close: a push (of a newer store) now works
    with ReplayStore.open(tmp_path / "a", "r+") as again:
        fill(again, 10)
        again.push(url)


# -- mirror -----------------------------------------------------------------------------
def test_mirror_pushes_every_flush_in_the_background(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"mirror-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a", mirror=url) as store:
        for i in range(5):
            fill(store, 300, seed=i)
            store.flush()
            assert store.mirror is not None and store.mirror.lag <= store.mirror.max_lag
        store.flush(wait_mirror=True)
        assert store.mirror.pushed == store.generation
    pull(open_objects(url), tmp_path / "b")
    with ReplayStore.open(tmp_path / "a", "r") as a, ReplayStore.open(tmp_path / "b", "r") as b:
        assert_same(a, b)


def test_mirror_keeps_the_newest_reports_and_counts_every_push(
        s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mmreplay.mirror.KEEP_REPORTS", 2)  # a long run, in four pushes
    url = s3.url(f"mirror-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a", mirror=url) as store:
        assert store.mirror is not None
        for i in range(4):
            fill(store, 50, seed=i)
            store.flush(wait_mirror=True)
        info = store.mirror.info()
        assert info.pushes == store.mirror.pushes >= 4
        assert [r.generation for r in store.mirror.reports] == [store.generation - 1,
                                                                store.generation]


def test_mirror_that_cannot_reach_the_bucket_raises_when_waited_on(
        s3: S3Server, tmp_path: Path) -> None:
    proxy = FaultProxy(s3.ports[3])
    url = s3.url(f"gone-{uuid.uuid4().hex[:8]}")
    store = make(tmp_path / "a", mirror=url, storage_options=s3.options(proxy.endpoint))
    store.flush(wait_mirror=True)
    proxy.close()  # the network is gone
    fill(store, 200)
    with pytest.raises(ObjectStoreError, match="failed pushes"):
        store.flush(wait_mirror=True)
    with pytest.raises(ObjectStoreError):
        store.close()  # the last generation never reached the bucket: said, not hidden
    assert store._closed  # noqa: SLF001 -- and the store is closed all the same


# -- reading from the bucket ----------------------------------------------------------------
def test_read_from_bucket_fetches_only_needed_chunks(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"read-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2500)
        store.push(url)
    with ReplayStore.open(tmp_path / "a", "r") as local, \
            ReplayStore.open(url, "r", cache_dir=tmp_path, cache_bytes=1 << 20) as remote:
        ids = local.valid_ids()
        got = remote.get(ids[::50])
        want = local.get(ids[::50])
        np.testing.assert_array_equal(np.asarray(got.obs), np.asarray(want.obs))
        frame_bytes = sum(p.stat().st_size for p in (tmp_path / "a" / "frames").glob("c.*"))
        assert remote.remote is not None
        assert 0 < remote.remote.bytes_fetched < frame_bytes / 2  # not whole shards
        batch = next(iter(remote.batches(16, prefetch=2)))
        assert batch.obs.shape[0] == 16
    assert cli(["info", url]) == 0
    assert cli(["verify", url]) == 0
    # the bucket is a plain zarr v3 group too
    import zarr
    from obstore.store import S3Store

    prefix = url.split("/", 3)[3]
    bucket = zarr.storage.ObjectStore(S3Store(s3.bucket, prefix=prefix, config=s3.options()),
                                      read_only=True)
    local = zarr.open_group(str(tmp_path / "a"), mode="r")["frames"]
    np.testing.assert_array_equal(zarr.open_group(bucket, mode="r")["frames"][0, :200],
                                  local[0, :200])


def test_cache_is_bounded(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(f"bounded-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2500)
        store.push(url)
    with ReplayStore.open(url, "r", cache_dir=tmp_path, cache_bytes=64 << 10) as remote:
        assert remote.remote is not None
        for _ in range(20):
            remote.sample(32)
        assert remote.remote.cached_bytes <= (64 << 10) + 40_000  # the last read's shards


def test_connection_cut_mid_read_retries_then_clear_error(s3: S3Server, s3_proxy: FaultProxy,
                                                          tmp_path: Path) -> None:
    url = s3.url(f"cut-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2500)
        store.push(url)
    opts = s3.options(s3_proxy.endpoint)
    with ReplayStore.open(tmp_path / "a", "r") as local, \
            ReplayStore.open(url, "r", cache_dir=tmp_path, storage_options=opts) as remote:
        ids = local.valid_ids()
        for k in range(6):  # a cut in the middle of each read: retried, frames exact
            s3_proxy.cut_after_down = s3_proxy.bytes_down + 3000
            part = ids[k::97]
            np.testing.assert_array_equal(np.asarray(remote.get(part).obs),
                                          np.asarray(local.get(part).obs))
    s3_proxy.cut_after_down = None
    dead = FaultProxy(s3.ports[3])
    dead_opts = s3.options(dead.endpoint)
    remote = ReplayStore.open(url, "r", cache_dir=tmp_path, storage_options=dead_opts)
    dead.close()  # the server is gone for good: a clear error, no wrong frame
    with pytest.raises(ObjectStoreError, match="failed"):
        remote.sample(64)
    remote.close()


# -- faults: the server dies mid-push -----------------------------------------------------
def test_server_killed_mid_push_keeps_last_generation(s3: S3Server, tmp_path: Path) -> None:
    """After a SIGKILL mid-push and a restart, the bucket holds a generation >= the last
    one whose push returned (its manifest PUT was acknowledged): none is lost. The ring
    wraps between pushes, so `add` commits give-up generations that no push uploads."""
    url = s3.url(f"kill-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2800)
        acked = store.push(url).generation
        for round_ in range(2):
            fill(store, 600, seed=10 + round_)
            store.flush()
            assert store.generation > acked + 1, "no give-up generation between the pushes"
            assert _bucket_generation(url) == acked
            slow = FaultProxy(s3.ports[3], bandwidth=100_000)  # ~1 s per push
            errors: list[BaseException] = []
            pusher = threading.Thread(target=_push, args=(store, url, s3.options(
                slow.endpoint), errors))
            pusher.start()
            threading.Event().wait(0.3)
            s3.kill()
            pusher.join(120)
            slow.close()
            assert errors, "the push finished before the server was killed"
            s3.start()
            after = _bucket_generation(url)
            assert after >= acked, f"generation {acked} was pushed, the bucket holds {after}"
            assert after in (acked, store.generation)
            with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
                assert remote.generation == after
                with ReplayStore.open(tmp_path / "a", "r") as local:  # 0 wrong frames
                    ids = np.intersect1d(remote.valid_ids(), local.valid_ids())[::7]
                    assert len(ids) > 100
                    np.testing.assert_array_equal(np.asarray(remote.get(ids).obs),
                                                  np.asarray(local.get(ids).obs))
            # the dead push's lease is still in the bucket
            acked = store.push(url, take_over=True).generation
            assert acked == store.generation == _bucket_generation(url)


def _push(store: ReplayStore, url: str, options: dict[str, str],
          errors: list[BaseException]) -> None:
    try:
        store.push(url, storage_options=options)
    except Exception as exc:  # noqa: BLE001 -- the server was killed under it
        errors.append(exc)


def _bucket_generation(url: str) -> int:
    return int(json.loads(open_objects(url).get("manifest.json"))["generation"])


# -- hostile buckets ---------------------------------------------------------------------
@pytest.fixture
def pushed(s3: S3Server, tmp_path: Path) -> str:
    url = s3.url(f"hostile-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "src") as store:
        fill(store, 1500)
        store.push(url)
    return url


def test_hostile_truncated_frame_object(pushed: str, tmp_path: Path) -> None:
    objects = open_objects(pushed)
    key = sorted(k for k in objects.list("frames/c."))[0]
    objects.put(key, objects.get(key)[:-100])
    with pytest.raises(InvalidStoreError, match="index"):
        pull(objects, tmp_path / "p")
    assert cli(["pull", pushed, str(tmp_path / "q")]) == 2
    assert not (tmp_path / "q").exists()
    with ReplayStore.open(pushed, "r", cache_dir=tmp_path) as remote, \
            pytest.raises(InvalidStoreError, match="index"):  # read on the shard's first use
        remote.get(remote.valid_ids())


def test_hostile_manifest_names_missing_object(pushed: str, tmp_path: Path) -> None:
    objects = open_objects(pushed)
    manifest = json.loads(objects.get("manifest.json"))
    objects.delete(manifest["tail"])
    with pytest.raises(InvalidStoreError, match="missing"):
        ReplayStore.open(pushed, "r", cache_dir=tmp_path)
    assert cli(["info", pushed]) == 2


def test_hostile_swapped_step_block(pushed: str, tmp_path: Path) -> None:
    objects = open_objects(pushed)
    manifest = json.loads(objects.get("manifest.json"))
    names = [n for n in manifest["files"] if n.startswith("steps/")]
    objects.put(names[0], objects.get(manifest["tail"]))
    with pytest.raises(InvalidStoreError, match="crc32"):
        ReplayStore.open(pushed, "r", cache_dir=tmp_path)
    assert cli(["sample", pushed]) == 2


def test_hostile_prefix_that_is_not_a_store(s3: S3Server, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url(f"junk-{uuid.uuid4().hex[:8]}")
    open_objects(url).put("notes.txt", b"hello")
    assert cli(["info", url]) == 2
    assert "not an mmreplay store" in capsys.readouterr().err
    with make(tmp_path / "a") as store, pytest.raises(InvalidStoreError, match="not an mmreplay"):
        store.push(url)


def test_credentials_never_in_errors_or_bucket(s3: S3Server, s3_proxy: FaultProxy,
                                               tmp_path: Path) -> None:
    secret = "TOPSECRET-" + uuid.uuid4().hex
    opts = {**s3.options(s3_proxy.endpoint), "secret_access_key": secret}
    url = s3.url(f"cred-{uuid.uuid4().hex[:8]}")
    s3_proxy.close()  # every request fails
    with make(tmp_path / "a") as store:
        with pytest.raises(ObjectStoreError) as info:
            store.push(url, storage_options=opts)
        assert secret not in str(info.value) and secret not in repr(info.value)
        assert secret not in repr(open_objects(url, opts))
        ok = s3.options()
        store.push(url, storage_options=ok)
    for key in open_objects(url).list():
        assert s3.options()["secret_access_key"].encode() not in open_objects(url).get(key)


def test_hostile_corpus_uploaded_to_a_bucket_is_refused(tmp_path: Path) -> None:
    """Every tenth case of the local hostile corpus (`hostile_stores`), its regular files
    uploaded as they are (a bucket holds no symlink or FIFO), is refused by an open of the
    bucket with an `InvalidStoreError` (all 709 such cases were, when run whole)."""
    from hostile_stores import build_store, cases, make_case

    bases = {kind: tmp_path / kind for kind in ("uniform", "prio", "zstd_dict")}
    for kind, path in bases.items():
        build_store(path, kind)
    chosen = [c for c in cases() if not c.huge and not c.name.startswith(("link-", "fifo-"))]
    for i, case in enumerate(chosen[::10]):
        env = make_case(case, bases, tmp_path / f"case{i}")
        url = f"file://{tmp_path}/bucket{i}"
        put_tree(open_objects(url), env.root)
        with pytest.raises(InvalidStoreError):
            ReplayStore.open(url, "r", cache_dir=tmp_path).close()
            pytest.fail(f"case {case.name} opened from the bucket")

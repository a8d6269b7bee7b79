"""Reading a store from a bucket: lazy shard indexes, the batch pipeline, connection cuts,
plain zarr, and the hostile corpus against a real S3 server (SeaweedFS, `s3_server`).

Each test uses its own prefix in the session's bucket.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from mmreplay import InvalidStoreError, ReplayStore
from mmreplay.errors import ObjectStoreError
from mmreplay.storage.objects import open_objects
from mmreplay.tools.cli import main as cli

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import FaultProxy, S3Server  # noqa: E402
from test_object_storage import fill, make, put_tree  # noqa: E402

pytest_plugins = ["s3_server"]  # the fixtures s3, s3_proxy, s3_session


@pytest.fixture
def pushed_store(s3: S3Server, tmp_path: Path) -> tuple[Path, str]:
    """A prioritized store of 2,500 steps (several shard files), pushed to a new prefix."""
    url = s3.url(f"read-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a") as store:
        fill(store, 2500)
        store.push(url)
    return tmp_path / "a", url


def test_open_reads_no_shard_index_then_only_the_touched_ones(
        pushed_store: tuple[Path, str], tmp_path: Path) -> None:
    path, url = pushed_store
    shards = len(open_objects(url).list("frames/c."))
    assert shards >= 4
    with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
        assert remote.remote is not None
        assert remote.remote.requests == 0 and remote.remote.bytes_fetched == 0
        with ReplayStore.open(path, "r") as local:
            ids = local.valid_ids()[:40]  # the first frames: one shard file
            np.testing.assert_array_equal(np.asarray(remote.get(ids).obs),
                                          np.asarray(local.get(ids).obs))
        held = sorted((tmp_path).glob("mmreplay-*/frames/c.*"))
        assert 1 <= len(held) < shards  # indexes read: only the shards touched


def test_batches_pipeline_draws_what_sample_draws(pushed_store: tuple[Path, str],
                                                  s3: S3Server, s3_proxy: FaultProxy,
                                                  tmp_path: Path) -> None:
    """Several batches in flight (a 20 ms round trip), yet the same draws, in the same
    order, as `sample` on the same generation, with the same frames."""
    path, url = pushed_store
    s3_proxy.latency_s = 0.02
    opts = s3.options(s3_proxy.endpoint)
    with ReplayStore.open(path, "r") as local, \
            ReplayStore.open(url, "r", cache_dir=tmp_path, storage_options=opts) as remote:
        with remote.batches(16, prefetch=6, beta=0.5) as it:
            got = [next(it) for _ in range(12)]
        want = [local.sample(16, beta=0.5) for _ in range(12)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g.ids), np.asarray(w.ids))
            np.testing.assert_array_equal(np.asarray(g.weights), np.asarray(w.weights))
            np.testing.assert_array_equal(np.asarray(g.obs), np.asarray(w.obs))
            np.testing.assert_array_equal(np.asarray(g.next_obs), np.asarray(w.next_obs))


def test_batches_pipeline_hands_a_lost_server_to_the_learner(
        pushed_store: tuple[Path, str], s3: S3Server, tmp_path: Path) -> None:
    _, url = pushed_store
    proxy = FaultProxy(s3.ports[3])
    remote = ReplayStore.open(url, "r", cache_dir=tmp_path,
                              storage_options=s3.options(proxy.endpoint))
    proxy.close()  # every request fails from now on
    it = remote.batches(8, prefetch=4)
    with pytest.raises(ObjectStoreError, match="failed"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    remote.close()


def test_twenty_connection_cuts_mid_read_give_no_wrong_frame(
        pushed_store: tuple[Path, str], s3: S3Server, s3_proxy: FaultProxy,
        tmp_path: Path) -> None:
    path, url = pushed_store
    opts = s3.options(s3_proxy.endpoint)
    cuts = 0
    with ReplayStore.open(path, "r") as local, \
            ReplayStore.open(url, "r", cache_dir=tmp_path, storage_options=opts,
                             cache_bytes=1) as remote:  # every read fetches again
        ids = local.valid_ids()
        for k in range(20):  # a cut in the middle of each read: retried, frames exact
            s3_proxy.cut_after_down = s3_proxy.bytes_down + 1500
            part = ids[k::53]
            got, want = remote.get(part), local.get(part)
            cuts += s3_proxy.cut_after_down is None
            np.testing.assert_array_equal(np.asarray(got.obs), np.asarray(want.obs))
            np.testing.assert_array_equal(np.asarray(got.next_obs), np.asarray(want.next_obs))
    assert cuts == 20  # each read was cut


def test_bucket_store_is_a_plain_zarr_array(pushed_store: tuple[Path, str], s3: S3Server) -> None:
    """`zarr.open_array` over `zarr.storage.ObjectStore` (obstore) reads every frame the
    store kept, as it reads the local directory."""
    import zarr
    from obstore.store import S3Store

    path, url = pushed_store
    prefix = url.split("/", 3)[3]
    bucket = zarr.storage.ObjectStore(S3Store(s3.bucket, prefix=prefix, config=s3.options()),
                                      read_only=True)
    remote = zarr.open_array(bucket, path="frames", mode="r")
    local = zarr.open_array(str(path), path="frames", mode="r")
    assert remote.shape == local.shape and remote.dtype == local.dtype
    with ReplayStore.open(path, "r") as store:
        written = int(store.counts.frames_written)
    np.testing.assert_array_equal(remote[0, :written], local[0, :written])
    assert remote[0, :written].any()


def test_truncated_frame_object_is_refused_on_first_read(pushed_store: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    """Indexes are read lazily: the open succeeds, the first read of the damaged shard is an
    `InvalidStoreError`, and `mmreplay verify URL` exits with 2."""
    _, url = pushed_store
    objects = open_objects(url)
    key = "frames/c.0.0.0.0"
    objects.put(key, objects.get(key)[:-100])
    with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
        with pytest.raises(InvalidStoreError, match="index"):
            remote.get(remote.valid_ids()[:8])
    assert cli(["verify", url]) == 2


def test_missing_frame_object_is_refused_on_first_read(pushed_store: tuple[Path, str],
                                                       tmp_path: Path) -> None:
    _, url = pushed_store
    open_objects(url).delete("frames/c.0.0.0.0")
    with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
        with pytest.raises(InvalidStoreError, match="absent"):
            remote.get(remote.valid_ids()[:8])


def test_hostile_corpus_in_an_s3_bucket(s3: S3Server, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every 25th case of the local hostile corpus (`hostile_stores`), its regular files
    uploaded as they are to a prefix of the S3 server: the open is refused with an
    `InvalidStoreError`, and `mmreplay info URL` exits with 2 and one clear line."""
    from hostile_stores import build_store, cases, make_case

    bases = {kind: tmp_path / kind for kind in ("uniform", "prio", "zstd_dict")}
    for kind, path in bases.items():
        build_store(path, kind)
    chosen = [c for c in cases() if not c.huge and not c.name.startswith(("link-", "fifo-"))]
    for i, case in enumerate(chosen[::25]):
        env = make_case(case, bases, tmp_path / f"case{i}")
        url = s3.url(f"hostile-corpus-{uuid.uuid4().hex[:8]}")
        put_tree(open_objects(url), env.root)
        with pytest.raises(InvalidStoreError):
            ReplayStore.open(url, "r", cache_dir=tmp_path).close()
            pytest.fail(f"case {case.name} opened from the bucket")
        capsys.readouterr()
        assert cli(["info", url]) == 2, case.name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mmreplay: "), (case.name, err)
        assert "Traceback" not in err[0]

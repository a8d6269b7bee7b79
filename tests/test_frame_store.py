"""frame_store: chunk layout, zarr compatibility, RAM tail, checksums, cache."""

from __future__ import annotations

import struct
from functools import partial

import google_crc32c
import numpy as np
import pytest
import zarr
from conftest import ShadowWriter, new_frame_store

from mmreplay.errors import InvalidStoreError
from mmreplay.spec import make_spec
from mmreplay.storage.chunk_table import ChunkTable
from mmreplay.storage.frame_reader import LZ4_SHARDS_ONE_PASS
from mmreplay.storage.frame_store import FrameStore, create_frames_array

make = partial(new_frame_store, slots=7, chunk=4, envs=2, shard=1, obs_shape=(3, 2))
"""(spec, FrameStore): 7 slots per env, 2 envs, 4-frame chunks, one chunk per shard."""


def fill(store, env, values):
    for v in values:
        slot = int(store.next_slot[env])
        store.append(np.array([env]), np.array([slot]), np.full((1, 3, 2), v, np.uint8))
    store.drain()  # chunk writes happen on a background thread


@pytest.mark.parametrize("codec", ["lz4", "zstd", "zstd-dict"])
@pytest.mark.parametrize(("slots", "chunk"), [(7, 4), (8, 4), (5, 1), (6, 6)])
def test_written_chunks_read_back_with_plain_zarr(tmp_path, slots, chunk, codec):
    spec, store = make(tmp_path, slots=slots, chunk=chunk, codec=codec)
    fill(store, 1, range(10, 10 + slots))  # one full lap: every chunk written
    arr = zarr.open_group(str(tmp_path), mode="r")["frames"]
    assert arr[1, :, 0, 0].tolist() == list(range(10, 10 + slots))
    assert arr[0].max() == 0


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_reads_frames_written_by_zarr(tmp_path, codec):
    spec, _ = make(tmp_path, codec=codec)
    arr = zarr.open_group(str(tmp_path), mode="r+")["frames"]
    arr[0, 4:7] = np.arange(3, dtype=np.uint8)[:, None, None] + 40
    fresh = FrameStore(tmp_path, spec, writable=False)
    fresh.load_tail(np.zeros_like(fresh.tail), np.zeros(2, np.int64))
    assert fresh.read(np.array([4, 5, 6]))[:, 0, 0].tolist() == [40, 41, 42]


def test_tail_comes_from_ram_and_minus_one_is_zeros(tmp_path):
    _, store = make(tmp_path)
    fill(store, 0, [1, 2, 3, 4, 5, 6])  # chunk 0 on disk, slots 4..5 in the tail
    assert not store.chunk_path(0, 1).exists()
    got = store.read(np.array([[0, 3, 4, 5, -1]]))
    assert got.shape == (1, 5, 3, 2)
    assert got[0, :, 0, 0].tolist() == [1, 4, 5, 6, 0]


def test_hook_runs_before_each_chunk_write(tmp_path):
    calls = []
    _, store = make(tmp_path, hook=lambda env, first, last: calls.append((env, first, last)))
    fill(store, 0, range(7))
    fill(store, 1, range(4))
    assert calls == [(0, 0, 0), (0, 1, 1), (1, 0, 0)]


def test_corrupted_or_missing_chunk_is_detected(tmp_path):
    spec, store = make(tmp_path)
    fill(store, 0, range(8))
    path = store.chunk_path(0, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = FrameStore(tmp_path, spec, writable=False)
    with pytest.raises(InvalidStoreError, match="checksum"):
        fresh.read(np.array([0]))
    path.unlink()
    with pytest.raises(InvalidStoreError, match="missing"):
        fresh.read(np.array([1]))


@pytest.mark.parametrize("field, value", [(4, 6 * 4 - 1), (4, 6 * 4 + 1), (12, 5)])
def test_blosc_header_sizes_are_checked_before_decoding(tmp_path, field, value):
    """A chunk whose crc is right but whose blosc header lies about its sizes is refused
    (blosc itself would trust them and write past or short of the frames)."""
    spec, store = make(tmp_path)
    fill(store, 0, range(4))
    path = store.chunk_path(0, 0)
    payload = bytearray(path.read_bytes()[:-4])
    struct.pack_into("<I", payload, field, value)
    path.write_bytes(bytes(payload) + struct.pack("<I", google_crc32c.value(bytes(payload))))
    fresh = FrameStore(tmp_path, spec, writable=False)
    with pytest.raises(InvalidStoreError, match="blosc header"):
        fresh.read(np.array([0]))


def test_no_temp_files_left_after_writes(tmp_path):
    _, store = make(tmp_path)
    fill(store, 0, range(20))
    assert list((tmp_path / "tmp").iterdir()) == []


def test_cache_respects_its_byte_budget():
    cache = ChunkTable(num_keys=10, chunk_bytes=100, chunk_frames=4, budget_bytes=250)
    assert cache.num_rows == 2 and not cache.whole
    for key in range(10):
        cache.put(key, np.full(100, key, np.uint8))
    assert cache.held == 2 and (cache.row_of >= 0).sum() == 2
    assert cache.row_of[9] >= 0 and cache.row_of[0] == -1
    assert (cache.rows[cache.row_of[9]] == 9).all()
    whole = ChunkTable(num_keys=10, chunk_bytes=100, chunk_frames=4, budget_bytes=1000)
    for key in (3, 7, 3):
        whole.put(key, np.full(100, key, np.uint8))
    assert whole.whole and whole.held == 2 and whole.row_of[7] == 7


def test_failed_chunk_write_is_reported_and_retried(tmp_path, monkeypatch):
    """A chunk whose write fails stays readable from RAM; drain retries it, and a chunk
    whose write failed twice is retried again, never lost."""
    spec, store = make(tmp_path, slots=40, chunk=4, envs=1)
    import mmreplay.storage.chunk_writer as fs
    real, fail = fs.write_atomic, [True]

    def flaky(*args, **kwargs):
        if fail[0]:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "write_atomic", flaky)
    for v in range(3):
        store.append(np.array([0]), np.array([v]), np.full((1, 3, 2), v, np.uint8))
    with pytest.raises(OSError, match="No space"):  # the 4th frame completes chunk 0
        store.append(np.array([0]), np.array([3]), np.full((1, 3, 2), 3, np.uint8))
    for v in range(4, 8):  # chunk 1 fails too; frames keep arriving
        try:
            store.append(np.array([0]), np.array([v]), np.full((1, 3, 2), v, np.uint8))
        except OSError:
            assert v == 7
    assert store.read(np.arange(8))[:, 0, 0].tolist() == list(range(8))  # still in RAM
    with pytest.raises(OSError, match="No space"):
        store.drain()  # retried, failed again
    assert not store.chunk_path(0, 0).exists()
    fail[0] = False
    store.drain()  # retried
    assert store.chunk_path(0, 0).exists() and store.chunk_path(0, 1).exists()
    assert not store.finished.writer.failed
    fresh = FrameStore(tmp_path, spec, writable=False)
    assert fresh.read(np.arange(8))[:, 0, 0].tolist() == list(range(8))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compiled_decoding_matches_numcodecs(tmp_path, codec):
    """The compiled decode (c-blosc and zstd called from numba) and numcodecs' own decoders
    agree, and a stream that lies about nothing but its compressed bytes is refused (or, where
    the codec cannot tell, decodes to other frames without crashing)."""
    spec = make_spec(capacity=8, obs_shape=(3, 2), chunk_frames=4, codec=codec)
    create_frames_array(tmp_path, spec)
    store = FrameStore(tmp_path, spec, writable=False)
    frames = np.random.default_rng(0).integers(0, 4, (4, 3, 2)).astype(np.uint8)
    data = store._codec.encode(frames)
    reference = np.frombuffer(store._codec._inner.decode(data[:-4]), np.uint8)
    assert np.array_equal(store._codec.decode(data, "x").reshape(-1), reference)
    assert np.array_equal(reference.reshape(frames.shape), frames)
    bad = bytearray(data[:-4])
    bad[-1] ^= 0xFF  # the compressed stream, not the header
    bad = bytes(bad) + struct.pack("<I", google_crc32c.value(bytes(bad)))
    try:
        got = store._codec.decode(bad, "x")
    except InvalidStoreError as exc:
        assert "decode" in str(exc) or "frame" in str(exc)
    else:  # lz4 cannot always tell; then the frames differ and nothing crashed
        assert not np.array_equal(got, frames)


def test_default_cache_holds_every_chunk_of_a_ring_that_ends_in_a_short_chunk(tmp_path):
    """Small observations are cached whole by default, also when the ring's last chunk is
    short (it decodes padded): once every chunk was read, reads need no frame file."""
    from mmreplay import ReplayStore

    store = ReplayStore.create(tmp_path / "s", capacity=10_001, obs_shape=(1,), seed=0)
    assert store.spec.slots_per_env % store.spec.chunk_frames  # a short last chunk
    store.reset(np.zeros(1, np.uint8))
    for i in range(10_000):
        store.add(0, 0.0, np.full(1, i % 200, np.uint8), False, False)
    store.get(store.valid_ids())  # every chunk once
    for path in (tmp_path / "s" / "frames").glob("c.*"):
        path.unlink()
    batch = store.sample(4096)
    ids = batch.ids.numpy()  # transition t starts at frame t, which holds (t - 1) % 200
    np.testing.assert_array_equal(batch.obs[:, 0, 0].numpy(), np.where(ids, (ids - 1) % 200, 0))
    store.close()


@pytest.mark.parametrize("shard_chunks", [1, 3])
def test_chunk_table_reads_what_uncached_reads_read(tmp_path, shard_chunks):
    """Small observations read through the table of every decoded chunk; the same stream
    (three envs advancing unevenly, stack padding, wraparound, RAM tails, reopened and
    read-only stores) reads the same through a store with no cache at all."""
    from mmreplay import ReplayStore

    rng = np.random.default_rng(shard_chunks)
    kw = dict(capacity=3 * 45, obs_shape=(3,), num_envs=3, frame_stack=3, seed=0,
              chunk_frames=4, shard_chunks=shard_chunks)
    table = ReplayStore.create(tmp_path / "table", **kw)
    plain = ReplayStore.create(tmp_path / "plain", cache_bytes=0, **kw)
    assert table._frames._table is not None and plain._frames._table is None
    stores = (table, plain)
    for store in stores:
        store.reset(np.zeros((3, 3), np.uint8))
    for step in range(1, 300):
        envs = np.flatnonzero(rng.random(3) < [0.9, 0.6, 0.3])
        obs = rng.integers(0, 255, (envs.size, 3)).astype(np.uint8)
        done = rng.random(envs.size) < 0.04
        for store in stores:
            if envs.size:
                store.add(np.zeros(envs.size, np.int64), np.zeros(envs.size, np.float32), obs,
                          done, np.zeros(envs.size, bool), env_ids=envs, autoreset=None)
                if done.any():
                    store.reset(obs[done], env_ids=envs[done])
        if step % 37 == 0:
            a, b = table.sample(64), plain.sample(64)
            assert torch_equal(a.obs, b.obs) and torch_equal(a.next_obs, b.next_obs)
            ids = table.valid_ids()
            assert torch_equal(table.get(ids).obs, plain.get(ids).obs)
    for store in stores:
        store.flush()
    readers = [ReplayStore.open(s.path, "r") for s in stores]
    ids = readers[0].valid_ids()
    assert readers[0]._frames._table is not None
    assert torch_equal(readers[0].get(ids).next_obs, readers[1].get(ids).next_obs)
    assert torch_equal(readers[0].get(ids).obs, table.get(ids).obs)
    for store in (*readers, *stores):
        store.close()


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("slots", [13, 16])
def test_one_pass_read_matches_the_frames_written(tmp_path, slots):
    """The one-call read of an lz4 shard store with no cache (`read_frames`): random reads
    beside the writer, and of a read-only store after it, return the frames last written
    at each slot (RAM tails, chunks pending in a shard not yet written, partial shard
    writes by `drain`, files not mapped yet, wraparound, a short last chunk, -1 = zeros),
    whichever order and duplicates the slots come in."""
    spec, fs = new_frame_store(tmp_path, slots=slots, chunk=2, shard=3, envs=2,
                               obs_shape=(3, 2))
    assert fs.reader.fast_path == LZ4_SHARDS_ONE_PASS
    writer = ShadowWriter(fs, np.random.default_rng(slots))
    for step in range(5 * slots):
        writer.append()
        if step % 11 == 0:
            fs.drain()
        flat = writer.readable(40)
        assert np.array_equal(fs.read(flat), writer.want(flat))
    fs.drain()
    reader = FrameStore(tmp_path, spec, writable=False)
    assert reader.reader.fast_path == LZ4_SHARDS_ONE_PASS
    flat = writer.readable(40)
    reader.load_tail(fs.tail_frames(), fs.next_slot)
    assert np.array_equal(reader.read(flat), writer.want(flat))


def test_one_pass_read_reports_a_damaged_chunk(tmp_path):
    spec, fs = new_frame_store(tmp_path, slots=12, chunk=2, shard=3, obs_shape=(3, 2))
    for slot in range(12):
        fs.append(np.array([0]), np.array([slot]), np.full((1, 3, 2), slot + 1, np.uint8))
    fs.drain()
    path = fs.file_path(0, 0)
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the first chunk's bytes
    path.write_bytes(bytes(data))
    reader = FrameStore(tmp_path, spec, writable=False)
    with pytest.raises(InvalidStoreError, match="crc32c"):
        reader.read(np.array([1, 7], np.int64))
    assert np.array_equal(reader.read(np.array([7], np.int64))[0], np.full((3, 2), 8))

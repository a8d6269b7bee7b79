"""Reads through the table of decoded chunks (`storage.chunk_table`) against reads with no
cache: the one-call table read of lz4 shard stores (`table_kernels.table_read`) and its
paths: chunks decoded from mapped files, from files not mapped yet, from a finished chunk
still in the writer's RAM, RAM tails, the zero frame, wraparound, a damaged chunk."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ShadowWriter, numbered_frame

from mmreplay import ReplayStore, UnknownIdError
from mmreplay.errors import InvalidInputError, InvalidStoreError
from mmreplay.spec import make_spec
from mmreplay.storage.frame_reader import LZ4_SHARDS_ONE_PASS, LZ4_SHARDS_TABLE
from mmreplay.storage.frame_store import FrameStore, create_frames_array

SHAPE = (3, 2)


CHUNK_BYTES = 2 * 6
WHOLE, TINY = 1 << 30, 3 * CHUNK_BYTES  # every chunk, or 3 rows evicted by CLOCK


def _stores(tmp_path, slots: int, envs: int = 2, cache: int = WHOLE, codec: str = "lz4",
            shard: int = 3):
    spec = make_spec(capacity=slots * envs, num_envs=envs, obs_shape=SHAPE, chunk_frames=2,
                     shard_chunks=shard, codec=codec)
    create_frames_array(tmp_path, spec)
    (tmp_path / "tmp").mkdir()
    writer = FrameStore(tmp_path, spec, writable=True, cache_bytes=cache)
    assert writer._table is not None
    assert (writer.reader.fast_path == LZ4_SHARDS_TABLE) == (codec == "lz4" and shard > 1)
    assert writer._table.whole == (cache == WHOLE)
    return spec, writer


def _slots(writer: ShadowWriter) -> np.ndarray:
    """Random flat slots (and -1) holding a written frame: 40, or 1 to 8 (a small read)."""
    n = int(writer.rng.choice([0, 40]))
    return writer.readable(n or int(writer.rng.integers(1, 9)))


CASES = [(13, WHOLE, "lz4", 3), (16, WHOLE, "lz4", 3), (13, TINY, "lz4", 3),
         (16, TINY, "lz4", 3), (13, TINY, "zstd", 3), (13, TINY, "lz4", 1),
         (16, WHOLE, "zstd", 1)]


@pytest.mark.parametrize(("slots", "cache", "codec", "shard"), CASES)
def test_table_read_matches_the_frames_written(tmp_path, slots, cache, codec, shard):
    """Random reads beside the writer through its cache return the frames last written at
    each slot, also when the table forgot what it held (its chunks come back from the
    writer's RAM, pending in a shard not written yet, or from their files, mapped or not),
    over several laps of the ring, with the whole store in the table or 3 rows evicted by
    CLOCK (reads of more chunks than that read without keeping); a read-only reader with
    the same cache and a reader with no cache read the same after it."""
    spec, fs = _stores(tmp_path, slots, cache=cache, codec=codec, shard=shard)
    rows = fs._table.num_rows
    writer = ShadowWriter(fs, np.random.default_rng(slots))
    from_ram = 0
    for step in range(6 * slots):
        writer.append()
        if step % 11 == 0:
            fs.drain()
        if writer.rng.random() < 0.4:  # every chunk read again from RAM or its file
            fs._table.clear()
            if fs.finished.shard_writer is not None:
                from_ram += int(np.count_nonzero(fs.finished.shard_writer.ram_src))
        flat = _slots(writer)
        assert np.array_equal(fs.read(flat), writer.want(flat))
        _check_stats(fs, cache, rows)
    assert from_ram or shard == 1  # some reads took chunks from the writer's RAM
    fs.drain()
    table = FrameStore(tmp_path, spec, writable=False, cache_bytes=cache)
    plain = FrameStore(tmp_path, spec, writable=False, cache_bytes=0)
    assert plain._table is None
    for reader in (table, plain):
        reader.load_tail(fs.tail_frames(), fs.next_slot)
    kept = 0
    for _ in range(30):
        flat = _slots(writer)
        assert np.array_equal(table.read(flat), writer.want(flat))
        assert np.array_equal(plain.read(flat), writer.want(flat))
        kept = max(kept, _check_stats(table, cache, rows))
    assert kept > 0  # the reader's reads filled its table


@pytest.mark.parametrize("cache", [WHOLE, TINY, 0])
def test_fast_paths_read_what_the_general_path_reads(tmp_path, cache):
    """Each fast path of an lz4 shard store (`table_read` through the cache, falling back to
    `read_frames` for a read wider than the table; `read_frames` with no cache) returns what
    `read_general` returns for the same slots: beside the writer (RAM tails, chunks pending
    in a shard, files not mapped yet, wraparound) and in a read-only reader after it."""
    slots = 13
    spec = make_spec(capacity=slots * 2, num_envs=2, obs_shape=SHAPE, chunk_frames=2,
                     shard_chunks=3)
    create_frames_array(tmp_path, spec)
    (tmp_path / "tmp").mkdir()
    fs = FrameStore(tmp_path, spec, writable=True, cache_bytes=cache)
    assert fs.reader.fast_path == (LZ4_SHARDS_TABLE if cache else LZ4_SHARDS_ONE_PASS)
    writer = ShadowWriter(fs, np.random.default_rng(cache))
    for step in range(6 * slots):
        writer.append()
        if step % 11 == 0:
            fs.drain()
        flat = _slots(writer)
        assert np.array_equal(fs.read(flat), fs.reader.read_general(flat))
    fs.drain()
    reader = FrameStore(tmp_path, spec, writable=False, cache_bytes=cache)
    reader.load_tail(fs.tail_frames(), fs.next_slot)
    for _ in range(20):
        flat = _slots(writer)
        assert np.array_equal(reader.read(flat), reader.reader.read_general(flat))


def _check_stats(fs, cache, rows):
    """`cache_stats` says what the table holds: its rows' keys, each key's row, no more
    rows than the budget allows."""
    table, stats = fs._table, fs.cache_stats()
    held = np.flatnonzero(table.key_of >= 0)
    assert stats.chunks == held.size == np.count_nonzero(table.row_of >= 0) <= rows
    assert stats.nbytes == held.size * CHUNK_BYTES <= max(cache, CHUNK_BYTES)
    assert stats.budget_bytes == cache
    assert (table.row_of[table.key_of[held]] == held).all()
    return stats.chunks


def test_table_read_of_many_chunks_and_shapes(tmp_path):
    """Reads of any shape, with repeats, touching every chunk at once, and into `out`."""
    spec, fs = _stores(tmp_path, 16)
    for t in range(40):
        env = t % 2
        fs.append(np.array([env]), np.array([fs.next_slot[env]]),
                  np.full((1, *SHAPE), t + 1, np.uint8))
    fs.drain()
    reader = FrameStore(tmp_path, spec, writable=False, cache_bytes=1 << 30)
    plain = FrameStore(tmp_path, spec, writable=False, cache_bytes=0)
    for r in (reader, plain):
        r.load_tail(fs.tail_frames(), fs.next_slot)
    flat = np.concatenate([np.arange(32), np.arange(32)[::-1], [-1, -1]]).reshape(2, 3, 11)
    out = np.full(flat.size * 6 + 5, 7, np.uint8)
    got = reader.read(flat, out=out)
    assert got.shape == (2, 3, 11, *SHAPE) and np.shares_memory(got, out)
    assert np.array_equal(got, plain.read(flat))
    assert np.array_equal(reader.read(flat), plain.read(flat))  # now all from the table


def test_table_read_reports_a_damaged_chunk_as_the_default_read_does(tmp_path):
    spec, fs = _stores(tmp_path, 12, envs=1)
    for slot in range(12):
        fs.append(np.array([0]), np.array([slot]), np.full((1, *SHAPE), slot + 1, np.uint8))
    fs.drain()
    path = fs.file_path(0, 0)
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the first chunk's bytes
    path.write_bytes(bytes(data))
    messages = []
    for cache in (WHOLE, TINY, 0):
        reader = FrameStore(tmp_path, spec, writable=False, cache_bytes=cache)
        with pytest.raises(InvalidStoreError, match="crc32c") as info:
            reader.read(np.array([7, 1], np.int64))
        messages.append(str(info.value))
        assert np.array_equal(reader.read(np.array([7], np.int64))[0], np.full(SHAPE, 8))
        with pytest.raises(InvalidStoreError, match="crc32c"):  # not kept as loaded
            reader.read(np.array([0], np.int64))
        assert reader.cache_stats().chunks == (cache > 0)  # chunk 3 only
    assert messages[0] == messages[1] == messages[2]


def test_a_table_reader_beside_a_writer_that_wraps_reads_each_id_s_frames(tmp_path):
    """A read-only store with the whole ring decoded in RAM, beside a writer that laps the
    ring and flushes: every transition it returns has its own frames (or is refused)."""
    kw = dict(capacity=60, obs_shape=(8,), frame_stack=1, seed=0, chunk_frames=4,
              shard_chunks=3)
    writer = ReplayStore.create(tmp_path / "s", cache_bytes=0, **kw)
    writer.reset(numbered_frame(0, (8,)))
    t = 0
    checked = 0
    reader = None
    for _ in range(5):
        for _ in range(25):
            t += 1
            writer.add(0, float(t), numbered_frame(t, (8,)), False, False)
        writer.flush()
        if reader is None:
            reader = ReplayStore.open(tmp_path / "s", "r", cache_bytes=1 << 30)
            assert reader._frames.reader.fast_path == LZ4_SHARDS_TABLE
        for _ in range(3):
            try:
                batch = reader.get(reader.valid_ids())
            except UnknownIdError:
                continue
            ids = batch.ids.numpy()
            first = batch.obs.numpy().reshape(ids.size, -1)[:, :4].copy().view("<u4").reshape(-1)
            assert np.array_equal(first, ids)
            checked += ids.size
        reader.close()
        reader = ReplayStore.open(tmp_path / "s", "r", cache_bytes=1 << 30)
    assert checked
    reader.close()
    writer.close()


@pytest.mark.parametrize("capacity", [40, 43])  # 43: the ring's last chunk is short
def test_decoded_bytes_is_the_budget_that_keeps_the_whole_ring(tmp_path, capacity):
    """`spec.decoded_bytes` as `cache_bytes` keeps every chunk decoded; a byte less keeps a
    row fewer and evicts."""
    kw = dict(capacity=capacity, obs_shape=(8,), frame_stack=1, seed=0, chunk_frames=4,
              shard_chunks=3)
    with ReplayStore.create(tmp_path / "s", cache_bytes=0, **kw) as writer:
        writer.reset(numbered_frame(0, (8,)))
        for t in range(1, 3 * capacity):
            writer.add(0, float(t), numbered_frame(t, (8,)), False, False)
        spec = writer.spec
    chunks = spec.num_envs * spec.num_chunks
    assert spec.decoded_bytes == chunks * 4 * 8
    for budget, held in ((spec.decoded_bytes, chunks), (spec.decoded_bytes - 1, chunks - 1)):
        with ReplayStore.open(tmp_path / "s", "r", cache_bytes=budget) as reader:
            for _ in range(2):  # every valid transition read, twice
                batch = reader.get(reader.valid_ids())
                first = batch.obs.numpy().reshape(len(batch), -1)[:, :4].copy().view("<u4")
                assert np.array_equal(first.reshape(-1), batch.ids.numpy())
            stats = reader.views.memory().cache
            assert (stats.chunks, stats.nbytes) == (held, held * 4 * 8)


def test_cache_bytes_all_keeps_every_frame_decoded_and_says_what_it_refuses(tmp_path):
    """``cache_bytes="all"`` is `spec.decoded_bytes`, on create and on open: every chunk of
    the ring ends up decoded in RAM. Opened above `max_ram_bytes`, for a URL, or with
    another word, it is refused with what was expected and what arrived."""
    kw = dict(capacity=43, obs_shape=(32, 32), frame_stack=1, seed=0, chunk_frames=4,
              shard_chunks=3)
    with ReplayStore.create(tmp_path / "s", cache_bytes="all", **kw) as writer:
        assert writer.views.memory().cache.budget_bytes == writer.spec.decoded_bytes
        writer.reset(numbered_frame(0, (32, 32)))
        for t in range(1, 3 * 43):
            writer.add(0, float(t), numbered_frame(t, (32, 32)), False, False)
        spec = writer.spec
    with ReplayStore.open(tmp_path / "s", "r", cache_bytes="all") as reader:
        batch = reader.get(reader.valid_ids())
        first = batch.obs.numpy().reshape(len(batch), -1)[:, :4].copy().view("<u4")
        assert np.array_equal(first.reshape(-1), batch.ids.numpy())
        stats = reader.views.memory().cache
        chunks = spec.num_envs * spec.num_chunks
        assert (stats.budget_bytes, stats.chunks) == (spec.decoded_bytes, chunks)
    with pytest.raises(InvalidInputError, match=r"cache_bytes='all' would keep .* GiB of "
                                                r"decoded frames in RAM, more than max_ram"):
        ReplayStore.open(tmp_path / "s", "r", cache_bytes="all",
                         max_ram_bytes=spec.decoded_bytes - 1)
    with ReplayStore.open(tmp_path / "s", "r", cache_bytes="all",
                          max_ram_bytes=spec.decoded_bytes) as reader:
        assert reader.views.memory().cache.budget_bytes == spec.decoded_bytes
    with pytest.raises(InvalidInputError, match="for a URL, cache_bytes bounds the files"):
        ReplayStore.open(f"file://{tmp_path}/bucket", "r", cache_bytes="all")
    for bad in ("ALL", "1GB", 1.5, -1, True):
        with pytest.raises(InvalidInputError, match=r"cache_bytes must be an int >= 0, 'all' "
                                                    r"or None, got"):
            ReplayStore.open(tmp_path / "s", "r", cache_bytes=bad)


@pytest.mark.parametrize("stack", [1, 2, 4])
def test_a_batch_gather_copies_shared_frames_from_its_obs_as_the_table_holds_them(stack):
    """`gather_frames` of a batch's obs and next stacks (``stack`` > 0) interleaves the two
    and copies a frame they share from the obs just written: every frame equals the
    plain gather's, for table rows, RAM tails and the zero frame, shared or not."""
    from mmreplay.kernels import tables

    gather = tables().gather_frames
    rng = np.random.default_rng(stack)
    fb, rows, tail_rows = 24, 30, 6
    table = rng.integers(0, 255, (rows, fb), dtype=np.uint8)
    tails = rng.integers(0, 255, (tail_rows, fb), dtype=np.uint8)
    zero = -1 - tail_rows
    for _ in range(50):
        batch = int(rng.integers(1, 9))
        obs = rng.choice(np.r_[np.arange(rows), -1 - np.arange(tail_rows), zero],
                         size=(batch, stack))
        shift = rng.integers(0, stack + 1, batch)  # next stack = obs moved on `shift` frames
        nxt = rng.choice(np.r_[np.arange(rows), -1 - np.arange(tail_rows), zero],
                         size=(batch, stack))
        for b in range(batch):
            nxt[b, :stack - shift[b]] = obs[b, shift[b]:]
        sources = np.concatenate([obs.ravel(), nxt.ravel()]).astype(np.int64)
        want = np.full((sources.size, fb), 7, np.uint8)
        got = np.full((sources.size, fb), 7, np.uint8)
        gather(table, tails, sources, want, 0)
        gather(table, tails, sources, got, stack)
        expected = np.stack([table[s] if s >= 0 else tails[-1 - s] if s > zero
                             else np.zeros(fb, np.uint8) for s in sources])
        np.testing.assert_array_equal(want, expected)
        np.testing.assert_array_equal(got, expected)

"""Threads sharing a read (`ReadThreads`, `FrameReader.use_threads`): the same frames as one
thread, every path; errors after every share is done; ``batches(workers=N)`` of a writable
store and the fill of a ``device=`` store use them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import ShadowWriter, frame, new_frame_store

import mmreplay.device_reader as device_reader
from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError
from mmreplay.storage import read_threads
from mmreplay.storage.frame_reader import LZ4_SHARDS_ONE_PASS, LZ4_SHARDS_TABLE
from mmreplay.storage.frame_store import FrameStore
from mmreplay.storage.read_threads import ReadThreads

OBS = (3, 2)


@pytest.fixture
def small_shares(monkeypatch):
    """Split reads of a few frames too (a test store's reads are small)."""
    monkeypatch.setattr(read_threads, "MIN_SHARE_FRAMES", 2)


def test_shares_come_back_in_part_order_from_several_threads():
    threads = ReadThreads(3)
    together = threading.Barrier(3, timeout=10)  # broken unless the three run at once

    def share(part: int, parts: int) -> tuple[int, int, int]:
        together.wait()
        return part, parts, threading.get_ident()

    try:
        seen = threads.run(share, 3)
        assert [s[:2] for s in seen] == [(0, 3), (1, 3), (2, 3)]
        assert seen[0][2] == threading.get_ident()  # part 0 in the caller's thread
        assert len({s[2] for s in seen}) == 3
        assert threads.parts(10) == 1 and threads.parts(100_000) == 3
    finally:
        threads.close()


@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_is_raised_only_once_every_share_finished(failing):
    """A read's rows and mapped files must not be in use once the caller lets go of the
    store's lock: a share that fails waits for the others."""
    threads = ReadThreads(3)
    finished: list[int] = []

    def share(part: int, parts: int) -> int:
        if part == failing:
            raise ValueError(f"share {part} failed")
        time.sleep(0.05)
        finished.append(part)
        return part

    try:
        with pytest.raises(ValueError, match=f"share {failing} failed"):
            threads.run(share, 3)
        assert sorted(finished) == sorted({0, 1, 2} - {failing})
    finally:
        threads.close()


@pytest.mark.parametrize(("codec", "shard", "cache"), [
    ("lz4", 3, 0),  # the one-pass path, its chunks split among the threads
    ("lz4", 3, 1 << 20),  # a table store: the general path, its decoding split
    ("zstd", 3, 0),  # the general path (scratch rows), decoding split
    ("lz4", 1, 0),  # a file per chunk (format 1): general path
])
def test_reads_shared_by_threads_return_the_frames_written(tmp_path, small_shares, codec, shard,
                                                           cache):
    """Beside the writer (RAM tails, chunks pending, files not mapped yet, wraparound, -1)
    and in a read-only store after it, a read shared by 3 threads returns what one thread
    returns: the frames last written at each slot."""
    slots = 14
    spec, fs = new_frame_store(tmp_path, slots=slots, chunk=2, shard=shard, envs=2,
                               obs_shape=OBS, codec=codec)
    if cache:
        fs.close()
        fs = FrameStore(tmp_path, spec, writable=True, cache_bytes=cache)
    path = {("lz4", 3, 0): LZ4_SHARDS_ONE_PASS, ("lz4", 3, 1 << 20): LZ4_SHARDS_TABLE}
    assert fs.reader.fast_path == path.get((codec, shard, cache))
    release = fs.reader.use_threads(3)
    assert fs.reader.threads is not None and fs.reader.threads.count == 3
    writer = ShadowWriter(fs, np.random.default_rng(shard + cache))
    for step in range(5 * slots):
        writer.append()
        if step % 11 == 0:
            fs.drain()
        flat = np.repeat(writer.readable(48), 2)  # repeats, as a batch's stacks have
        assert np.array_equal(fs.read(flat), writer.want(flat))
    release()
    assert fs.reader.threads is None
    fs.drain()
    reader = FrameStore(tmp_path, spec, writable=False, cache_bytes=cache)
    reader.load_tail(fs.tail_frames(), fs.next_slot)
    release = reader.reader.use_threads(3)
    flat = np.repeat(writer.readable(48), 2)
    assert np.array_equal(reader.read(flat), writer.want(flat))
    release()
    reader.close()
    fs.close()


def test_a_damaged_chunk_is_reported_by_whichever_thread_decodes_it(tmp_path, small_shares):
    spec, fs = new_frame_store(tmp_path, slots=24, chunk=2, shard=3, obs_shape=OBS)
    for slot in range(24):
        fs.append(np.array([0]), np.array([slot]), np.full((1, *OBS), slot + 1, np.uint8))
    fs.drain()
    path = fs.file_path(0, 6)  # the shard of chunks 6..8: slots 12..17
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside its first chunk's bytes
    path.write_bytes(bytes(data))
    reader = FrameStore(tmp_path, spec, writable=False)
    reader.reader.use_threads(3)
    with pytest.raises(InvalidStoreError, match="crc32c"):
        reader.read(np.arange(24, dtype=np.int64))  # chunk 6 goes to one of three threads
    good = np.array([0, 1, 2, 3, 4, 5, 20, 21, 22, 23], np.int64)
    assert reader.read(good)[:, 0, 0].tolist() == (good + 1).tolist()
    reader.close()  # stops the threads
    assert reader.reader.threads is None
    fs.close()


def test_the_most_threads_asked_for_share_reads_until_every_user_let_go(tmp_path):
    _, fs = new_frame_store(tmp_path, slots=8, chunk=2, shard=2, obs_shape=OBS)
    first, second = fs.reader.use_threads(2), fs.reader.use_threads(4)
    assert fs.reader.threads.count == 4
    second()
    second()  # twice: no effect
    assert fs.reader.threads.count == 2
    first()
    assert fs.reader.threads is None
    fs.close()


def _writable(tmp_path) -> ReplayStore:
    store = ReplayStore.create(tmp_path / "s", capacity=4000, obs_shape=(6, 5), frame_stack=4,
                               n_step=2, seed=0, chunk_frames=4)
    store.reset(frame(0, (6, 5)))
    _record(store, 0, 600)
    return store


def _record(store: ReplayStore, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        store.add(i % 3, 1.0, frame(i + 1, (6, 5)), i % 50 == 49, False)
        if i % 50 == 49:
            store.reset(frame(i + 1, (6, 5)))


@pytest.mark.parametrize("device", [None, "cpu"])
def test_workers_of_a_writable_store_share_its_reads_beside_the_writer(tmp_path, small_shares,
                                                                      device):
    """``batches(workers=3)`` on a writable store: one prefetch thread, reads shared by 3
    threads while the iterator lives; batches hold their ids' transitions while the
    writer adds."""
    store = _writable(tmp_path)
    reader = store._frames.reader
    with store.batches(32, prefetch=2, workers=3, device=device) as it:
        assert reader.threads is not None and reader.threads.count == 3
        for step in range(20):
            batch = next(it)
            with store._lock:  # the writer waits: nothing given up between the two reads
                again = store.get(batch.ids)
            assert torch.equal(batch.obs, again.obs)
            assert torch.equal(batch.next_obs, again.next_obs)
            assert torch.equal(batch.reward, again.reward)
            _record(store, 600 + 5 * step, 5)
    assert reader.threads is None
    store.close()


def test_a_device_store_fill_is_decoded_by_several_threads(tmp_path, small_shares, monkeypatch):
    store = _writable(tmp_path)
    store.close()
    used: list[int] = []
    monkeypatch.setattr(device_reader, "fill_threads", lambda: 3)
    real = FrameStore.read

    def spy(self, flat, out=None):
        used.append(0 if self.reader.threads is None else self.reader.threads.count)
        return real(self, flat, out)

    monkeypatch.setattr(FrameStore, "read", spy)
    with ReplayStore.open(tmp_path / "s", "r", device="cpu") as on_device:
        assert used and set(used) == {3}  # the fill's reads, shared by 3
        assert on_device._frames.reader.threads is None  # and no longer
        monkeypatch.setattr(FrameStore, "read", real)
        plain = ReplayStore.open(tmp_path / "s", "r")
        ids = plain.valid_ids()
        assert torch.equal(on_device.get(ids).obs, plain.get(ids).obs)
        assert torch.equal(on_device.get(ids).next_obs, plain.get(ids).next_obs)
        plain.close()


def test_each_share_decodes_its_own_chunks_and_writes_only_their_rows(tmp_path, small_shares,
                                                                      monkeypatch):
    """Shares split a read by chunk: run one at a time, each writes a disjoint set of rows
    (the rows of its chunks, all of each chunk's frames), and together every row; shares that
    find files not mapped write nothing (mapped, then all run again)."""
    spec, fs = new_frame_store(tmp_path, slots=24, chunk=2, shard=3, obs_shape=OBS)
    for slot in range(24):
        fs.append(np.array([0]), np.array([slot]), np.full((1, *OBS), slot + 1, np.uint8))
    fs.drain()
    out = np.full(64 * 6, 0xEE, np.uint8)
    rows = out[:48 * 6].reshape(48, 6)
    written: list[set[int]] = []

    def one_at_a_time(self, share, parts):
        results = []
        for part in range(parts):
            before = rows.copy()
            results.append(share(part, parts))
            written.append(set(np.flatnonzero((rows != before).any(axis=1)).tolist()))
        return results

    monkeypatch.setattr(ReadThreads, "run", one_at_a_time)
    fs.reader.use_threads(3)
    flat = np.repeat(np.arange(24, dtype=np.int64), 2)  # 12 chunks, 4 rows each
    got = fs.read(flat, out=out)
    assert got[:, 0, 0].tolist() == (flat + 1).tolist()
    # the files were not mapped yet: no share writes, they are mapped, every share again
    assert len(written) == 6 and written[:3] == [set(), set(), set()]
    written = written[3:]
    assert all(len(w) == 16 for w in written)  # 4 chunks each
    assert set.union(*written) == set(range(48))
    for w in written:  # whole chunks: a chunk's rows 4c..4c+3 all in one share
        assert all({4 * (r // 4) + i for i in range(4)} <= w for r in w)
    fs.close()

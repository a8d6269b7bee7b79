"""shards: the shard file format, its checked index, open files, and whole-shard writes."""

from __future__ import annotations

import os
import struct
from functools import partial
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import zarr
from conftest import new_frame_store

from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError
from mmreplay.storage.frame_store import FrameStore
from mmreplay.storage.shards import (
    ABSENT,
    ShardFiles,
    encode_shard,
    index_size,
    parse_index,
    read_shard,
)

MAX_CHUNK = 100


def parse(data: bytes, k: int = 4) -> np.ndarray:
    return parse_index(data[-index_size(k):], len(data), k, MAX_CHUNK, "shard")


def with_index(body: bytes, entries: list[tuple[int, int]]) -> bytes:
    raw = np.array(entries, "<u8").tobytes()
    return body + raw + struct.pack("<I", google_crc32c.value(raw))


def test_encode_then_parse_round_trips_with_absent_chunks():
    data = encode_shard({0: b"a" * 10, 2: b"b" * 7}, 4)
    index = parse(data)
    assert index.tolist() == [[0, 10], [-1, -1], [10, 7], [-1, -1]]
    assert len(data) == 17 + index_size(4)


@pytest.mark.parametrize(("entries", "message"), [
    ([(0, 10), (ABSENT, 5), (ABSENT, ABSENT), (ABSENT, ABSENT)], "half absent"),
    ([(0, 10), (10, 11), (ABSENT, ABSENT), (ABSENT, ABSENT)], "outside"),  # runs past the data
    ([(21, 5), (ABSENT, ABSENT), (ABSENT, ABSENT), (ABSENT, ABSENT)], "outside"),
    ([(2**63, 5), (ABSENT, ABSENT), (ABSENT, ABSENT), (ABSENT, ABSENT)], "outside"),
    ([(0, 2**64 - 2), (ABSENT, ABSENT), (ABSENT, ABSENT), (ABSENT, ABSENT)], "outside"),
    ([(0, 3), (ABSENT, ABSENT), (ABSENT, ABSENT), (ABSENT, ABSENT)], "no chunk"),  # < crc + 1
])
def test_index_entries_outside_the_file_are_refused(entries, message):
    with pytest.raises(InvalidStoreError, match=message):
        parse(with_index(b"x" * 20, entries))


def test_chunks_larger_than_a_chunk_can_encode_to_are_refused():
    body = b"x" * (MAX_CHUNK + 1)
    with pytest.raises(InvalidStoreError, match="no chunk"):
        parse(with_index(body, [(0, MAX_CHUNK + 1), *[(ABSENT, ABSENT)] * 3]))


def test_a_damaged_or_short_index_is_refused():
    data = bytearray(encode_shard({0: b"a" * 10}, 4))
    data[-10] ^= 1
    with pytest.raises(InvalidStoreError, match="crc32c"):
        parse(bytes(data))
    with pytest.raises(InvalidStoreError, match="too short"):
        parse_index(b"", 10, 4, MAX_CHUNK, "shard")


make = partial(new_frame_store, slots=24, chunk=2, shard=4, envs=1, obs_shape=(3,))
"""(spec, FrameStore): 24 slots, 2-frame chunks, 4 chunks per shard file."""


def put(store, env, values):
    for v in values:
        slot = int(store.next_slot[env])
        store.append(np.array([env]), np.array([slot]), np.full((1, 3), v, np.uint8))


def test_a_shard_is_written_when_its_last_chunk_is_finished(tmp_path):
    hooked = []
    _, store = make(tmp_path, hook=lambda env, first, last: hooked.append((first, last)))
    put(store, 0, range(1, 8))  # chunks 0..2 finished, chunk 3 not: shard 0 waits in RAM
    assert not os.path.exists(tmp_path / "frames" / "c.0.0.0") and hooked == []
    assert store.read(np.arange(7))[:, 0].tolist() == list(range(1, 8))  # served from RAM
    put(store, 0, [8])
    assert os.path.exists(tmp_path / "frames" / "c.0.0.0") and hooked == [(0, 3)]
    arr = zarr.open_group(str(tmp_path), mode="r")["frames"]
    assert arr[0, :8, 0].tolist() == list(range(1, 9))


def test_drain_writes_a_partial_shard_keeping_the_chunks_it_does_not_rewrite(tmp_path):
    _, store = make(tmp_path)
    put(store, 0, range(1, 25))  # one lap: shards 0..2 complete
    put(store, 0, range(101, 104))  # lap 2: chunk 0 finished, slot 2 in the tail
    store.drain()  # shard 0 = new chunk 0 + lap-1 chunks 1..3
    arr = zarr.open_group(str(tmp_path), mode="r")["frames"]
    assert arr[0, :8, 0].tolist() == [101, 102, 3, 4, 5, 6, 7, 8]
    reader = FrameStore(tmp_path, store.spec, writable=False)
    reader.load_tail(store.tail_frames(), store.next_slot)
    assert reader.read(np.arange(8))[:, 0].tolist() == [101, 102, 103, 4, 5, 6, 7, 8]
    reader.close()
    put(store, 0, range(104, 109))  # chunks 1..3 of lap 2: shard 0 complete again
    assert arr[0, :8, 0].tolist() == list(range(101, 109))
    store.close()


def test_a_fresh_writer_merges_the_chunks_an_earlier_flush_wrote(tmp_path):
    """After a reopen the writer holds none of the shard's earlier chunks in RAM."""
    store = ReplayStore.create(tmp_path / "s", capacity=32, obs_shape=(3,), chunk_frames=2,
                               shard_chunks=8)
    store.reset(np.zeros(3, np.uint8))
    for i in range(1, 21):
        store.add(0, 0.0, np.full(3, i, np.uint8), False, False)
    store.close()  # frames 0..19: shard 1 holds chunks 0..1 only
    with ReplayStore.open(tmp_path / "s") as again:
        for i in range(21, 40):
            again.add(0, 0.0, np.full(3, i, np.uint8), False, False)
        got = again.get(again.valid_ids())
        assert (got.obs[:, -1, 0].long() == got.ids % 256).all() and len(got.ids) > 20
    arr = zarr.open_group(str(tmp_path / "s"), mode="r")["frames"]
    assert arr[0, 16:24, 0].tolist() == list(range(16, 24))


def test_a_failed_shard_write_is_retried_and_readable_meanwhile(tmp_path, monkeypatch):
    import mmreplay.storage.shards as shards
    real, fail = shards.write_atomic, [True]

    def flaky(*args, **kwargs):
        if fail[0]:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    _, store = make(tmp_path)
    monkeypatch.setattr(shards, "write_atomic", flaky)
    put(store, 0, range(1, 8))
    with pytest.raises(OSError, match="No space"):
        put(store, 0, [8])  # completes shard 0
    put(store, 0, range(9, 12))
    assert store.read(np.arange(11))[:, 0].tolist() == list(range(1, 12))
    with pytest.raises(OSError, match="No space"):
        store.drain()
    fail[0] = False
    store.drain()
    arr = zarr.open_group(str(tmp_path), mode="r")["frames"]
    assert arr[0, :10, 0].tolist() == list(range(1, 11))
    store.close()


def test_open_shard_files_are_bounded(tmp_path):
    _, store = make(tmp_path, slots=48)
    put(store, 0, range(1, 49))  # six shard files
    store.close()
    files = ShardFiles(str(tmp_path / "frames"), ".0", 4, 200, num_envs=1, num_chunks=24,
                       max_open=2)
    before = len(os.listdir("/proc/self/fd"))

    def mapped_frame_files() -> int:
        maps = Path("/proc/self/maps").read_text()
        return len({line.split()[-1] for line in maps.splitlines()
                    if str(tmp_path / "frames") in line})

    for chunk in range(0, 24, 4):  # six shard files of four 2-frame chunks each
        data = files.chunk(0, chunk)
        assert data[:4] != b"" and files.mapped <= 2 and mapped_frame_files() <= 2
        assert len(os.listdir("/proc/self/fd")) == before  # a mapping holds no descriptor
    src, size = files.addresses(np.array([20, 23], np.int64))  # the newest shard: mapped
    assert (src > 0).all() and (size > 0).all() and files.mapped == 2
    files.close()
    assert files.mapped == 0 and mapped_frame_files() == 0 and not files.src.any()


def test_read_shard_of_a_missing_file_is_empty_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "c.0.0.0"
    assert read_shard(str(path), "shard", 4, 200) == {}
    path.write_bytes(encode_shard({1: b"hello"}, 4)[:-1])
    with pytest.raises(InvalidStoreError, match="frame|crc|short"):
        read_shard(str(path), "shard", 4, 200)

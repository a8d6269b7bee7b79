"""Golden on-disk fixtures: stores written by earlier builds must read the same.

Format 1 (a file per chunk; zstd, then blosc-lz4 chunks) and format 2 (shard files), all
holding the same steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from mmreplay import InvalidStoreError, ReplayStore

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "store_v1"  # zstd chunks, the first codec
GOLDEN_LZ4 = FIXTURES / "store_v1_lz4"  # the same steps with blosc-lz4 chunks
GOLDEN_V2 = FIXTURES / "store_v2"  # the same steps in shard files (format 2, the default)
ALL = pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_LZ4, GOLDEN_V2],
                              ids=["zstd", "lz4", "v2"])
EXPECTED = json.loads((FIXTURES / "store_v1.expected.json").read_text())


def fields(batch) -> dict:
    return {f: getattr(batch, f).tolist() for f in (
        "ids", "obs", "next_obs", "action", "reward", "discount", "terminated", "truncated")}


@ALL
def test_golden_store_reads_back_identically(golden):
    with ReplayStore.open(golden, mode="r") as store:
        got = fields(store.get(store.valid_ids()))
        assert store.sample(8).ids.tolist() == EXPECTED["next_samples"]  # RNG state persisted
    for name in ("ids", "obs", "next_obs", "action", "terminated", "truncated"):
        assert got[name] == EXPECTED[name], name
    np.testing.assert_allclose(got["reward"], EXPECTED["reward"], rtol=1e-6)
    np.testing.assert_allclose(got["discount"], EXPECTED["discount"], rtol=1e-6)


@pytest.mark.parametrize(("golden", "codec"), [(GOLDEN, "zstd"), (GOLDEN_LZ4, "blosc")],
                         ids=["zstd", "lz4"])
def test_golden_manifest_and_zarr_layout(golden, codec):
    manifest = json.loads((golden / "manifest.json").read_text())
    assert manifest["format"] == "mmreplay" and manifest["format_version"] == 1
    frames = zarr.open_group(str(golden), mode="r")["frames"]
    assert frames.shape == (2, 12, 4, 3) and frames.chunks == (1, 4, 4, 3)
    meta = json.loads((golden / "frames" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", codec, "crc32c"]
    with ReplayStore.open(golden, mode="r") as store:  # plain zarr reads the same frames
        tail_chunk = int(store._frames.next_slot[0]) // 4  # its newest frames live in tail/
        slots = np.array([s for s in range(12) if s // 4 != tail_chunk])
        assert frames[0, slots].tolist() == store._frames.read(slots).tolist()


@ALL
def test_golden_store_can_be_resumed(tmp_path, golden):
    path = tmp_path / "copy"
    shutil.copytree(golden, path)
    with ReplayStore.open(path) as store:
        before = store.counts
        store.reset(np.zeros((2, 4, 3), np.uint8))
        store.add(np.array([1, 2]), np.zeros(2), np.ones((2, 4, 3), np.uint8),
                  np.ones(2, bool), np.zeros(2, bool))
    with ReplayStore.open(path, mode="r") as store:
        assert store.counts.transitions == before.transitions + 2
        assert store.get([before.transitions]).next_obs[0, -1].sum().item() == 12


@ALL
@pytest.mark.parametrize("name", ["manifest.json", "frames/zarr.json"])
def test_fixture_is_committed(golden, name):
    assert (golden / name).is_file()


def test_golden_v2_manifest_and_sharded_zarr_layout():
    manifest = json.loads((GOLDEN_V2 / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["spec"]["shard_chunks"] == 3
    frames = zarr.open_group(str(GOLDEN_V2), mode="r")["frames"]
    assert frames.shape == (2, 12, 4, 3) and frames.shards == (1, 12, 4, 3)
    assert frames.chunks == (1, 4, 4, 3)
    meta = json.loads((GOLDEN_V2 / "frames" / "zarr.json").read_text())
    (shard,) = meta["codecs"]
    assert shard["name"] == "sharding_indexed"
    assert [c["name"] for c in shard["configuration"]["codecs"]] == ["bytes", "blosc", "crc32c"]
    assert sorted(p.name for p in (GOLDEN_V2 / "frames").iterdir()) == [
        "c.0.0.0.0", "c.1.0.0.0", "zarr.json"]
    with ReplayStore.open(GOLDEN_V2, mode="r") as store:  # plain zarr reads the same frames
        tail_chunk = int(store._frames.next_slot[0]) // 4
        slots = np.array([s for s in range(12) if s // 4 != tail_chunk])
        assert frames[0, slots].tolist() == store._frames.read(slots).tolist()


GOLDEN_V3 = FIXTURES / "store_v3"  # format 3: per-step extras in the step blocks
EXPECTED_V3 = json.loads((FIXTURES / "store_v3.expected.json").read_text())


def test_golden_v3_extras_and_sequences_read_back_identically():
    manifest = json.loads((GOLDEN_V3 / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    assert manifest["spec"]["extras"] == [["logp", [], "float32"], ["state", [2], "float16"]]
    with ReplayStore.open(GOLDEN_V3, mode="r") as store:
        batch = store.get(store.valid_ids())
        assert batch.ids.tolist() == EXPECTED_V3["ids"]
        assert batch.obs.tolist() == EXPECTED_V3["obs"]
        assert {k: v.tolist() for k, v in batch.extras.items()} == EXPECTED_V3["extras"]
        for cross in (False, True):
            want = EXPECTED_V3[f"sequences_cross_{cross}"]
            starts = store.sequence_starts(3, cross_episodes=cross)
            seq = store.get_sequences(starts, 3, cross_episodes=cross)
            for name in ("ids", "obs", "next_obs", "action", "reward", "terminated",
                         "truncated", "is_first", "mask"):
                assert getattr(seq, name).tolist() == want[name], (cross, name)
            assert {k: v.tolist() for k, v in seq.extras.items()} == want["extras"]
        assert store.sample(8).ids.tolist() == EXPECTED_V3["next_samples"]
        assert store.sample_sequences(4, 3).ids.tolist() == EXPECTED_V3["next_sequences"]


def test_golden_v3_is_refused_field_by_field_when_edited(tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(GOLDEN_V3, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["spec"]["extras"][0][2] = "float64"  # the step blocks no longer match
    del manifest["checksum"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidStoreError):
        ReplayStore.open(path, mode="r")

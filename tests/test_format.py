"""Golden on-disk fixture: the format-1 store written by an earlier build must read the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from mmreplay import ReplayStore

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "store_v1"
EXPECTED = json.loads((FIXTURES / "store_v1.expected.json").read_text())


def fields(batch) -> dict:
    return {f: getattr(batch, f).tolist() for f in (
        "ids", "obs", "next_obs", "action", "reward", "discount", "terminated", "truncated")}


def test_golden_store_reads_back_identically():
    with ReplayStore.open(GOLDEN, mode="r") as store:
        got = fields(store.get(store.valid_ids()))
        assert store.sample(8).ids.tolist() == EXPECTED["next_samples"]  # RNG state persisted
    for name in ("ids", "obs", "next_obs", "action", "terminated", "truncated"):
        assert got[name] == EXPECTED[name], name
    np.testing.assert_allclose(got["reward"], EXPECTED["reward"], rtol=1e-6)
    np.testing.assert_allclose(got["discount"], EXPECTED["discount"], rtol=1e-6)


def test_golden_manifest_and_zarr_layout():
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    assert manifest["format"] == "mmreplay" and manifest["format_version"] == 1
    frames = zarr.open_group(str(GOLDEN), mode="r")["frames"]
    assert frames.shape == (2, 12, 4, 3) and frames.chunks == (1, 4, 4, 3)
    meta = json.loads((GOLDEN / "frames" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]


def test_golden_store_can_be_resumed(tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(GOLDEN, path)
    with ReplayStore.open(path) as store:
        before = store.counts
        store.reset(np.zeros((2, 4, 3), np.uint8))
        store.add(np.array([1, 2]), np.zeros(2), np.ones((2, 4, 3), np.uint8),
                  np.ones(2, bool), np.zeros(2, bool))
    with ReplayStore.open(path, mode="r") as store:
        assert store.counts.transitions == before.transitions + 2
        assert store.get([before.transitions]).next_obs[0, -1].sum().item() == 12


@pytest.mark.parametrize("name", ["manifest.json", "frames/zarr.json"])
def test_fixture_is_committed(name):
    assert (GOLDEN / name).is_file()

"""Codec ``"lz4hc"`` (format 5): blosc's lz4hc chunks, the lz4 format that the store's compiled
reads decode as they decode ``"lz4"``; the golden format-5 store reads back the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from store_compare import (
    assert_golden_frames_through_zarr,
    assert_golden_reads_back,
    assert_golden_resumes,
)

from mmreplay import ReplayStore
from mmreplay.errors import InvalidInputError
from mmreplay.spec import make_spec

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_V5 = FIXTURES / "store_v5"
EXPECTED_V5 = json.loads((FIXTURES / "store_v5.expected.json").read_text())
sys.path.insert(0, str(FIXTURES))
from make_store_v4 import frame  # noqa: E402  (the v5 fixture holds the same frames)


def test_golden_v5_reads_back_identically() -> None:
    manifest = json.loads((GOLDEN_V5 / "manifest.json").read_text())
    assert manifest["format_version"] == 5 and manifest["spec"]["codec"] == "lz4hc"
    assert manifest["spec"]["codec_level"] == 3
    with ReplayStore.open(GOLDEN_V5, mode="r") as store:
        assert store.format_version == 5
    assert_golden_reads_back(GOLDEN_V5, EXPECTED_V5)


def test_golden_v5_frames_read_through_plain_zarr() -> None:
    meta = json.loads((GOLDEN_V5 / "frames" / "zarr.json").read_text())
    (shard,) = meta["codecs"]
    inner = shard["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "blosc", "crc32c"]
    assert inner[1]["configuration"]["cname"] == "lz4hc"
    assert_golden_frames_through_zarr(GOLDEN_V5, frame)


def test_golden_v5_can_be_resumed(tmp_path: Path) -> None:
    assert_golden_resumes(GOLDEN_V5, tmp_path / "copy", frame)  # chunks rewritten by lz4hc


def moving_frames(count: int) -> np.ndarray:
    """84x84 frames of a block moving over a striped background (Atari-like redundancy)."""
    out = np.zeros((count, 84, 84), np.uint8)
    out[:, ::6] = 90
    for t in range(count):
        x, y = (t * 3) % 76, (t * 5) % 76
        out[t, y:y + 8, x:x + 8] = 200
    return out


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_an_lz4hc_store_reads_what_an_lz4_store_reads_in_fewer_bytes(tmp_path: Path,
                                                                      sampler: str) -> None:
    """The same stream into an ``"lz4"`` and an ``"lz4hc"`` store (past a ring lap): the
    same batches from the same seed, through the one compiled call a batch (both are
    lz4-format stores), the frames recorded, after a reopen too; lz4hc chunks are smaller."""
    frames = moving_frames(301)
    stores = {}
    for codec in ("lz4", "lz4hc"):
        store = ReplayStore.create(tmp_path / codec, capacity=256, obs_shape=(84, 84),
                                   frame_stack=4, n_step=3, seed=3, codec=codec,
                                   sampler=sampler)
        store.reset(frames[0])
        for t in range(1, 301):
            store.add(t % 3, float(t), frames[t], False, False)  # transition t: frame t
        assert store._frames.one_call_reads(256)
        stores[codec] = store
    for _ in range(3):
        a, b = stores["lz4"].sample(16), stores["lz4hc"].sample(16)
        assert np.array_equal(a.ids.numpy(), b.ids.numpy())
        assert np.array_equal(a.obs.numpy(), b.obs.numpy())
        assert np.array_equal(a.next_obs.numpy(), b.next_obs.numpy())
        assert np.array_equal(b.obs.numpy()[:, -1], frames[b.ids.numpy()])
        assert np.array_equal(b.next_obs.numpy()[:, -1], frames[b.ids.numpy() + 3])
    for store in stores.values():
        store.close()
    sizes = {codec: sum(p.stat().st_size for p in (tmp_path / codec / "frames").glob("c.*"))
             for codec in stores}
    assert 0 < sizes["lz4hc"] < sizes["lz4"], sizes
    with ReplayStore.open(tmp_path / "lz4hc", mode="r") as store:
        ids = store.valid_ids()
        assert np.array_equal(store.get(ids).obs.numpy()[:, -1], frames[ids])


def test_lz4hc_levels_are_checked() -> None:
    spec = make_spec(capacity=10, obs_shape=(4,), codec="lz4hc")
    assert spec.codec_level == 3 and spec.format_version == 5
    assert make_spec(capacity=10, obs_shape=(4,), codec="lz4hc", codec_level=9).codec_level == 9
    for level in (0, 10):
        with pytest.raises(InvalidInputError, match="codec_level"):
            make_spec(capacity=10, obs_shape=(4,), codec="lz4hc", codec_level=level)

"""Step blocks as they travel actor -> store: the compressed frames come back exactly, and a
damaged or lying payload is a clear `InvalidInputError` (no Ray needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zstandard

from mmreplay.errors import InvalidInputError
from mmreplay.integrations.blocks import compress_block_frames, make_block


def block(frames: np.ndarray, compress: bool = True):
    rows, envs = frames.shape[:2]
    return make_block(env_ids=np.arange(envs), action=np.zeros((rows, envs), np.int64),
                      reward=np.zeros((rows, envs), np.float32), frames=frames,
                      terminated=np.zeros((rows, envs), bool),
                      truncated=np.zeros((rows, envs), bool),
                      autoreset=np.zeros((rows, envs), bool), stream=0, compress=compress)


@pytest.fixture
def frames() -> np.ndarray:
    out = np.zeros((16, 2, 84, 84), np.uint8)
    out[:, :, 70:74, :] = 140  # a paddle-like band every frame shares
    for t in range(16):  # and a ball that moves
        out[t, :, 10 + 2 * t:12 + 2 * t, 20 + 3 * t:22 + 3 * t] = 255
    return out


def test_compressed_block_frames_round_trip_and_are_smaller(frames: np.ndarray) -> None:
    packed = block(frames)
    assert packed.frames is None and packed.frames_zstd is not None
    assert len(packed.frames_zstd) < frames.nbytes // 2
    assert packed.nbytes < block(frames, compress=False).nbytes
    got = packed.frame_array()
    assert got.dtype == frames.dtype and np.array_equal(got, frames)


def test_float_frames_round_trip() -> None:
    frames = np.linspace(0, 1, 5 * 1 * 4, dtype=np.float32).reshape(5, 1, 4)
    assert np.array_equal(block(frames).frame_array(), frames)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "too_long", "too_short", "none"])
def test_a_damaged_payload_is_refused_with_a_clear_error(frames: np.ndarray,
                                                         damage: str) -> None:
    packed = block(frames)
    payload = {
        "garbage": b"not a zstd frame at all",
        "truncated": packed.frames_zstd[: len(packed.frames_zstd) // 2],
        "too_long": compress_block_frames(np.concatenate([frames, frames])),  # a bomb, small
        "too_short": compress_block_frames(frames[:3]),
        "none": None,
    }[damage]
    bad = dataclasses.replace(packed, frames_zstd=payload)
    with pytest.raises(InvalidInputError, match="frames_zstd"):
        bad.frame_array()


def test_a_frame_without_its_size_in_the_header_is_still_bounded(frames: np.ndarray) -> None:
    """A zstd frame that does not state its content size (streamed) decodes at most the
    block's size: a larger one is refused, not allocated."""
    big = np.zeros(frames.nbytes * 4, np.uint8)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(big.data)
    bad = dataclasses.replace(block(frames), frames_zstd=unsized)
    with pytest.raises(InvalidInputError, match="frames_zstd"):
        bad.frame_array()

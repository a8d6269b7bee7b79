"""The frame buffers of transition batches (`OutputBuffers`): a buffer is written again only once
no batch, tensor or array views it. Held batches, views outliving their batch, numpy batches
and prefetched ones keep their frames through later samples; a dropped batch's buffer is
reused, on every read path (one compiled pass, the table of decoded chunks, the generic
decode of zstd chunks). CPU only: ``pin_memory=True`` needs CUDA (tests/test_sb3_stage.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import numbered_frame

from mmreplay import ReplayStore

SHAPE = (32, 32)  # 1 KiB frames: a batch of 32 4-stacks and next stacks is 256 KiB, pooled
PATHS = {  # read path -> create arguments that take it
    "one_pass": {"cache_bytes": 0},           # lz4 shard files, no cache: `read_frames`
    "table": {"cache_bytes": 64 << 20},       # the whole store decoded in RAM
    "zstd": {"codec": "zstd", "cache_bytes": 0},  # decode of each chunk, then a gather
}


def filled(tmp_path, path: str, frames: int = 900) -> ReplayStore:
    """A store of `frames` numbered frames (every frame differs) in episodes of 40 steps."""
    store = ReplayStore.create(tmp_path / path, capacity=600, obs_shape=SHAPE, frame_stack=4,
                               seed=11, **PATHS[path])
    store.reset(numbered_frame(0, SHAPE))
    for t in range(1, frames):
        end = t % 40 == 0
        store.add(t % 3, float(t), numbered_frame(t, SHAPE), end, False, autoreset=None)
        if end:
            store.reset(numbered_frame(t + 100_000, SHAPE))
    return store


def snapshot(batch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.obs.clone(), batch.next_obs.clone()


def span(tensor: torch.Tensor) -> range:
    """The bytes of memory a tensor's storage covers."""
    start = tensor.untyped_storage().data_ptr()
    return range(start, start + tensor.untyped_storage().nbytes())


@pytest.mark.parametrize("path", PATHS)
def test_a_held_batch_keeps_its_frames_through_later_samples(tmp_path, path):
    store = filled(tmp_path, path)
    held = [store.sample(32) for _ in range(6)]  # more than the pool keeps (4)
    saved = [snapshot(b) for b in held]
    for _ in range(20):
        later = store.sample(32)
        for b in held:  # never written into a buffer a held batch views
            assert later.obs.data_ptr() not in span(b.obs)
    for b, (obs, next_obs) in zip(held, saved, strict=True):
        assert torch.equal(b.obs, obs) and torch.equal(b.next_obs, next_obs)
    store.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_dropped_batch_buffer_is_reused(tmp_path, path):
    store = filled(tmp_path, path)
    first = store.sample(32)
    address = first.obs.data_ptr()
    del first
    again = store.sample(32)
    assert again.obs.data_ptr() == address  # nothing viewed it: written again, not allocated
    assert len({store.sample(32).obs.data_ptr() for _ in range(10)}) == 1  # each dropped at once
    store.close()


def test_a_view_outliving_its_batch_keeps_the_buffer(tmp_path):
    store = filled(tmp_path, "one_pass")
    view = store.sample(32).obs[5:9]  # the batch is gone; a torch view of its frames is not
    saved, address = view.clone(), view.untyped_storage().data_ptr()
    for _ in range(10):
        assert store.sample(32).obs.data_ptr() != address
    assert torch.equal(view, saved)
    del view
    assert store.sample(32).obs.data_ptr() == address  # free again
    store.close()


def test_numpy_batches_and_their_views_keep_their_buffers(tmp_path):
    store = filled(tmp_path, "one_pass")
    arrays = store.sample_arrays(32)
    obs = arrays.next_obs  # a numpy view, kept after its batch is dropped
    saved_all, saved_obs = arrays.frames.copy(), obs.copy()
    held = store.sample_arrays(32)
    del arrays
    for _ in range(10):
        store.sample_arrays(32)
        store.sample(32)
    assert np.array_equal(obs, saved_obs)
    assert not np.shares_memory(held.frames, obs)
    assert np.array_equal(saved_all[1], saved_obs)
    store.close()


def test_prefetched_batches_keep_their_frames(tmp_path):
    store = filled(tmp_path, "one_pass")
    it = store.batches(32, prefetch=2)
    held = [next(it) for _ in range(5)]
    saved = [snapshot(b) for b in held]
    for _ in range(10):
        next(it)
    for b, (obs, next_obs) in zip(held, saved, strict=True):
        assert torch.equal(b.obs, obs) and torch.equal(b.next_obs, next_obs)
    it.close()
    store.close()


@pytest.mark.parametrize("path", PATHS)
def test_batches_in_reused_buffers_hold_their_transitions(tmp_path, path):
    """Each sample, written into a reused buffer, holds what `get` of its ids reads (into
    another buffer), in the dtypes `ArrayBatch` documents."""
    store = filled(tmp_path, path)
    for _ in range(8):
        batch = store.sample_arrays(32)
        again = store.get(batch.ids)
        assert np.array_equal(batch.obs, again.obs.numpy())
        assert np.array_equal(batch.next_obs, again.next_obs.numpy())
        for name, dtype in (("reward", np.float32), ("discount", np.float32),
                            ("ids", np.int64), ("steps", np.int64), ("terminated", np.bool_)):
            field = getattr(batch, name)
            assert field.dtype == dtype and field.flags.c_contiguous and field.flags.writeable
            assert np.array_equal(field, getattr(again, name).numpy()), name
    store.close()

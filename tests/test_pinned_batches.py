"""Page-locked batches (`PinnedBlocks`): a fresh block of PyTorch's pinned allocator a batch,
never recycled by the library, and every tensor handed out a view of that block (so the
allocator, which reuses a block only after the copies queued from it are done, sees every
copy). On the CPU the allocator is replaced by plain ``torch.empty`` (the same code runs);
the lagging-GPU check of the bytes that reach the GPU runs where CUDA is."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import numbered_frame

import mmreplay.torch_batch as torch_batch
from mmreplay import InvalidInputError, ReplayStore
from mmreplay.torch_batch import frames_tensor, make_batch, pinned_frames

SHAPE = (32, 32)
CUDA = torch.cuda.is_available()


def filled(tmp_path, frames: int = 900, **kw) -> ReplayStore:
    """A store of `frames` numbered frames (every frame differs) in episodes of 40 steps."""
    store = ReplayStore.create(tmp_path / "s", capacity=600, obs_shape=SHAPE, frame_stack=4,
                               seed=11, **kw)
    store.reset(numbered_frame(0, SHAPE))
    for t in range(1, frames):
        end = t % 40 == 0
        store.add(t % 3, float(t), numbered_frame(t, SHAPE), end, False, autoreset=None)
        if end:
            store.reset(numbered_frame(t + 100_000, SHAPE))
    return store


class FakeAllocator:
    """Stands in for ``torch.empty(..., pin_memory=True)`` on the CPU: hands out plain
    tensors and remembers each (weakly), to see who keeps them."""

    def __init__(self) -> None:
        self.handed: list[weakref.ref[np.ndarray]] = []  # the memory of each block

    def __call__(self, nbytes: int) -> torch.Tensor:
        memory = np.empty(nbytes, np.uint8)  # lives as long as any tensor or view of it
        self.handed.append(weakref.ref(memory))
        return torch.from_numpy(memory)

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.handed)


@pytest.fixture
def blocks(monkeypatch) -> FakeAllocator:
    fake = FakeAllocator()
    if not CUDA:
        monkeypatch.setattr(torch_batch, "page_locked_empty", fake)
    return fake


def block_base(tensor: torch.Tensor) -> int:
    """The address the allocator knows a tensor's memory by: its storage's start."""
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("cache", [{"cache_bytes": 0}, {}])
def test_each_pinned_batch_has_its_own_block_and_the_library_keeps_none(tmp_path, blocks,
                                                                        cache):
    if CUDA:
        pytest.skip("counts the fake allocator's blocks (CPU only)")
    store = filled(tmp_path, **cache)
    held = [store.sample_arrays(32, pin_memory=True) for _ in range(6)]
    assert len(blocks.handed) == 6 and blocks.alive() == 6
    starts = {block_base(a.pinned) for a in held}
    assert len(starts) == 6  # no two live batches share a block
    for arrays in held:  # the frames are a numpy view of the tensor the batch carries
        assert arrays.frames.ctypes.data == block_base(arrays.pinned)
        assert np.array_equal(arrays.pinned.numpy(), arrays.frames)
    del held, arrays
    assert blocks.alive() == 0  # no pool holds them: only the allocator may reuse a block
    for _ in range(5):
        store.sample_arrays(32, pin_memory=True)
    assert len(blocks.handed) == 11  # a fresh block each time, never one recycled by us
    store.close()


def test_batch_tensors_are_views_of_the_block_on_every_pinned_path(tmp_path, blocks):
    """A copy from a tensor is attributed to a block by its storage; a tensor made by
    ``torch.from_numpy`` of a view inside the block has a storage of its own."""
    store = filled(tmp_path)
    arrays = store.sample_arrays(32, pin_memory=True)
    batch = make_batch(arrays)
    for tensor in (batch.obs, batch.next_obs, frames_tensor(arrays)):
        assert block_base(tensor) == block_base(arrays.pinned)
    assert block_base(torch.from_numpy(arrays.next_obs)) != block_base(arrays.pinned)
    with store.batches(32, prefetch=2, pin_memory=True) as it:
        for _ in range(4):
            got = next(it)
            assert block_base(got.next_obs) == block_base(got.obs)
            assert got.next_obs.data_ptr() == block_base(got.obs) + got.obs.nbytes
    store.close()


def test_pinned_batches_hold_the_transitions_of_their_ids(tmp_path, blocks):
    store = filled(tmp_path)
    with store.batches(32, prefetch=3, pin_memory=True) as it:
        held = [next(it) for _ in range(12)]
    for batch in held:
        again = store.get(batch.ids)
        assert torch.equal(batch.obs, again.obs) and torch.equal(batch.next_obs, again.next_obs)
        assert torch.equal(batch.reward, again.reward)
    store.close()


def test_pinned_frames_needs_a_tensor_that_owns_the_frames_from_their_start():
    assert pinned_frames(np.zeros((2, 3, 4), np.uint8)) is None
    block = torch.arange(48, dtype=torch.uint8)
    frames = block.numpy()[:24].reshape(2, 3, 4)
    view = pinned_frames(frames)
    assert view is not None and view.shape == (2, 3, 4) and block_base(view) == block_base(block)
    assert pinned_frames(block.numpy()[8:32].reshape(2, 3, 4)) is None  # not the block's start
    floats = torch.zeros(96, dtype=torch.uint8).numpy()[:96].view(np.float32).reshape(4, 6)
    assert pinned_frames(floats).dtype == torch.float32


def test_pageable_batches_carry_no_block(tmp_path):
    store = filled(tmp_path)
    assert store.sample_arrays(32).pinned is None
    assert make_batch(store.sample_arrays(32)).obs.untyped_storage().data_ptr() != 0
    store.close()


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_pin_memory_without_cuda_says_so(tmp_path):
    store = filled(tmp_path)
    with pytest.raises(InvalidInputError, match="pin_memory=True needs CUDA"):
        store.sample_arrays(8, pin_memory=True)
    store.close()


# -- where CUDA is --------------------------------------------------------------------------
def lagging_copies(batches, count: int, lag_cycles: int = 2_000_000):
    """`count` batches copied with ``non_blocking=True`` behind a GPU kept busy, never
    synchronized; each batch dropped at once. Returns (CPU references, GPU copies)."""
    refs, on_gpu = [], []
    for _ in range(count):
        obs, next_obs = batches()
        torch.cuda._sleep(lag_cycles)  # the GPU runs behind: copies stay queued
        refs.append((obs.clone(), next_obs.clone()))
        on_gpu.append((obs.to("cuda", non_blocking=True), next_obs.to("cuda", non_blocking=True)))
        del obs, next_obs
    torch.cuda.synchronize()
    return refs, on_gpu


def wrong(refs, on_gpu) -> int:
    return sum(not (torch.equal(o.cpu(), ro) and torch.equal(n.cpu(), rn))
               for (ro, rn), (o, n) in zip(refs, on_gpu, strict=True))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_pinned_batches_reach_a_lagging_gpu_intact(tmp_path):  # pragma: no cover - GPU only
    store = filled(tmp_path)
    with store.batches(32, prefetch=4, pin_memory=True) as it:
        def take():
            batch = next(it)
            return batch.obs, batch.next_obs
        assert wrong(*lagging_copies(take, 400)) == 0

    def halves():  # numpy users: the block's own tensor, then any view of it
        both = frames_tensor(store.sample_arrays(32, pin_memory=True))
        return both[0], both[1]
    assert wrong(*lagging_copies(halves, 400)) == 0

    def numpy_views():  # invisible to the allocator: held until the stream passes a mark
        arrays = store.sample_arrays(32, pin_memory=True)
        return torch.from_numpy(arrays.obs), torch.from_numpy(arrays.next_obs)
    assert wrong(*lagging_copies(numpy_views, 400)) == 0
    store.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_whole_numpy_frames_reach_a_lagging_gpu_intact(tmp_path):  # pragma: no cover
    """``torch.from_numpy(arrays.frames)`` starts at the block: its copy is tracked too."""
    store = filled(tmp_path)
    refs, on_gpu = [], []
    for _ in range(400):
        frames = torch.from_numpy(store.sample_arrays(32, pin_memory=True).frames)
        torch.cuda._sleep(2_000_000)
        refs.append(frames.clone())
        on_gpu.append(frames.to("cuda", non_blocking=True))
        del frames
    torch.cuda.synchronize()
    assert sum(not torch.equal(g.cpu(), r) for r, g in zip(refs, on_gpu, strict=True)) == 0
    store.close()


class Mark:
    """Stands in for a CUDA event: passed once the test says the GPU got there."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_a_dropped_block_waits_for_the_stream_mark_of_whoever_dropped_it(tmp_path, blocks,
                                                                        monkeypatch):
    """A numpy user's ``torch.from_numpy(arrays.next_obs)`` is invisible to the pinned
    allocator: when the batch's block dies, it is held until the GPU passes a mark recorded
    then on the current stream, and let go after."""
    if CUDA:
        pytest.skip("counts the fake allocator's blocks (CPU only)")
    marks: list[Mark] = []

    def mark() -> Mark:
        marks.append(Mark())
        return marks[-1]

    monkeypatch.setattr(torch_batch, "stream_mark", mark)
    store = filled(tmp_path)
    arrays = store.sample_arrays(32, pin_memory=True)
    queued = torch.from_numpy(arrays.next_obs)  # what a copy would read from, later
    del arrays
    assert blocks.alive() == 1 and not marks  # still viewed: no mark yet
    del queued
    assert len(marks) == 1 and blocks.alive() == 1  # gone from Python, held for the GPU
    store.sample_arrays(32, pin_memory=True)  # a take before the mark passed: still held
    assert blocks.alive() >= 1 and blocks.handed[0]() is not None
    marks[0].passed = True
    store.sample_arrays(32, pin_memory=True)
    assert blocks.handed[0]() is None  # let go once the GPU passed the mark
    store.close()

"""``store.batches(..., device=...)``: batches copied to a device by the prefetch thread
(`DeviceMover`). ``device="cpu"`` runs the same path (no streams); the stream checks (the
learner's stream waits on the copy, record_stream, a lagging GPU) run where CUDA is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_used_equal, frame, lag_copies, used_at_once

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.device_batches import DeviceMover, Staged, parse_device
from mmreplay.torch_batch import FrameSetBatch

OBS = (6, 5)
CUDA = torch.cuda.is_available()


def filled(tmp_path, **kw) -> ReplayStore:
    store = ReplayStore.create(tmp_path / "s", capacity=3000, obs_shape=OBS, frame_stack=4,
                               n_step=2, seed=0, chunk_frames=4,
                               extras={"logits": ((3,), "float32")}, **kw)
    store.reset(frame(0, OBS))
    for i in range(400):
        store.add(i % 3, 1.0 + i, frame(i + 1, OBS), i % 50 == 49, False,
                  extras={"logits": np.full(3, i, np.float32)})
        if i % 50 == 49:
            store.reset(frame(i + 1, OBS))
    return store


def assert_same(batch, again) -> None:
    for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "discount",
                 "weights", "ids", "steps"):
        got, want = getattr(batch, name), getattr(again, name)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), name
    assert torch.equal(batch.extras["logits"].cpu(), again.extras["logits"])


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_device_batches_hold_the_transitions_of_their_ids(tmp_path, device):
    store = filled(tmp_path)
    with store.batches(16, prefetch=3, device=device) as it:
        for _ in range(10):
            batch = next(it)
            assert batch.obs.device.type == "cpu"
            assert batch.obs.untyped_storage().data_ptr() == \
                batch.next_obs.untyped_storage().data_ptr()  # one frames tensor, one copy
            assert_same(batch, store.get(batch.ids))
    store.close()


def test_device_batches_from_several_workers(tmp_path):
    store = filled(tmp_path, sampler="prioritized")
    ids = store.valid_ids()
    store.update_priorities(ids, np.linspace(0.1, 3, ids.size))
    with store.batches(16, prefetch=4, device="cpu", workers=2, beta=1.0) as it:
        batches = [next(it) for _ in range(20)]
    for batch in batches:
        again = store.get(batch.ids)
        assert torch.equal(batch.obs, again.obs) and torch.equal(batch.reward, again.reward)
        assert batch.weights.min() < 1  # importance weights, beta=1
    store.close()


def test_bad_devices_and_workers_are_refused(tmp_path, monkeypatch):
    store = filled(tmp_path)
    with pytest.raises(InvalidInputError, match="device must be"):
        store.batches(8, device="tpu")
    with pytest.raises(InvalidInputError, match="device must be"):
        store.batches(8, device=3.5)
    with pytest.raises(InvalidInputError, match="workers must be a positive int, got 0"):
        store.batches(8, workers=0)
    reader = ReplayStore.open(tmp_path / "s", mode="r")
    for bad in ("2", 1.5, True):
        with pytest.raises(InvalidInputError, match=f"workers must be a positive int, got {bad!r}"):
            reader.batches(8, workers=bad)
    opened = []
    open_store = ReplayStore.open

    def spy(*args, **kw):
        opened.append(open_store(*args, **kw))
        return opened[-1]

    with monkeypatch.context() as patch:
        patch.setattr(ReplayStore, "open", spy)
        with pytest.raises(InvalidInputError, match="prefetch must be a positive int"):
            reader.batches(8, workers=2, prefetch=0)
    assert len(opened) == 2 and all(view.closed for view in opened)  # none left open
    reader.close()
    if not CUDA:
        with pytest.raises(InvalidInputError, match="needs CUDA"):
            store.batches(8, device="cuda")
    store.close()


def test_receive_takes_only_what_upload_made():
    mover = DeviceMover("cpu")
    assert not mover.pin_memory and mover.stream is None
    with pytest.raises(TypeError, match="expected a Staged batch"):
        mover.receive(object())
    assert parse_device("cpu") == torch.device("cpu")


def test_errors_reach_the_consumer_on_the_device_path(tmp_path):
    store = ReplayStore.create(tmp_path / "empty", capacity=50, obs_shape=OBS, frame_stack=4)
    it = store.batches(4, device="cpu")
    with pytest.raises(Exception, match="no sampleable transition"):
        next(it)
    store.close()


# -- where CUDA is --------------------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_batches_wait_on_the_copy_and_record_the_stream(tmp_path):  # pragma: no cover
    store = filled(tmp_path)
    mover = DeviceMover("cuda")
    staged = mover.upload(store.sample_arrays(16, pin_memory=True))
    assert isinstance(staged, Staged) and staged.event is not None
    batch = mover.receive(staged)
    assert batch.obs.is_cuda and batch.obs.data_ptr() + batch.obs.nbytes == \
        batch.next_obs.data_ptr()
    assert_same(batch, store.get(batch.ids.cpu()))
    store.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("lagging", ["learner", "copies"])
def test_cuda_batches_behind_a_lagging_gpu_are_intact(tmp_path, monkeypatch, lagging
                                                      ):  # pragma: no cover
    """400 batches used on the current stream at once, never synchronized, the GPU kept
    behind: the learner's stream (memory reuse: `record_stream`) or the copies' side stream
    (a sleep queued there before each upload: the learner must wait for the copies,
    `wait_event`); each batch compared at the end with what `get` reads for its ids."""
    if lagging == "copies":
        lag_copies(monkeypatch, 1_000_000)
    store = filled(tmp_path)
    used = []
    with store.batches(16, prefetch=4, device="cuda") as it:
        for _ in range(400):
            batch = next(it)
            if lagging == "learner":
                torch.cuda._sleep(1_000_000)
            used.append(used_at_once(batch))
            del batch
    assert_used_equal(store, used)
    store.close()


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_device_batches_equal_sample_arrays_of_the_same_draw(tmp_path, sampler):
    """The device path reads each distinct frame once and gathers the stacks after the copy:
    the batch equals the general path's (`sample_arrays`) for the same seed."""
    store = filled(tmp_path, sampler=sampler)
    if sampler == "prioritized":
        ids = store.valid_ids()
        store.update_priorities(ids, np.linspace(0.1, 3, ids.size))
    store.reseed(7)
    want = [store.sample_arrays(16, 0.6) for _ in range(3)]
    store.reseed(7)
    with store.batches(16, prefetch=1, beta=0.6, device="cpu") as it:
        got = [next(it) for _ in range(3)]
    for batch, arrays in zip(got, want, strict=True):
        assert np.array_equal(batch.obs.numpy(), arrays.obs)
        assert np.array_equal(batch.next_obs.numpy(), arrays.next_obs)
        for name in ("action", "reward", "discount", "weights", "ids", "steps", "terminated"):
            assert np.array_equal(getattr(batch, name).numpy(), getattr(arrays, name)), name
        assert np.array_equal(batch.extras["logits"].numpy(), arrays.extras["logits"])
    store.close()


def test_each_distinct_frame_crosses_once(tmp_path, monkeypatch):
    """A 2-step batch of 4-stacks: obs t-3..t and next obs t-1..t+2 share 2 frames, so at
    most 6 distinct frames a transition reach `upload`, not 8."""
    seen = []
    upload = DeviceMover.upload

    def spy(self, arrays):
        seen.append(arrays)
        return upload(self, arrays)

    monkeypatch.setattr(DeviceMover, "upload", spy)
    store = filled(tmp_path)
    with store.batches(64, prefetch=1, device="cpu") as it:
        batch = next(it)
    sent = seen[0]
    assert isinstance(sent, FrameSetBatch) and sent.index.shape == (2, 64, 4)
    assert sent.frames.shape[0] <= 6 * 64 and sent.frames.shape[1:] == OBS
    assert np.array_equal(sent.assembled().frames, np.stack([batch.obs, batch.next_obs]))
    store.close()

"""The SB3 buffer's staged adds (one env, no stacking: `StepStage`) and the batch buffers
(`ArrayBatch`, `OutputBuffers`): what the store records and returns equals the unstaged path
and SB3's own buffer."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3", reason='pip install "mmreplay[sb3]"')

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402

from mmreplay import InvalidInputError, ReplayStore  # noqa: E402
from mmreplay.integrations.sb3 import STAGE_ROWS, FrameOnceReplayBuffer  # noqa: E402
from mmreplay.torch_batch import OutputBuffers  # noqa: E402

SPACE, ACT = spaces.Box(-10, 10, (4,), np.float32), spaces.Discrete(2)


def feed(buffers, steps: int, seed: int, scalars: bool = False) -> None:
    """SB3-style adds of a CartPole-like stream: terminations, time-outs (with and without
    ``done``) and resets without a done flag (a second ``learn()``); `scalars`: reward and
    done as Python scalars (SB3's buffer takes them too)."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((1, 4)).astype(np.float32)
    for _ in range(steps):
        if rng.random() < 0.02:  # envs reset without done: the episode ends truncated
            obs = rng.standard_normal((1, 4)).astype(np.float32)
        nxt = rng.standard_normal((1, 4)).astype(np.float32)
        end = rng.random()
        done = np.array([end < 0.06])
        infos = [{"TimeLimit.truncated": True} if 0.03 < end < 0.08 else {}]
        action, reward = rng.integers(0, 2, (1, 1)), rng.standard_normal(1).astype(np.float32)
        for buf in buffers:
            if scalars:
                buf.add(obs, nxt, action, float(reward[0]), bool(done[0]), infos)
            else:
                buf.add(obs, nxt, action, reward, done, infos)
        ended = done[0] or "TimeLimit.truncated" in infos[0]
        obs = rng.standard_normal((1, 4)).astype(np.float32) if ended else nxt


def unstaged(tmp_path, name: str, size: int) -> FrameOnceReplayBuffer:
    """A buffer that records every add at once (the path of several envs or stacks)."""
    buf = FrameOnceReplayBuffer(size, SPACE, ACT, device="cpu", path=tmp_path / name, seed=0)
    buf._stage = None
    return buf


@pytest.mark.parametrize("size", [40, 10_000])
def test_staged_adds_record_what_single_adds_record(tmp_path, size):
    staged = FrameOnceReplayBuffer(size, SPACE, ACT, device="cpu", path=tmp_path / "a", seed=0)
    assert staged._stage is not None
    plain = unstaged(tmp_path, "b", size)
    ref = ReplayBuffer(size, SPACE, ACT, device="cpu")
    for seed in range(3):  # drained by reads between blocks, and by a full stage
        feed([staged, plain, ref], 2 * STAGE_ROWS + 37 * seed, seed)
        assert staged.size() == plain.size() == ref.size()
        a, b = staged.store, plain.store
        assert a.counts == b.counts
        assert np.array_equal(a.views.step_columns().steps, b.views.step_columns().steps)
        ids = a.valid_ids()
        assert ids.tolist() == b.valid_ids().tolist() and ids.size
        x, y = staged.get(ids), plain.get(ids)
        for field in ("observations", "actions", "next_observations", "dones", "rewards"):
            assert torch.equal(getattr(x, field), getattr(y, field)), field
        assert (staged._running == plain._running).all()
        assert np.array_equal(staged._last_next, plain._last_next)
    torch.manual_seed(0)
    staged.store.reseed(1), plain.store.reseed(1)
    s, t = staged.sample(64), plain.sample(64)
    assert torch.equal(s.observations, t.observations) and torch.equal(s.dones, t.dones)
    staged.close(), plain.close()


def test_scalar_rewards_and_dones_are_staged_too(tmp_path):
    staged = FrameOnceReplayBuffer(10_000, SPACE, ACT, device="cpu", path=tmp_path / "a", seed=0)
    plain = unstaged(tmp_path, "b", 10_000)
    feed([staged, plain], 100, 4, scalars=True)
    assert staged._stage.size == 100  # all staged, none through the buffer's own path
    ids = staged.store.valid_ids()
    assert ids.tolist() == plain.store.valid_ids().tolist()
    x, y = staged.get(ids), plain.get(ids)
    for field in ("observations", "actions", "next_observations", "dones", "rewards"):
        assert torch.equal(getattr(x, field), getattr(y, field)), field
    staged.close(), plain.close()


def test_staged_steps_are_recorded_when_the_buffer_goes(tmp_path):
    buf = FrameOnceReplayBuffer(1000, SPACE, ACT, device="cpu", path=tmp_path / "s", seed=0)
    feed([buf], 30, 0)
    assert buf._stage.size == 30  # still in RAM
    del buf
    gc.collect()
    store = ReplayStore.open(tmp_path / "s", "r")
    assert store.counts.transitions == 30
    store.close()


def test_a_refused_add_keeps_the_steps_staged_before_it(tmp_path):
    buf = FrameOnceReplayBuffer(1000, SPACE, ACT, device="cpu", path=tmp_path / "s", seed=0)
    feed([buf], 20, 1)
    bad = np.full((1, 4), np.nan, np.float32)
    with pytest.raises(ValueError, match="finite"):
        buf.add(bad, bad, np.zeros((1, 1), np.int64), np.ones(1, np.float32),
                np.array([False]), [{}])
    with pytest.raises(ValueError, match="rewards must be finite"):
        buf.add(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32),
                np.zeros((1, 1), np.int64), np.array([np.inf], np.float32),
                np.array([False]), [{}])
    assert buf._stage.size == 0 and buf.store.counts.transitions == 20
    buf.close()


# -- batch arrays and their buffers ----------------------------------------------------------
def filled(tmp_path) -> ReplayStore:
    store = ReplayStore.create(tmp_path / "p", capacity=500, obs_shape=(32, 32), seed=3,
                               frame_stack=4)
    store.reset(np.zeros((32, 32), np.uint8))
    for i in range(300):
        store.add(i % 3, 1.0, np.full((32, 32), i % 251, np.uint8), i % 50 == 49, False,
                  autoreset=None)
        if i % 50 == 49:
            store.reset(np.full((32, 32), 7, np.uint8))
    return store


def test_sample_arrays_are_the_sample_fields(tmp_path):
    store = filled(tmp_path)
    store.reseed(5)
    arrays = store.sample_arrays(32)
    store.reseed(5)
    batch = store.sample(32)
    assert np.array_equal(arrays.obs, batch.obs.numpy())
    assert np.array_equal(arrays.next_obs, batch.next_obs.numpy())
    for name in ("action", "reward", "terminated", "truncated", "discount", "weights", "ids",
                 "steps"):
        got, want = getattr(arrays, name), getattr(batch, name).numpy()
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    store.close()


def test_frame_buffers_are_reused_only_once_no_batch_views_them(tmp_path):
    store = filled(tmp_path)  # 2 x 32 x 4 frames of 1 KiB: 256 KiB, pooled
    first = store.sample(32)
    address = first.obs.data_ptr()
    second = store.sample(32)
    assert second.obs.data_ptr() != address  # `first` still views its buffer
    del first
    third = store.sample(32)
    assert third.obs.data_ptr() == address  # free again: reused
    store.close()


def test_small_buffers_come_fresh_and_pinned_ones_need_cuda(tmp_path):
    pool = OutputBuffers()
    assert pool.take(1024) is None and pool.take(1 << 20).size == 1 << 20
    store = filled(tmp_path)
    if torch.cuda.is_available():  # pragma: no cover - no GPU where the tests run
        assert store.sample_arrays(8, pin_memory=True).frames.base is not None
    else:
        with pytest.raises(InvalidInputError, match="pin_memory=True needs CUDA"):
            store.sample_arrays(8, pin_memory=True)
    store.close()

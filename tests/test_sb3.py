"""`FrameOnceReplayBuffer` (mmreplay.integrations.sb3) against SB3's own buffers and algorithms.

The differential tests drive SB3's `DummyVecEnv` + `VecFrameStack` exactly as
`OffPolicyAlgorithm.collect_rollouts` does (terminal observations swapped in for done envs,
``TimeLimit.truncated`` in the infos), feed the same stream to SB3's `ReplayBuffer` /
`NStepReplayBuffer` and to the adapter, and compare every transition the adapter can sample,
field by field, with what SB3's own ``_get_samples`` returns for it.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

pytest.importorskip("stable_baselines3")  # the sb3 extra is part of `test`: CI always has it

from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.envs import FakeImageEnv  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecFrameStack,
    VecNormalize,
)

from mmreplay import ReplayStore  # noqa: E402
from mmreplay.integrations.sb3 import FrameOnceReplayBuffer  # noqa: E402


# -- a frame stream with random terminations and truncations ---------------------------------
class RandomFrames(gym.Env):
    """Random uint8 frames; episodes of 1..`max_len` steps end terminated or truncated."""

    def __init__(self, shape: tuple[int, ...], seed: int, max_len: int = 9) -> None:
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = spaces.Discrete(3)
        self._rng = np.random.default_rng(seed)
        self._max_len = max_len
        self._left = 0

    def _frame(self) -> np.ndarray:
        return self._rng.integers(1, 256, self.observation_space.shape, dtype=np.uint8)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._left = int(self._rng.integers(1, self._max_len + 1))
        return self._frame(), {}

    def step(self, action):
        self._left -= 1
        end = self._left <= 0
        truncated = end and bool(self._rng.random() < 0.5)
        reward = float(self._rng.normal())
        return self._frame(), reward, end and not truncated, truncated, {}


def drive(buffers, *, n_envs: int, frame_shape: tuple[int, ...], steps: int, seed: int,
          reset_at: tuple[int, ...] = (), channels_order: str | None = None) -> int:
    """Feed `steps` SB3-style `add` calls to every buffer; at each step in `reset_at` the
    envs are reset without a done flag (a second ``learn()``). Returns the number of adds."""
    venv = VecFrameStack(DummyVecEnv([lambda i=i: RandomFrames(frame_shape, seed * 10 + i)
                                      for i in range(n_envs)]), 4, channels_order=channels_order)
    return drive_venv(buffers, venv, steps=steps, seed=seed, reset_at=reset_at)


def drive_venv(buffers, venv, *, steps: int, seed: int, reset_at: tuple[int, ...] = ()) -> int:
    """`drive` on a given SB3 vector env (as `collect_rollouts`, random actions)."""
    n_envs = venv.num_envs
    rng = np.random.default_rng(seed)
    obs = venv.reset()
    for t in range(steps):
        if t in reset_at:
            mark_running_truncated(buffers)
            obs = venv.reset()
        actions = rng.integers(0, venv.action_space.n, n_envs)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done:
                next_obs[i] = infos[i]["terminal_observation"]
        for buf in buffers:
            buf.add(obs, next_obs, actions, rewards, dones, infos)
        obs = new_obs
    return steps


def mark_running_truncated(buffers) -> None:
    """What the adapter does when envs reset without done, written into SB3's buffers:
    SB3 itself would stitch the old episode to the new one in its n-step windows."""
    for buf in buffers:
        if isinstance(buf, ReplayBuffer) and not isinstance(buf, FrameOnceReplayBuffer):
            last = buf.pos - 1
            buf.timeouts[last] = np.maximum(buf.timeouts[last], 1.0 - buf.dones[last])


def sb3_samples(buf: ReplayBuffer, inds: np.ndarray, envs: np.ndarray):
    """SB3's own ``_get_samples`` for given (position, env) pairs."""
    with mock.patch("numpy.random.randint", return_value=envs):
        return buf._get_samples(inds)


def make_pair(tmp_path: Path, venv_space: spaces.Box, *, n_envs: int, n_steps: int,
              buffer_size: int = 10_000, channels_order: str | None = None):
    act = spaces.Discrete(3)
    if n_steps == 1:
        ref: ReplayBuffer = ReplayBuffer(10_000, venv_space, act, device="cpu", n_envs=n_envs)
    else:
        ref = NStepReplayBuffer(10_000, venv_space, act, device="cpu", n_envs=n_envs,
                                n_steps=n_steps, gamma=0.9)
    ours = FrameOnceReplayBuffer(buffer_size, venv_space, act, device="cpu", n_envs=n_envs,
                                 path=tmp_path / "store", frame_stack=4, n_steps=n_steps,
                                 gamma=0.9, channels_order=channels_order, seed=0)
    return ref, ours


def assert_same_transitions(ref: ReplayBuffer, ours: FrameOnceReplayBuffer, adds: int,
                            n_steps: int) -> np.ndarray:
    """Every sampleable transition of `ours` equals SB3's; returns the ids compared."""
    ids = ours.store.valid_ids()
    assert ids.size > 0
    got = ours.get(ids)
    want = sb3_samples(ref, ids // ours.n_envs, ids % ours.n_envs)
    assert got.observations.dtype == want.observations.dtype == torch.uint8
    assert torch.equal(got.observations, want.observations)
    assert torch.equal(got.next_observations, want.next_observations)
    assert got.actions.dtype == want.actions.dtype and torch.equal(got.actions, want.actions)
    assert torch.equal(got.dones, want.dones)
    if n_steps == 1:
        assert torch.equal(got.rewards, want.rewards)
        assert got.discounts is None and want.discounts is None
    else:
        torch.testing.assert_close(got.rewards, want.rewards, rtol=1e-6, atol=1e-6)
        # gamma^m also after a termination, as SB3's own (float32 there: rtol)
        torch.testing.assert_close(got.discounts, want.discounts, rtol=1e-6, atol=0)
        assert got.discounts.dtype == want.discounts.dtype
    return ids


@pytest.mark.parametrize("channels", ["first", "last"])
@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("n_envs", [1, 4])
def test_every_transition_equals_sb3s(tmp_path, n_envs, n_steps, channels):
    frame = (2, 6, 5) if channels == "first" else (6, 5, 2)
    stacked = (8, 6, 5) if channels == "first" else (6, 5, 8)
    space = spaces.Box(0, 255, stacked, np.uint8)
    ref, ours = make_pair(tmp_path, space, n_envs=n_envs, n_steps=n_steps,
                          channels_order=channels)
    adds = drive([ref, ours], n_envs=n_envs, frame_shape=frame, steps=160, seed=n_envs + n_steps,
                 reset_at=(57, 58, 101), channels_order=channels)
    ids = assert_same_transitions(ref, ours, adds, n_steps)
    # every transition is compared, except the open n-step windows at the very end
    missing = np.setdiff1d(np.arange(adds * n_envs), ids)
    assert (missing // n_envs >= adds - (n_steps - 1)).all(), missing
    assert ours.store.counts.frames_written < 2 * adds * n_envs  # frames, not stacks pairs
    ours.close()


def test_guessed_channels_and_evicted_frames(tmp_path):
    """Channel order guessed as VecFrameStack does; a small buffer that wraps many times."""
    space = spaces.Box(0, 255, (4, 7, 7), np.uint8)  # 1-channel frames stacked first
    ref, ours = make_pair(tmp_path, space, n_envs=4, n_steps=3, buffer_size=64)
    adds = drive([ref, ours], n_envs=4, frame_shape=(1, 7, 7), steps=300, seed=7,
                 reset_at=(150,))
    ids = assert_same_transitions(ref, ours, adds, 3)
    assert ours.layout.first
    assert ids.min() > 4 * 200  # only the newest ~16 frames per env are kept
    assert len(ours.store) == ids.size <= 64
    assert ours.size() == 64 // 4  # SB3's: positions per env, capped at buffer_size // n_envs


@pytest.mark.parametrize("n_envs", [1, 3])
def test_size_counts_positions_per_env_as_sb3s(tmp_path, n_envs):
    """``size()`` after every ``add``, filling and wrapping, equals SB3's ``ReplayBuffer``."""
    space = spaces.Box(0, 255, (4, 5, 5), np.uint8)
    ref = ReplayBuffer(48, space, spaces.Discrete(3), device="cpu", n_envs=n_envs)
    ours = FrameOnceReplayBuffer(48, space, spaces.Discrete(3), device="cpu", n_envs=n_envs,
                                 path=tmp_path / "s", frame_stack=4, seed=0)
    venv = VecFrameStack(DummyVecEnv([lambda i=i: RandomFrames((1, 5, 5), i)
                                      for i in range(n_envs)]), 4)
    rng = np.random.default_rng(0)
    obs, sizes = venv.reset(), []
    for _ in range(70):
        actions = rng.integers(0, 3, n_envs)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done:
                next_obs[i] = infos[i]["terminal_observation"]
        for buf in (ref, ours):
            buf.add(obs, next_obs, actions, rewards, dones, infos)
        sizes.append((ours.size(), ref.size()))
        obs = new_obs
    assert [a for a, _ in sizes] == [b for _, b in sizes]
    assert sizes[-1][1] == 48 // n_envs  # wrapped: capped as SB3 caps it
    ours.close()


def test_zero_padding_matches_vecframestack(tmp_path):
    """An episode's first stack is rebuilt as VecFrameStack made it: zeros, then o_0."""
    space = spaces.Box(0, 255, (7, 7, 4), np.uint8)
    ref, ours = make_pair(tmp_path, space, n_envs=1, n_steps=1, channels_order="last")
    drive([ref, ours], n_envs=1, frame_shape=(7, 7, 1), steps=40, seed=3,
          channels_order="last")
    first = ours.get(np.array([0]))
    assert not first.observations[0, ..., :3].any() and first.observations[0, ..., 3].all()
    assert torch.equal(first.observations[0], torch.from_numpy(ref.observations[0, 0]))


# -- ports of SB3's tests/test_n_step_replay.py, run against the adapter ----------------------
def nstep_buffer(tmp_path: Path, n_steps: int = 3, gamma: float = 0.99) -> FrameOnceReplayBuffer:
    return FrameOnceReplayBuffer(10, spaces.Box(0, 1, (4,), np.float32),
                                 spaces.Box(0, 1, (2,), np.float32), device="cpu",
                                 path=tmp_path / f"s{n_steps}", n_steps=n_steps, gamma=gamma)


def fill_buffer(buffer, length, done_at=None, truncated_at=None):
    for i in range(length):
        obs = np.full((1, 4), i, dtype=np.float32)
        next_obs = np.full((1, 4), i + 1, dtype=np.float32)
        done = np.array([1.0 if i == done_at else 0.0])
        infos = [{"TimeLimit.truncated": i == truncated_at}]
        buffer.add(obs, next_obs, np.zeros((1, 2), np.float32), np.array([1.0]), done, infos)


def expected_return(gamma: float, n_steps: int, stop_idx: int | None = None) -> float:
    rewards = [gamma**i for i in range(n_steps)]
    return sum(rewards if stop_idx is None else rewards[: stop_idx + 1])


@pytest.mark.parametrize("done_at", [1, 2])
@pytest.mark.parametrize("n_steps", [3, 5])
def test_nstep_early_termination(tmp_path, done_at, n_steps):
    buffer = nstep_buffer(tmp_path, n_steps)
    fill_buffer(buffer, length=5, done_at=done_at)
    batch = buffer.get(np.array([0]))
    np.testing.assert_allclose(batch.rewards.item(), expected_return(0.99, n_steps, done_at),
                               rtol=1e-6)
    assert batch.dones.item() == 1.0
    assert batch.next_observations[0, 0].item() == done_at + 1


@pytest.mark.parametrize("truncated_at", [1, 2])
def test_nstep_early_truncation(tmp_path, truncated_at):
    buffer = nstep_buffer(tmp_path)
    fill_buffer(buffer, length=5, truncated_at=truncated_at)
    batch = buffer.get(np.array([0]))
    np.testing.assert_allclose(batch.rewards.item(), expected_return(0.99, 3, truncated_at),
                               rtol=1e-6)
    assert batch.dones.item() == 0.0
    np.testing.assert_allclose(batch.discounts.item(), 0.99 ** (truncated_at + 1), rtol=1e-6)


@pytest.mark.parametrize("n_steps", [3, 5])
def test_nstep_no_termination_or_truncation(tmp_path, n_steps):
    buffer = nstep_buffer(tmp_path, n_steps)
    fill_buffer(buffer, length=10)
    batch = buffer.get(np.array([3]))
    np.testing.assert_allclose(batch.rewards.item(), expected_return(0.99, n_steps), rtol=1e-6)
    assert batch.dones.item() == 0.0
    assert batch.next_observations[0, 0].item() == 3 + n_steps


def test_nstep_one_matches_normal_buffer(tmp_path):
    buffer = nstep_buffer(tmp_path, n_steps=1)
    ref = ReplayBuffer(10, spaces.Box(0, 1, (4,), np.float32), spaces.Box(0, 1, (2,), np.float32),
                       device="cpu")
    fill_buffer(buffer, length=10)
    fill_buffer(ref, length=10)
    got, want = buffer.get(np.array([3])), sb3_samples(ref, np.array([3]), np.array([0]))
    for name in ("observations", "actions", "next_observations", "dones", "rewards"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# -- ports of SB3's tests/test_buffers.py (normalization, device) ----------------------------
class CyclingEnv(gym.Env):
    """SB3's test DummyEnv: observations and rewards cycle through 1..5."""

    def __init__(self) -> None:
        self.action_space = spaces.Box(1, 5, (1,))
        self.observation_space = spaces.Box(1, 5, (1,))
        self._t = 0

    def reset(self, *, seed=None, options=None):
        self._t = 0
        return np.array([1.0], np.float32), {}

    def step(self, action):
        index = self._t % 5
        self._t += 1
        return np.array([index + 1.0], np.float32), index + 1.0, self._t >= 100, False, {}


def add_unnormalized(buffer, env, steps):
    """`steps` random steps of the VecNormalize `env` added to `buffer` as raw observations
    and rewards (what SB3's algorithms store)."""
    env.reset()
    obs = env.get_original_obs()
    for _ in range(steps):
        action = env.action_space.sample()
        _, _, done, info = env.step(action)
        next_obs, reward = env.get_original_obs(), env.get_original_reward()
        buffer.add(obs, next_obs, action, reward, done, info)
        obs = next_obs


def test_sample_normalizes_with_vecnormalize(tmp_path):
    env = VecNormalize(make_vec_env(CyclingEnv))
    buffer = FrameOnceReplayBuffer(100, env.observation_space, env.action_space, device="cpu",
                                   path=tmp_path / "s")
    add_unnormalized(buffer, env, 100)
    sample = buffer.sample(50, env)
    raw = buffer.sample(50)
    for observations in (sample.observations, sample.next_observations):
        assert torch.allclose(observations.mean(0), torch.zeros(1), atol=1)
    assert np.allclose(sample.rewards.mean(0), np.zeros(1), atol=1)
    assert raw.observations.min() >= 1 and raw.rewards.min() >= 1  # unnormalized without env


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_samples_on_buffer_device(tmp_path, device):
    env = make_vec_env(CyclingEnv)
    buffer = FrameOnceReplayBuffer(100, env.observation_space, env.action_space, device=device,
                                   path=tmp_path / "s")
    obs = env.reset()
    for _ in range(20):
        action = np.array([env.action_space.sample()])
        next_obs, reward, done, info = env.step(action)
        buffer.add(obs, next_obs, action, reward, done, info)
        obs = next_obs
    want = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"
    data = buffer.sample(10)
    for value in (data.observations, data.actions, data.next_observations, data.dones,
                  data.rewards):
        assert value.device.type == want
    buffer.device = torch.device("meta")  # load_replay_buffer reassigns the device
    assert buffer.sample(2).observations.device.type == "meta"


# -- SB3 algorithms: learn, save/load, replay buffer round trip ------------------------------
def tiny_image_env(n_envs: int = 2) -> VecFrameStack:
    return VecFrameStack(make_vec_env(lambda: FakeImageEnv(screen_height=36, screen_width=36,
                                                           n_channels=1, discrete=True),
                                      n_envs=n_envs, seed=0), n_stack=4)


def tiny_dqn(env, path: Path, **kwargs) -> DQN:
    return DQN("CnnPolicy", env, buffer_size=400, learning_starts=30, batch_size=8,
               train_freq=8, seed=0,
               policy_kwargs=dict(net_arch=[8], features_extractor_kwargs=dict(features_dim=8)),
               replay_buffer_class=FrameOnceReplayBuffer,
               replay_buffer_kwargs=dict(path=str(path), frame_stack=4), **kwargs)


@pytest.mark.integration
def test_dqn_cnn_learn_save_load_and_replay_buffer_round_trip(tmp_path):
    env = tiny_image_env()
    model = tiny_dqn(env, tmp_path / "store")
    model.learn(120)
    first = model.num_timesteps
    model.learn(40)  # a second learn(): the envs reset with no done flag
    buf = model.replay_buffer
    assert isinstance(buf, FrameOnceReplayBuffer)
    total = first + model.num_timesteps
    assert buf.store.counts.transitions == total
    before = buf.get(buf.store.valid_ids())
    model.save(tmp_path / "model.zip")
    model.save_replay_buffer(tmp_path / "buffer.pkl")
    with ReplayStore.open(tmp_path / "store", mode="r") as reader:  # flushed by the pickling
        assert reader.counts.transitions == total
    stream = io.BytesIO()
    model.save_replay_buffer(stream)  # SB3 also takes file objects
    assert 0 < len(stream.getvalue()) < 4 * 2 * 4 * 36 * 36 + 8192
    state = pickle.loads((tmp_path / "buffer.pkl").read_bytes()).__getstate__()
    assert set(state) == {"version", "path", "config", "observation_space", "action_space",
                          "device", "running", "last_next", "ended", "mode", "at"}
    assert (tmp_path / "buffer.pkl").stat().st_size < 4 * 2 * 4 * 36 * 36 + 8192  # no frames
    buf.close()
    del model, buf

    loaded = DQN.load(tmp_path / "model.zip", env=env)  # builds a buffer on the same store
    assert loaded.replay_buffer.store.counts.transitions == total  # opened, not wiped
    loaded.load_replay_buffer(tmp_path / "buffer.pkl")
    again = loaded.replay_buffer
    assert isinstance(again, FrameOnceReplayBuffer) and again.device == loaded.device
    after = again.get(again.store.valid_ids())
    first_resumed = loaded.num_timesteps
    for name in ("observations", "actions", "next_observations", "dones", "rewards"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name
    loaded.learn(40, reset_num_timesteps=False)
    assert again.store.counts.transitions == total + loaded.num_timesteps - first_resumed
    again.close()


@pytest.mark.integration
def test_dqn_n_steps_is_taken_from_the_algorithm(tmp_path):
    with pytest.warns(UserWarning, match="takes n_steps=3, gamma=0.9 from the algorithm"):
        model = tiny_dqn(tiny_image_env(1), tmp_path / "a", n_steps=3, gamma=0.9)
    assert (model.replay_buffer.n_steps, model.replay_buffer.gamma) == (3, 0.9)
    assert model.replay_buffer.store.spec.n_step == 3
    model.learn(60)
    assert model.replay_buffer.sample(4).discounts is not None
    model.replay_buffer.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_steps=3, replay_buffer_kwargs=dict(n_steps=2)), "contradicts the algorithm's n_steps"),
    (dict(n_steps=3, gamma=0.9, replay_buffer_kwargs=dict(gamma=0.99)), "gamma=0.99 contradicts"),
])
def test_dqn_n_steps_conflicts_are_refused(tmp_path, kwargs, message):
    extra = kwargs.pop("replay_buffer_kwargs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=message):
            DQN("CnnPolicy", tiny_image_env(1), buffer_size=100,
                replay_buffer_class=FrameOnceReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "s"), frame_stack=4, **extra),
                **kwargs)
    assert not (tmp_path / "s").exists()


@pytest.mark.integration
def test_dqn_optimize_memory_usage_and_no_timeout_handling(tmp_path):
    model = DQN("CnnPolicy", tiny_image_env(1), buffer_size=200, learning_starts=20,
                batch_size=4, optimize_memory_usage=True, seed=0,
                policy_kwargs=dict(net_arch=[8], features_extractor_kwargs=dict(features_dim=8)),
                replay_buffer_class=FrameOnceReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "s"), frame_stack=4,
                                          handle_timeout_termination=False))
    model.learn(50)
    first = model.num_timesteps
    model.learn(30)  # SB3's "truncate last trajectory" path for optimize_memory_usage
    assert model.replay_buffer.optimize_memory_usage
    assert model.replay_buffer.store.counts.transitions == first + model.num_timesteps
    model.replay_buffer.close()


def test_without_timeout_handling_every_done_terminates(tmp_path):
    space = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    ours = FrameOnceReplayBuffer(1000, space, spaces.Discrete(3), device="cpu",
                                 path=tmp_path / "s", frame_stack=4,
                                 handle_timeout_termination=False)
    ref = ReplayBuffer(1000, space, spaces.Discrete(3), device="cpu",
                       handle_timeout_termination=False)
    drive([ref, ours], n_envs=1, frame_shape=(1, 6, 5), steps=80, seed=5)
    ids = assert_same_transitions(ref, ours, 80, 1)
    assert ours.get(ids).dones.sum() == ref.dones[:80].sum() > 0


# -- bad input ---------------------------------------------------------------------------------
def test_bad_kwargs_are_refused(tmp_path):
    box = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    act = spaces.Discrete(3)
    with pytest.raises(ValueError, match="needs a store directory"):
        FrameOnceReplayBuffer(100, box, act)
    with pytest.raises(ValueError, match="not a multiple of frame_stack=3"):
        FrameOnceReplayBuffer(100, box, act, path=tmp_path / "a", frame_stack=3,
                              channels_order="first")
    with pytest.raises(ValueError, match="channels_order must be"):
        FrameOnceReplayBuffer(100, box, act, path=tmp_path / "a", frame_stack=4,
                              channels_order="middle")
    with pytest.raises(ValueError, match="cannot tell whether"):
        FrameOnceReplayBuffer(100, spaces.Box(0, 255, (8, 9, 8), np.uint8), act,
                              path=tmp_path / "a", frame_stack=4)
    with pytest.raises(ValueError, match="Box observation space"):
        FrameOnceReplayBuffer(100, spaces.Discrete(4), act, path=tmp_path / "a")
    with pytest.raises(ValueError, match="frame_stack must be a positive int"):
        FrameOnceReplayBuffer(100, box, act, path=tmp_path / "a", frame_stack=0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        FrameOnceReplayBuffer(100, box, act, path=tmp_path / "a", framestack=4)
    assert not (tmp_path / "a").exists()


def test_existing_store_is_opened_or_refused_never_wiped(tmp_path):
    box = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    ours = FrameOnceReplayBuffer(500, box, spaces.Discrete(3), device="cpu",
                                 path=tmp_path / "s", frame_stack=4)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=30, seed=1)
    ours.close()
    with pytest.raises(ValueError, match="has frame_stack=4, this buffer needs frame_stack=2"):
        FrameOnceReplayBuffer(500, box, spaces.Discrete(3), path=tmp_path / "s", frame_stack=2)
    with pytest.raises(ValueError, match="capacity"):
        FrameOnceReplayBuffer(900, box, spaces.Discrete(3), path=tmp_path / "s", frame_stack=4)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a store")
    with pytest.raises(Exception, match="manifest|store"):
        FrameOnceReplayBuffer(500, box, spaces.Discrete(3), path=tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "not a store"
    reopened = FrameOnceReplayBuffer(500, box, spaces.Discrete(3), path=tmp_path / "s",
                                     frame_stack=4)
    assert reopened.store.counts.transitions == 30
    reopened.close()


def test_bad_steps_are_refused_and_change_nothing(tmp_path):
    box = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    ours = FrameOnceReplayBuffer(500, box, spaces.Discrete(3), device="cpu",
                                 path=tmp_path / "s", frame_stack=4)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=10, seed=2)
    counts = ours.store.counts
    running = ours._running.copy()
    fresh = np.zeros((1, 4, 6, 5), np.uint8)
    fresh[0, 3] = 7
    stale = np.full((1, 4, 6, 5), 9, np.uint8)
    unshifted = fresh.copy()
    unshifted[0, 0] = 1
    info = [{}]
    cases = [
        ((stale, np.roll(stale, -1, 1), [1], [0.5], [False], info), "holds older frames"),
        ((fresh, unshifted, [1], [0.5], [False], info), "not its obs shifted"),
        ((fresh, np.roll(fresh, -1, 1), [1], [float("nan")], [False], info), "finite"),
        ((fresh[:, :2], fresh, [1], [0.5], [False], info), "obs shape"),
        ((fresh.astype(np.float32), fresh, [1], [0.5], [False], info), "dtype"),
        ((fresh, np.roll(fresh, -1, 1), [1, 2], [0.5], [False], info), "action shape"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ours.add(*args)
        assert ours.store.counts == counts and (ours._running == running).all()
    ours.close()


@pytest.mark.integration
def test_importing_needs_no_optional_dependency_and_names_the_extra():
    code = ("import sys; import mmreplay, mmreplay.tools.cli; "
            "assert 'stable_baselines3' not in sys.modules; "
            "sys.modules['stable_baselines3'] = None\n"
            "try:\n    import mmreplay.integrations.sb3\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out.startswith("mmreplay.integrations.sb3 needs"), out
    assert out.endswith(' needs stable-baselines3: pip install "mmreplay[sb3]"'), out


def test_store_is_a_plain_store(tmp_path):
    """The buffer's directory is an ordinary store: any mmreplay tool reads it."""
    box = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    ours = FrameOnceReplayBuffer(500, box, spaces.Discrete(3), device="cpu",
                                 path=tmp_path / "s", frame_stack=4)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=25, seed=4)
    ours.close()
    with ReplayStore.open(tmp_path / "s", mode="r") as store:
        assert store.spec.obs_shape == (1, 6, 5) and store.counts.transitions == 25


@pytest.mark.integration
def test_docs_snippet_runs(tmp_path, monkeypatch):
    """The SB3 guide's first snippet, with a small buffer and a short run."""
    guide = (Path(__file__).parent.parent / "docs" / "guides" / "sb3.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    small = code.replace("buffer_size=1_000_000", "buffer_size=2_000").replace(
        "model.learn(100_000)", "model.learn(64)")
    assert small != code and "FrameOnceReplayBuffer" in small
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(small, "docs/guides/sb3.md", "exec"), scope)
    buf = scope["model"].replay_buffer
    assert isinstance(buf, FrameOnceReplayBuffer) and buf.store.counts.transitions == 64
    assert buf.store.spec.obs_shape == (1, 84, 84) and buf.store.spec.frame_stack == 4
    assert (tmp_path / "runs" / "sb3_store" / "manifest.json").exists()
    buf.close()


def test_pickle_of_a_store_that_moved_on_restarts_episodes(tmp_path):
    box = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    ours = FrameOnceReplayBuffer(500, box, spaces.Discrete(3), device="cpu",
                                 path=tmp_path / "s", frame_stack=4)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=20, seed=6)
    saved = pickle.dumps(ours)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=5, seed=8)
    ours.close()
    with pytest.warns(UserWarning, match="changed since this buffer was saved"):
        back = pickle.loads(saved)
    assert not back._running.any() and back.store.counts.transitions == 25
    back._running[:] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = pickle.loads(pickle.dumps(back))  # nothing changed in between: state kept
    assert same._running.all() and same.store is back.store  # one writer per path
    back.close()
    same.close()


def test_real_atari_frames_with_life_losses_equal_sb3s(tmp_path):
    """Breakout through make_atari_env (EpisodicLifeEnv: a life loss arrives as a done
    without time-out) and VecFrameStack, channels last, 2 envs, reset mid-episode."""
    ale_py = pytest.importorskip("ale_py")
    from stable_baselines3.common.env_util import make_atari_env

    gym.register_envs(ale_py)
    venv = VecFrameStack(make_atari_env("BreakoutNoFrameskip-v4", n_envs=2, seed=0), 4)
    ref, ours = make_pair(tmp_path, venv.observation_space, n_envs=2, n_steps=3)
    ref.action_space = ours.action_space = venv.action_space
    adds = drive_venv([ref, ours], venv, steps=250, seed=0, reset_at=(120,))
    ids = assert_same_transitions(ref, ours, adds, 3)
    assert ours.layout.first is False and ours.layout.frame_shape == (84, 84, 1)
    assert ref.dones[:adds].sum() > 0  # life losses happened
    assert ids.size >= 2 * (adds - 2)
    ours.close()

"""`FrameOnceReplayBuffer` fed as cleanrl's ``dqn_atari.py`` feeds SB3's ``ReplayBuffer``.

The loop is cleanrl's: a gymnasium ``SyncVectorEnv`` of Atari envs (``AtariPreprocessing``,
``FrameStackObservation`` giving ``(4, 84, 84)`` stacks padded with the first frame),
``real_next_obs`` replaced by the final observation on truncation only,
``rb.add(obs, real_next_obs, actions, rewards, terminations, infos)`` per step. Short
episodes (life losses end them, a ``TimeLimit`` truncates them) put many episode edges in a
few hundred steps. Every transition the store holds is compared with SB3's buffer fed the
same stream and with the stream itself; then the refusals, on small synthetic stacks.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3", reason='pip install "mmreplay[sb3]"')
ale_py = pytest.importorskip("ale_py", reason='pip install "mmreplay[atari]"')

import gymnasium as gym  # noqa: E402
from gymnasium import spaces  # noqa: E402
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TimeLimit  # noqa: E402
from mmreplay.sb3 import FrameOnceReplayBuffer  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402

gym.register_envs(ale_py)
SAME, NEXT = gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.NEXT_STEP


def atari_env(max_steps: int, padding: str) -> gym.Env:
    env = gym.make("BreakoutNoFrameskip-v4")
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=10,
                             terminal_on_life_loss=True)
    env = TimeLimit(env, max_episode_steps=max_steps)
    return FrameStackObservation(env, 4, padding_type=padding)


def make_envs(n_envs: int, mode: Any, padding: str = "reset") -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda i=i: atari_env(25 + 7 * i, padding) for i in range(n_envs)], autoreset_mode=mode)


@dataclass
class Log:
    """What the loop added, one entry per ``add``."""

    obs: list[np.ndarray] = field(default_factory=list)
    next_obs: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    terminated: list[np.ndarray] = field(default_factory=list)
    truncated: list[np.ndarray] = field(default_factory=list)


def cleanrl_loop(envs: gym.vector.SyncVectorEnv, buffers: list, steps: int, seed: int) -> Log:
    """cleanrl's dqn_atari.py data path, random actions; in next-step mode the final
    observation is ``next_obs`` itself (gymnasium 1.x puts none in ``infos``)."""
    rng = np.random.default_rng(seed)
    log = Log()
    obs, _ = envs.reset(seed=seed)
    for _ in range(steps):
        actions = rng.integers(0, envs.single_action_space.n, envs.num_envs)
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        real_next_obs = next_obs.copy()
        for idx, trunc in enumerate(truncations):
            if trunc and "final_obs" in infos:
                real_next_obs[idx] = infos["final_obs"][idx]
        for rb in buffers:
            rb.add(obs, real_next_obs, actions, rewards, terminations, infos)
        for column, value in zip(
                (log.obs, log.next_obs, log.actions, log.rewards, log.terminated, log.truncated),
                (obs, real_next_obs, actions, rewards, terminations, truncations), strict=True):
            column.append(np.array(value))
        obs = next_obs
    return log


def expected(log: Log, next_step: bool) -> tuple[dict[str, np.ndarray], int]:
    """The stream's transitions in store id order (per add, env by env), skipping next-step
    reset steps, and the number of episode starts."""
    rows: dict[str, list] = {k: [] for k in ("obs", "next_obs", "action", "reward",
                                             "terminated", "truncated")}
    n_envs = log.obs[0].shape[0]
    ended, starts = np.zeros(n_envs, bool), n_envs
    for t in range(len(log.obs)):
        for i in range(n_envs):
            if next_step and ended[i]:
                starts += 1  # a reset step: no transition, R starts the next episode
                ended[i] = False
                continue
            if not next_step and ended[i]:
                starts += 1
            rows["obs"].append(log.obs[t][i])
            rows["next_obs"].append(log.next_obs[t][i])
            rows["action"].append(log.actions[t][i])
            rows["reward"].append(log.rewards[t][i])
            rows["terminated"].append(log.terminated[t][i])
            # an end both terminated and truncated is terminated (no bootstrap)
            rows["truncated"].append(log.truncated[t][i] and not log.terminated[t][i])
            ended[i] = log.terminated[t][i] or log.truncated[t][i]
    return {k: np.array(v) for k, v in rows.items()}, starts


def ours_for(envs: gym.vector.SyncVectorEnv, path: Path, size: int, **kwargs: Any
             ) -> FrameOnceReplayBuffer:
    """The buffer as cleanrl would build it: its SB3 arguments, plus a path and the stack."""
    return FrameOnceReplayBuffer(size, envs.single_observation_space, envs.single_action_space,
                                 "cpu", n_envs=envs.num_envs, optimize_memory_usage=True,
                                 handle_timeout_termination=False, path=path, frame_stack=4,
                                 channels_order="first", seed=0, **kwargs)


def sb3_for(envs: gym.vector.SyncVectorEnv, optimize: bool) -> ReplayBuffer:
    return ReplayBuffer(1000, envs.single_observation_space, envs.single_action_space, "cpu",
                        n_envs=envs.num_envs, optimize_memory_usage=optimize,
                        handle_timeout_termination=False)


def assert_stream_held(ours: FrameOnceReplayBuffer, want: dict[str, np.ndarray],
                       starts: int) -> np.ndarray:
    """Every transition the store can sample is the stream's, and each frame was written
    once: one per transition, one per episode start. Returns the ids compared."""
    ids = ours.store.valid_ids()
    assert ids.size > 100
    got, batch = ours.get(ids), ours.store.get(ids)
    live = ~want["terminated"][ids]  # a terminated step's next state is never used
    assert np.array_equal(got.observations.numpy(), want["obs"][ids])
    assert np.array_equal(got.next_observations.numpy()[live], want["next_obs"][ids][live])
    assert np.array_equal(got.actions.numpy()[:, 0], want["action"][ids])
    assert np.array_equal(got.rewards.numpy()[:, 0], want["reward"][ids].astype(np.float32))
    assert np.array_equal(got.dones.numpy()[:, 0], want["terminated"][ids].astype(np.float32))
    assert np.array_equal(batch.truncated.numpy(), want["truncated"][ids])
    counts = ours.store.counts
    assert counts.transitions == want["obs"].shape[0]
    assert counts.frames_written == counts.transitions + starts
    return ids


@pytest.mark.parametrize("n_envs", [1, 2])
def test_cleanrl_same_step_loop_equals_sb3s_buffer(tmp_path, n_envs):
    envs = make_envs(n_envs, SAME)
    ours = ours_for(envs, tmp_path / "rb", size=120 * n_envs)  # wraps: old frames evicted
    ref, plain = sb3_for(envs, optimize=True), sb3_for(envs, optimize=False)
    log = cleanrl_loop(envs, [ours, ref, plain], steps=300, seed=n_envs)
    want, starts = expected(log, next_step=False)
    assert want["terminated"].sum() >= 3 and want["truncated"].sum() >= 3  # edges happened
    assert ours.store.spec.stack_padding == "first"  # read off FrameStackObservation's reset
    ids = assert_stream_held(ours, want, starts)
    assert ours.store.counts.frames_kept < ours.store.counts.frames_written

    # SB3's buffers at the same transitions: id k * n_envs + i is env i's k-th add.
    store = ours.store
    store.reseed(3)
    drawn = store.sample(32)
    for sel in (ids, drawn.ids.numpy()):
        got = ours.samples(store.get(sel))
        pos, env = sel // n_envs, sel % n_envs
        assert torch.equal(got.observations, torch.from_numpy(ref.observations[pos, env]))
        assert torch.equal(got.actions[:, 0], torch.from_numpy(ref.actions[pos, env, 0]))
        assert torch.equal(got.rewards[:, 0], torch.from_numpy(ref.rewards[pos, env]))
        assert torch.equal(got.dones[:, 0], torch.from_numpy(ref.dones[pos, env]))
        live = got.dones[:, 0].numpy() == 0  # SB3 trains on next_obs only there
        assert np.array_equal(got.next_observations.numpy()[live],
                              plain.next_observations[pos, env][live])
        # optimize_memory_usage=True reads next_obs from the next add's obs: the same but
        # at truncations, where that is the next episode's first stack
        inside = live & ~store.get(sel).truncated.numpy()
        assert np.array_equal(got.next_observations.numpy()[inside],
                              ref.observations[pos + 1, env][inside])
    batch = ours.sample(32)  # what cleanrl's update reads
    assert batch.observations.shape == (32, 4, 84, 84) and batch.actions.shape == (32, 1)
    ours.close()


@pytest.mark.parametrize("n_envs", [1, 2])
def test_cleanrl_next_step_loop_skips_reset_steps(tmp_path, n_envs):
    envs = make_envs(n_envs, NEXT)
    ours = ours_for(envs, tmp_path / "rb", size=1000)
    log = cleanrl_loop(envs, [ours], steps=250, seed=10 + n_envs)
    want, starts = expected(log, next_step=True)
    assert starts >= n_envs + 4
    assert_stream_held(ours, want, starts)
    assert ours._edges.mode == "next-step"
    ours.close()


def test_declared_modes_take_the_same_streams(tmp_path):
    for mode, name in ((SAME, "same-step"), (NEXT, "next-step")):
        envs = make_envs(1, mode)
        ours = ours_for(envs, tmp_path / name, size=1000, autoreset_mode=name,
                        stack_padding="first")
        log = cleanrl_loop(envs, [ours], steps=120, seed=5)
        want, starts = expected(log, next_step=mode == NEXT)
        assert_stream_held(ours, want, starts)
        ours.close()


def test_zero_padded_frame_stacks_are_detected(tmp_path):
    envs = make_envs(2, SAME, padding="zero")
    ours = ours_for(envs, tmp_path / "rb", size=1000)
    log = cleanrl_loop(envs, [ours], steps=120, seed=7)
    assert ours.store.spec.stack_padding == "zero"
    want, starts = expected(log, next_step=False)
    assert_stream_held(ours, want, starts)
    ours.close()


def test_cleanrl_cartpole_next_step_loop_through_the_staged_path(tmp_path):
    """cleanrl's dqn.py (CartPole, no stacking) on next-step autoreset: the one-env buffer
    stages steps in RAM, and hands the step after each end to the plan, which skips it.
    (Every end here is a termination: an unstacked obs cannot show an unflagged one.)"""
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")], autoreset_mode=NEXT)
    ours = FrameOnceReplayBuffer(1000, envs.single_observation_space, envs.single_action_space,
                                 "cpu", optimize_memory_usage=True,
                                 handle_timeout_termination=False, path=tmp_path / "rb", seed=0)
    assert ours._stage is not None
    log = cleanrl_loop(envs, [ours], steps=400, seed=3)
    assert ours._stage.size > 0  # staged, not recorded yet
    want, starts = expected(log, next_step=True)
    assert starts >= 10
    assert_stream_held(ours, want, starts)
    ours.close()


# -- refusals, on (4, 3, 2) stacks of one-channel frames --------------------------------------
BOX = spaces.Box(0, 255, (4, 3, 2), np.uint8)


def stack(*frames: int) -> np.ndarray:
    """``(1, 4, 3, 2)``: one stack of frames filled with these values, oldest first."""
    return np.array([np.full((3, 2), v, np.uint8) for v in frames])[None]


def small(tmp_path: Path, **kwargs: Any) -> FrameOnceReplayBuffer:
    return FrameOnceReplayBuffer(100, BOX, spaces.Discrete(3), "cpu", path=tmp_path / "s",
                                 frame_stack=4, channels_order="first",
                                 handle_timeout_termination=False, **kwargs)


def step(buf: FrameOnceReplayBuffer, obs, next_obs, *, reward=0.0, term=False,
         infos: Any = None) -> None:
    buf.add(obs, next_obs, np.array([1]), np.array([reward]), np.array([term]),
            {} if infos is None else infos)


def final(obs: np.ndarray) -> dict[str, Any]:
    return {"final_obs": np.array([obs[0]]), "_final_obs": np.array([True])}


def assert_refused(buf: FrameOnceReplayBuffer, message: str, *args, **kwargs) -> None:
    counts, edges = buf.store.counts, buf._edges
    before = (edges.running.copy(), edges.ended.copy(), edges.last_next.copy(), edges.mode)
    with pytest.raises(ValueError, match=message):
        step(buf, *args, **kwargs)
    assert buf.store.counts == counts
    after = (edges.running, edges.ended, edges.last_next, edges.mode)
    assert all(np.array_equal(a, b) for a, b in zip(before[:3], after[:3], strict=True))
    assert before[3] == after[3]


def test_a_declared_padding_refuses_the_other(tmp_path):
    buf = small(tmp_path, stack_padding="zero")
    with pytest.raises(ValueError, match=r"holds older frames.*zeros \(stack_padding='zero'"):
        step(buf, stack(5, 5, 5, 5), stack(5, 5, 5, 6))
    step(buf, stack(0, 0, 0, 5), stack(0, 0, 5, 6))
    assert_refused(buf, "holds older frames", stack(7, 7, 7, 7), stack(7, 7, 7, 8))
    buf.close()


def test_mixed_paddings_are_refused(tmp_path):
    box = spaces.Box(0, 255, (4, 3, 2), np.uint8)
    buf = FrameOnceReplayBuffer(100, box, spaces.Discrete(3), "cpu", n_envs=2,
                                path=tmp_path / "s", frame_stack=4, channels_order="first")
    obs = np.concatenate([stack(0, 0, 0, 5), stack(4, 4, 4, 4)])
    nxt = np.concatenate([stack(0, 0, 5, 6), stack(4, 4, 4, 6)])
    with pytest.raises(ValueError, match=r"first stacks of envs \[0, 1\] hold older frames"):
        buf.add(obs, nxt, np.array([1, 1]), np.array([0.0, 0.0]), np.array([False, False]), {})
    with pytest.raises(ValueError, match="no store"):
        _ = buf.store  # nothing was created
    buf.close()


def test_terminated_step_with_the_next_episodes_stack_is_stored(tmp_path):
    buf = small(tmp_path)
    step(buf, stack(1, 1, 1, 1), stack(1, 1, 1, 2))
    step(buf, stack(1, 1, 1, 2), stack(9, 9, 9, 9), reward=1.0, term=True)  # cleanrl: R
    step(buf, stack(9, 9, 9, 9), stack(9, 9, 9, 3))
    got = buf.get(np.arange(3))
    assert got.dones[:, 0].tolist() == [0.0, 1.0, 0.0]
    assert torch.equal(got.observations[2], torch.from_numpy(stack(9, 9, 9, 9)[0]))
    assert buf.store.counts.frames_written == 5 and buf.store.spec.stack_padding == "first"
    buf.close()


def test_the_final_obs_in_infos_is_the_next_obs_where_next_obs_is_not(tmp_path):
    buf = small(tmp_path)
    step(buf, stack(1, 1, 1, 1), stack(1, 1, 1, 2))
    # a truncation whose next_obs was left as the reset stack: infos hold the real one
    step(buf, stack(1, 1, 1, 2), stack(9, 9, 9, 9), infos=final(stack(1, 1, 2, 4)))
    got, batch = buf.get([1]), buf.store.get([1])
    assert torch.equal(got.next_observations[0], torch.from_numpy(stack(1, 1, 2, 4)[0]))
    assert batch.truncated.tolist() == [True] and got.dones.tolist() == [[0.0]]
    assert buf._edges.mode == "same-step"
    buf.close()


def test_streams_that_would_return_wrong_data_are_refused(tmp_path):
    buf = small(tmp_path, autoreset_mode="same-step")
    step(buf, stack(1, 1, 1, 1), stack(1, 1, 1, 2))
    # not shifted, not terminated, nothing in infos: a truncation left unreplaced
    assert_refused(buf, "not its obs shifted by one frame, and infos carry no final",
                   stack(1, 1, 1, 2), stack(9, 9, 9, 9))
    assert_refused(buf, "nor is the final observation in infos", stack(1, 1, 1, 2),
                   stack(9, 9, 9, 9), infos=final(stack(3, 3, 3, 3)))
    assert_refused(buf, r"final observation of env 0 in infos has shape \(4, 3\)",
                   stack(1, 1, 1, 2), stack(1, 1, 2, 3), infos={"final_obs": [np.zeros((4, 3))],
                                                               "_final_obs": [True]})
    buf.close()


def test_next_step_streams_refuse_what_they_cannot_hold(tmp_path):
    buf = small(tmp_path, autoreset_mode="next-step")
    step(buf, stack(1, 1, 1, 1), stack(1, 1, 1, 2))
    assert_refused(buf, "same-step autoreset", stack(1, 1, 1, 2), stack(1, 1, 2, 3),
                   term=True, infos=final(stack(1, 1, 2, 3)))
    step(buf, stack(1, 1, 1, 2), stack(1, 1, 2, 3), term=True)  # F = [1 1 2 3]
    assert_refused(buf, r"must only reset it .* got reward 2.0", stack(1, 1, 2, 3),
                   stack(8, 8, 8, 8), reward=2.0)
    step(buf, stack(1, 1, 2, 3), stack(8, 8, 8, 8))  # the reset step: no transition
    step(buf, stack(8, 8, 8, 8), stack(8, 8, 8, 5))
    assert buf.store.counts.transitions == 3 and buf.store.counts.episodes == 2
    buf.close()


def test_an_unflagged_next_step_end_truncates_the_episode(tmp_path):
    buf = small(tmp_path)
    step(buf, stack(1, 1, 1, 1), stack(1, 1, 1, 2))
    step(buf, stack(1, 1, 1, 2), stack(1, 1, 2, 3))  # truncated: cleanrl passes no flag
    step(buf, stack(1, 1, 2, 3), stack(8, 8, 8, 8))  # the reset step
    step(buf, stack(8, 8, 8, 8), stack(8, 8, 8, 5))
    batch = buf.store.get(np.arange(3))
    assert batch.truncated.tolist() == [False, True, False]
    assert batch.terminated.tolist() == [False, False, False]
    assert buf._edges.mode == "next-step"
    buf.close()


def test_the_store_is_committed_every_flush_every_adds(tmp_path):
    buf = small(tmp_path, flush_every=50)
    frames = np.arange(1, 200)
    obs = stack(*[frames[0]] * 4)
    for t in range(120):
        nxt = np.concatenate([obs[:, 1:], stack(*[frames[t + 1]] * 4)[:, :1]], axis=1)
        step(buf, obs, nxt)
        obs = nxt
    with ReplayStore.open(tmp_path / "s", mode="r") as reader:  # what a crash would keep
        assert reader.counts.transitions == 99  # committed before the 100th add
    assert buf.store.counts.transitions == 120
    buf.close()


@pytest.mark.parametrize("infos, padding", [({}, "first"), ([{}], "zero")])
def test_a_first_stack_of_zeros_takes_the_padding_of_its_source(tmp_path, infos, padding):
    """o_0 of zeros fits both paddings: gymnasium (infos a dict) pads with o_0, SB3 with zeros."""
    buf = small(tmp_path)
    step(buf, stack(0, 0, 0, 0), stack(0, 0, 0, 4), infos=infos)
    assert buf.store.spec.stack_padding == padding
    buf.close()


def test_pickled_buffers_keep_their_episode_edges(tmp_path):
    pending = pickle.loads(pickle.dumps(small(tmp_path)))  # no store yet: created at add
    step(pending, stack(2, 2, 2, 2), stack(2, 2, 2, 3))
    step(pending, stack(2, 2, 2, 3), stack(2, 2, 3, 4), term=True)  # next-step: F = next_obs
    step(pending, stack(2, 2, 3, 4), stack(6, 6, 6, 6))  # the reset step
    again = pickle.loads(pickle.dumps(pending))
    assert again._edges.mode == "next-step" and again.store.spec.stack_padding == "first"
    step(again, stack(6, 6, 6, 6), stack(6, 6, 6, 7))
    assert again.store.counts.transitions == 3 and again.store.counts.episodes == 2
    again.close()
    pending.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(stack_padding="reset"), r"stack_padding must be None or one of \('zero', 'first'\)"),
    (dict(autoreset_mode="next"), r"autoreset_mode must be None or one of"),
    (dict(flush_every=0), "flush_every must be a positive int, got 0"),
])
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        small(tmp_path, **kwargs)

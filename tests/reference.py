"""Naive reference implementation of the replay semantics, for equivalence tests.

Deliberately simple: every env keeps a plain list of episodes, every frame ever written is kept
in memory, and `expected()` recomputes every transition from scratch with Python loops. Nothing
here is meant to be fast; it is meant to be obviously correct when read next to the spec:

    env stream:   o_0 o_1 o_2 ... o_T | o_0 o_1 ... (next episode)
    step t:       (stack(o_t), a_t, R, stack(o_{t+m}), discount)
                  m = min(n_step, steps from t to the episode's last step)
                  R = sum_{j<m} gamma^j r_{t+j}
                  discount = 0 if the episode terminated at step t+m-1 else gamma^m

Each env keeps only its most recent `capacity // num_envs` frames; a transition is sampleable
iff every real frame it reads is still kept and its n-step window is complete. Input is not
validated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Episode:
    """One episode of one env: frames o_0..o_L and the L recorded steps between them."""

    start: int  # index of o_0 in the env's frame stream (counts every frame the env got)
    frames: list[np.ndarray] = field(default_factory=list)
    actions: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    terminated: bool = False  # the last recorded step terminated the episode
    truncated: bool = False  # the last recorded step truncated the episode
    ended: bool = False

    def num_steps(self) -> int:
        return len(self.actions)


class ReferenceReplay:
    """Recording API of `ReplayStore`, plus `expected()`: every sampleable transition."""

    def __init__(
        self,
        *,
        capacity: int,
        obs_shape: tuple[int, ...],
        num_envs: int = 1,
        frame_stack: int = 1,
        n_step: int = 1,
        gamma: float = 0.99,
        stack_padding: str = "zero",
    ) -> None:
        self.capacity = capacity
        self.obs_shape = tuple(obs_shape)
        self.num_envs = num_envs
        self.frame_stack = frame_stack
        self.n_step = n_step
        self.gamma = gamma
        self.stack_padding = stack_padding
        self.frames_per_env = capacity // num_envs
        self.episodes: list[list[Episode]] = [[] for _ in range(num_envs)]
        self.frames_written = [0 for _ in range(num_envs)]
        self.next_id = 0

    # ----------------------------------------------------------------- recording

    def reset(self, obs: Any, env_ids: Any = None) -> None:
        """Start a new episode with o_0 = obs in every env (or in the listed envs)."""
        if env_ids is None:
            env_ids = list(range(self.num_envs))
            if self.num_envs == 1:
                obs = [obs]
        for i, env in enumerate(env_ids):
            self._start_episode(int(env), obs[i])

    def add(
        self,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        autoreset: Any = None,
        env_ids: Any = None,
    ) -> None:
        """One step of every env (or of the listed envs, row i for env_ids[i], in that order);
        where autoreset is True the env starts a new episode instead."""
        if env_ids is None:
            env_ids = list(range(self.num_envs))
            if self.num_envs == 1:
                action, reward, next_obs = [action], [reward], [next_obs]
                terminated, truncated = [terminated], [truncated]
                if autoreset is not None:
                    autoreset = [autoreset]
        if autoreset is None:
            autoreset = [False for _ in env_ids]
        for i, env in enumerate(int(e) for e in env_ids):
            if bool(autoreset[i]):
                self._start_episode(env, next_obs[i])
            else:
                self._step(
                    env,
                    action[i],
                    reward[i],
                    next_obs[i],
                    bool(terminated[i]),
                    bool(truncated[i]),
                )

    def _start_episode(self, env: int, frame: Any) -> None:
        episodes = self.episodes[env]
        if episodes and not episodes[-1].ended:
            # A running episode is cut: its last recorded step (if any) becomes truncated.
            if episodes[-1].num_steps() > 0:
                episodes[-1].truncated = True
            episodes[-1].ended = True
        episode = Episode(start=self.frames_written[env])
        episodes.append(episode)
        self._write_frame(env, episode, frame)

    def _step(
        self, env: int, action: Any, reward: Any, frame: Any, terminated: bool, truncated: bool
    ) -> None:
        episode = self.episodes[env][-1]
        episode.actions.append(action)
        episode.rewards.append(float(reward))
        episode.ids.append(self.next_id)
        self.next_id += 1
        self._write_frame(env, episode, frame)
        if terminated:
            episode.terminated = True
        if truncated:
            episode.truncated = True
        if terminated or truncated:
            episode.ended = True

    def _write_frame(self, env: int, episode: Episode, frame: Any) -> None:
        episode.frames.append(np.array(frame, copy=True))
        self.frames_written[env] += 1

    # ----------------------------------------------------------------- reading

    def expected(self) -> dict[int, dict[str, Any]]:
        """Every sampleable transition id -> its fields, recomputed from scratch."""
        result: dict[int, dict[str, Any]] = {}
        for env in range(self.num_envs):
            for episode in self.episodes[env]:
                for t in range(episode.num_steps()):
                    transition = self._transition(env, episode, t)
                    if transition is not None:
                        result[episode.ids[t]] = transition
        return result

    def _transition(self, env: int, episode: Episode, t: int) -> dict[str, Any] | None:
        num_steps = episode.num_steps()
        if t + self.n_step <= num_steps:
            m = self.n_step
        elif episode.ended:
            m = num_steps - t
        else:
            return None  # n-step window not complete yet
        if not self._stack_kept(env, episode, t) or not self._stack_kept(env, episode, t + m):
            return None
        ends_at_window = t + m == num_steps  # the window's last step is the episode's last step
        terminated = episode.terminated and ends_at_window
        truncated = episode.truncated and ends_at_window
        reward = 0.0
        for j in range(m):
            reward += self.gamma**j * episode.rewards[t + j]
        return {
            "obs": self._stack(episode, t),
            "action": episode.actions[t],
            "reward": reward,
            "next_obs": self._stack(episode, t + m),
            "terminated": terminated,
            "truncated": truncated,
            "discount": 0.0 if terminated else self.gamma**m,
        }

    def _stack_kept(self, env: int, episode: Episode, i: int) -> bool:
        """Whether every real frame of stack(o_i) is among the env's most recent frames."""
        oldest_kept = self.frames_written[env] - self.frames_per_env
        for position in range(i - self.frame_stack + 1, i + 1):
            if position >= 0 and episode.start + position < oldest_kept:
                return False
        return True

    def _stack(self, episode: Episode, i: int) -> np.ndarray:
        """stack(o_i) = o_{i-k+1..i}; positions before o_0 are zeros or o_0 repeated."""
        frames = []
        for position in range(i - self.frame_stack + 1, i + 1):
            if position >= 0:
                frames.append(episode.frames[position])
            elif self.stack_padding == "first":
                frames.append(episode.frames[0])
            else:
                frames.append(np.zeros_like(episode.frames[0]))
        return np.stack(frames)

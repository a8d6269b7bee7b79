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
    extras: list[dict[str, Any]] = field(default_factory=list)  # per step, like actions
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
        extras: dict[str, Any] | None = None,
    ) -> None:
        """One step of every env (or of the listed envs, row i for env_ids[i], in that order);
        where autoreset is True the env starts a new episode instead."""
        extras = extras or {}
        if env_ids is None:
            env_ids = list(range(self.num_envs))
            if self.num_envs == 1:
                extras = {name: [value] for name, value in extras.items()}
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
                    {name: np.array(value[i]) for name, value in extras.items()},
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
        self, env: int, action: Any, reward: Any, frame: Any, terminated: bool, truncated: bool,
        extras: dict[str, Any] | None = None,
    ) -> None:
        episode = self.episodes[env][-1]
        episode.actions.append(action)
        episode.extras.append(extras or {})
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
            "steps": m,
            "extras": episode.extras[t],
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

    # ----------------------------------------------------------------- sequences

    def sequences(
        self, length: int, *, cross_episodes: bool = False, period: int = 1
    ) -> dict[int, dict[str, Any]]:
        """Every valid sequence start id -> its fields (lists of per-step values).

        Within episodes: start step t (t % period == 0) of an episode whose first stack is
        kept and which has ended or holds t + length steps; steps past the episode's end are
        padding (mask False, id -1, zero frames). Across episodes: the env's steps in order
        (the final frame of an ended episode is not a step), the start's frame number
        % period == 0, `length` steps must exist.
        """
        result: dict[int, dict[str, Any]] = {}
        for env in range(self.num_envs):
            steps = [(ep, t) for ep in self.episodes[env] for t in range(ep.num_steps())]
            for i, (episode, t) in enumerate(steps):
                if not self._stack_kept(env, episode, t):
                    continue
                if cross_episodes:
                    if (episode.start + t) % period or i + length > len(steps):
                        continue
                    window = steps[i:i + length]
                elif t % period or (t + length > episode.num_steps() and not episode.ended):
                    continue
                else:
                    window = [(episode, u) for u in range(t, min(t + length,
                                                                 episode.num_steps()))]
                result[episode.ids[t]] = self._sequence(window, length)
        return result

    def _sequence(self, window: list[tuple[Episode, int]], length: int) -> dict[str, Any]:
        zero = np.zeros((self.frame_stack, *self.obs_shape), np.uint8)
        out: dict[str, Any] = {name: [] for name in (
            "obs", "action", "reward", "terminated", "truncated", "is_first", "mask", "ids",
            "extras")}
        for episode, u in window:
            last = u == episode.num_steps() - 1
            out["obs"].append(self._stack(episode, u))
            out["action"].append(episode.actions[u])
            out["reward"].append(episode.rewards[u])
            out["terminated"].append(episode.terminated and last)
            out["truncated"].append(episode.truncated and last)
            out["is_first"].append(u == 0)
            out["mask"].append(True)
            out["ids"].append(episode.ids[u])
            out["extras"].append(episode.extras[u])
        for _ in range(length - len(window)):
            out["obs"].append(zero)
            for name, value in (("action", None), ("reward", 0.0), ("terminated", False),
                                ("truncated", False), ("is_first", False), ("mask", False),
                                ("ids", -1), ("extras", None)):
                out[name].append(value)
        episode, u = window[-1]
        out["next_obs"] = self._stack(episode, u + 1)
        return out

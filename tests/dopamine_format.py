"""Dopamine replay checkpoints for tests: a naive writer and Dopamine's sampling semantics.

`DopamineBuffer` follows google/dopamine ``OutOfGraphReplayBuffer.add`` record by record
(zero padding before each episode, circular cursor, ``invalid_range``) and `save` writes
the six ``*_ckpt.N.gz`` files as Dopamine does (gzip of ``np.save``). `dopamine_transition`
is ``sample_transition_batch`` for one index, in plain Python loops.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DopamineBuffer:
    def __init__(self, capacity: int, obs_shape: tuple[int, ...], *, stack_size: int = 4,
                 update_horizon: int = 1, gamma: float = 0.99) -> None:
        self.capacity, self.stack_size, self.h, self.gamma = (capacity, stack_size,
                                                             update_horizon, gamma)
        self.observation = np.zeros((capacity, *obs_shape), np.uint8)
        self.action = np.zeros(capacity, np.int32)
        self.reward = np.zeros(capacity, np.float32)
        self.terminal = np.zeros(capacity, np.uint8)
        self.add_count = 0
        self.invalid_range = np.zeros(stack_size)

    def cursor(self) -> int:
        return self.add_count % self.capacity

    def add(self, obs: np.ndarray, action: int, reward: float, terminal: bool) -> None:
        if self.add_count == 0 or self.terminal[self.cursor() - 1] == 1:
            for _ in range(self.stack_size - 1):
                self._add(np.zeros_like(obs), 0, 0.0, False)
        self._add(obs, action, reward, terminal)

    def _add(self, obs: np.ndarray, action: int, reward: float, terminal: bool) -> None:
        c = self.cursor()
        self.observation[c], self.action[c] = obs, action
        self.reward[c], self.terminal[c] = reward, terminal
        self.add_count += 1
        cur = self.cursor()
        self.invalid_range = np.array([(cur - self.h + i) % self.capacity
                                       for i in range(self.stack_size + self.h)])

    def save(self, directory: Path, number: int) -> None:
        arrays = {"$store$_observation": self.observation, "$store$_action": self.action,
                  "$store$_reward": self.reward, "$store$_terminal": self.terminal,
                  "add_count": np.array(self.add_count), "invalid_range": self.invalid_range}
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            write_npy_gz(directory / f"{name}_ckpt.{number}.gz", array)

    # -- Dopamine's sampling, one index at a time ---------------------------------------
    def is_full(self) -> bool:
        return self.add_count >= self.capacity

    def is_valid(self, index: int) -> bool:
        """``is_valid_transition`` (the sampling range's bounds included)."""
        if not self.is_full():
            if index >= self.cursor() - self.h or index < self.stack_size - 1:
                return False
        if index in set(self.invalid_range.tolist()):
            return False
        stack_terminals = [self.terminal[(index - j) % self.capacity]
                           for j in range(self.stack_size - 1, 0, -1)]
        return not any(stack_terminals)

    def valid_indices(self) -> list[int]:
        limit = self.capacity if self.is_full() else self.add_count
        return [i for i in range(limit) if self.is_valid(i)]

    def stack(self, index: int) -> np.ndarray:
        return np.stack([self.observation[(index - j) % self.capacity]
                         for j in range(self.stack_size - 1, -1, -1)])

    def transition(self, index: int) -> DopamineTransition:
        terminals = [bool(self.terminal[(index + j) % self.capacity]) for j in range(self.h)]
        length = terminals.index(True) + 1 if any(terminals) else self.h
        discounts = np.array([self.gamma ** j for j in range(length)], np.float32)
        rewards = np.array([self.reward[(index + j) % self.capacity] for j in range(length)])
        return DopamineTransition(
            state=self.stack(index), action=int(self.action[index]),
            reward=float(discounts.dot(rewards)), terminal=any(terminals),
            next_state=self.stack((index + length) % self.capacity))


@dataclass(frozen=True)
class DopamineTransition:
    state: np.ndarray        # (stack_size, *obs_shape), oldest first
    action: int
    reward: float
    terminal: bool
    next_state: np.ndarray


def write_npy_gz(path: Path, array: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)


def episode_records(frames: np.ndarray, is_first: np.ndarray, actions: np.ndarray,
                    rewards: np.ndarray, terminated: np.ndarray,
                    truncated: np.ndarray) -> list[tuple[np.ndarray, int, float, bool]]:
    """An `ale_frames` stream as the (o_t, a_t, r_t, terminal) records a Dopamine agent logs.

    Step ``frames[i-1] -> frames[i]`` is logged at ``frames[i-1]`` with the action and
    reward of ``i``; it is terminal when ``i`` ends its episode. The stream's last frame,
    if no step leaves it, is not logged.
    """
    records = []
    for i in range(1, len(frames)):
        if is_first[i]:
            continue
        done = bool(terminated[i] or truncated[i])
        records.append((frames[i - 1], int(actions[i]), float(rewards[i]), done))
    return records

"""Sampling distributions over flat slots; the store calls only this interface.

A sampler is told which flat slots are sampleable (``update``) and draws
``(slots, weights)`` with a `np.random.Generator` the store owns and passes in.
It knows no frames, files or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .spec import StoreSpec
from .sum_tree import SumTree


@dataclass(frozen=True)
class Draw:
    """Flat slots drawn and their importance weights (ones when uniform)."""

    slots: np.ndarray
    weights: np.ndarray


class Sampler(Protocol):
    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        """Mark `slots` sampleable where `valid` is True, else give them no mass.

        `ids` are the transition ids now in those slots: a slot whose id changed
        holds a new transition (prioritized samplers give it the max priority).
        """

    def count(self) -> int:
        """Number of sampleable slots."""

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float) -> Draw:
        """Draw `batch_size` slots with replacement (the store checks count > 0 first)."""


class UniformSampler:
    """Uniform over sampleable slots via a 0/1 sum tree.

    A draw picks ``k ~ U{0..count-1}`` and returns the k-th sampleable slot in
    slot order, so the result depends only on the set of sampleable slots and
    the RNG state, not on the history that produced that set (exact resume).
    """

    def __init__(self, num_slots: int) -> None:
        self._tree = SumTree(num_slots)

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        self._tree.set(slots, valid.astype(np.float64))

    def count(self) -> int:
        return int(round(self._tree.total()))

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float = 0.0) -> Draw:
        k = rng.integers(0, self.count(), size=batch_size)
        slots = self._tree.find(k.astype(np.float64) + 0.5)
        return Draw(slots=slots, weights=np.ones(batch_size, np.float32))


def make_sampler(spec: StoreSpec) -> Sampler:
    if spec.sampler != "uniform":
        raise NotImplementedError(f"sampler {spec.sampler!r} is not available yet")
    return UniformSampler(spec.num_envs * spec.slots_per_env)

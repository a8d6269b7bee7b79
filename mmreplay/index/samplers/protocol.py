"""What the store calls of a sampler (`Sampler`, `PrioritySampler`) and what a draw returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from mmreplay.kernels.structs import TreeDraw

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Draw(NamedTuple):
    """Flat slots drawn and their importance weights (ones when uniform). A named tuple:
    made on every draw, it costs a third of a frozen dataclass."""

    slots: np.ndarray
    weights: np.ndarray


class Applied(NamedTuple):
    """Slots whose priorities an update set (increasing, unique) and the values set."""

    slots: np.ndarray
    priorities: np.ndarray


@dataclass(frozen=True)
class SlotMarks:
    """Where a compiled update marks the slots it writes: ``mask[slot % period // group]``."""

    mask: BoolArray
    period: int
    group: int


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

    def tree_draw(self, rng: np.random.Generator, batch_size: int, beta: float) -> TreeDraw:
        """`sample`'s draw, left for a compiled call to finish: takes what `sample` takes
        from `rng`, so either gives the same slots."""

    def check_valid(self) -> None:
        """Raise `RuntimeError` if internal state is inconsistent."""

    def nbytes(self) -> int:
        """Bytes of the arrays the sampler holds in RAM."""


class PrioritySampler(Sampler, Protocol):
    """A `Sampler` with per-transition priorities: what the store calls beyond `Sampler`."""

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New raw priorities of `slots`; bad values raise and change nothing. Unique slots
        (`PrioritizedSampler` also takes repeats: the last value of a slot wins)."""

    def priorities(self) -> np.ndarray:
        """Raw priority per slot, float64 ``(num_slots,)``, for persistence."""

    def slot_ids(self) -> np.ndarray:
        """Transition id each slot's priority belongs to, int64 ``(num_slots,)``."""

    def max_priority(self) -> float:
        """Priority a new transition enters with."""

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        """Rebuild from persisted arrays; later draws match the sampler that was saved."""


def array_nbytes(obj: object, depth: int = 2) -> int:
    """Bytes of the numpy arrays an object holds, looking `depth` attribute levels deep.

    A measurement for ``info``, not persistence: it stays right whatever arrays a sampler
    (and its tree and table) keep. Views are counted as the arrays they look at.
    """
    total = 0
    for value in vars(obj).values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif depth > 1 and hasattr(value, "__dict__") and not isinstance(value, type):
            total += array_nbytes(value, depth - 1)
    return total

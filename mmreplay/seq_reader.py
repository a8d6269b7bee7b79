"""Reading sequence batches: one `SequenceIndex` per (length, mode, period) asked for, the
draw, the windows and the one frame read of a batch. The store only orchestrates.

An index is built on the first request for its key (one O(kept frames) pass) and kept
current from then on at O(T + k) per refresh. Frames of a batch are read in one
``FrameStore.read`` of every stack slot: each distinct chunk is decoded once however many
stacks and sequences share it, and each frame is copied straight into the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .frame_store import FrameStore
from .ring import StepRing
from .samplers import Sampler
from .sequences import SequenceIndex, SequenceKey, SequenceWindows, windows


@dataclass(frozen=True)
class SequenceArrays:
    """A sequence batch in numpy: the windows, their frames and importance weights."""

    windows: SequenceWindows
    obs: np.ndarray        # (B, T, k, *obs_shape)
    next_obs: np.ndarray   # (B, k, *obs_shape)
    weights: np.ndarray    # (B,) float32
    starts: np.ndarray     # (B,) flat slots of the starts


class SequenceReader:
    """Sequence indexes of one store and the batch assembly over its ring and frames."""

    def __init__(self, ring: StepRing, frames: FrameStore,
                 make_sampler: Callable[[], Sampler],
                 priority_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.ring = ring
        self.frames = frames
        self._make_sampler = make_sampler
        self._priority_of = priority_of
        self.indexes: dict[SequenceKey, SequenceIndex] = {}

    def index(self, key: SequenceKey) -> SequenceIndex:
        """The (refreshed) index of `key`, built on first use."""
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SequenceIndex(self.ring, key, self._make_sampler(),
                                                      self._priority_of)
        index.refresh()
        return index

    def read(self, key: SequenceKey, starts: np.ndarray, weights: np.ndarray) -> SequenceArrays:
        """Windows at valid start slots and their frames (one read for the whole batch)."""
        win = windows(self.ring, starts, key)
        size, length, k = win.obs_slots.shape
        both = np.concatenate([win.obs_slots.reshape(size, -1), win.next_obs_slots], axis=1)
        frames = self.frames.read(both)
        obs = frames[:, :length * k].reshape(size, length, k, *frames.shape[2:])
        return SequenceArrays(windows=win, obs=obs, next_obs=frames[:, length * k:],
                              weights=weights, starts=starts)

    def sample(self, key: SequenceKey, rng: np.random.Generator, batch_size: int,
               beta: float) -> SequenceArrays:
        """`batch_size` valid starts drawn by the key's sampler (the caller checks count)."""
        draw = self.index(key).sampler.sample(rng, batch_size, beta)
        return self.read(key, draw.slots, draw.weights)

    def valid_starts(self, flat: np.ndarray) -> np.ndarray:
        """Whether each flat slot is a valid start of any index built so far."""
        ok = np.zeros(flat.size, bool)
        for index in self.indexes.values():
            index.refresh()
            ok |= index.valid[flat]
        return ok

    def set_priorities(self, flat: np.ndarray, priorities: np.ndarray) -> None:
        """Tell every prioritized index the new priorities of these step slots."""
        for index in self.indexes.values():
            if index.priority_of is not None:
                index.set_priorities(flat, priorities)

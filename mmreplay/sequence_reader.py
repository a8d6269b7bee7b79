"""Reading sequence batches: one `SequenceIndex` per (length, mode, period) asked for, the
draw, the windows and the one frame read of a batch. The store only orchestrates.

An index is built on the first request for its key (one O(kept frames) pass) and kept
current from then on at O(T + k) per refresh. Frames of a batch are read in one
``FrameStore.read`` of every stack slot: each distinct chunk is decoded once however many
stacks and sequences share it, and each frame is copied straight into the batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import Sampler
from mmreplay.index.sequences import SequenceIndex, SequenceKey, SequenceWindows, windows
from mmreplay.storage.frame_store import FrameStore


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
        self._buffers = BufferPool()

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
        frames = self.frames.read(both, out=self._buffers.take(both.size * self._frame_bytes))
        obs = frames[:, :length * k].reshape(size, length, k, *frames.shape[2:])
        return SequenceArrays(windows=win, obs=obs, next_obs=frames[:, length * k:],
                              weights=weights, starts=starts)

    @property
    def _frame_bytes(self) -> int:
        return self.frames.spec.frame_bytes

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


class BufferPool:
    """Frame buffers of sequence batches, reused once every batch viewing them is gone.

    A sequence batch of pixels is large (32 x 80 4-stacks of 84x84: 73 MB), beyond what
    glibc's malloc keeps in its heap, so a fresh array costs a page fault per 4 KiB on
    first touch, about as much as the gather itself. A batch's tensors hold a reference to
    their buffer; a pooled buffer that only the pool references is free for the next batch.
    """

    def __init__(self, capacity: int = 4, min_bytes: int = 32 << 20) -> None:
        self.capacity = capacity
        self.min_bytes = min_bytes  # smaller arrays come from malloc's heap already
        self._free_refs = -1
        self.buffers: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray | None:
        """A free buffer of at least `nbytes` (pooled or new), or None for small ones."""
        if nbytes < self.min_bytes:
            return None
        for buffer in self.buffers:
            if buffer.size >= nbytes and sys.getrefcount(buffer) <= self._refs_when_free():
                return buffer
        buffer = np.empty(nbytes, np.uint8)
        self.buffers.append(buffer)
        if len(self.buffers) > self.capacity:
            self.buffers.pop(0)  # still viewed by someone, or too small: theirs to free
        return buffer

    def _refs_when_free(self) -> int:
        """References a buffer held only by the pool has, seen from the loop in `take`."""
        if self._free_refs < 0:
            probe = [np.empty(1, np.uint8)]
            for buffer in probe:
                self._free_refs = sys.getrefcount(buffer)
        return self._free_refs

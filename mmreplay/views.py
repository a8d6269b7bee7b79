"""Read-only views of an open store for the tools that look inside it (inspection,
verification, dataset export): ``store.views``.

Everything a tool reads beyond the facade's own methods comes from here, so the store's
parts (ring, frames, sampler) stay private to it. Each call takes the store's lock and
brings the index up to date (following a writer, for read-only stores) first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.index.ring import StepColumns, StepRing
from mmreplay.index.samplers import Sampler
from mmreplay.priorities import Priorities, PriorityState
from mmreplay.reader import Reader
from mmreplay.sequence_reader import SequenceReader
from mmreplay.storage.frame_store import CacheStats, FrameStore


@dataclass(frozen=True)
class MemoryUse:
    """What an open store holds in RAM: step columns, the index beside them (mask, id map,
    cursors), the sampler's arrays, the frame tail (`tail_frames` frames not yet in a chunk
    file), and the decoded-chunk cache."""

    steps_bytes: int
    index_bytes: int
    sampler_bytes: int
    tail_bytes: int
    tail_frames: int
    cache: CacheStats


class StoreViews:
    """The read-only views of one store (see the module doc)."""

    def __init__(self, lock: threading.RLock, reader: Reader, priorities: Priorities,
                 sequences: SequenceReader) -> None:
        self._lock = lock
        self._reader = reader
        self._ring: StepRing = reader.ring
        self._frames: FrameStore = reader.frames
        self._sampler: Sampler = reader.sampler
        self._priorities = priorities
        self._sequences = sequences

    def step_columns(self) -> StepColumns:
        """A read-only view of the step columns and cursors (see `StepColumns`)."""
        with self._lock:
            self._reader.refresh()
            return self._ring.columns()

    def read_frames(self, slots: Any) -> np.ndarray:
        """The frames at these flat slots of `step_columns`, ``(N, *obs_shape)``."""
        flat = np.asarray(slots)
        size = self._ring.valid.size
        if flat.ndim != 1 or (flat.size and (flat.dtype.kind not in "iu" or flat.min() < 0
                                             or flat.max() >= size)):
            raise InvalidInputError(f"slots must be a 1-d int array of values in [0, {size}), "
                                    f"got {flat.dtype} {flat.shape}")
        with self._lock:
            return self._frames.read(flat.astype(np.int64))

    def priority_state(self) -> PriorityState | None:
        """Raw priorities of the sampleable transitions and the max; None when uniform."""
        with self._lock:
            self._reader.refresh()
            return self._priorities.state(self._ring.valid)

    def memory(self) -> MemoryUse:
        """Bytes held in RAM now, by part (see `MemoryUse`)."""
        with self._lock:
            frames = self._frames
            return MemoryUse(steps_bytes=self._ring.steps.nbytes,
                             index_bytes=self._ring.index_nbytes(),
                             sampler_bytes=self._sampler.nbytes(), tail_bytes=frames.tail.nbytes,
                             tail_frames=int(frames.tail_fill.sum()),
                             cache=frames.cache_stats())

    def check_valid(self) -> None:
        """Raise `RuntimeError` if the ring, the sampler or a sequence index is inconsistent
        (each compared with a full recompute, or checked against its own invariants)."""
        with self._lock:
            self._reader.refresh()
            self._ring.check_valid()
            self._sampler.check_valid()
            for index in self._sequences.indexes.values():
                index.check_valid()

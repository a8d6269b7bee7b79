"""Reading sequence batches: one `SequenceIndex` per (length, mode, period) asked for, the
draw, the windows and the one frame read of a batch. The store only orchestrates.

Reads beside a writer follow it as transition reads do (`reader.Reader`): a batch whose
starts a writer gave up while it was read is drawn again, a `get` of them raises.

An index is built on the first request for its key (one O(kept frames) pass) and kept
current from then on at O(T + k) per refresh. Frames of a batch are read in one
``FrameStore.read`` of every stack slot: each distinct chunk is decoded once however many
stacks and sequences share it, and each frame is copied straight into the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmreplay import validate
from mmreplay.errors import EmptyStoreError, InvalidInputError, UnknownIdError
from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import Sampler
from mmreplay.index.sequences import SequenceIndex, SequenceKey, SequenceWindows, windows
from mmreplay.reader import Reader
from mmreplay.spec import StoreSpec
from mmreplay.storage.frame_store import FrameStore
from mmreplay.torch_batch import OutputBuffers


class Started(Protocol):
    """What a sequence read returns: anything that names the flat slots of its starts."""

    @property
    def starts(self) -> np.ndarray: ...


Read = Callable[[SequenceKey, np.ndarray, np.ndarray], Any]  # (key, starts, weights)


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

    def __init__(self, reader: Reader, make_sampler: Callable[[], Sampler],
                 priority_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.reader = reader
        self.ring: StepRing = reader.ring
        self.frames: FrameStore = reader.frames
        self._make_sampler = make_sampler
        self._priority_of = priority_of
        self.indexes: dict[SequenceKey, SequenceIndex] = {}
        self._any_slot = np.ones(self.ring.valid.size, bool)
        # A sequence batch of pixels is large (32 x 80 4-stacks of 84x84: 73 MB), beyond what
        # malloc keeps in its heap: a fresh array costs a page fault per 4 KiB on first touch,
        # about as much as the gather itself, so such buffers are pooled and reused.
        self._buffers = OutputBuffers(min_bytes=32 << 20)

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
               beta: float, read: Read | None = None) -> Any:
        """`batch_size` valid starts drawn by the key's sampler (the caller checks count),
        read by `read` (default `SequenceReader.read`: frames from the frame store)."""
        draw = self.index(key).sampler.sample(rng, batch_size, beta)
        return (read or self.read)(key, draw.slots, draw.weights)

    # -- what the store's sequence methods do, after their argument checks ----------------
    def sample_batch(self, key: SequenceKey, rng: np.random.Generator, size: int,
                     beta: float, read: Read | None = None) -> Any:
        """`size` starts drawn by the key's sampler, drawn again if a writer gave one up;
        `read` as in `sample` (a `SequenceArrays` by default)."""
        def attempt() -> Started | None:
            self.reader.refresh()  # the step priorities that starts take
            self.reader.before_draw()
            index = self.index(key)
            if index.sampler.count() == 0:
                raise EmptyStoreError(f"cannot sample: no valid start for sequences of "
                                      f"{key.length} steps yet")
            arrays = self.sample(key, rng, size, beta, read)
            return arrays if self.reader.still_valid(arrays.starts, index.valid) else None

        return self.reader.consistent(attempt)

    def get(self, key: SequenceKey, wanted: np.ndarray, read: Read | None = None) -> Any:
        """The sequences starting at these transition ids (each a valid start); `read` as
        in `sample`."""
        self.reader.refresh()
        index = self.index(key)
        flat, found = self.ring.flat_of_ids(wanted, valid=index.valid)
        if not found.all():
            bad = wanted[~found][:5].tolist()
            raise UnknownIdError(f"ids {bad} are not (or no longer) valid starts of sequences "
                                 f"of {key.length} steps")
        arrays = (read or self.read)(key, flat, np.ones(flat.size, np.float32))
        if not self.reader.still_valid(flat, index.valid):
            raise UnknownIdError("some of these sequences were overwritten by the writer "
                                 "while they were read")
        return arrays

    def start_ids(self, key: SequenceKey) -> np.ndarray:
        """The transition ids of every valid start of `key`, increasing."""
        self.reader.refresh()
        return self.reader.ids(np.flatnonzero(self.index(key).valid))

    def starts_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat slots, found) of start ids: found = a valid start of an index built so far."""
        self.reader.refresh()
        flat, found = self.ring.flat_of_ids(ids, valid=self._any_slot)
        return flat, found & self.valid_starts(flat)

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


def sequence_key(spec: StoreSpec, length: object, cross_episodes: object,
                 period: object) -> SequenceKey:
    """The checked `SequenceKey` of a request (rank-sampled stores have no sequences)."""
    key = SequenceKey(*validate.sequence_key(spec, length, cross_episodes, period))
    if spec.sampler == "rank":
        raise InvalidInputError("sequences are sampled uniformly or by proportional "
                                "priority; this store samples 'rank'")
    return key

"""numpy -> torch: the `Batch` handed to learners (the only core module that imports torch).

torch is imported on the first batch built, not by ``import mmreplay``: the ``mmreplay``
command and code that only records or inspects never pay its import (over a second).
`Batch` and `SequenceBatch` are defined without it (their annotations are strings).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Batch:
    """A batch of transitions; every field is a torch tensor with leading dim B.

    ``obs``/``next_obs`` are ``(B, frame_stack, *obs_shape)`` in the store's dtype
    (uint8 for pixels: scaling is the model's job). ``reward`` is the n-step
    discounted return, ``discount`` is ``0`` after termination and
    ``gamma ** m`` otherwise, so the target is ``reward + discount * V(next_obs)``;
    ``steps`` is that m, the window's length (n, or fewer where the episode ended; None
    in batches rebuilt from transported fields).
    ``extras`` holds the store's declared per-step extras of step t (recorded by the
    same ``add`` as ``action``), ``(B, *shape)`` each; empty without extras.
    """

    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    discount: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class ArrayBatch:
    """A `Batch` as numpy arrays, in the dtypes its tensors have (`ReplayStore.sample_arrays`).

    ``frames`` is one C-contiguous ``(2, B, frame_stack, *obs_shape)`` array; ``obs`` and
    ``next_obs`` are its two halves. With a buffer pool (`OutputBuffers`) the frames may
    live in a reused buffer: it is reused only once nothing views it any more.
    """

    frames: np.ndarray
    action: np.ndarray
    reward: np.ndarray      # float32 n-step return
    terminated: np.ndarray  # bool
    truncated: np.ndarray   # bool
    discount: np.ndarray    # float32
    weights: np.ndarray     # float32
    ids: np.ndarray         # int64
    steps: np.ndarray       # int64
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def obs(self) -> np.ndarray:
        return self.frames[0]

    @property
    def next_obs(self) -> np.ndarray:
        return self.frames[1]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def make_batch(arrays: ArrayBatch) -> Batch:
    """A `Batch` of CPU tensors viewing `arrays` (no copy: `torch.from_numpy` of each)."""
    import torch

    tensor, frames = torch.from_numpy, arrays.frames  # numpy halves: cheaper than torch's
    return Batch(
        obs=tensor(frames[0]), action=tensor(arrays.action), reward=tensor(arrays.reward),
        next_obs=tensor(frames[1]), terminated=tensor(arrays.terminated),
        truncated=tensor(arrays.truncated), discount=tensor(arrays.discount),
        weights=tensor(arrays.weights), ids=tensor(arrays.ids),
        extras={name: tensor(a) for name, a in arrays.extras.items()},
        steps=tensor(arrays.steps))


def native(array: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """`array` as a C-contiguous, native-order array of `dtype` (itself when it is one)."""
    want = np.dtype(dtype)
    if array.dtype == want and want.isnative and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=want.newbyteorder("="))


class OutputBuffers:
    """Byte buffers for batch frames, reused once no batch views them.

    A batch's tensors view their buffer (`torch.from_numpy`), so a pooled buffer that only
    the pool references is free. Small requests get fresh arrays (malloc's heap serves them
    at once), unless the buffers are pinned: with ``pin_memory=True`` every buffer is
    page-locked host memory (``torch.empty(..., pin_memory=True)``), so ``tensor.to("cuda",
    non_blocking=True)`` copies without staging; that needs CUDA.
    """

    def __init__(self, *, pin_memory: bool = False, capacity: int = 4,
                 min_bytes: int = 64 << 10) -> None:
        self.pin_memory = pin_memory
        self.capacity = capacity
        self.min_bytes = 0 if pin_memory else min_bytes
        self.buffers: list[np.ndarray] = []
        self._free_refs = -1

    def take(self, nbytes: int) -> np.ndarray | None:
        """A free buffer of at least `nbytes` (pooled or new), or None for small ones."""
        if nbytes < self.min_bytes:
            return None
        for buffer in self.buffers:
            if buffer.size >= nbytes and sys.getrefcount(buffer) <= self._refs_when_free():
                return buffer
        buffer = self._allocate(nbytes)
        self.buffers.append(buffer)
        if len(self.buffers) > self.capacity:
            self.buffers.pop(0)  # still viewed by a batch: its to free
        return buffer

    def _allocate(self, nbytes: int) -> np.ndarray:
        if not self.pin_memory:
            return np.empty(nbytes, np.uint8)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def _refs_when_free(self) -> int:
        """References a buffer held only by the pool has, seen from the loop in `take`."""
        if self._free_refs < 0:
            probe = [np.empty(1, np.uint8)]
            for buffer in probe:
                self._free_refs = sys.getrefcount(buffer)
        return self._free_refs


def tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Fresh native-order tensors of a dict of arrays (each keeps its dtype)."""
    return {name: _tensor(a, a.dtype) for name, a in arrays.items()}


def _tensor(array: np.ndarray, dtype: np.dtype | type) -> torch.Tensor:
    """A fresh, C-contiguous, native-byte-order copy as a tensor."""
    import torch

    native = np.dtype(dtype).newbyteorder("=")
    return torch.from_numpy(np.array(array, dtype=native, order="C", copy=True))


@dataclass(frozen=True)
class SequenceBatch:
    """B sequences of T steps; every field a torch tensor with leading dims (B, T) or B.

    ``obs`` is ``(B, T, frame_stack, *obs_shape)``: the stack of each step (zeros where
    ``mask`` is False). ``reward`` is the one-step reward of each step, ``terminated`` /
    ``truncated`` say the episode ended with that step, ``is_first`` that the step is o_0
    of its episode, ``ids`` the transition id of each step (-1 on padding), ``weights``
    (B,) importance weights (ones when uniform), ``next_obs`` ``(B, frame_stack,
    *obs_shape)`` the stack after the last real step, ``extras`` ``(B, T, *shape)`` each.
    """

    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    is_first: torch.Tensor
    mask: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    next_obs: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def make_sequence_batch(*, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray,
                        reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                        is_first: np.ndarray, mask: np.ndarray, ids: np.ndarray,
                        weights: np.ndarray, extras: dict[str, np.ndarray]) -> SequenceBatch:
    """A `SequenceBatch` of CPU tensors; `obs`/`next_obs` are views of one fresh array
    that the batch takes over without a copy."""
    import torch

    return SequenceBatch(
        obs=torch.from_numpy(obs), next_obs=torch.from_numpy(next_obs),
        action=_tensor(action, action.dtype), reward=_tensor(reward, np.float32),
        terminated=_tensor(terminated, np.bool_), truncated=_tensor(truncated, np.bool_),
        is_first=_tensor(is_first, np.bool_), mask=_tensor(mask, np.bool_),
        ids=_tensor(ids, np.int64), weights=_tensor(weights, np.float32),
        extras=tensors(extras))

"""numpy -> torch: the `Batch` handed to learners (the only core module that imports torch).

torch is imported on the first batch built, not by ``import mmreplay``: the ``mmreplay``
command and code that only records or inspects never pay its import (over a second).
`Batch` and `SequenceBatch` are defined without it (their annotations are strings).
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mmreplay.errors import InvalidInputError

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

    ``pinned`` is set when the frames are page-locked (``pin_memory=True``): the same bytes as
    a tensor of the block PyTorch's pinned allocator handed out (see `PinnedBlocks`). Copy
    to the GPU from it or its views (`frames_tensor`, `make_batch`): those copies are
    known to the allocator, which reuses the block only once they are done, on any stream.
    A copy made through ``torch.from_numpy`` is known to it only where it starts at the
    block (the whole ``frames``, or ``obs``); from ``next_obs`` or another view inside it,
    `PinnedBlocks` covers a copy queued on the current stream of the thread that drops it.
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
    pinned: torch.Tensor | None = None  # frames as a tensor of their page-locked block

    @property
    def obs(self) -> np.ndarray:
        return self.frames[0]

    @property
    def next_obs(self) -> np.ndarray:
        return self.frames[1]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class FrameSetBatch:
    """An `ArrayBatch` whose frames are each read once: ``frames`` ``(U, *obs_shape)`` are
    the distinct frames of its stacks, ``index`` ``(2, B, frame_stack)`` (int64) their rows,
    so its ``frames`` would be ``frames[index]``. Where stacks share frames (a one-step
    batch of 4-stacks: 5 distinct frames a transition, not 8) fewer bytes are read and cross
    the bus; the stacks are built where the batch goes (`DeviceMover.upload`, or
    `assembled`). ``pinned`` as in `ArrayBatch`; the other fields are an `ArrayBatch`'s."""

    frames: np.ndarray
    index: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    discount: np.ndarray
    weights: np.ndarray
    ids: np.ndarray
    steps: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    pinned: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def assembled(self) -> ArrayBatch:
        """The same batch with its stacks built (``frames[index]``): what `sample_arrays`
        gives for the same draw."""
        return ArrayBatch(frames=self.frames[self.index], action=self.action,
                          reward=self.reward, terminated=self.terminated,
                          truncated=self.truncated, discount=self.discount,
                          weights=self.weights, ids=self.ids, steps=self.steps,
                          extras=self.extras)


def make_batch(arrays: ArrayBatch) -> Batch:
    """A `Batch` of CPU tensors viewing `arrays` (no copy: `torch.from_numpy` of each)."""
    import torch

    tensor, frames = torch.from_numpy, arrays.frames
    if arrays.pinned is None:  # numpy halves: cheaper than torch's
        obs, next_obs = tensor(frames[0]), tensor(frames[1])
    else:  # views of the block's tensor: the pinned allocator sees copies from them
        obs, next_obs = arrays.pinned[0], arrays.pinned[1]
    return Batch(
        obs=obs, action=tensor(arrays.action), reward=tensor(arrays.reward),
        next_obs=next_obs, terminated=tensor(arrays.terminated),
        truncated=tensor(arrays.truncated), discount=tensor(arrays.discount),
        weights=tensor(arrays.weights), ids=tensor(arrays.ids),
        extras={name: tensor(a) for name, a in arrays.extras.items()},
        steps=tensor(arrays.steps))


def frames_tensor(arrays: ArrayBatch | FrameSetBatch) -> torch.Tensor:
    """``arrays.frames`` as a tensor: the pinned block's own tensor when it has one (copies
    from any view of it are tracked by the allocator), else ``torch.from_numpy``."""
    import torch

    return torch.from_numpy(arrays.frames) if arrays.pinned is None else arrays.pinned


def native(array: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """`array` as a C-contiguous, native-order array of `dtype` (itself when it is one)."""
    want = np.dtype(dtype)
    if array.dtype == want and want.isnative and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=want.newbyteorder("="))


class OutputBuffers:
    """Pageable byte buffers for batch frames, reused once no batch views them.

    A batch's tensors view their buffer (`torch.from_numpy`), so a pooled buffer that only
    the pool references is free: every use of pageable memory is over once no Python object
    views it (a copy to a GPU from pageable memory returns only after the bytes left it).
    Small requests get fresh arrays (malloc's heap serves them at once). Page-locked buffers
    are not pooled here: see `PinnedBlocks`.
    """

    def __init__(self, *, capacity: int = 4, min_bytes: int = 64 << 10) -> None:
        self.capacity = capacity
        self.min_bytes = min_bytes
        self.buffers: list[np.ndarray] = []
        self._free_refs = -1

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
            self.buffers.pop(0)  # still viewed by a batch: its to free
        return buffer

    def _refs_when_free(self) -> int:
        """References a buffer held only by the pool has, seen from the loop in `take`."""
        if self._free_refs < 0:
            probe = [np.empty(1, np.uint8)]
            for buffer in probe:
                self._free_refs = sys.getrefcount(buffer)
        return self._free_refs


class PinnedBlocks:
    """Page-locked frame buffers: a fresh block from PyTorch's pinned allocator per batch.

    A pool that rewrites a page-locked buffer once no Python object views it hands out wrong
    frames: ``tensor.to("cuda", non_blocking=True)`` only *queues* the copy, and the DMA
    reads the buffer whenever the GPU's stream gets to it, after the tensor may be gone.
    So this class keeps no buffer. Each `take` asks ``torch.empty(..., pin_memory=True)``
    (PyTorch's ``CachingHostAllocator``), which does the bookkeeping a pool cannot:

    - a ``non_blocking`` copy from a pinned tensor records the stream it ran on with the
      block (``record_event`` in ``aten/src/ATen/native/cuda/Copy.cu``; the block is found
      by the storage's context, so every view of the block's tensor counts, on any stream);
    - a freed block is put back only with an event recorded on each of those streams, and
      is handed out again only once those events completed (``CachingHostAllocator.h``:
      ``free`` then ``process_events``).

    Blocks come from the allocator's cache after the first few batches (no ``cudaHostAlloc``
    a batch). The frames the reader writes are a numpy view of the block's tensor; the
    batch carries that tensor (`ArrayBatch.pinned`) and `make_batch` hands out views of it,
    never ``torch.from_numpy`` copies of its address (a storage the allocator does not know
    records nothing). DataLoader's ``pin_memory=True`` does the same: a fresh block a batch.

    One case escapes the allocator: a numpy user's ``torch.from_numpy`` of a view inside
    the block (``arrays.next_obs``), copied ``non_blocking``. For it, when the last numpy
    view of the block dies (the batch's arrays and what was made of them), a mark is
    recorded on the current CUDA stream of the thread that let it go, and the block is held
    until the GPU passed that mark: a copy queued on that stream before is done by then (a
    copy queued on another stream is not covered). This only ever extends a block's life.
    """

    def __init__(self) -> None:
        self.held: deque[tuple[object, Any]] = deque()  # (storage, stream mark), in order

    def take(self, nbytes: int) -> np.ndarray:
        """A page-locked uint8 array of `nbytes`: a view of a fresh tensor (its ``base``)."""
        self.release_passed()
        block = page_locked_empty(nbytes)
        array = block.numpy()  # every numpy view of the batch keeps this one alive
        watch = weakref.finalize(array, self._hold, block.untyped_storage())
        watch.atexit = False
        return array

    def _hold(self, storage: object) -> None:
        mark = stream_mark()
        if mark is not None:  # without CUDA nothing can be queued: let go at once
            self.held.append((storage, mark))

    def release_passed(self) -> None:
        """Let go of the blocks whose stream mark the GPU passed (in order)."""
        held = self.held
        while held and held[0][1].query():
            held.popleft()


def stream_mark() -> Any:
    """A CUDA event recorded on this thread's current stream, or None without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def page_locked_empty(nbytes: int) -> torch.Tensor:
    """``torch.empty(nbytes, uint8, pin_memory=True)``; `InvalidInputError` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidInputError("pin_memory=True needs CUDA (torch.cuda.is_available() is "
                                "False): page-locked buffers only speed up copies to a GPU")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinned_frames(frames: np.ndarray) -> torch.Tensor | None:
    """`frames` as a tensor of the block it lives in (`PinnedBlocks`), or None when no
    tensor owns its memory (a read that could not use the block it was given)."""
    import torch

    owner = frames.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if not isinstance(owner, torch.Tensor) or owner.data_ptr() != frames.ctypes.data \
            or not frames.flags.c_contiguous:
        return None
    dtype = torch.from_numpy(frames[:0].reshape(-1)).dtype
    return owner[:frames.nbytes].view(dtype).view(frames.shape)


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

"""Batches delivered on a device (``store.batches(..., device="cuda")``); imports torch.

The prefetch thread copies each batch to the device on a side stream; the learner's
``next()`` hands it over to whatever stream it is on::

    prefetch thread                              learner thread, ``next()``
    sample into a page-locked block (`PinnedBlocks`)
    on the side stream: x.to(device, non_blocking)
    event.record(side stream)    --- queue --->  current stream waits on the event
                                                 x.record_stream(current stream), each x
                                                 x is usable at once on the current stream

- The copies overlap the learner's kernels: they run on a stream of their own, queued by
  another thread.
- ``wait_event`` orders the learner's later work after the copies, on the GPU: the CPU
  never waits.
- The device tensors were allocated on the side stream, so PyTorch's caching allocator
  would hand their memory to the next batch's copies as soon as they are freed, while the
  learner's queued kernels may still read them; ``record_stream`` makes it wait for the
  learner's stream too.
- The page-locked source block goes back to the pinned allocator when the CPU batch is
  dropped, and is reused only after the side stream's copy event (see `PinnedBlocks`).

On ``device="cpu"`` the same steps run without streams or events: the "copy" is the
CPU batch itself (``Tensor.to`` of a tensor already there), as `make_batch` builds it.

`DeviceMover.upload` is the one place that decides what crosses the bus. The store hands
it a `FrameSetBatch`: each distinct frame of the batch once (a one-step batch of 4-stacks:
5 frames a transition, not 8) and their rows, one copy each; the stacks and next stacks
are gathered on the device, on the side stream. A bucket store's pipeline hands it an
`ArrayBatch` (stacks built on the CPU), copied as one block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmreplay.device_frames import parse_device
from mmreplay.torch_batch import ArrayBatch, Batch, FrameSetBatch, frames_tensor


@dataclass(frozen=True)
class Staged:
    """A batch whose copies are queued on the side stream, and the event that ends them."""

    batch: Batch
    event: torch.cuda.Event | None  # None on the CPU


class DeviceMover:
    """Copies batches to one device on a side stream (`upload`, in the prefetch thread) and
    hands them to the consumer's stream (`receive`, in the consumer's thread)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = parse_device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    @property
    def pin_memory(self) -> bool:
        """Whether batches should be sampled into page-locked memory before `upload`."""
        return self.cuda

    def upload(self, arrays: ArrayBatch | FrameSetBatch) -> Staged:
        """Queue the copies of `arrays` to the device (a `FrameSetBatch`: its distinct
        frames, then its stacks gathered there); on the CPU, the batch itself."""
        if self.stream is None:
            return Staged(_batch_of(arrays, _on_cpu), None)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            batch = _batch_of(arrays, self._copy)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(batch, event)

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def receive(self, staged: Any) -> Batch:
        """The batch of `staged`, usable at once on this thread's current stream."""
        if not isinstance(staged, Staged):
            raise TypeError(f"expected a Staged batch from DeviceMover.upload, got "
                            f"{type(staged).__name__}")
        if staged.event is None:
            return staged.batch
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.event)
        for tensor in _tensors(staged.batch):
            tensor.record_stream(stream)
        return staged.batch


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _batch_of(arrays: ArrayBatch | FrameSetBatch,
              move: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """A `Batch` of `arrays` with each tensor passed through `move`: the frames as one
    tensor (a single copy; a frame set's stacks gathered after it), ``obs`` and
    ``next_obs`` its halves."""
    tensor = torch.from_numpy
    frames = move(frames_tensor(arrays))
    if isinstance(arrays, FrameSetBatch):
        frames = frames[move(tensor(arrays.index))]  # (2, B, stack, *obs): one gather
    return Batch(
        obs=frames[0], next_obs=frames[1], action=move(tensor(arrays.action)),
        reward=move(tensor(arrays.reward)), terminated=move(tensor(arrays.terminated)),
        truncated=move(tensor(arrays.truncated)), discount=move(tensor(arrays.discount)),
        weights=move(tensor(arrays.weights)), ids=move(tensor(arrays.ids)),
        extras={name: move(tensor(a)) for name, a in arrays.extras.items()},
        steps=move(tensor(arrays.steps)))


def _tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of `batch` (``obs`` and ``next_obs`` share one storage: once is enough
    for ``record_stream``, which is per storage)."""
    found = [batch.obs, batch.action, batch.reward, batch.terminated, batch.truncated,
             batch.discount, batch.weights, batch.ids, *batch.extras.values()]
    return found if batch.steps is None else [*found, batch.steps]

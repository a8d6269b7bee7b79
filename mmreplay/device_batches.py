"""Batches delivered on a device (``store.batches(..., device="cuda")``); imports torch.

The prefetch thread copies each batch to the device on a side stream; the learner's
``next()`` hands it over to whatever stream it is on::

    prefetch thread                              learner thread, ``next()``
    sample into a page-locked block (`PinnedBlocks`)
    on the side stream: the frames, then every
      small field packed in one buffer (`to_device`),
      each in one non_blocking copy
    event.record(side stream)    --- queue --->  current stream waits on the event
                                                 record_stream(current stream), both copies
                                                 the batch is usable at once there

- The copies overlap the learner's kernels: they run on a stream of their own, queued by
  another thread. Two copies a batch, both from page-locked memory (a copy from pageable
  memory would stage through the driver, holding the GIL meanwhile); ``next()`` records
  two storages.
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

from dataclasses import dataclass
from typing import Any

import torch

from mmreplay.device_frames import parse_device, small_arrays, to_device, transition_batch
from mmreplay.torch_batch import ArrayBatch, Batch, FrameSetBatch, frames_tensor


@dataclass(frozen=True)
class Staged:
    """A batch whose copies are queued on the side stream, the event that ends them, and
    the device tensors whose storages hold the batch (its frames, its small fields)."""

    batch: Batch
    event: torch.cuda.Event | None  # None on the CPU
    storages: tuple[torch.Tensor, ...] = ()


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
            return Staged(_batch_of(arrays, self.device), None)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            batch = _batch_of(arrays, self.device)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(batch, event, (batch.obs, batch.ids))

    def receive(self, staged: Any) -> Batch:
        """The batch of `staged`, usable at once on this thread's current stream."""
        if not isinstance(staged, Staged):
            raise TypeError(f"expected a Staged batch from DeviceMover.upload, got "
                            f"{type(staged).__name__}")
        if staged.event is None:
            return staged.batch
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.event)
        for tensor in staged.storages:  # per storage: one tensor of each is enough
            tensor.record_stream(stream)
        return staged.batch


def _batch_of(arrays: ArrayBatch | FrameSetBatch, device: torch.device) -> Batch:
    """A `Batch` of `arrays` on `device`: the frames in one copy (a frame set's stacks then
    gathered there, one ``index_select``), every small field (and a frame set's index) in
    one more (`to_device`); ``obs`` and ``next_obs`` are the halves of one tensor, the small
    fields views of one buffer. On the CPU the frames are not copied."""
    small = small_arrays(arrays)
    if isinstance(arrays, FrameSetBatch):
        small["index"] = arrays.index
    frames = frames_tensor(arrays).to(device, non_blocking=True)
    moved = to_device(small, device)
    if isinstance(arrays, FrameSetBatch):
        index = moved.pop("index")  # (2, B, stack)
        frames = frames.index_select(0, index.reshape(-1)).view(*index.shape,
                                                                  *frames.shape[1:])
    return transition_batch(frames, moved)

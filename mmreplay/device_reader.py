"""Batches of a ``device=`` store, assembled on the device: the index work on the CPU, one
small copy, one gather.

A batch of B transitions of k-stacks is planned on the CPU exactly as the disk read path
plans it (the sampler's draw, then `StepRing.lookup`: the ``(2, B, k)`` flat slots of every
obs and next-obs stack, ``-1`` for zero padding, the first frame's slot for ``"first"``
padding, the n-step window's next stack), so a device batch equals the plain store's batch of
the same draw field by field. The plan and the small fields (action, reward, flags, discount,
weights, ids, steps, extras) travel in one host-to-device copy (a few KB); then one gather
builds ``obs`` and ``next_obs`` on the device (`DeviceFrames.gather_packed`: on the ring's
stream, which the caller's current stream waits for). A sampled batch is drawn and looked up
by one compiled call straight into the buffer that copy moves (`Packing.host`): nothing is
packed after it. Sequences are the same with `sequences.windows` as the plan.

The store holds the lock and checks arguments; this module owns no state but the frames.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmreplay.device_frames import (
    EXTRA,
    DeviceFrames,
    Packing,
    check_fits,
    extras_of,
    small_fields,
    transition_batch,
)
from mmreplay.index.ring import Lookup
from mmreplay.index.sequences import SequenceKey, windows
from mmreplay.kernels import lazy_entry, samples
from mmreplay.kernels.structs import LookupOut, SampleOut
from mmreplay.reader import Reader
from mmreplay.recorder import Recorder
from mmreplay.sequence_reader import SequenceReader
from mmreplay.spec import StoreSpec
from mmreplay.torch_batch import Batch, SequenceBatch

if TYPE_CHECKING:
    import torch

_DRAW_AND_LOOK = lazy_entry(samples, "draw_and_look")


@dataclass(frozen=True)
class DeviceSequences:
    """A sequence batch on the device and the flat slots of its starts (for the re-check)."""

    batch: SequenceBatch
    starts: np.ndarray


class DeviceReader:
    """Transition and sequence batches of one store, gathered from its `DeviceFrames`."""

    def __init__(self, frames: DeviceFrames, reader: Reader,
                 sequences: SequenceReader | None) -> None:
        self.frames = frames
        self.reader = reader
        self.sequences = sequences
        self._packings: dict[int, Packing] = {}  # a transition batch's, by batch size

    @property
    def device(self) -> torch.device:
        return self.frames.device

    # -- transitions -------------------------------------------------------------------
    def sample(self, rng: np.random.Generator, size: int, beta: float) -> Batch:
        """`size` transitions drawn by the store's sampler (see `ReplayStore.sample`), as
        `Reader.sample` draws them: beside a writer, from the give-ups seen last, drawn again
        if the writer gave one up since (so the draws equal a plain reader's)."""
        reader = self.reader
        ring = reader.ring

        def attempt() -> Batch | None:
            reader.ready(follow=False)
            packing = self.packing(size)
            buffer, out = packing.host(self.device)
            flat, plan = np.empty(size, np.int64), out["plan"]
            _DRAW_AND_LOOK(reader.sampler.tree_draw(rng, size, beta), ring.lookup_columns,
                           SampleOut(flat, out["weights"], plan, LookupOut(
                               obs=plan[0], next_obs=plan[1], ret=out["reward"],
                               term=out["terminated"], trunc=out["truncated"],
                               discount=out["discount"], steps=out["steps"], ids=out["ids"])))
            if not reader.still_valid(flat):
                return None
            out["action"][...] = ring.actions_at(flat)
            for name, values in ring.extras_at(flat).items():
                out[EXTRA + name][...] = values
            return self.on_device(packing, buffer, plan)

        return reader.consistent(attempt)

    def receive(self, batch: Batch) -> Batch:
        """`batch`, sampled in another thread (``batches``' prefetch thread), made usable on
        this thread's current stream (`DeviceFrames.hand_over`: its frames, and its small
        fields' buffer)."""
        self.frames.hand_over(batch.obs, batch.ids)
        return batch

    def get(self, wanted: np.ndarray) -> Batch:
        """The sampleable transitions with these ids (`UnknownIdError` otherwise)."""
        flat = self.reader.locate(wanted)
        return self.batch(self.reader.ring.lookup(flat), np.ones(flat.size, np.float32))

    def packing(self, size: int) -> Packing:
        """Where each field of a batch of `size` transitions sits in the buffer copied to the
        device: the plan (flat slots of the stacks), then the small fields."""
        packing = self._packings.get(size)
        if packing is None:
            spec = self.reader.ring.spec
            packing = self._packings[size] = Packing([
                ("plan", (2, size, spec.frame_stack), np.int64), *small_fields(spec, size)])
        return packing

    def batch(self, look: Lookup, weights: np.ndarray) -> Batch:
        """The `Batch` of a lookup (and its draw's weights), packed and moved in one copy,
        its stacks gathered."""
        packing = self.packing(look.ids.size)
        buffer, views = packing.pack({
            "plan": look.slots, "action": look.action, "reward": look.reward,
            "terminated": look.terminated, "truncated": look.truncated,
            "discount": look.discount, "weights": weights, "ids": look.ids, "steps": look.steps,
            **{EXTRA + name: a for name, a in look.extras.items()}}, self.device)
        return self.on_device(packing, buffer, views["plan"])

    def on_device(self, packing: Packing, buffer: torch.Tensor, plan: np.ndarray) -> Batch:
        """The `Batch` of a buffer laid out by `packing` (`plan`: its plan's view): moved,
        its stacks gathered."""
        return transition_batch(*self.frames.gather_packed(packing, buffer, plan))

    # -- sequences ---------------------------------------------------------------------
    def sample_sequences(self, key: SequenceKey, rng: np.random.Generator, size: int,
                         beta: float) -> SequenceBatch:
        """`size` sequences of `key` (see `ReplayStore.sample_sequences`)."""
        assert self.sequences is not None
        return self.sequences.sample_batch(key, rng, size, beta, read=self.read_sequences).batch

    def get_sequences(self, key: SequenceKey, wanted: np.ndarray) -> SequenceBatch:
        """The sequences of `key` starting at these ids (see `ReplayStore.get_sequences`)."""
        assert self.sequences is not None
        return self.sequences.get(key, wanted, read=self.read_sequences).batch

    def read_sequences(self, key: SequenceKey, starts: np.ndarray,
                       weights: np.ndarray) -> DeviceSequences:
        """The windows at valid start slots, gathered on the device (one gather)."""
        win = windows(self.reader.ring, starts, key)
        size, length, k = win.obs_slots.shape
        frames, moved = self.frames.gather_batch({
            "plan": np.concatenate([win.obs_slots.reshape(size, -1), win.next_obs_slots], 1),
            "action": win.action, "reward": np.asarray(win.reward, np.float32),
            "terminated": win.terminated, "truncated": win.truncated,
            "is_first": win.is_first, "mask": win.mask, "ids": np.asarray(win.ids, np.int64),
            "weights": np.asarray(weights, np.float32),
            **{EXTRA + name: a for name, a in win.extras.items()}})
        obs = frames[:, :length * k].reshape(size, length, k, *frames.shape[2:])
        batch = SequenceBatch(
            obs=obs, next_obs=frames[:, length * k:], action=moved["action"],
            reward=moved["reward"], terminated=moved["terminated"],
            truncated=moved["truncated"], is_first=moved["is_first"], mask=moved["mask"],
            ids=moved["ids"], weights=moved["weights"], extras=extras_of(moved))
        return DeviceSequences(batch=batch, starts=starts)


def fill_threads() -> int:
    """Threads decoding a fill on open: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def open_device(device: object, spec: StoreSpec, reader: Reader,
                sequences: SequenceReader | None, recorder: Recorder) -> DeviceReader | None:
    """A `DeviceReader` whose frame ring holds every kept frame of the store `reader` reads
    (None for no `device`): checked against the device's free memory, allocated, filled from
    the frame store a block at a time (decoded by `fill_threads` threads), and written
    through by `recorder` from now on. A read-only store beside a writer follows it after
    the fill, as after any read: frames the writer gave up meanwhile are no longer
    sampleable (a fill that found a file gone raises `InvalidStoreError`, and the read-only
    open starts again)."""
    if device is None:
        return None
    frames = DeviceFrames(spec, check_fits(spec, device))
    release = reader.frames.reader.use_threads(fill_threads())  # decoding shared
    try:
        frames.fill(reader.kept_slots(), reader.frames.read)
    finally:
        release()
    reader.refresh()
    recorder.device = frames
    return DeviceReader(frames, reader, sequences)

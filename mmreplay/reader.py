"""Reading transitions beside a writer: the refresh of the index, the follow protocol, the
retry of reads a writer overwrote, and the batch assembly. The store only orchestrates.

A writer commits a manifest that gives frames up *before* it overwrites them::

    writer:  commit manifest (kept_from moves on)  ->  overwrite the frames given up
    reader:  read frames  ->  re-check the manifest  ->  any frame it read given up? retry

so a read-only store that re-checks the manifest after reading knows whether what it read
may have changed underneath it (`Reader.follow_writer`). A writable store is the writer:
it has nothing to follow. A read is retried at most `READER_RETRIES` times
(`Reader.consistent`, shared by transitions and sequences).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from mmreplay.errors import EmptyStoreError, InvalidStoreError, UnknownIdError
from mmreplay.index.ring import StepRing, lookup_out
from mmreplay.index.samplers import Draw, Sampler
from mmreplay.kernels.structs import SampleOut, TreeDraw
from mmreplay.storage.frame_store import FrameStore
from mmreplay.storage.manifest import MANIFEST, read_manifest
from mmreplay.torch_batch import (
    ArrayBatch,
    FrameSetBatch,
    OutputBuffers,
    PinnedBlocks,
    native,
    pinned_frames,
)

READER_RETRIES = 5
T = TypeVar("T")


@dataclass(frozen=True)
class Planned:
    """A batch drawn ahead of its read (`Reader.plan`)."""

    slots: np.ndarray  # flat slots drawn
    weights: np.ndarray  # importance weights of the draw
    chunks: np.ndarray  # keys of the frame chunks on disk its read decodes


class Reader:
    """Keeps a store's sampler current with its ring, and reads consistent batches."""

    def __init__(self, path: Path, ring: StepRing, frames: FrameStore, sampler: Sampler, *,
                 writable: bool) -> None:
        self.path = path
        self.ring = ring
        self.frames = frames
        self.sampler = sampler
        self.writable = writable
        self.manifest_key: tuple[int, int, int] | None = None  # (inode, mtime, size) seen last
        self.manifest_path = os.fspath(path / MANIFEST)  # checked once a batch: joined once
        self.frame_nbytes = math.prod(ring.spec.obs_shape) * np.dtype(ring.spec.obs_dtype).itemsize
        self.pageable = OutputBuffers()  # reused once no batch views them
        self.pinned = PinnedBlocks()  # fresh page-locked blocks: never reused by us
        # called by every draw after its refresh (the store's: late priority updates)
        self.before_draw: Callable[[], None] = _nothing

    # -- keeping the index current -------------------------------------------------
    def refresh(self, *, follow: bool = True) -> None:
        """Follow the writer (read-only stores; unless `follow` is False), then re-test what
        changed since last time."""
        if follow:
            self.follow_writer()
        slots, valid = self.ring.refresh()
        if slots.size:  # most samples of a learner that adds between them change nothing
            self.sampler.update(slots, valid, self.ring.steps["id"].reshape(-1)[slots])

    def follow_writer(self) -> bool:
        """Read-only: give up the frames a writer has given up since; True if any were."""
        if self.writable:
            return False
        try:
            st = os.stat(self.manifest_path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self.manifest_key:
                return False
            self.manifest_key = key
            kept = np.asarray(read_manifest(self.path)["kept_from"], dtype=np.int64)
        except (OSError, InvalidStoreError, ValueError, TypeError):
            return False  # the writer's business; this reader keeps its generation
        ring = self.ring
        if kept.shape != ring.kept_from.shape or (kept <= ring.kept_from).all():
            return False
        np.maximum(ring.kept_from, kept, out=ring.kept_from)
        ring.rebuild_validity()
        self.update_all_slots()
        return True

    def update_all_slots(self) -> None:
        """Tell the sampler the validity and id of every slot (after a full rebuild)."""
        ring = self.ring
        self.sampler.update(np.arange(ring.valid.size), ring.valid, ring.steps["id"].reshape(-1))

    # -- consistent reads ------------------------------------------------------------
    def consistent(self, attempt: Callable[[], T | None]) -> T:
        """`attempt()` until it returns a result (None: a writer overwrote what it read)."""
        for _ in range(READER_RETRIES):
            result = attempt()
            if result is not None:
                return result
        raise InvalidStoreError(f"{self.path}: a writer overwrote frames while they were read "
                                f"{READER_RETRIES} times in a row; try again")

    def still_valid(self, flat: np.ndarray, valid: np.ndarray | None = None) -> bool:
        """After a read: False if a writer gave up any of these slots meanwhile (valid in
        `valid`, e.g. a sequence index's starts, instead of the transition mask)."""
        if not self.follow_writer():
            return True
        return bool((self.ring.valid if valid is None else valid)[flat].all())

    def sample(self, rng: np.random.Generator, size: int, beta: float, *,
               pin_memory: bool = False, out: np.ndarray | None = None) -> ArrayBatch:
        """`size` transitions drawn by the sampler (see `ReplayStore.sample`); their frames
        written into `out` if given (a checked uint8 buffer: `ReplayStore.sample_arrays`)."""
        def attempt() -> ArrayBatch | None:
            self.ready(follow=False)  # `still_valid` follows the writer after the read
            if self.frames.one_call_reads(2 * size * self.ring.spec.frame_stack):
                flat, batch = self.drawn_batch(self.sampler.tree_draw(rng, size, beta),
                                               pin_memory, out)
            else:
                draw = self.sampler.sample(rng, size, beta)
                flat, batch = draw.slots, self.batch(draw.slots, draw.weights,
                                                     pin_memory=pin_memory, out=out)
            return batch if self.still_valid(flat) else None

        return self.consistent(attempt)

    def sample_frame_set(self, rng: np.random.Generator, size: int, beta: float, *,
                         pin_memory: bool = False, out: np.ndarray | None = None
                         ) -> FrameSetBatch:
        """`sample`'s batch (the same draw) with each distinct frame read once
        (`FrameSetBatch`); the frames into `out` if given (as `frame_set`)."""
        def attempt() -> FrameSetBatch | None:
            self.ready(follow=False)
            draw = self.sampler.sample(rng, size, beta)
            batch = self.frame_set(draw.slots, draw.weights, pin_memory, out)
            return batch if self.still_valid(draw.slots) else None

        return self.consistent(attempt)

    def frame_set(self, flat: np.ndarray, weights: np.ndarray, pin_memory: bool,
                  out: np.ndarray | None = None) -> FrameSetBatch:
        """The transitions at valid flat slots, each distinct frame of their stacks read once
        (-1, the zero padding of an episode's first stacks, is a frame like any other), into
        `out` (uint8, room for every frame of the stacks) or a buffer of the pool."""
        look = self.ring.lookup(flat)
        unique, index = np.unique(look.slots, return_inverse=True)
        frames = self.frames.read(unique, out=self.destination(pin_memory, out,
                                                               unique.size * self.frame_nbytes))
        return FrameSetBatch(
            frames=frames, index=index.reshape(look.slots.shape).astype(np.int64, copy=False),
            action=native(look.action, look.action.dtype), reward=look.reward,
            terminated=look.terminated, truncated=look.truncated, discount=look.discount,
            weights=native(weights, np.float32), ids=look.ids, steps=look.steps,
            extras={k: native(a, a.dtype) for k, a in look.extras.items()},
            pinned=pinned_frames(frames) if pin_memory else None)

    def ready(self, *, follow: bool = True) -> None:
        """Refresh; `EmptyStoreError` if no transition is sampleable.

        ``follow=False`` (`sample`) draws from the writer's give-ups as the last read's
        re-check saw them: one manifest check a batch instead of two. A draw that took a
        slot given up since is read, found out by that read's re-check and drawn again."""
        self.refresh(follow=follow)
        self.before_draw()
        if self.sampler.count() == 0:
            raise EmptyStoreError("cannot sample: the store holds no sampleable transition yet")

    def draw(self, rng: np.random.Generator, size: int, beta: float) -> Draw:
        """The sampler's draw of `size` slots, after a refresh."""
        self.ready()
        return self.sampler.sample(rng, size, beta)

    def drawn_batch(self, draw: TreeDraw, pin_memory: bool,
                    out: np.ndarray | None = None) -> tuple[np.ndarray, ArrayBatch]:
        """The flat slots and the batch of `draw`, drawn, looked up and read in one compiled
        call (`FrameStore.read_drawn`): what `batch` of the sampler's `sample` gives."""
        size, stack = draw.values.size, self.ring.spec.frame_stack
        stacks = np.empty((2, size, stack), np.int64)
        outs = SampleOut(flat=np.empty(size, np.int64), weights=np.empty(size, np.float32),
                         stacks=stacks, look=lookup_out(stacks))
        frames = self.frames.read_drawn(draw, self.ring.lookup_columns, outs,
                                        self.destination(pin_memory, out,
                                                         stacks.size * self.frame_nbytes))
        flat, look = outs.flat, outs.look
        action = self.ring.actions_at(flat)
        extras = self.ring.extras_at(flat) if self.ring.spec.extras else {}
        return flat, ArrayBatch(
            frames=frames, action=native(action, action.dtype), reward=look.ret,
            terminated=look.term, truncated=look.trunc, discount=look.discount,
            weights=outs.weights, ids=look.ids, steps=look.steps,
            extras={k: native(a, a.dtype) for k, a in extras.items()},
            pinned=pinned_frames(frames) if pin_memory else None)

    def plan(self, rng: np.random.Generator, size: int, beta: float) -> Planned:
        """Draw a batch now, read its frames later (`assemble`): what `sample` draws next,
        with the frame chunks the read will need (fetched meanwhile, without the lock)."""
        draw = self.draw(rng, size, beta)
        look = self.ring.lookup(draw.slots)
        chunks = self.frames.disk_chunks(look.slots)
        return Planned(draw.slots, draw.weights, chunks)

    def assemble(self, planned: Planned, rng: np.random.Generator, size: int,
                 beta: float) -> ArrayBatch:
        """The batch `planned` drew; drawn again (`sample`) if a writer gave up any of its
        transitions since."""
        batch = self.batch(planned.slots, planned.weights)
        return batch if self.still_valid(planned.slots) else self.sample(rng, size, beta)

    def get(self, wanted: np.ndarray) -> ArrayBatch:
        """The sampleable transitions with these ids (see `ReplayStore.get`)."""
        flat = self.locate(wanted)
        batch = self.batch(flat, np.ones(flat.size, np.float32))
        if not self.still_valid(flat):
            raise UnknownIdError("some of these transitions were overwritten by the writer "
                                 "while they were read")
        return batch

    def locate(self, wanted: np.ndarray) -> np.ndarray:
        """After a refresh, the flat slots of these transition ids; `UnknownIdError` if any
        is not sampleable."""
        self.refresh()
        flat, found = self.ring.flat_of_ids(wanted)
        if not found.all():
            bad = wanted[~found][:5].tolist()
            raise UnknownIdError(f"transition ids {bad} are not (or no longer) sampleable")
        return flat

    def kept_slots(self) -> np.ndarray:
        """The flat slots of every kept frame, env-major and in frame order."""
        env, frames = self.ring.kept_frames()
        return env * self.ring.slots_per_env + frames % self.ring.slots_per_env

    def batch(self, flat: np.ndarray, weights: np.ndarray, *,
              pin_memory: bool = False, out: np.ndarray | None = None) -> ArrayBatch:
        """The transitions at valid flat slots, frames read in one call into a buffer of
        the pool (`OutputBuffers`) when it has one for their size."""
        look = self.ring.lookup(flat)  # every field but the frames, in its batch dtype
        slots = look.slots
        frames = self.frames.read(slots, out=self.destination(pin_memory, out,
                                                              slots.size * self.frame_nbytes))
        return ArrayBatch(frames=frames, action=native(look.action, look.action.dtype),
                          reward=look.reward, terminated=look.terminated,
                          truncated=look.truncated, discount=look.discount,
                          weights=native(weights, np.float32), ids=look.ids, steps=look.steps,
                          extras={k: native(a, a.dtype) for k, a in look.extras.items()},
                          pinned=pinned_frames(frames) if pin_memory else None)

    def destination(self, pin_memory: bool, out: np.ndarray | None,
                    nbytes: int) -> np.ndarray | None:
        """Where a batch's `nbytes` of frames go: `out` if given, else a buffer of the
        `pool`."""
        return out if out is not None else self.pool(pin_memory).take(nbytes)

    def pool(self, pin_memory: bool) -> OutputBuffers | PinnedBlocks:
        """Where the frames of a batch go: reused pageable buffers, or with `pin_memory` a
        fresh page-locked block a batch (`PinnedBlocks` says why)."""
        return self.pinned if pin_memory else self.pageable

    def ids(self, flat: np.ndarray) -> np.ndarray:
        """The transition ids at these flat slots, increasing."""
        return np.sort(self.ring.steps["id"].reshape(-1)[flat])


def _nothing() -> None:
    """`Reader.before_draw` of a reader nobody told otherwise."""

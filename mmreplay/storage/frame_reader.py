"""Reading frames: one general path, and the fast paths of lz4 shard stores.

Every read returns ``(frames, frame_bytes)`` uint8 rows, one frame a row, by *source*
(`kernels.table_kernels`): a frame of a decoded chunk's row in a table, of an env's RAM tail,
or the zero frame (slot -1)::

    general             plan: each frame's source and the chunks to load, claimed in the
    (`read_general`)          decoded-chunk cache (`table_plan`) or, with no cache or a read
                              wider than it, in a scratch table for this read (`scratch_plan`)
                        load: each chunk from the writer's RAM, else decoded from disk (a
                              scratch chunk only up to the last frame the read takes)
                        gather: `gather_frames`, every read's one gather
    lz4 shards, cache   `table_read`: plan, decode and gather in one compiled call
    lz4 shards, none    `read_frames`: each chunk decoded into a scratch buffer and its
                        frames copied out while they are in the CPU's cache, in one call

With threads turned on (`use_threads`: ``batches(workers=N)`` of a writable store, the fill
of a ``device=`` store), a read is shared by `ReadThreads`: the one-pass path's chunks are
split among them, and every other store takes the general path with its decoding split
(the table's claims stay in one thread).

The fast paths serve lz4 shard stores whose chunks are local (no ``fetch``): their bytes are
addresses in mapped files or in the writer's RAM, which compiled code can decode with no
Python per chunk. `read_drawn` is the same two paths behind a draw and a ring lookup in the
same call (`kernels.sample_kernels`). Tests hold each fast path equal to `read_general`.

This module knows slots, chunks and codecs; the writer's side (chunks finished but not yet
in their file, a chunk's bytes on disk) it asks of its `ChunkSource`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.kernels import compiled, lazy_entry, samples, tables
from mmreplay.kernels.structs import (
    ChunkBytes,
    FrameLayout,
    OnePassRead,
    RingColumns,
    SampleOut,
    TableRead,
    TreeDraw,
)
from mmreplay.spec import StoreSpec
from mmreplay.storage.chunk_table import ChunkTable
from mmreplay.storage.codec import ChunkCodec
from mmreplay.storage.read_threads import ReadThreads
from mmreplay.storage.shards import ShardFiles

LZ4_SHARDS_TABLE = "lz4_shards_table"  # `table_read` (and `read_frames` for a wide read)
LZ4_SHARDS_ONE_PASS = "lz4_shards_one_pass"  # `read_frames`

# the compiled kernels called here, each found without a look-up (`kernels.lazy_entry`)
# (plans check only `flat`: the other arrays are allocated here)
_TABLE_PLAN = lazy_entry(tables, "table_plan", check=(0,))
_SCRATCH_PLAN = lazy_entry(tables, "scratch_plan", check=(0,))
_TABLE_READ = lazy_entry(tables, "table_read")
_READ_FRAMES = lazy_entry(compiled, "read_frames")
_SAMPLE_ONE_PASS = lazy_entry(samples, "sample_one_pass")
_SAMPLE_TABLE = lazy_entry(samples, "sample_table")
T = TypeVar("T")


class ChunkSource(Protocol):
    """What a reader asks of the frame store's writing side (`chunk_writer.FinishedChunks`):
    chunks finished but not in their file yet."""

    def maybe_in_ram(self, keys: np.ndarray) -> list[int]:
        """Positions in `keys` of chunks that may be held in RAM (finished, not in their
        file yet); the others are not."""

    def in_ram(self, env: int, chunk: int) -> np.ndarray | None:
        """A chunk's frames held in RAM, or None."""

    def writer_ram(self) -> tuple[np.ndarray, np.ndarray]:
        """Address and size per chunk key of encoded chunks in the writer's RAM (0: none)."""

    def pending_bytes(self, env: int, chunk: int) -> bytes | None:
        """A finished chunk's encoded bytes in the writer's RAM, or None."""


class _Plan(NamedTuple):
    """A general read's plan: each frame's source in ``rows`` (a table of decoded chunks, one
    a row), and the chunks to load (``keys`` into rows ``key_rows``), claimed in ``table``
    (None: ``rows`` is a scratch table of this read)."""

    rows: np.ndarray
    sources: np.ndarray
    keys: np.ndarray
    key_rows: np.ndarray
    table: ChunkTable | None


class FrameReader:
    """Batched frame reads of a frame store (see the module docstring)."""

    def __init__(self, spec: StoreSpec, layout: FrameLayout, codec: ChunkCodec,
                 source: ChunkSource, chunk_bytes: Callable[[int, int], tuple[bytes, str]], *,
                 shards: ShardFiles | None, table: ChunkTable | None, local: bool) -> None:
        self.spec = spec
        self._layout = layout
        self._codec = codec
        self._source = source
        self._chunk_bytes_on_disk = chunk_bytes  # and where they are, for messages
        self._shards = shards
        self._table = table
        self.fast_path: str | None = None  # which fast path `read` takes, if any
        if shards is not None and codec.lz4 and local:
            self.fast_path = LZ4_SHARDS_ONE_PASS if table is None else LZ4_SHARDS_TABLE
        self.threads: ReadThreads | None = None  # sharing each read (`use_threads`)
        self._thread_counts: list[int] = []  # what each user of `use_threads` asked for

    # -- threads sharing a read -------------------------------------------------
    def use_threads(self, count: int) -> Callable[[], None]:
        """Share every read among `count` threads (the most any user asks for) until the
        returned function is called. Call both under the store's lock: no read is running
        while the threads change."""
        self._thread_counts.append(count)
        self._resize_threads()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._thread_counts.remove(count)
                self._resize_threads()

        return release

    def _resize_threads(self) -> None:
        want = max(self._thread_counts, default=1)
        if want == (self.threads.count if self.threads is not None else 1):
            return
        old, self.threads = self.threads, ReadThreads(want) if want > 1 else None
        if old is not None:
            old.close()

    def close(self) -> None:
        """Stop the threads sharing reads, if any."""
        self._thread_counts.clear()
        self._resize_threads()

    def _shares(self, share: Callable[[int, int], T], frames: int) -> list[T]:
        """``share(part, parts)`` of a read of `frames` frames, split among the threads
        if there are any and the read is big enough (`ReadThreads.parts`)."""
        threads = self.threads
        if threads is None or (parts := threads.parts(frames)) == 1:
            return [share(0, 1)]
        return threads.run(share, parts)

    # -- the general path -------------------------------------------------------
    def read(self, flat_slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A fresh array of the frames at `flat_slots` (any shape); -1 gives zeros.

        `out`, if given, is a C-contiguous uint8 buffer of at least the result's bytes that
        the result is written into (a view of it is returned). Through the store's fast
        path if it has one, else `read_general`."""
        flat = np.asarray(flat_slots, dtype=np.int64)
        shape = (*flat.shape, *self.spec.obs_shape)
        flat = flat.reshape(-1)
        if flat.size == 0:
            return np.zeros(shape, self.spec.obs_dtype)
        dest = self._destination(flat, out)
        path = self.fast_path
        if path is None or (path == LZ4_SHARDS_TABLE and self.threads is not None):
            self._read_general(flat, dest)
        elif path == LZ4_SHARDS_ONE_PASS or not self._read_lz4_shards_table(flat, dest):
            self._read_lz4_shards_one_pass(flat, dest)  # also a read wider than the table
        return dest.view(self.spec.obs_dtype).reshape(shape)

    def read_general(self, flat_slots: np.ndarray) -> np.ndarray:
        """`read` through the general path whatever the store: what each fast path must
        equal."""
        flat = np.asarray(flat_slots, dtype=np.int64)
        shape = (*flat.shape, *self.spec.obs_shape)
        dest = self._destination(flat.reshape(-1), None)
        if flat.size:
            self._read_general(flat.reshape(-1), dest)
        return dest.view(self.spec.obs_dtype).reshape(shape)

    def _read_general(self, flat: np.ndarray, dest: np.ndarray) -> None:
        """Plan, load, gather (see the module docstring); a failed load drops its claims."""
        plan = self._plan(flat)
        try:
            self._load(plan)
        except BaseException:
            if plan.table is not None:
                plan.table.drop(plan.keys)
            raise
        tables().gather_frames(plan.rows, self._layout.tail_rows, plan.sources, dest, 0)

    def _plan(self, flat: np.ndarray) -> _Plan:
        """Sources in the cache's rows, with a row claimed for each chunk it lacks; or, with
        no cache or a read touching more chunks than it has rows, in a scratch table."""
        size = flat.size
        sources, keys, rows = (np.empty(size, np.int64), np.empty(size, np.int64),
                               np.empty(size, np.int64))
        table = self._table
        if table is not None:
            count, wide = _TABLE_PLAN(flat, self._layout, table.arrays(), sources, keys, rows)
            if not wide:
                return _Plan(table.rows, sources, keys[:count], rows[:count], table)
            table.drop(keys[:count])
        count = _SCRATCH_PLAN(flat, self._layout, keys, sources)
        scratch = np.empty((count, self._codec.nbytes), np.uint8)
        return _Plan(scratch, sources, keys[:count], np.arange(count), None)

    def _load(self, plan: _Plan) -> None:
        """Fill the plan's rows with its chunks: from RAM (finished, not yet in their file)
        or decoded from disk (into a scratch table only up to the last frame the read takes
        from each)."""
        if not plan.keys.size:  # every frame held already (or a tail, or zeros)
            return
        found = []
        for i in self._source.maybe_in_ram(plan.keys):
            frames = self._source.in_ram(*divmod(int(plan.keys[i]), self._layout.num_chunks))
            if frames is not None:
                plan.rows[plan.key_rows[i]] = np.ascontiguousarray(frames).reshape(-1).view(
                    np.uint8)
                found.append(i)
        disk = np.arange(plan.keys.size)
        if found:
            disk = np.setdiff1d(disk, found, assume_unique=True)
        if disk.size:
            prefixes = None if plan.table is not None else plan.sources[plan.sources >= 0]
            self._decode(plan.keys[disk], plan.key_rows[disk], plan.rows, prefixes)

    def _decode(self, keys: np.ndarray, dest: np.ndarray, rows: np.ndarray,
                frame_rows: np.ndarray | None) -> None:
        """Decode chunks `keys` from disk into ``rows[dest]`` with the compiled kernel.
        Given the read's `frame_rows` (its frames as rows of `rows` seen one frame a row),
        a chunk is decoded only up to the last frame the read takes from it."""
        keep: list[bytes] = []  # format 1: the files' bytes stay alive during the call
        if self._shards is not None:
            src, size = self._shards.addresses(keys)
        else:
            num_chunks = self._layout.num_chunks
            keep = [self._chunk_bytes_on_disk(*divmod(k, num_chunks))[0] for k in keys.tolist()]
            src = np.array([_address(b) for b in keep], np.int64)
            size = np.array([len(b) for b in keep], np.int64)

        def decode(part: int, parts: int) -> np.ndarray:
            take = slice(part, None, parts)  # every parts-th chunk: contiguous copies
            src_, size_, dest_ = (np.ascontiguousarray(a[take]) for a in (src, size, dest))
            if frame_rows is None:
                return self._codec.decode_many(src_, size_, rows, dest_)
            return self._codec.decode_prefixes(src_, size_, rows, dest_, frame_rows)

        shares = self._shares(decode, keys.size * self._layout.chunk)
        status = np.empty(keys.size, np.int64)
        for part, share in enumerate(shares):
            status[part::len(shares)] = share
        if status.any():
            bad = int(np.argmax(status != 0))
            data, where = self._chunk_bytes_on_disk(*divmod(int(keys[bad]),
                                                           self._layout.num_chunks))
            raise InvalidStoreError(self._codec.damage(data, int(status[bad]), where))

    def disk_chunks(self, flat_slots: np.ndarray) -> np.ndarray:
        """The keys (``env * num_chunks + chunk``) of the chunks on disk that
        ``read(flat_slots)`` would decode (not the RAM tails nor the zero frame), once each:
        what a store read from a bucket fetches ahead."""
        flat = np.asarray(flat_slots, dtype=np.int64).reshape(-1)
        keys = np.empty(flat.size, np.int64)
        count = _SCRATCH_PLAN(flat, self._layout, keys, np.empty(flat.size, np.int64))
        return keys[:count]

    # -- the fast paths of lz4 shard stores ---------------------------------------
    def _read_lz4_shards_one_pass(self, flat: np.ndarray, dest: np.ndarray) -> None:
        """`read_frames`: each frame's chunk; each chunk's bytes (pending in the writer's
        RAM, else in its mapped file; files not mapped yet are mapped and the call made
        again); one pass that decodes each chunk up to the last frame it gives into a
        scratch buffer and copies its frames out while they are in the CPU's cache."""
        assert self._shards is not None
        while True:
            share = functools.partial(self._one_pass_share, flat, dest, self._chunk_bytes())
            shares = self._shares(share, flat.size)
            unmapped = [missing[:status] for status, missing in shares if status > 0]
            if not unmapped:
                break
            self._shards.addresses(np.unique(np.concatenate(unmapped)))  # maps, or raises
        for status, missing in shares:
            if status:
                self._raise_damaged(int(flat[missing[0]]), -int(status))

    def _one_pass_share(self, flat: np.ndarray, dest: np.ndarray, chunks: ChunkBytes, part: int,
                        parts: int) -> tuple[int, np.ndarray]:
        """Share `part` of `parts` of a one-pass read: its status and where the chunks it
        could not take are named (`read_frames`)."""
        missing = np.empty(flat.size, np.int64)
        read = OnePassRead(self._layout, chunks, np.empty(self._codec.nbytes, np.uint8), dest,
                           missing)
        return _READ_FRAMES(flat, read, part, parts), missing

    def _read_lz4_shards_table(self, flat: np.ndarray, dest: np.ndarray) -> bool:
        """`table_read`: each frame's source; the chunks the table lacks decoded whole from
        the writer's RAM or their mapped file straight into their rows (files not mapped yet
        are mapped and the call made again); one gather. False for a read touching more
        chunks than the table has rows."""
        assert self._shards is not None and self._table is not None
        sources, missing = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
        kernels = tables()
        while True:
            status = _TABLE_READ(flat, self._table_read(sources, dest, missing), 0)
            if status <= 0:
                break
            self._shards.addresses(missing[:status])  # maps their files, or raises if absent
        if status == kernels.WIDE:
            return False
        if status:
            env, chunk = divmod(int(missing[0]), self._layout.num_chunks)
            self._raise_damaged(env * self._layout.slots + chunk * self._layout.chunk,
                                -int(status))
        return True

    def read_drawn(self, draw: TreeDraw, ring: RingColumns, outs: SampleOut,
                   out: np.ndarray | None = None) -> np.ndarray:
        """The frames of the stacks ``outs.stacks`` of a batch that one compiled call draws
        (`draw`, a sampler's `TreeDraw`), looks up (`ring`, the ring's `RingColumns`, into
        `outs`: see `sample_kernels`) and reads, for a store with a `fast_path`; what that
        call cannot finish (files to map, a damaged chunk, more chunks than the table has
        rows) `read` finishes from the stacks looked up. `out` as in `read`."""
        stacks = outs.stacks
        flat = stacks.reshape(-1)
        dest = self._destination(flat, out)
        missing = np.empty(flat.size, np.int64)
        if self._table is None:
            read = OnePassRead(self._layout, self._chunk_bytes(),
                               np.empty(self._codec.nbytes, np.uint8), dest, missing)
            status = _SAMPLE_ONE_PASS(draw, ring, outs, read)
        else:
            sources = np.empty(flat.size, np.int64)
            status = _SAMPLE_TABLE(draw, ring, outs, self._table_read(sources, dest, missing))
        if status != 0:
            return self.read(stacks, out)
        return dest.view(self.spec.obs_dtype).reshape(*stacks.shape, *self.spec.obs_shape)

    def _chunk_bytes(self) -> ChunkBytes:
        """Where each chunk's bytes are now: the writer's RAM and the shard files' tables
        (`ShardFiles.read_state`)."""
        assert self._shards is not None
        mapped = self._shards.read_state()
        ram_src, ram_size = self._source.writer_ram()
        return ChunkBytes(src=mapped.src, size=mapped.size, ram_src=ram_src, ram_size=ram_size,
                          used=mapped.used, tick=mapped.tick, shard_chunks=mapped.shard_chunks)

    def _table_read(self, sources: np.ndarray, dest: np.ndarray,
                    missing: np.ndarray) -> TableRead:
        assert self._table is not None
        return TableRead(self._layout, self._chunk_bytes(), self._table.arrays(), sources, dest,
                         missing)

    # -- shared ------------------------------------------------------------------
    def _destination(self, flat: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """``(flat.size, frame_bytes)`` uint8 rows a read writes: in `out` when it is big
        enough, else fresh."""
        frame_bytes = self._layout.tail_rows.shape[1]
        size = flat.size * frame_bytes
        if out is None or out.size < size:
            out = np.empty(size, np.uint8)
        return out[:size].reshape(flat.size, frame_bytes)

    def _raise_damaged(self, flat_slot: int, status: int) -> None:
        """`InvalidStoreError` saying how the chunk of `flat_slot` is damaged."""
        env, slot = divmod(flat_slot, self._layout.slots)
        chunk = slot // self._layout.chunk
        held = self._source.pending_bytes(env, chunk)
        data, place = ((held, "a finished chunk in RAM") if held is not None
                       else self._chunk_bytes_on_disk(env, chunk))
        raise InvalidStoreError(self._codec.damage(data, status, place))


def _address(data: bytes) -> int:
    """The address of a bytes object's buffer (the caller keeps `data` alive)."""
    return int(np.frombuffer(data, np.uint8).ctypes.data)

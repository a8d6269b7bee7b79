"""Where frames live: a plain zarr v3 array on disk plus an unfinished tail in RAM.

Layout::

    <root>/frames/zarr.json              zarr v3 array metadata
    <root>/frames/c.<env>.<chunk>.0.0    one chunk = `chunk_frames` consecutive slots of one env

The array has shape ``(num_envs, slots_per_env, *obs_shape)`` and chunk shape
``(1, chunk_frames, *obs_shape)``; chunk keys use zarr's default encoding with
the ``"."`` separator (one flat directory, no directory per chunk); codecs are
``bytes -> blosc(lz4) -> crc32c`` (``bytes -> zstd -> crc32c`` with ``codec="zstd"``), so
``zarr.open_group(root)["frames"]`` reads it with no help from mmreplay. With
``codec="zstd-dict"`` the compressor is zstd with the store's dictionary (`zstd_dict`):
zarr reads it through the codec mmreplay registers (`zarr_codec`).

Frames arrive one slot at a time per env (the ring's cursor). The chunk being
filled lives in RAM (the *tail*); it is encoded and written whole, atomically
(temp file + rename), as soon as its last slot arrives, so no chunk is ever
read-modify-written. Encoding and writing happen in the caller's thread
(`ChunkWriter`), in order; until a chunk is on disk, reads are served from RAM.
Before it writes a chunk it calls ``before_chunk_write`` so
the owner can give up (in a committed manifest) the old frames that chunk held.
A ``"zstd-dict"`` store without a dictionary yet holds finished chunks in RAM until it
has trained one (`DictionaryTrainer`); the dictionary file and ``zarr.json`` are written
before the first chunk.

This module knows slots, chunks, codecs and caches; it knows nothing of
episodes, stacking, priorities or torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.kernels import compiled, samples, tables
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
from mmreplay.storage.codec import ChunkCodec, compressor, max_chunk_bytes
from mmreplay.storage.safe_io import TMP_DIR, fsync_dir, read_small, write_atomic
from mmreplay.storage.shards import MAX_MAPPED, ShardFiles, ShardWriter, max_shard_bytes, write_each
from mmreplay.storage.zstd_dict import DictionaryTrainer, dictionary_record, install, train

FRAMES = "frames"
ChunkHook = Callable[[int, int, int], None]  # (env, first chunk, last chunk) to be replaced


def create_frames_array(root: Path, spec: StoreSpec) -> None:
    """Create the zarr group at `root` and its empty `frames` array.

    zarr is imported here, not with the module: only creating a store needs it (reads and
    writes go through `codec` and `shards`), and its import costs a CLI call ~0.2 s.
    """
    import zarr
    from zarr.codecs import Crc32cCodec

    group = zarr.open_group(str(root), mode="w-", zarr_format=3)
    sharded = spec.shard_chunks > 1
    group.create_array(
        FRAMES,
        shape=(spec.num_envs, spec.slots_per_env, *spec.obs_shape),
        chunks=(1, spec.chunk_frames, *spec.obs_shape),
        shards=(1, spec.chunk_frames * spec.shard_chunks, *spec.obs_shape) if sharded else None,
        dtype=spec.obs_dtype,
        compressors=[compressor(spec), Crc32cCodec()],
        chunk_key_encoding={"name": "default", "separator": "."},
        fill_value=0,
    )


def max_file_bytes(spec: StoreSpec) -> int:
    """Largest valid file in ``frames/`` besides ``zarr.json``: a chunk or a shard."""
    if spec.shard_chunks == 1:
        return max_chunk_bytes(spec)
    return max_shard_bytes(spec.shard_chunks, max_chunk_bytes(spec))


@dataclass(frozen=True)
class CacheStats:
    """The decoded-chunk cache now: its byte budget, bytes held and chunks held."""

    budget_bytes: int
    nbytes: int
    chunks: int


class ChunkWriter:
    """Encodes and writes finished chunks (temp file + rename), in the caller's thread.

    A background writer thread was measured and dropped: on 2 cores it cut `add` in a
    tight loop from ~60k to ~21k steps/s, because the thread needs the GIL between its
    system calls and fights the caller for it, while an inline write of an 8-frame
    chunk into the page cache costs ~40 µs (~5 µs per step).

    A failed write keeps its chunk in ``failed`` (readers are served from RAM), raises
    to the caller, and is retried by the next `drain`, which raises the first error it
    meets again; so no commit ever names a chunk that is not on disk.
    """

    def __init__(self, codec: ChunkCodec, tmp_dir: Path) -> None:
        self._codec = codec
        self._tmp_dir = tmp_dir
        self.failed: dict[tuple[int, int], tuple[Path, np.ndarray]] = {}  # not on disk
        self.written: list[Path] = []

    def submit(self, key: tuple[int, int], path: Path, frames: np.ndarray) -> None:
        """Write a chunk (a newer lap replaces an older failed write of it); on failure it
        stays in ``failed`` for `drain` and the error is raised."""
        self.failed[key] = (path, frames)
        self._write(key)

    def _write(self, key: tuple[int, int]) -> None:
        path, frames = self.failed[key]
        write_atomic(path, self._codec.encode(frames), self._tmp_dir, durable=False)
        del self.failed[key]
        self.written.append(path)

    def drain(self) -> None:
        """Retry every failed write, in order; raise the first error if any failed again."""
        write_each(list(self.failed), self._write)


class FrameStore:
    """Batched frame reads and appends over the zarr `frames` array.

    Slots are addressed *flat*: ``env * slots_per_env + slot``; ``-1`` reads as
    a frame of zeros (stack padding).
    """

    def __init__(self, root: Path, spec: StoreSpec, *, writable: bool, durable: bool = False,
                 cache_bytes: int = 0, before_chunk_write: ChunkHook | None = None,
                 fetch: Callable[[np.ndarray, Callable[[int, int], None]], None] | None = None,
                 dictionary: bytes | None = None):
        self.spec = spec
        self._root = Path(root)
        self._dir = Path(root) / FRAMES
        self._dir_str = str(self._dir)
        self._key_suffix = ".0" * len(spec.obs_shape)
        self._tmp_dir = Path(root) / TMP_DIR
        self._writable = writable
        self._durable = durable
        self._codec = ChunkCodec(spec, dictionary)
        self._trainer = (DictionaryTrainer(spec.dict_train_chunks)
                         if writable and self._codec.needs_dictionary else None)
        self._max_bytes = max_chunk_bytes(spec)
        self.cache_budget = cache_bytes  # decoded chunks kept in RAM (`ChunkTable`)
        self._table = ChunkTable(spec.num_envs * spec.num_chunks, self._codec.nbytes,
                                 spec.chunk_frames, cache_bytes) \
            if 0 < self._codec.nbytes <= cache_bytes else None
        self._hook = before_chunk_write
        self._chunk_len = spec.chunk_frames
        self.num_chunks = spec.num_chunks
        self.tail = np.zeros((spec.num_envs, spec.chunk_frames, *spec.obs_shape), spec.obs_dtype)
        self.tail_fill = np.zeros(spec.num_envs, np.int64)
        self._tail_rows = self.tail.reshape(spec.num_envs * spec.chunk_frames, -1).view(np.uint8)
        self.next_slot = np.zeros(spec.num_envs, np.int64)
        self._layout = FrameLayout(  # written in place, never moved
            slots=spec.slots_per_env, chunk=spec.chunk_frames, num_chunks=spec.num_chunks,
            next_slot=self.next_slot, tail_fill=self.tail_fill, tail_rows=self._tail_rows)
        sharded = spec.shard_chunks > 1  # format 2; else a file per chunk
        self._writer = ChunkWriter(self._codec, self._tmp_dir) if writable and not sharded \
            else None
        self._held: dict[tuple[int, int], np.ndarray] = {}  # finished, not yet submitted
        self._shards: ShardFiles | None = None
        self._shard_writer: ShardWriter | None = None
        self._read_chunk = self._chunk_file_bytes
        # `_read_one_pass`: chunks come from mapped files or the writer's RAM, none kept decoded
        self._one_pass = sharded and self._codec.lz4 and self._table is None and fetch is None
        # `_read_table_one_call`: the same, through the table (chunks decoded whole, kept)
        self._table_one_call = (sharded and self._codec.lz4 and self._table is not None
                                and fetch is None)
        if sharded:
            self._shards = ShardFiles(self._dir_str, self._key_suffix, spec.shard_chunks,
                                      self._max_bytes, num_envs=spec.num_envs,
                                      num_chunks=self.num_chunks, max_open=MAX_MAPPED,
                                      fetch=fetch)
            self._read_chunk = self._shards.chunk
            if writable:
                self._shard_writer = ShardWriter(self._shards, str(self._tmp_dir),
                                                 self.num_chunks, before_chunk_write,
                                                 durable=durable)

    def forget_shard(self, env: int, shard: int) -> None:
        """Unmap a shard file about to be replaced by someone else (a bucket's cache)."""
        if self._shards is not None:
            self._shards.forget(env, shard)

    # -- layout ---------------------------------------------------------------
    def chunk_path(self, env: int, chunk: int) -> Path:
        """The file of a chunk in the file-per-chunk layout (format 1)."""
        return Path(self._chunk_file(env, chunk))

    def file_path(self, env: int, chunk: int) -> Path:
        """The file holding `chunk`: its shard file, or its own file (format 1)."""
        if self._shards is not None:
            return Path(self._shards.path(env, chunk // self.spec.shard_chunks))
        return self.chunk_path(env, chunk)

    def decode(self, data: bytes, where: str) -> np.ndarray:
        """One chunk's frames from its bytes (`InvalidStoreError` if they are damaged)."""
        return self._codec.decode(data, where)

    def _chunk_file(self, env: int, chunk: int) -> str:
        return f"{self._dir_str}/c.{env}.{chunk}{self._key_suffix}"

    def cache_stats(self) -> CacheStats:
        """Budget and fill of the decoded-chunk cache."""
        held = 0 if self._table is None else self._table.held
        return CacheStats(budget_bytes=self.cache_budget, nbytes=held * self._codec.nbytes,
                          chunks=held)

    def chunk_slots(self, chunk: int) -> int:
        """Real slots in `chunk`; the last chunk of the ring may be short."""
        return min(self._chunk_len, self.spec.slots_per_env - chunk * self._chunk_len)

    # -- writing --------------------------------------------------------------
    def append(self, envs: np.ndarray, slots: np.ndarray, frames: np.ndarray) -> None:
        """Put one frame per listed env at that env's next slot (the ring's cursor)."""
        for env, slot, frame in zip(envs.tolist(), slots.tolist(), frames, strict=True):
            self.append_one(env, slot, frame)

    def append_one(self, env: int, slot: int, frame: np.ndarray) -> None:
        chunk, offset = divmod(slot, self._chunk_len)
        assert offset == self.tail_fill[env], "frames must arrive in slot order"
        self.tail[env, offset] = frame
        self.tail_fill[env] = offset + 1
        self.next_slot[env] = (slot + 1) % self.spec.slots_per_env
        if offset + 1 == self.chunk_slots(chunk):
            self._write_chunk(env, chunk)

    def _write_chunk(self, env: int, chunk: int) -> None:
        frames = self.tail[env].copy()
        frames[self.tail_fill[env]:] = 0
        if self._table is not None:
            self._table.put(env * self.num_chunks + chunk, frames)
        self.tail_fill[env] = 0
        if self._trainer is not None:
            self._hold_for_training(env, chunk, frames)
            return
        self._emit_chunk(env, chunk, frames)

    def _emit_chunk(self, env: int, chunk: int, frames: np.ndarray) -> None:
        if self._shard_writer is not None:
            self._shard_writer.add(env, chunk, self._codec.encode(frames))
            return
        self._held[(env, chunk)] = frames
        _submit_held(self)

    # -- the dictionary of "zstd-dict" ------------------------------------------
    def _hold_for_training(self, env: int, chunk: int, frames: np.ndarray) -> None:
        """Hold a chunk until the dictionary exists (`DictionaryTrainer` says when)."""
        assert self._trainer is not None
        if self._trainer.add((env, chunk), frames):
            self.train_dictionary()

    def train_dictionary(self) -> None:
        """Train the dictionary on the held chunks' frames and write them (no-op unless a
        "zstd-dict" store holds chunks waiting for one)."""
        if self._trainer is not None and len(self._trainer):
            self.set_dictionary(train(self._trainer.frames(), self.spec.dict_bytes,
                                      self.spec.codec_level))

    def set_dictionary(self, dictionary: bytes) -> None:
        """Fix the store's dictionary: its file and ``zarr.json``, then the chunks held
        for it."""
        install(self._root, dictionary, self._tmp_dir, durable=self._durable)
        self._codec.set_dictionary(dictionary)
        held = self._trainer.take() if self._trainer is not None else []
        self._trainer = None
        for (env, chunk), frames in held:
            self._emit_chunk(env, chunk, frames)

    def dictionary_record(self) -> dict[str, int] | None:
        """The manifest's record of the dictionary (None until there is one)."""
        data = self._codec.dictionary
        return None if data is None else dictionary_record(data)

    def drain(self) -> None:
        """Wait until every finished chunk is on disk (raises a failed write's error); a
        "zstd-dict" store trains its dictionary now if chunks are waiting for it."""
        self.train_dictionary()
        if self._shard_writer is not None:
            self._shard_writer.drain()
        if self._writer is not None:
            _submit_held(self)
            self._writer.drain()

    def sync(self) -> None:
        """Drain, then fsync every chunk written since the last sync and the directory."""
        self.drain()
        writer = self._writer or self._shard_writer
        if writer is None:
            return
        written, writer.written = writer.written, []
        for path in written:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if written:
            fsync_dir(self._dir)

    def close(self) -> None:
        """Stop writing. Writes are synchronous, so only chunks whose write failed (an
        error their caller already got, and `drain`/`flush` raise again) are dropped."""
        self._writer = self._shard_writer = None
        if self._shards is not None:
            self._shards.close()

    # -- the RAM tail ---------------------------------------------------------
    def tail_frames(self) -> np.ndarray:
        """The unfinished chunk of every env (rows past `tail_fill` are zeros)."""
        out = self.tail.copy()
        for env, fill in enumerate(self.tail_fill.tolist()):
            out[env, fill:] = 0
        return out

    def load_tail(self, frames: np.ndarray, next_slots: np.ndarray) -> None:
        """Restore the RAM tail; `next_slots` is each env's write cursor."""
        self.next_slot[...] = next_slots
        self.tail_fill[...] = self.next_slot % self._chunk_len
        self.tail[...] = frames

    # -- reading --------------------------------------------------------------
    def read(self, flat_slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A fresh array of the frames at `flat_slots` (any shape); -1 gives zeros.

        `out`, if given, is a C-contiguous uint8 buffer of at least the result's bytes that
        the result is written into (a view of it is returned).

        Default lz4 shard stores read in one compiled call (`_read_one_pass`). Else every
        distinct chunk the slots touch (the zero frame and RAM tails count as chunks) is
        fetched once into one table, from RAM or decoded from the mapped file, and one
        compiled gather of that table is the result (each frame copied once).
        """
        flat = np.asarray(flat_slots, dtype=np.int64)
        shape = (*flat.shape, *self.spec.obs_shape)
        flat = flat.reshape(-1)
        if flat.size == 0:
            return np.zeros(shape, self.spec.obs_dtype)
        if self._table is not None or self._one_pass:
            got = _fast_read(self, flat, out)
            if got is not None:
                return got.view(self.spec.obs_dtype).reshape(shape)
        keys = np.empty(flat.size, np.int64)
        rows_of = np.empty(flat.size, np.int64)  # each frame's row in the table's frames
        count = compiled().chunk_plan(flat, self._layout, keys, rows_of)
        unique = keys[:count]
        table = np.empty((count, self._chunk_len, *self.spec.obs_shape), self.spec.obs_dtype)
        rows = table.reshape(count, -1).view(np.uint8)
        on_disk = _fill_from_ram(self, unique, table)
        if on_disk.size:
            self._decode(unique[on_disk], on_disk, rows, rows_of)
        dest = _destination(self, flat, out)
        compiled().gather_rows(rows.reshape(count * self._chunk_len, dest.shape[1]), rows_of,
                               dest)
        return dest.view(self.spec.obs_dtype).reshape(shape)

    @property
    def one_call_reads(self) -> bool:
        """Whether `read_drawn` draws, looks up and reads a batch in one compiled call (lz4
        shard stores whose chunks are local; else it would read as `read` does)."""
        return self._one_pass or self._table_one_call

    def read_drawn(self, draw: TreeDraw, ring: RingColumns, outs: SampleOut,
                   out: np.ndarray | None = None) -> np.ndarray:
        """The frames of the stacks ``outs.stacks`` of a batch that one compiled call draws
        (`draw`, a sampler's `TreeDraw`), looks up (`ring`, the ring's `RingColumns`, into
        `outs`: see `sample_kernels`) and reads, for a store with `one_call_reads`;
        what that call cannot finish (files to map, a damaged chunk, more chunks than the
        table has rows) `read` finishes from the stacks looked up. `out` as in `read`."""
        stacks = outs.stacks
        flat = stacks.reshape(-1)
        dest = _destination(self, flat, out)
        status = _sample_call(self, draw, ring, outs, flat.size, dest)
        if status != 0:
            return self.read(stacks, out)
        return dest.view(self.spec.obs_dtype).reshape(*stacks.shape, *self.spec.obs_shape)

    def _decode(self, keys: np.ndarray, dest: np.ndarray, rows: np.ndarray,
                frame_rows: np.ndarray | None = None) -> None:
        """Decode chunks `keys` from disk into ``rows[dest]`` with the compiled kernel.
        Given the read's `frame_rows` (its frames as rows of `rows` seen one frame a row),
        a chunk is decoded only up to the last frame the read takes from it."""
        keep: list[bytes] = []  # format 1: the files' bytes stay alive during the call
        if self._shards is not None:
            src, size = self._shards.addresses(keys)
        else:
            keep = [self._read_chunk(*divmod(k, self.num_chunks)) for k in keys.tolist()]
            src = np.array([_address(b) for b in keep], np.int64)
            size = np.array([len(b) for b in keep], np.int64)
        if frame_rows is None:
            status = self._codec.decode_many(src, size, rows, dest)
        else:
            status = self._codec.decode_prefixes(src, size, rows, dest, frame_rows)
        if status.any():
            bad = int(np.argmax(status != 0))
            env, chunk = divmod(int(keys[bad]), self.num_chunks)
            data, where = self.chunk_bytes(env, chunk)
            raise InvalidStoreError(self._codec.damage(data, int(status[bad]), where))

    def chunk_bytes(self, env: int, chunk: int) -> tuple[bytes, str]:
        """A chunk's bytes on disk and where they are (for messages); `InvalidStoreError`
        if its file, or its entry in its shard file, is missing or damaged."""
        return self._read_chunk(env, chunk), self._chunk_where(env, chunk)

    def _chunk_file_bytes(self, env: int, chunk: int) -> bytes:
        path = self._chunk_file(env, chunk)
        return read_small(path, f"frame chunk {path}", self._max_bytes)

    def _chunk_where(self, env: int, chunk: int) -> str:
        if self._shards is not None:
            shard, j = divmod(chunk, self.spec.shard_chunks)
            return f"{self._shards.path(env, shard)} (chunk {j})"
        return self._chunk_file(env, chunk)

def append_run(fs: FrameStore, env: int, slot: int, frames: np.ndarray) -> None:
    """`FrameStore.append_one` of consecutive frames of `env` from `slot` on: copied a chunk's
    piece at a time, each chunk written once full. A chunk write that raises does not
    stop the run (the frames stay in order with the ring); the first error is raised
    at the end."""
    error: Exception | None = None
    done, total = 0, len(frames)
    while done < total:
        chunk, offset = divmod(slot, fs._chunk_len)
        assert offset == fs.tail_fill[env], "frames must arrive in slot order"
        room = fs.chunk_slots(chunk) - offset
        take = min(total - done, room)
        fs.tail[env, offset:offset + take] = frames[done:done + take]
        fs.tail_fill[env] = offset + take
        slot = (slot + take) % fs.spec.slots_per_env
        fs.next_slot[env] = slot
        done += take
        if take == room:
            try:
                fs._write_chunk(env, chunk)
            except Exception as exc:  # noqa: BLE001 - re-raised once the run is in place
                error = error or exc
    if error is not None:
        raise error


def _fill_from_ram(fs: FrameStore, unique: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Fill the table rows of tails, the zero chunk and chunks held in RAM; returns
    the rows left to decode from disk. `unique` is sorted (`chunk_plan`): chunks on
    disk first, then the tails and the zero chunk."""
    tails = fs.spec.num_envs * fs.num_chunks
    on_disk = int(np.searchsorted(unique, tails))
    for i in range(on_disk, unique.size):
        k = int(unique[i]) - tails
        table[i] = fs.tail[k] if k < fs.spec.num_envs else 0
    found = []
    for i in _maybe_in_ram(fs, unique[:on_disk]):
        chunk = _in_ram(fs, *divmod(int(unique[i]), fs.num_chunks))
        if chunk is not None:
            table[i] = chunk
            found.append(i)
    disk = np.arange(on_disk)
    return np.setdiff1d(disk, found, assume_unique=True) if found else disk


def _address(data: bytes) -> int:
    """The address of a bytes object's buffer (the caller keeps `data` alive)."""
    return int(np.frombuffer(data, np.uint8).ctypes.data)


def _submit_held(fs: FrameStore) -> None:
    """Hand finished chunks to the writer, in order, each after its hook.

    A chunk whose hook (a give-up commit) raised stays held, readable from RAM,
    and is retried by the next chunk or `drain`, so no finished chunk is ever lost.
    """
    assert fs._writer is not None, "append on a read-only frame store"
    while fs._held:
        key, frames = next(iter(fs._held.items()))
        if fs._hook is not None:
            fs._hook(key[0], key[1], key[1])
        del fs._held[key]
        fs._writer.submit(key, fs.chunk_path(*key), frames)


def _ram_ranges(fs: FrameStore) -> np.ndarray:
    """Key ranges ``[lo, hi)`` (rows of an ``(R, 2)`` array) holding every chunk that may
    be held in RAM: finished, not yet in its file (a pending shard's whole range), or whose
    write failed."""
    keys: list[tuple[int, int]] = [*fs._held]
    if fs._trainer is not None:
        keys += fs._trainer.keys()
    if fs._writer is not None:
        keys += list(fs._writer.failed)
    ranges = [(e * fs.num_chunks + c, e * fs.num_chunks + c + 1) for e, c in keys]
    if fs._shard_writer is not None:
        span = fs.spec.shard_chunks
        for env, shard in fs._shard_writer.pending_shards():
            lo = env * fs.num_chunks + shard * span
            ranges.append((lo, lo + span))
    return np.array(ranges, np.int64).reshape(-1, 2)


def _maybe_in_ram(fs: FrameStore, keys: np.ndarray) -> list[int]:
    """The positions in `keys` (sorted chunk keys) of the chunks that may be held in RAM:
    one binary search of a few key ranges per batch, not a lookup per pending chunk."""
    ranges = _ram_ranges(fs)
    if not (ranges.size and keys.size):
        return []
    spans = np.searchsorted(keys, ranges.reshape(-1)).reshape(-1, 2).tolist()
    return sorted({i for lo, hi in spans for i in range(lo, hi)})


def _in_ram(fs: FrameStore, env: int, chunk: int) -> np.ndarray | None:
    """A chunk held in RAM: finished but not yet written, or whose write failed."""
    found = None
    if fs._shard_writer is not None:
        data = fs._shard_writer.get(env, chunk)
        found = None if data is None else fs._codec.decode(data, "a finished chunk in RAM")
    if found is None:
        found = fs._held.get((env, chunk))
    if found is None and fs._trainer is not None:
        found = fs._trainer.get((env, chunk))
    if found is None and fs._writer is not None:
        failed = fs._writer.failed.get((env, chunk))
        found = None if failed is None else failed[1]
    return found


_NO_RAM = np.zeros(0, np.int64)


def _writer_ram(fs: FrameStore) -> tuple[np.ndarray, np.ndarray]:
    """Address and size per chunk key of the finished chunks in the writer's RAM (0: none)."""
    writer = fs._shard_writer
    return (_NO_RAM, _NO_RAM) if writer is None else (writer.ram_src, writer.ram_size)


def _destination(fs: FrameStore, flat: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``(flat.size, frame_bytes)`` uint8 rows a read writes: in `out` when it is big
    enough, else fresh."""
    frame_bytes = fs._tail_rows.shape[1]
    size = flat.size * frame_bytes
    if out is None or out.size < size:
        out = np.empty(size, np.uint8)
    return out[:size].reshape(flat.size, frame_bytes)


def _read_one_pass(fs: FrameStore, flat: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """`read` of an lz4 store of shard files with no cache, in one compiled call
    (`read_frames`): each frame's chunk; each chunk's bytes (pending in the writer's RAM,
    else in its mapped file; files not mapped yet are mapped and the call made again); one
    pass that decodes each chunk up to the last frame it gives into a scratch buffer and
    copies its frames out while they are in the CPU's cache. Returns ``(flat.size,
    frame_bytes)`` uint8."""
    shards = fs._shards
    assert shards is not None
    dest = _destination(fs, flat, out)
    missing, scratch = np.empty(flat.size, np.int64), np.empty(fs._codec.nbytes, np.uint8)
    while True:
        status = compiled().read_frames(flat, _one_pass_read(fs, scratch, dest, missing))
        if status <= 0:
            break
        shards.addresses(missing[:status])  # maps their files, or raises if one is absent
    if status:
        _raise_damaged(fs, int(flat[missing[0]]), -int(status))
    return dest


def _read_table_one_call(fs: FrameStore, flat: np.ndarray, out: np.ndarray | None
                         ) -> np.ndarray | None:
    """`read` of an lz4 store of shard files through the table, in one compiled call
    (`table_read`): each frame's source; the chunks the table lacks decoded whole from the
    writer's RAM or their mapped file straight into their rows (files not mapped yet are
    mapped and the call made again); one gather. Returns ``(flat.size, frame_bytes)``
    uint8, or None for a read touching more chunks than the table has rows."""
    shards, table = fs._shards, fs._table
    assert shards is not None and table is not None
    dest = _destination(fs, flat, out)
    sources, missing = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    kernels = tables()
    while True:
        status = kernels.table_read(flat, _table_read(fs, table, sources, dest, missing))
        if status <= 0:
            break
        shards.addresses(missing[:status])  # maps their files, or raises if one is absent
    if status == kernels.WIDE:
        return None
    if status:
        env, chunk = divmod(int(missing[0]), fs.num_chunks)
        _raise_damaged(fs, env * fs.spec.slots_per_env + chunk * fs._chunk_len, -int(status))
    return dest


def _sample_call(fs: FrameStore, draw: TreeDraw, ring: RingColumns, outs: SampleOut,
                 frames: int, dest: np.ndarray) -> int:
    """`FrameStore.read_drawn`'s compiled call (`sample_one_pass`, or `sample_table` with a
    table); its read's status."""
    table, kernels, missing = fs._table, samples(), np.empty(frames, np.int64)
    if table is None:
        scratch = np.empty(fs._codec.nbytes, np.uint8)
        return kernels.sample_one_pass(draw, ring, outs,
                                       _one_pass_read(fs, scratch, dest, missing))
    return kernels.sample_table(draw, ring, outs,
                                _table_read(fs, table, np.empty(frames, np.int64), dest,
                                            missing))


def _chunk_bytes(fs: FrameStore) -> ChunkBytes:
    """Where each chunk's bytes are now: the writer's RAM and the shard files' tables
    (`ShardFiles.read_state`)."""
    assert fs._shards is not None
    mapped = fs._shards.read_state()
    ram_src, ram_size = _writer_ram(fs)
    return ChunkBytes(src=mapped.src, size=mapped.size, ram_src=ram_src, ram_size=ram_size,
                      used=mapped.used, tick=mapped.tick, shard_chunks=mapped.shard_chunks)


def _one_pass_read(fs: FrameStore, scratch: np.ndarray, dest: np.ndarray,
                   missing: np.ndarray) -> OnePassRead:
    """What `read_frames` takes besides the frames, for one read."""
    return OnePassRead(fs._layout, _chunk_bytes(fs), scratch, dest, missing)


def _table_read(fs: FrameStore, table: ChunkTable, sources: np.ndarray, dest: np.ndarray,
                missing: np.ndarray) -> TableRead:
    """What `table_read` takes besides the frames, for one read."""
    return TableRead(fs._layout, _chunk_bytes(fs), table.arrays(), sources, dest, missing)


def _raise_damaged(fs: FrameStore, flat_slot: int, status: int) -> None:
    """`InvalidStoreError` saying how the chunk of `flat_slot` is damaged."""
    env, slot = divmod(flat_slot, fs.spec.slots_per_env)
    chunk = slot // fs._chunk_len
    held = None if fs._shard_writer is None else fs._shard_writer.get(env, chunk)
    data, place = ((held, "a finished chunk in RAM") if held is not None
                   else fs.chunk_bytes(env, chunk))
    raise InvalidStoreError(fs._codec.damage(data, status, place))


def _fast_read(fs: FrameStore, flat: np.ndarray, out: np.ndarray | None
               ) -> np.ndarray | None:
    """`read` through the table, or in one pass with none; None: the read touches more
    chunks than the table has rows, and no lz4 one-pass read can take it."""
    if fs._table is None:
        return _read_one_pass(fs, flat, out)
    if not fs._table_one_call:
        return _read_table(fs, flat, out)
    got = _read_table_one_call(fs, flat, out)
    return _read_one_pass(fs, flat, out) if got is None else got


def _read_table(fs: FrameStore, flat: np.ndarray, out: np.ndarray | None
                ) -> np.ndarray | None:
    """`read` through the table: one compiled plan (a row claimed for each chunk it lacks),
    those chunks loaded (from RAM or decoded from disk straight into their rows; claims
    dropped if that fails), one compiled gather. Returns ``(flat.size, frame_bytes)``
    uint8, or None for a read touching more chunks than the table has rows."""
    kernels, table = tables(), fs._table
    assert table is not None
    src = np.empty(flat.size, np.int64)
    missing, rows = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    count = kernels.table_plan(flat, fs._layout, table.arrays(), src, missing, rows)
    if count == kernels.WIDE:
        return None
    if count:
        try:
            _load_rows(fs, table, missing[:count], rows[:count])
        except BaseException:
            table.drop(missing[:count])
            raise
    dest = _destination(fs, flat, out)
    kernels.table_gather(table.frames, fs._tail_rows, src, dest)
    return dest


def _load_rows(fs: FrameStore, table: ChunkTable, keys: np.ndarray, rows: np.ndarray) -> None:
    """Fill rows `rows` with chunks `keys`: from RAM (finished, not yet in their file) or
    decoded from disk."""
    disk = []
    for i, key in enumerate(keys.tolist()):
        chunk = _in_ram(fs, *divmod(key, fs.num_chunks))
        if chunk is None:
            disk.append(i)
        else:
            table.rows[rows[i]] = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    if disk:
        at = np.array(disk, np.int64)
        fs._decode(keys[at], rows[at], table.rows)


def disk_chunks(frames: FrameStore, flat_slots: np.ndarray) -> np.ndarray:
    """The keys (``env * num_chunks + chunk``) of the chunks on disk that
    ``frames.read(flat_slots)`` would decode (not the RAM tails nor the zero frame), once
    each: what a store read from a bucket fetches ahead."""
    flat = np.asarray(flat_slots, dtype=np.int64).reshape(-1)
    keys = np.empty(flat.size, np.int64)
    rows_of = np.empty(flat.size, np.int64)
    spec = frames.spec
    count = compiled().chunk_plan(flat, frames._layout, keys, rows_of)
    unique = keys[:count]
    return unique[unique < spec.num_envs * frames.num_chunks]

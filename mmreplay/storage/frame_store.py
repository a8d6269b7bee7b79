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
read-modify-written. Encoding and writing happen in the caller's thread, in order
(`chunk_writer.FinishedChunks`); until a chunk is on disk, reads are served from RAM.
Before it writes a chunk it calls ``before_chunk_write`` so
the owner can give up (in a committed manifest) the old frames that chunk held.
A ``"zstd-dict"`` store without a dictionary yet holds finished chunks in RAM until it
has trained one (`DictionaryTrainer`); the dictionary file and ``zarr.json`` are written
before the first chunk.

`FrameStore` owns the layout and the RAM tail and takes the frames; where a finished chunk
goes is `chunk_writer`'s, and reading is `frame_reader`'s (one general path and the fast
paths of lz4 shard stores). This module knows slots, chunks, codecs and caches; it knows
nothing of episodes, stacking, priorities or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmreplay.kernels.structs import FrameLayout, RingColumns, SampleOut, TreeDraw
from mmreplay.spec import StoreSpec
from mmreplay.storage.chunk_table import ChunkTable
from mmreplay.storage.chunk_writer import ChunkHook, FinishedChunks
from mmreplay.storage.codec import ChunkCodec, compressor, max_chunk_bytes
from mmreplay.storage.frame_reader import FrameReader
from mmreplay.storage.safe_io import TMP_DIR, read_small
from mmreplay.storage.shards import MAX_MAPPED, ShardFiles, max_shard_bytes
from mmreplay.storage.zstd_dict import dictionary_record

FRAMES = "frames"


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
        self._codec = ChunkCodec(spec, dictionary)
        self._max_bytes = max_chunk_bytes(spec)
        self.cache_budget = cache_bytes  # decoded chunks kept in RAM (`ChunkTable`)
        self._table = ChunkTable(spec.num_envs * spec.num_chunks, self._codec.nbytes,
                                 spec.chunk_frames, cache_bytes) \
            if 0 < self._codec.nbytes <= cache_bytes else None
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
        self._shards: ShardFiles | None = None
        self._read_chunk = self._chunk_file_bytes
        if sharded:
            self._shards = ShardFiles(self._dir_str, self._key_suffix, spec.shard_chunks,
                                      self._max_bytes, num_envs=spec.num_envs,
                                      num_chunks=self.num_chunks, max_open=MAX_MAPPED,
                                      fetch=fetch)
            self._read_chunk = self._shards.chunk
        self.finished = FinishedChunks(
            spec, self._codec, self._root, shards=self._shards, writable=writable,
            durable=durable, hook=before_chunk_write, chunk_path=self.chunk_path)
        self.reader = FrameReader(spec, self._layout, self._codec, self.finished,
                                  self.chunk_bytes, shards=self._shards, table=self._table,
                                  local=fetch is None)

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
        """`append_run` of one frame, without its loop (the per-step path of `add`;
        ``test_record_block`` holds the two equal)."""
        chunk, offset = divmod(slot, self._chunk_len)
        assert offset == self.tail_fill[env], "frames must arrive in slot order"
        self.tail[env, offset] = frame
        self.tail_fill[env] = offset + 1
        self.next_slot[env] = (slot + 1) % self.spec.slots_per_env
        if offset + 1 == self.chunk_slots(chunk):
            self._write_chunk(env, chunk)

    def append_run(self, env: int, slot: int, frames: np.ndarray) -> None:
        """`append_one` of consecutive frames of `env` from `slot` on: copied a chunk's
        piece at a time, each chunk written once full. A chunk write that raises does not
        stop the run (the frames stay in order with the ring); the first error is raised
        at the end."""
        error: Exception | None = None
        done, total = 0, len(frames)
        while done < total:
            chunk, offset = divmod(slot, self._chunk_len)
            assert offset == self.tail_fill[env], "frames must arrive in slot order"
            room = self.chunk_slots(chunk) - offset
            take = min(total - done, room)
            self.tail[env, offset:offset + take] = frames[done:done + take]
            self.tail_fill[env] = offset + take
            slot = (slot + take) % self.spec.slots_per_env
            self.next_slot[env] = slot
            done += take
            if take == room:
                try:
                    self._write_chunk(env, chunk)
                except Exception as exc:  # noqa: BLE001 - re-raised once the run is in place
                    error = error or exc
        if error is not None:
            raise error

    def _write_chunk(self, env: int, chunk: int) -> None:
        frames = self.tail[env].copy()
        frames[self.tail_fill[env]:] = 0
        if self._table is not None:
            self._table.put(env * self.num_chunks + chunk, frames)
        self.tail_fill[env] = 0
        self.finished.add(env, chunk, frames)

    # -- the dictionary of "zstd-dict" ------------------------------------------
    def train_dictionary(self) -> None:
        """Train the dictionary on the chunks held for it (`FinishedChunks`)."""
        self.finished.train_dictionary()

    def set_dictionary(self, dictionary: bytes) -> None:
        """Fix the store's dictionary (`FinishedChunks.set_dictionary`)."""
        self.finished.set_dictionary(dictionary)

    def dictionary_record(self) -> dict[str, int] | None:
        """The manifest's record of the dictionary (None until there is one)."""
        data = self._codec.dictionary
        return None if data is None else dictionary_record(data)

    def drain(self) -> None:
        """Wait until every finished chunk is on disk (`FinishedChunks.drain`)."""
        self.finished.drain()

    def sync(self) -> None:
        """Drain, then fsync every chunk written since the last sync and the directory."""
        self.finished.sync(self._dir)

    def close(self) -> None:
        """Stop writing (`FinishedChunks.close`) and unmap the shard files."""
        self.finished.close()
        self.reader.close()
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

    # -- reading (`FrameReader`) ------------------------------------------------
    def read(self, flat_slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A fresh array of the frames at `flat_slots` (any shape); -1 gives zeros; `out`:
        a C-contiguous uint8 buffer the result is written into (`FrameReader.read`)."""
        return self.reader.read(flat_slots, out)

    def one_call_reads(self, frames: int) -> bool:
        """Whether `read_drawn` draws, looks up and reads a batch of `frames` frames in one
        compiled call (lz4 shard stores whose chunks are local, unless threads would share
        that read: `FrameReader.use_threads`; else it would read as `read` does)."""
        threads = self.reader.threads
        return self.reader.fast_path is not None and (threads is None
                                                      or threads.parts(frames) == 1)

    def read_drawn(self, draw: TreeDraw, ring: RingColumns, outs: SampleOut,
                   out: np.ndarray | None = None) -> np.ndarray:
        """A batch drawn, looked up and read in one compiled call (`FrameReader.read_drawn`)."""
        return self.reader.read_drawn(draw, ring, outs, out)

    def disk_chunks(self, flat_slots: np.ndarray) -> np.ndarray:
        """The chunks on disk a read of `flat_slots` decodes (`FrameReader.disk_chunks`)."""
        return self.reader.disk_chunks(flat_slots)

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

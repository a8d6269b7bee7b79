"""Where frames live: a plain zarr v3 array on disk plus an unfinished tail in RAM.

Layout::

    <root>/frames/zarr.json              zarr v3 array metadata
    <root>/frames/c.<env>.<chunk>.0.0    one chunk = `chunk_frames` consecutive slots of one env

The array has shape ``(num_envs, slots_per_env, *obs_shape)`` and chunk shape
``(1, chunk_frames, *obs_shape)``; chunk keys use zarr's default encoding with
the ``"."`` separator (one flat directory, no directory per chunk); codecs are
``bytes -> zstd -> crc32c``, so
``zarr.open_group(root)["frames"]`` reads it with no help from mmreplay.

Frames arrive one slot at a time per env (the ring's cursor). The chunk being
filled lives in RAM (the *tail*); it is encoded and written whole, atomically
(temp file + rename), as soon as its last slot arrives, so no chunk is ever
read-modify-written. Encoding and writing happen on one background thread
(`ChunkWriter`), in order; until a chunk is on disk, reads are served from RAM.
Before it writes a chunk it calls ``before_chunk_write`` so
the owner can give up (in a committed manifest) the old frames that chunk held.

This module knows slots, chunks, codecs and caches; it knows nothing of
episodes, stacking, priorities or torch.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from .errors import InvalidStoreError
from .safe_io import TMP_DIR, fsync_dir, read_small, write_atomic
from .spec import StoreSpec

FRAMES = "frames"
ChunkHook = Callable[[int, int], None]


def create_frames_array(root: Path, spec: StoreSpec) -> None:
    """Create the zarr group at `root` and its empty `frames` array."""
    group = zarr.open_group(str(root), mode="w-", zarr_format=3)
    group.create_array(
        FRAMES,
        shape=(spec.num_envs, spec.slots_per_env, *spec.obs_shape),
        chunks=(1, spec.chunk_frames, *spec.obs_shape),
        dtype=spec.obs_dtype,
        compressors=[ZstdCodec(level=spec.codec_level), Crc32cCodec()],
        chunk_key_encoding={"name": "default", "separator": "."},
        fill_value=0,
    )


def max_chunk_bytes(spec: StoreSpec) -> int:
    """Largest valid chunk file: zstd's compress bound of a raw chunk, plus the crc32c."""
    raw = spec.chunk_frames * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return raw + (raw >> 8) + max(0, (128 << 10) - raw) // 2048 + 4 + 512


class ChunkCodec:
    """Encodes one chunk exactly as zarr's ``bytes -> zstd -> crc32c`` chain does."""

    def __init__(self, spec: StoreSpec) -> None:
        self._zstd = numcodecs.Zstd(level=spec.codec_level)
        self._dtype = np.dtype(spec.obs_dtype).newbyteorder("<")
        self._shape = (spec.chunk_frames, *spec.obs_shape)
        self._nbytes = int(np.prod(self._shape)) * self._dtype.itemsize

    def encode(self, frames: np.ndarray) -> bytes:
        payload = self._zstd.encode(np.ascontiguousarray(frames, dtype=self._dtype).tobytes())
        return bytes(payload) + struct.pack("<I", google_crc32c.value(bytes(payload)))

    def decode(self, data: bytes, where: str) -> np.ndarray:
        if len(data) < 5:
            raise InvalidStoreError(f"frame chunk {where} is truncated ({len(data)} bytes)")
        payload, stored = data[:-4], struct.unpack("<I", data[-4:])[0]
        if google_crc32c.value(payload) != stored:
            raise InvalidStoreError(f"frame chunk {where} fails its crc32c checksum")
        try:
            raw = self._zstd.decode(payload)
        except Exception as exc:  # numcodecs raises RuntimeError on bad frames
            raise InvalidStoreError(f"frame chunk {where} does not decode: {exc}") from None
        if len(raw) != self._nbytes:
            raise InvalidStoreError(
                f"frame chunk {where} decodes to {len(raw)} bytes, expected {self._nbytes}")
        return np.frombuffer(raw, dtype=self._dtype).reshape(self._shape)


class ChunkCache:
    """A byte-budgeted LRU of decoded chunks, keyed by (env, chunk)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: tuple[int, int], value: np.ndarray) -> None:
        self.drop(key)
        self._items[key] = value
        self.nbytes += value.nbytes
        while self.nbytes > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes

    def drop(self, key: tuple[int, int]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes


class ChunkWriter:
    """Encodes and writes finished chunks on one background thread, in submission order.

    ``pending`` holds every submitted chunk until its file is renamed into place,
    so readers never miss a frame. At most `max_pending` chunks wait (back-pressure).
    A failed write keeps its chunk pending; `drain` raises the error and retries
    failed chunks on the next call, so no commit ever names a chunk that is not on disk.
    """

    def __init__(self, codec: ChunkCodec, tmp_dir: Path, *, max_pending: int = 64) -> None:
        self._codec = codec
        self._tmp_dir = tmp_dir
        self._max = max_pending
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmreplay-writer")
        self._lock = threading.Lock()
        self._futures: deque[Future[None]] = deque()
        self._failed: list[tuple[tuple[int, int], Path, np.ndarray]] = []
        self.pending: dict[tuple[int, int], np.ndarray] = {}
        self.written: list[Path] = []

    def submit(self, key: tuple[int, int], path: Path, frames: np.ndarray) -> None:
        """Queue a chunk, then raise an earlier write's error, if any (the chunk stays queued)."""
        with self._lock:
            self.pending[key] = frames
        future = self._pool.submit(self._write, key, path, frames)
        try:
            while len(self._futures) >= self._max or (self._futures and self._futures[0].done()):
                self._futures.popleft().result()  # a failed chunk stays in _failed for drain
        finally:
            self._futures.append(future)

    def _write(self, key: tuple[int, int], path: Path, frames: np.ndarray) -> None:
        try:
            write_atomic(path, self._codec.encode(frames), self._tmp_dir, durable=False)
        except BaseException:
            self._failed.append((key, path, frames))
            raise
        self.written.append(path)
        with self._lock:
            if self.pending.get(key) is frames:  # a newer lap may have replaced it
                del self.pending[key]

    def drain(self) -> None:
        """Wait for every submitted write; re-raise the first failure (after retrying)."""
        error: BaseException | None = None
        while self._futures:
            try:
                self._futures.popleft().result()
            except BaseException as exc:  # keep draining; report the first
                error = error or exc
        if error is not None:
            raise error
        with self._lock:  # a chunk a newer lap has replaced since must not be written back
            failed = [f for f in self._failed if self.pending.get(f[0]) is f[2]]
            self._failed = []
        for key, path, frames in failed:
            self._futures.append(self._pool.submit(self._write, key, path, frames))
        if failed:
            self.drain()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class FrameStore:
    """Batched frame reads and appends over the zarr `frames` array.

    Slots are addressed *flat*: ``env * slots_per_env + slot``; ``-1`` reads as
    a frame of zeros (stack padding).
    """

    def __init__(self, root: Path, spec: StoreSpec, *, writable: bool, durable: bool = False,
                 cache_bytes: int = 256 << 20, before_chunk_write: ChunkHook | None = None):
        self.spec = spec
        self._dir = Path(root) / FRAMES
        self._tmp_dir = Path(root) / TMP_DIR
        self._writable = writable
        self._durable = durable
        self._codec = ChunkCodec(spec)
        self._max_bytes = max_chunk_bytes(spec)
        self._cache = ChunkCache(cache_bytes)
        self._hook = before_chunk_write
        self._chunk_len = spec.chunk_frames
        self.num_chunks = -(-spec.slots_per_env // spec.chunk_frames)
        self.tail = np.zeros((spec.num_envs, spec.chunk_frames, *spec.obs_shape), spec.obs_dtype)
        self.tail_fill = np.zeros(spec.num_envs, np.int64)
        self.next_slot = np.zeros(spec.num_envs, np.int64)
        self._writer = ChunkWriter(self._codec, self._tmp_dir) if writable else None
        self._held: dict[tuple[int, int], np.ndarray] = {}  # finished, not yet submitted

    # -- layout ---------------------------------------------------------------
    def chunk_path(self, env: int, chunk: int) -> Path:
        zeros = ".0" * len(self.spec.obs_shape)
        return self._dir / f"c.{env}.{chunk}{zeros}"

    def chunk_slots(self, chunk: int) -> int:
        """Real slots in `chunk`; the last chunk of the ring may be short."""
        return min(self._chunk_len, self.spec.slots_per_env - chunk * self._chunk_len)

    # -- writing --------------------------------------------------------------
    def append(self, envs: np.ndarray, slots: np.ndarray, frames: np.ndarray) -> None:
        """Put one frame per listed env at that env's next slot (the ring's cursor)."""
        for env, slot, frame in zip(envs.tolist(), slots.tolist(), frames, strict=True):
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
        self._cache.put((env, chunk), frames)
        self.tail_fill[env] = 0
        self._held[(env, chunk)] = frames
        self._submit_held()

    def _submit_held(self) -> None:
        """Hand finished chunks to the writer, in order, each after its hook.

        A chunk whose hook (a give-up commit) raised stays held, readable from RAM,
        and is retried by the next chunk or `drain`, so no finished chunk is ever lost.
        """
        assert self._writer is not None, "append on a read-only frame store"
        while self._held:
            key, frames = next(iter(self._held.items()))
            if self._hook is not None:
                self._hook(*key)
            del self._held[key]
            self._writer.submit(key, self.chunk_path(*key), frames)

    def drain(self) -> None:
        """Wait until every finished chunk is on disk (raises a failed write's error)."""
        if self._writer is not None:
            self._submit_held()
            self._writer.drain()

    def sync(self) -> None:
        """Drain, then fsync every chunk written since the last sync and the directory."""
        self.drain()
        if self._writer is None:
            return
        written, self._writer.written = self._writer.written, []
        for path in written:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if written:
            fsync_dir(self._dir)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

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
    def read(self, flat_slots: np.ndarray) -> np.ndarray:
        """Frames at `flat_slots` (any shape); -1 gives zeros. One pass per distinct chunk."""
        flat = np.asarray(flat_slots, dtype=np.int64)
        out = np.zeros((*flat.shape, *self.spec.obs_shape), self.spec.obs_dtype)
        wanted = flat >= 0
        env, slot = np.divmod(flat[wanted], self.spec.slots_per_env)
        chunk, offset = np.divmod(slot, self._chunk_len)
        frames = np.empty((env.size, *self.spec.obs_shape), self.spec.obs_dtype)
        tail_chunk = self.next_slot[env] // self._chunk_len
        in_tail = (chunk == tail_chunk) & (offset < self.tail_fill[env])
        frames[in_tail] = self.tail[env[in_tail], offset[in_tail]]
        on_disk = ~in_tail
        keys = env[on_disk] * self.num_chunks + chunk[on_disk]
        frames[on_disk] = self._gather_disk(keys, offset[on_disk])
        out[wanted] = frames
        return out

    def _gather_disk(self, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Rows `offsets` of chunks `keys` (env * num_chunks + chunk), one load per chunk."""
        out = np.empty((keys.size, *self.spec.obs_shape), self.spec.obs_dtype)
        if keys.size == 0:
            return out
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        ends = np.r_[starts[1:], keys.size]
        for key, lo, hi in zip(sorted_keys[starts].tolist(), starts.tolist(), ends.tolist(),
                               strict=True):
            rows = order[lo:hi]
            out[rows] = self._load_chunk(*divmod(key, self.num_chunks))[offsets[rows]]
        return out

    def _load_chunk(self, env: int, chunk: int) -> np.ndarray:
        cached = self._cache.get((env, chunk))
        if cached is not None:
            return cached
        pending = self._held.get((env, chunk))
        if pending is None and self._writer is not None:
            pending = self._writer.pending.get((env, chunk))
        if pending is not None:
            return pending
        path = self.chunk_path(env, chunk)
        where = f"frame chunk {path}"
        frames = self._codec.decode(bytes(read_small(path, where, self._max_bytes)), str(path))
        self._cache.put((env, chunk), frames)
        return frames

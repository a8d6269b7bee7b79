"""Where a finished chunk goes until it is on disk, and where readers find it meanwhile.

An env's chunk is *finished* when its last slot arrives (`FrameStore`); then, in the
caller's thread::

    "zstd-dict" store without a dictionary yet   held by the `DictionaryTrainer` until it
                                                 trains one, then as below
    shard files (format 2)                       encoded into the `ShardWriter`'s pending
                                                 shard, written whole when it fills
    a file per chunk (format 1)                  held, then (after the give-up hook) written
                                                 by the `ChunkWriter` (temp file + rename)

Until its file holds it, a reader takes a chunk from RAM (`FinishedChunks.in_ram`, and the
encoded bytes' addresses for compiled reads, `writer_ram`). This module knows chunks, codecs
and files; it knows nothing of slots, episodes or reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmreplay.spec import StoreSpec
from mmreplay.storage.codec import ChunkCodec
from mmreplay.storage.safe_io import TMP_DIR, fsync_dir, write_atomic
from mmreplay.storage.shards import ShardFiles, ShardWriter, write_each
from mmreplay.storage.zstd_dict import DictionaryTrainer, install, train

ChunkHook = Callable[[int, int, int], None]  # (env, first chunk, last chunk) to be replaced
_NO_RAM = np.zeros(0, np.int64)


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


class FinishedChunks:
    """Finished chunks on their way to disk (see the module docstring)."""

    def __init__(self, spec: StoreSpec, codec: ChunkCodec, root: Path, *,
                 shards: ShardFiles | None, writable: bool, durable: bool,
                 hook: ChunkHook | None, chunk_path: Callable[[int, int], Path]) -> None:
        self.spec = spec
        self._codec = codec
        self._root = root
        self._tmp_dir = root / TMP_DIR
        self._durable = durable
        self._hook = hook
        self._chunk_path = chunk_path
        self._num_chunks = spec.num_chunks
        self.trainer = (DictionaryTrainer(spec.dict_train_chunks)
                        if writable and codec.needs_dictionary else None)
        self.held: dict[tuple[int, int], np.ndarray] = {}  # finished, not yet submitted
        self.writer = ChunkWriter(codec, self._tmp_dir) if writable and shards is None \
            else None
        self.shard_writer = (ShardWriter(shards, str(self._tmp_dir), spec.num_chunks, hook,
                                         durable=durable)
                             if writable and shards is not None else None)

    def add(self, env: int, chunk: int, frames: np.ndarray) -> None:
        """Take a finished chunk (its frames, zeros past a short last chunk)."""
        if self.trainer is not None:
            if self.trainer.add((env, chunk), frames):  # enough chunks to train on
                self.train_dictionary()
            return
        self._emit(env, chunk, frames)

    def _emit(self, env: int, chunk: int, frames: np.ndarray) -> None:
        if self.shard_writer is not None:
            self.shard_writer.add(env, chunk, self._codec.encode(frames))
            return
        self.held[(env, chunk)] = frames
        self._submit_held()

    def _submit_held(self) -> None:
        """Hand finished chunks to the writer, in order, each after its hook.

        A chunk whose hook (a give-up commit) raised stays held, readable from RAM,
        and is retried by the next chunk or `drain`, so no finished chunk is ever lost.
        """
        assert self.writer is not None, "append on a read-only frame store"
        while self.held:
            key, frames = next(iter(self.held.items()))
            if self._hook is not None:
                self._hook(key[0], key[1], key[1])
            del self.held[key]
            self.writer.submit(key, self._chunk_path(*key), frames)

    # -- the dictionary of "zstd-dict" ------------------------------------------
    def train_dictionary(self) -> None:
        """Train the dictionary on the held chunks' frames and write them (no-op unless a
        "zstd-dict" store holds chunks waiting for one)."""
        if self.trainer is not None and len(self.trainer):
            self.set_dictionary(train(self.trainer.frames(), self.spec.dict_bytes,
                                      self.spec.codec_level))

    def set_dictionary(self, dictionary: bytes) -> None:
        """Fix the store's dictionary: its file and ``zarr.json``, then the chunks held
        for it."""
        install(self._root, dictionary, self._tmp_dir, durable=self._durable)
        self._codec.set_dictionary(dictionary)
        held = self.trainer.take() if self.trainer is not None else []
        self.trainer = None
        for (env, chunk), frames in held:
            self._emit(env, chunk, frames)

    # -- durability ---------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every finished chunk is on disk (raises a failed write's error); a
        "zstd-dict" store trains its dictionary now if chunks are waiting for it."""
        self.train_dictionary()
        if self.shard_writer is not None:
            self.shard_writer.drain()
        if self.writer is not None:
            self._submit_held()
            self.writer.drain()

    def sync(self, folder: Path) -> None:
        """Drain, then fsync every chunk written since the last sync and `folder`."""
        self.drain()
        writer = self.writer or self.shard_writer
        if writer is None:
            return
        written, writer.written = writer.written, []
        for path in written:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if written:
            fsync_dir(folder)

    def close(self) -> None:
        """Stop writing. Writes are synchronous, so only chunks whose write failed (an
        error their caller already got, and `drain`/`flush` raise again) are dropped."""
        self.writer = self.shard_writer = None

    # -- what a reader asks (`frame_reader.ChunkSource`) ---------------------------
    def _ram_ranges(self) -> np.ndarray:
        """Key ranges ``[lo, hi)`` (rows of an ``(R, 2)`` array) holding every chunk that may
        be held in RAM: finished, not yet in its file (a pending shard's whole range), or
        whose write failed."""
        keys: list[tuple[int, int]] = [*self.held]
        if self.trainer is not None:
            keys += self.trainer.keys()
        if self.writer is not None:
            keys += list(self.writer.failed)
        n = self._num_chunks
        ranges = [(e * n + c, e * n + c + 1) for e, c in keys]
        if self.shard_writer is not None:
            span = self.spec.shard_chunks
            for env, shard in self.shard_writer.pending_shards():
                lo = env * n + shard * span
                ranges.append((lo, lo + span))
        return np.array(ranges, np.int64).reshape(-1, 2)

    def maybe_in_ram(self, keys: np.ndarray) -> list[int]:
        """The positions in `keys` (chunk keys, any order) of the chunks that may be held in
        RAM: one binary search of a few key ranges per read, not a lookup per pending chunk."""
        if not keys.size:
            return []
        ranges = self._ram_ranges()
        if not ranges.size:
            return []
        order = np.argsort(keys, kind="stable")
        spans = np.searchsorted(keys[order], ranges.reshape(-1)).reshape(-1, 2).tolist()
        return sorted({int(order[i]) for lo, hi in spans for i in range(lo, hi)})

    def in_ram(self, env: int, chunk: int) -> np.ndarray | None:
        """A chunk held in RAM: finished but not yet written, or whose write failed."""
        found = None
        if self.shard_writer is not None:
            data = self.shard_writer.get(env, chunk)
            found = None if data is None else self._codec.decode(data, "a finished chunk in RAM")
        if found is None:
            found = self.held.get((env, chunk))
        if found is None and self.trainer is not None:
            found = self.trainer.get((env, chunk))
        if found is None and self.writer is not None:
            failed = self.writer.failed.get((env, chunk))
            found = None if failed is None else failed[1]
        return found

    def writer_ram(self) -> tuple[np.ndarray, np.ndarray]:
        """Address and size per chunk key of the finished chunks in the writer's RAM (0: none)."""
        writer = self.shard_writer
        return (_NO_RAM, _NO_RAM) if writer is None else (writer.ram_src, writer.ram_size)

    def pending_bytes(self, env: int, chunk: int) -> bytes | None:
        """A finished chunk's encoded bytes still in the shard writer's RAM, or None."""
        return None if self.shard_writer is None else self.shard_writer.get(env, chunk)

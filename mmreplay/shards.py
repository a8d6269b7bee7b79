"""Shard files: many chunks in one frame file, zarr v3's ``sharding_indexed`` layout.

One file per ``shard_chunks`` consecutive chunks of one env::

    frames/c.<env>.<shard>.0.0 = chunk bytes ... | index | crc32c(index)
    index = shard_chunks x (offset, nbytes), little-endian uint64; (2**64-1, 2**64-1) = absent

Each chunk's bytes are exactly what the file-per-chunk layout stores (``bytes -> codec ->
crc32c``). A shard file is written whole, atomically (temp file + rename), so no reader ever
sees a torn index. A file per chunk cost one create and one rename per 8 frames, and (on a
discard-mounted disk) freeing the old file's blocks inside every rename of a ring's second
lap; one shard of 512 chunks pays that once per 4,096 frames, and a reader keeps the file
open and reads a chunk with one ``pread``.

This module knows shard bytes and open files; it knows nothing of slots or codecs.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import google_crc32c
import numpy as np

from .errors import InvalidStoreError
from .safe_io import open_bounded, read_at, read_small, write_atomic

ABSENT = (1 << 64) - 1
Key = tuple[int, int]  # (env, shard) or (env, chunk)
ENTRY = 16  # offset and nbytes, uint64 each


def index_size(shard_chunks: int) -> int:
    return shard_chunks * ENTRY + 4


def max_shard_bytes(shard_chunks: int, max_chunk: int) -> int:
    return shard_chunks * max_chunk + index_size(shard_chunks)


def encode_shard(chunks: Mapping[int, bytes], shard_chunks: int) -> bytes:
    """A shard file holding ``chunks`` (position in the shard -> chunk bytes)."""
    index = np.full((shard_chunks, 2), ABSENT, "<u8")
    parts, offset = [], 0
    for j in sorted(chunks):
        data = chunks[j]
        index[j] = (offset, len(data))
        parts.append(data)
        offset += len(data)
    raw = index.tobytes()
    return b"".join(parts) + raw + struct.pack("<I", google_crc32c.value(raw))


def parse_index(tail: bytes, file_size: int, shard_chunks: int, max_chunk: int,
                where: str) -> np.ndarray:
    """The checked index of a shard file from its last `index_size` bytes: an int64 array
    ``(shard_chunks, 2)`` of (offset, nbytes), -1 for absent chunks.

    Every present chunk lies inside the data part of the file and is no larger than a chunk
    can encode to, so no later read can run past the file or allocate more than that.
    """
    size = index_size(shard_chunks)
    if len(tail) != size or file_size < size:
        raise InvalidStoreError(f"{where} is {file_size} bytes, too short for its "
                                f"{size}-byte index")
    raw = tail[:-4]
    if google_crc32c.value(raw) != struct.unpack_from("<I", tail, size - 4)[0]:
        raise InvalidStoreError(f"{where}: its index fails its crc32c checksum")
    index = np.frombuffer(raw, "<u8").reshape(shard_chunks, 2)
    absent = index == ABSENT
    if (absent[:, 0] != absent[:, 1]).any():
        raise InvalidStoreError(f"{where}: an index entry is half absent")
    present = ~absent[:, 0]
    offset, nbytes = index[present, 0], index[present, 1]
    data_end = file_size - size
    bad = (offset > data_end) | (nbytes > np.uint64(data_end) - np.minimum(
        offset, np.uint64(data_end))) | (nbytes < 5) | (nbytes > max_chunk)
    if bad.any():
        j = int(np.flatnonzero(present)[np.argmax(bad)])
        raise InvalidStoreError(f"{where}: index entry {j} (offset {int(index[j, 0])}, "
                                f"{int(index[j, 1])} bytes) lies outside the file's "
                                f"{data_end} data bytes or is no chunk")
    out = np.full((shard_chunks, 2), -1, np.int64)
    out[present] = index[present].astype(np.int64)
    return out


def read_shard(path: str, where: str, shard_chunks: int, max_chunk: int) -> dict[int, bytes]:
    """Every present chunk of a shard file (position -> bytes); {} if there is no file."""
    if not os.path.lexists(path):
        return {}
    data = read_small(path, where, max_shard_bytes(shard_chunks, max_chunk))
    size = index_size(shard_chunks)
    index = parse_index(data[-size:], len(data), shard_chunks, max_chunk, where)
    return {j: data[o:o + n] for j, (o, n) in enumerate(index.tolist()) if o >= 0}


class ShardFiles:
    """Open shard files with their checked index: an LRU of at most `max_open` descriptors.

    An open file is read until it is evicted or `forget` drops it (the writer does after
    it replaces a file). A reader beside a writer may thus keep reading a file the writer
    replaced: it holds the frames of the generation that reader loaded, which is what it
    samples; frames the writer gave up since are dropped by the reader's manifest checks.
    """

    def __init__(self, frames_dir: str, key_suffix: str, shard_chunks: int, max_chunk: int,
                 *, max_open: int) -> None:
        self._dir, self._suffix = frames_dir, key_suffix
        self.shard_chunks, self.max_chunk = shard_chunks, max_chunk
        self._max_open = max_open
        self._open: OrderedDict[Key, tuple[int, np.ndarray]] = OrderedDict()

    def path(self, env: int, shard: int) -> str:
        return f"{self._dir}/c.{env}.{shard}{self._suffix}"

    def chunk(self, env: int, chunk: int) -> bytes:
        """The bytes of one chunk; an `InvalidStoreError` if its file or entry is missing."""
        shard, j = divmod(chunk, self.shard_chunks)
        fd, index = self._get(env, shard)
        offset, nbytes = index[j].tolist()
        if offset < 0:
            raise InvalidStoreError(f"frame chunk {j} of {self._where(env, shard)} is absent")
        try:
            data = os.pread(fd, nbytes, offset)
        except OSError:
            data = b""
        if len(data) == nbytes:
            return data
        return read_at(fd, nbytes, offset, f"frame chunk {j} of {self._where(env, shard)}")

    def _where(self, env: int, shard: int) -> str:
        return f"frame file {self.path(env, shard)}"

    def _get(self, env: int, shard: int) -> tuple[int, np.ndarray]:
        key = (env, shard)
        found = self._open.get(key)
        if found is not None:
            self._open.move_to_end(key)
            return found
        where = self._where(env, shard)
        fd, size = open_bounded(self.path(env, shard), where,
                                max_shard_bytes(self.shard_chunks, self.max_chunk))
        try:
            n = index_size(self.shard_chunks)
            tail = read_at(fd, n, size - n, where) if size >= n else b""
            index = parse_index(tail, size, self.shard_chunks, self.max_chunk, where)
        except BaseException:
            os.close(fd)
            raise
        self._open[key] = (fd, index)
        while len(self._open) > self._max_open:
            os.close(self._open.popitem(last=False)[1][0])
        return fd, index

    def forget(self, env: int, shard: int) -> None:
        found = self._open.pop((env, shard), None)
        if found is not None:
            os.close(found[0])

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1][0])

    def __del__(self) -> None:  # a store dropped without close() leaks no descriptor
        try:
            self.close()
        except (OSError, AttributeError):  # at interpreter exit, or a half-built object
            pass


def max_open_files() -> int:
    """Descriptors one store may keep open: a quarter of the soft limit, 16..4096."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


def write_each(keys: list[Key], write: Callable[[Key], None]) -> None:
    """`write` every key, even after one fails; then raise the first error, if any."""
    error: BaseException | None = None
    for key in keys:
        try:
            write(key)
        except BaseException as exc:  # keep writing the others; report the first
            error = error or exc
    if error is not None:
        raise error


class ShardWriter:
    """Collects finished chunks per shard and writes each shard file whole.

    A shard is written when its last chunk is finished, and by `drain` (every flush) while
    it is being filled; such a partial write keeps the chunks the current file holds for
    the positions not yet rewritten (the older lap's frames, or chunks an earlier flush
    wrote). Before a write, ``before_write(env, first, last)`` runs once for the new chunks
    (positions ``first..last`` of the ring), so the owner can give up (in a committed
    manifest) the old frames they replace.

    A failed write keeps its chunks (readers are served from RAM), raises to the caller,
    and is retried by `drain`, which raises the first error it meets again.
    """

    def __init__(self, files: ShardFiles, tmp_dir: str, num_chunks: int,
                 before_write: Callable[[int, int, int], None] | None, *, durable: bool) -> None:
        self._files, self._tmp_dir = files, tmp_dir
        self._num_chunks, self._hook = num_chunks, before_write
        self._durable = durable
        self.pending: dict[Key, dict[int, bytes]] = {}  # not in the file yet
        self.written: list[str] = []

    def add(self, env: int, chunk: int, data: bytes) -> None:
        shard, j = divmod(chunk, self._files.shard_chunks)
        key = (env, shard)
        self.pending.setdefault(key, {})[j] = data
        if j == self._real_chunks(shard) - 1:
            self._write(key)

    def get(self, env: int, chunk: int) -> bytes | None:
        shard, j = divmod(chunk, self._files.shard_chunks)
        found = self.pending.get((env, shard))
        return None if found is None else found.get(j)

    def drain(self) -> None:
        """Write every shard whose file lacks pending chunks; raise the first error."""
        write_each(sorted(self.pending), self._write)

    def _real_chunks(self, shard: int) -> int:
        return min(self._files.shard_chunks, self._num_chunks - shard * self._files.shard_chunks)

    def _write(self, key: Key) -> None:
        env, shard = key
        chunks = self.pending[key]
        if self._hook is not None:
            first = shard * self._files.shard_chunks
            self._hook(env, first + min(chunks), first + max(chunks))
        path = self._files.path(env, shard)
        complete = len(chunks) == self._real_chunks(shard)
        if not complete:
            old = read_shard(path, f"frame file {path}", self._files.shard_chunks,
                             self._files.max_chunk)
            chunks = {**old, **chunks}
        # durable: a partial write carries frames the committed manifest still claims, so
        # its bytes must be on disk before its name replaces the file that held them
        write_atomic(Path(path), encode_shard(chunks, self._files.shard_chunks),
                     Path(self._tmp_dir), durable=self._durable)
        self._files.forget(env, shard)
        self.written.append(path)
        del self.pending[key]  # all in the file now; a later write merges them from it

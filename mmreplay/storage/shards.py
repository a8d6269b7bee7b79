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

import ctypes
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import google_crc32c
import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.storage.safe_io import open_bounded, read_at, read_small, write_atomic

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


def checked_shard(data: bytes, k: int, max_chunk: int,
                 where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A whole shard file's index and its present positions, checked as reads check them
    (the index; every chunk's crc32c: positions None if one fails)."""
    if len(data) > max_shard_bytes(k, max_chunk):
        raise InvalidStoreError(f"{where} is {len(data)} bytes, more than a frame file "
                                f"can be")
    index = parse_index(data[-index_size(k):], len(data), k, max_chunk, where)
    present = np.flatnonzero(index[:, 0] >= 0)
    ok = all(chunk_crc_ok(data[o:o + n]) for o, n in index[present].tolist())
    return index, present if ok else None


def chunk_crc_ok(data: bytes) -> bool:
    """A chunk ends with the crc32c of the bytes before it (the codec's last step)."""
    return len(data) >= 5 and google_crc32c.value(data[:-4]) == struct.unpack(
        "<I", data[-4:])[0]


class MappedChunks(NamedTuple):
    """`ShardFiles.read_state`: chunk addresses and lengths, file use ticks, this read's tick
    (a named tuple: made once per read, it costs a third of a frozen dataclass)."""

    src: np.ndarray
    size: np.ndarray
    used: np.ndarray
    tick: int
    shard_chunks: int


class ShardFiles:
    """Shard files mapped read-only, with their checked index; at most `max_open` mapped.

    ``src`` and ``size`` give, for every chunk of the ring (``env * num_chunks + chunk``),
    the address of its bytes in a mapped file and their length (0: not mapped, or absent),
    so a batch finds the bytes of all its chunks with one fancy index and hands the
    addresses to the compiled decode. A file is checked (regular, bounded size, its index
    inside the file: `parse_index`) before it is mapped. Shard files are only ever replaced
    whole (temp file + rename), never written in place, so a mapping never sees its file
    change or shrink; the writer calls `forget` after it replaces one, and the next read
    maps the new file.

    A mapping lives until `forget`, `close`, or eviction of the least recently used one
    beyond `max_open`. A reader beside a writer may thus keep reading a file the writer
    replaced: it holds the frames of the generation that reader loaded, which is what it
    samples; frames the writer gave up since are dropped by the reader's manifest checks.
    """

    def __init__(self, frames_dir: str, key_suffix: str, shard_chunks: int, max_chunk: int,
                 *, num_envs: int, num_chunks: int, max_open: int,
                 fetch: Callable[[np.ndarray, Callable[[int, int], None]], None] | None = None
                 ) -> None:
        self._dir, self._suffix = frames_dir, key_suffix
        self._fetch = fetch  # makes chunks present in their (sparse) files first: a bucket
        self.shard_chunks, self.max_chunk = shard_chunks, max_chunk
        self._num_chunks, self._max_open = num_chunks, max_open
        self._num_shards = -(-num_chunks // shard_chunks)
        self.src = np.zeros(num_envs * num_chunks, np.int64)
        self.size = np.zeros(num_envs * num_chunks, np.int64)
        self._maps: dict[Key, tuple[int, int]] = {}  # (address, length)
        self._used = np.zeros(num_envs * self._num_shards, np.int64)  # tick of last use
        self._tick = 0

    def path(self, env: int, shard: int) -> str:
        return f"{self._dir}/c.{env}.{shard}{self._suffix}"

    def read_state(self) -> MappedChunks:
        """The tables a compiled read looks its chunks up in, for one read: it marks the
        files it takes bytes from used at the returned tick (`addresses` does it in Python)."""
        self._tick += 1
        return MappedChunks(self.src, self.size, self._used, self._tick, self.shard_chunks)

    @property
    def mapped(self) -> int:
        """How many files are mapped now."""
        return len(self._maps)

    def addresses(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(address, length) of the bytes of chunks ``keys`` (``env * num_chunks + chunk``),
        mapping their files as needed; `InvalidStoreError` if a file or entry is missing."""
        if self._fetch is not None:
            self._fetch(keys, self.forget)
        shards = (keys // self._num_chunks) * self._num_shards + (
            keys % self._num_chunks) // self.shard_chunks
        self._tick += 1
        self._used[shards] = self._tick
        src = self.src[keys]
        if not src.all():
            for flat in np.unique(shards[src == 0]).tolist():
                self._map(*divmod(flat, self._num_shards))
            src = self.src[keys]
            if not src.all():
                key = int(keys[np.argmin(src != 0)])
                env, (shard, j) = key // self._num_chunks, divmod(
                    key % self._num_chunks, self.shard_chunks)
                raise InvalidStoreError(
                    f"frame chunk {j} of {self._where(env, shard)} is absent")
        return src, self.size[keys]

    def chunk(self, env: int, chunk: int) -> bytes:
        """The bytes of one chunk (a copy); an `InvalidStoreError` if its file or entry is
        missing."""
        key = env * self._num_chunks + chunk
        self.addresses(np.array([key], np.int64))
        return ctypes.string_at(int(self.src[key]), int(self.size[key]))

    def _where(self, env: int, shard: int) -> str:
        return f"frame file {self.path(env, shard)}"

    def _map(self, env: int, shard: int) -> None:
        where = self._where(env, shard)
        fd, size = open_bounded(self.path(env, shard), where,
                                max_shard_bytes(self.shard_chunks, self.max_chunk))
        try:
            n = index_size(self.shard_chunks)
            tail = read_at(fd, n, size - n, where) if size >= n else b""
            index = parse_index(tail, size, self.shard_chunks, self.max_chunk, where)
            address = _map_file(fd, size, where)
        finally:
            os.close(fd)  # the mapping holds no descriptor
        self._evict()
        self._maps[(env, shard)] = (address, size)
        chunk, real = self._span(shard)
        first = env * self._num_chunks + chunk
        present = index[:real, 0] >= 0
        self.src[first:first + real] = np.where(present, address + index[:real, 0], 0)
        self.size[first:first + real] = np.where(present, index[:real, 1], 0)

    def _evict(self) -> None:
        """Unmap the least recently used files until one more fits under `max_open`."""
        excess = len(self._maps) + 1 - self._max_open
        if excess <= 0:
            return
        keys = list(self._maps)
        used = self._used[[e * self._num_shards + s for e, s in keys]]
        order = np.argsort(used, kind="stable")[:excess]
        for i in order[used[order] < self._tick].tolist():  # never one this read needs
            self.forget(*keys[i])

    def forget(self, env: int, shard: int) -> None:
        """Unmap a file (the writer replaced it, or it is evicted)."""
        mapping = self._maps.pop((env, shard), None)
        if mapping is None:
            return
        first, real = self._span(shard)
        self.src[env * self._num_chunks + first:env * self._num_chunks + first + real] = 0
        _LIBC.munmap(*mapping)

    def _span(self, shard: int) -> tuple[int, int]:
        """First chunk of a shard and how many chunks it has (the last may be short)."""
        first = shard * self.shard_chunks
        return first, min(self.shard_chunks, self._num_chunks - first)

    def close(self) -> None:
        for env, shard in list(self._maps):
            self.forget(env, shard)

    def __del__(self) -> None:  # a store dropped without close() leaks no mapping
        try:
            self.close()
        except (OSError, AttributeError):  # at interpreter exit, or a half-built object
            pass


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.restype = ctypes.c_int
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_file(fd: int, size: int, where: str) -> int:
    """Map a whole file read-only and shared; its address. (Python's `mmap` would keep a
    duplicate descriptor per mapping; thousands of shard files must not cost descriptors.)"""
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise InvalidStoreError(f"{where} cannot be mapped: {os.strerror(err)}")
    return int(address)


# Mapped shard files one store keeps (a mapping holds no descriptor; Linux allows ~65k
# mappings a process): 4,096 shards of 4,096 frames map every file of a 16M-frame ring.
MAX_MAPPED = 4096


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
        # address and length of every pending chunk's bytes (0: not pending), by
        # ``env * num_chunks + chunk``: what a compiled read takes before the files
        self.ram_src = np.zeros(files.src.size, np.int64)
        self.ram_size = np.zeros(files.src.size, np.int64)

    def add(self, env: int, chunk: int, data: bytes) -> None:
        shard, j = divmod(chunk, self._files.shard_chunks)
        key = (env, shard)
        self.pending.setdefault(key, {})[j] = data  # keeps the bytes ram_src points at
        flat = env * self._num_chunks + chunk
        self.ram_src[flat] = np.frombuffer(data, np.uint8).ctypes.data if data else 0
        self.ram_size[flat] = len(data)
        if j == self._real_chunks(shard) - 1:
            self._write(key)

    def get(self, env: int, chunk: int) -> bytes | None:
        shard, j = divmod(chunk, self._files.shard_chunks)
        found = self.pending.get((env, shard))
        return None if found is None else found.get(j)

    def pending_shards(self) -> list[Key]:
        """(env, shard) of every shard with finished chunks not yet in its file."""
        return list(self.pending)

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
        first = env * self._num_chunks + shard * self._files.shard_chunks
        self.ram_src[first:first + self._real_chunks(shard)] = 0
        del self.pending[key]  # all in the file now; a later write merges them from it

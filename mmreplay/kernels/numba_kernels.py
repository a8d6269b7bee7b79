"""Compiled kernels of the read path: plain arrays and byte addresses in, plain arrays out.

Chunk decode, the ring lookup of a batch's stacks and n-step windows, and a whole frame read
in one call (plan, decode, gather); the sum-tree walks are `tree_kernels`'.

Each operation has exactly one implementation on the read path, here (its naive twin lives
in ``tests/``; chunk decoding has a numcodecs twin, ``codec.ChunkCodec.check``, which
``mmreplay verify`` uses so that it needs no numba, tested to agree verdict for verdict);
the Python layer around a kernel keeps the validation and the error messages. The kernels
know no files, manifests, slots or torch. They run with the GIL released, in the caller's
thread: spreading one batch's chunks over the cores (``numba.prange``) measured 2x faster
alone (61 vs 114 µs for 46 chunks) but slower inside `sample` on a busy 2-core machine (a
read took 463 vs 252 µs: waking the pool's threads costs more than the work), and a
prefetch thread overlaps whole batches with the learner instead.

Chunk bytes are passed as addresses (``int64``): of a memory-mapped shard file plus an
entry's offset, or of a ``bytes``/numpy buffer the caller keeps alive for the call. A chunk
is ``codec stream | crc32c(codec stream)``; decoding checks, in order, the length, the crc32c,
the codec header's sizes, and that the codec returns exactly one chunk::

    status  0 ok   1 too short   2 crc32c   3 header sizes   4 codec failed

Codecs: ``LZ4`` (a c-blosc stream), ``ZSTD`` (a zstd frame) and ``ZSTD_DICT`` (a zstd frame
made with a dictionary, decoded with a prepared ``ZSTD_DDict`` whose address the caller
passes; `create_ddict` makes one). zstd frames are decoded with a ``ZSTD_DCtx`` the caller
passes (`create_dctx`; one thread at a time), or, given 0, one made for the call and reused
across its chunks: ``ZSTD_decompress`` creates and frees a context per chunk (~5 µs here,
about the decode itself for an 8-frame Atari chunk), and a context kept across calls saves
another ~0.5 µs a chunk (its ~96 KB stay warm in the CPU's caches).

The C functions are the ones the installed packages already ship: c-blosc (and the zstd it
bundles, dictionary API included) from numcodecs, crc32c (SSE4.2 where the CPU has it) from
google-crc32c. They are
bound by symbol name, so numba's on-disk cache (``cache=True``) holds the compiled code:
compiling costs ~1 s once per machine and loading the cache ~0.1 s once per process, paid on
a store's first read, never by ``import mmreplay``.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import google_crc32c
import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic
from numcodecs import blosc

from mmreplay.kernels import BAD_CRC, BAD_HEADER, NO_DECODE, OK, TOO_SHORT
from mmreplay.kernels.structs import (
    ChunkBytes,
    FrameLayout,
    LookupOut,
    OnePassRead,
    RingColumns,
)

BLOSC_HEADER = 16
LZ4, ZSTD, ZSTD_DICT = 0, 1, 2  # the codec argument of `decode_chunks`


def _load_libraries() -> None:
    """Make the C symbols visible to numba's linker (idempotent)."""
    libs = os.path.join(os.path.dirname(google_crc32c.__file__), os.pardir, "google_crc32c.libs")
    found = sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*")))
    if not found:
        raise ImportError(f"google-crc32c ships no libcrc32c under {libs}")
    llvm.load_library_permanently(found[0])
    llvm.load_library_permanently(blosc.__file__)


_load_libraries()

_crc32c: Any = types.ExternalFunction(
    "crc32c_extend", types.uint32(types.uint32, types.int64, types.intp))
_blosc_decompress: Any = types.ExternalFunction(
    "blosc_decompress_ctx", types.int32(types.int64, types.int64, types.intp, types.int32))
_lz4_decompress_partial: Any = types.ExternalFunction(
    "LZ4_decompress_safe_partial",
    types.int32(types.int64, types.int64, types.int32, types.int32, types.int32))
memcpy: Any = types.ExternalFunction("memcpy", types.int64(types.int64, types.int64, types.intp))
_zstd_content_size: Any = types.ExternalFunction(
    "ZSTD_getFrameContentSize", types.uint64(types.int64, types.intp))
_zstd_create_dctx: Any = types.ExternalFunction("ZSTD_createDCtx", types.int64())
_zstd_free_dctx: Any = types.ExternalFunction("ZSTD_freeDCtx", types.uint64(types.int64))
_zstd_decompress_dctx: Any = types.ExternalFunction(
    "ZSTD_decompressDCtx",
    types.uint64(types.int64, types.int64, types.intp, types.int64, types.intp))
_zstd_decompress_ddict: Any = types.ExternalFunction(
    "ZSTD_decompress_usingDDict",
    types.uint64(types.int64, types.int64, types.intp, types.int64, types.intp, types.int64))
_libzstd = ctypes.CDLL(blosc.__file__)  # the library numba binds, for the Python-side calls
_libzstd.ZSTD_createDDict.restype = ctypes.c_void_p
_libzstd.ZSTD_createDDict.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
_libzstd.ZSTD_freeDDict.argtypes = (ctypes.c_void_p,)
_libzstd.ZSTD_createDCtx.restype = ctypes.c_void_p
_libzstd.ZSTD_freeDCtx.argtypes = (ctypes.c_void_p,)


def create_ddict(dictionary: bytes) -> int:
    """The address of a ``ZSTD_DDict`` prepared from `dictionary` (a trained zstd dictionary,
    or any other bytes as raw content); 0 if libzstd refuses it. Free it with `free_ddict`."""
    return int(_libzstd.ZSTD_createDDict(dictionary, len(dictionary)) or 0)


def free_ddict(ddict: int) -> None:
    _libzstd.ZSTD_freeDDict(ctypes.c_void_p(ddict))


def create_dctx() -> int:
    """The address of a new ``ZSTD_DCtx`` (0 if libzstd is out of memory), for
    `decode_chunks` calls of one thread at a time. Free it with `free_dctx`."""
    return int(_libzstd.ZSTD_createDCtx() or 0)


def free_dctx(dctx: int) -> None:
    _libzstd.ZSTD_freeDCtx(ctypes.c_void_p(dctx))


@intrinsic  # type: ignore[misc]
def _u32_at_intrinsic(typingctx, addr):  # type: ignore[no-untyped-def]
    """The little-endian uint32 at byte address `addr` (any alignment)."""
    sig = types.uint32(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.load(ptr, align=1)

    return sig, codegen


_u32_at: Any = _u32_at_intrinsic  # called from compiled code only


@numba.njit(nogil=True, cache=True)
def _lz4_prefix(src: int, payload: int, dst: int, n: int, need: int) -> int:
    """The first `need` bytes of a c-blosc lz4 chunk whose length, crc32c and header sizes
    were checked: one block of bytes (typesize 1, no shuffle) is one lz4 stream after the
    block's start and its length (or its bytes as they are), decoded up to `need` bytes
    (``LZ4_decompress_safe_partial``); any other layout is decoded whole by c-blosc."""
    head = _u32_at(src)
    flags, typesize = (head >> 16) & 0xFF, head >> 24
    if flags & 0x02:  # the chunk was stored as it is, after the header
        if payload < BLOSC_HEADER + n:
            return NO_DECODE
        memcpy(dst, src + BLOSC_HEADER, need)
        return OK
    if (typesize != 1 or flags & 0x05 or flags >> 5 != 1 or _u32_at(src + 8) < n
            or payload < BLOSC_HEADER + 8):
        return OK if _blosc_decompress(src, dst, n, 1) == n else NO_DECODE
    start = np.int64(_u32_at(src + BLOSC_HEADER))
    if start < BLOSC_HEADER + 4 or start + 4 > payload:
        return NO_DECODE
    stream = np.int64(_u32_at(src + start))
    if stream < 1 or start + 4 + stream > payload:
        return NO_DECODE
    if stream == n:  # the block was stored as it is
        memcpy(dst, src + start + 4, need)
        return OK
    got = _lz4_decompress_partial(src + start + 4, dst, stream, need, n)
    return OK if got >= need else NO_DECODE


@numba.njit(nogil=True, cache=True)
def decode_one(src: int, size: int, dst: int, n: int, codec: int, dctx: int,
               ddict: int, need: int) -> int:
    """Decode one chunk (`size` bytes at address `src`) into the `n` bytes at `dst`, the
    first `need` of them at least (lz4); its status. The other kernels' one decode."""
    payload = size - 4
    if payload < (BLOSC_HEADER if codec == LZ4 else 1):
        return TOO_SHORT
    if _crc32c(np.uint32(0), src, payload) != _u32_at(src + payload):
        return BAD_CRC
    if codec == LZ4:
        if _u32_at(src + 4) != n or _u32_at(src + 12) != payload:
            return BAD_HEADER
        if need < n:
            return _lz4_prefix(src, payload, dst, n, need)
        return OK if _blosc_decompress(src, dst, n, 1) == n else NO_DECODE
    if _zstd_content_size(src, payload) != n:
        return BAD_HEADER
    if dctx == 0:
        return NO_DECODE
    if codec == ZSTD_DICT:
        got = _zstd_decompress_ddict(dctx, dst, n, src, payload, ddict)
    else:
        got = _zstd_decompress_dctx(dctx, dst, n, src, payload)
    return OK if got == n else NO_DECODE


@numba.njit(nogil=True, cache=True)
def decode_chunks(src: np.ndarray, size: np.ndarray, rows: np.ndarray, dest: np.ndarray,
                  codec: int, ddict: int, dctx: int = 0) -> np.ndarray:
    """Decode chunk ``i`` (``size[i]`` bytes at address ``src[i]``) into ``rows[dest[i]]``,
    C-contiguous uint8 rows of one decoded chunk each; returns each chunk's status.

    `codec` is `LZ4`, `ZSTD` or `ZSTD_DICT`; `ddict` the address of a ``ZSTD_DDict``
    (`create_ddict`) for `ZSTD_DICT`, else ignored; `dctx` a ``ZSTD_DCtx`` no other thread
    uses now (`create_dctx`), or 0 for one made and freed here."""
    n = rows.shape[1]
    status = np.empty(src.size, np.int32)
    base = rows.ctypes.data
    own = dctx == 0 and codec != LZ4 and src.size > 0
    ctx = _zstd_create_dctx() if own else dctx
    for i in range(src.size):
        status[i] = decode_one(src[i], size[i], base + dest[i] * n, n, codec, ctx, ddict, n)
    if own and ctx != 0:
        _zstd_free_dctx(ctx)
    return status


@numba.njit(nogil=True, cache=True)
def decode_prefixes(src: np.ndarray, size: np.ndarray, rows: np.ndarray, dest: np.ndarray,
                    frame_rows: np.ndarray, chunk: int) -> np.ndarray:
    """`decode_chunks` of lz4 chunks for one read, each decoded only up to the last frame
    the read takes from it: ``frame_rows`` are the read's frames as rows of `rows` seen as
    ``chunk`` frames a row (``row * chunk + offset``, `table_kernels.scratch_plan`). The
    crc32c and header of every chunk are checked whole; the frames past a chunk's last
    wanted one are left as they were (an lz4 stream is decoded from its start, so a read
    that takes frames 0..k of a chunk skips the rest). Same statuses as `decode_chunks`."""
    n = rows.shape[1]
    frame = n // chunk
    need = np.zeros(rows.shape[0], np.int64)
    for i in range(frame_rows.size):
        row, end = frame_rows[i] // chunk, (frame_rows[i] % chunk + 1) * frame
        if end > need[row]:
            need[row] = end
    status = np.empty(src.size, np.int32)
    base = rows.ctypes.data
    for i in range(src.size):
        status[i] = decode_one(src[i], size[i], base + dest[i] * n, n, LZ4, 0, 0,
                                need[dest[i]])
    return status


# -- index arithmetic (see `ring` for frame numbers, stacks and n-step windows) -------------


@numba.njit(nogil=True, cache=True)
def lookup(flat: np.ndarray, ring: RingColumns, out: LookupOut) -> None:
    """For valid transitions at flat slots `flat`: the flat slots of their stacks (``obs``,
    ``next_obs``: (B, stack), -1 = zero padding), n-step return, flags, discount, the
    window's length m (``steps``) and the transition ids, each written in its output's
    dtype (the float32 return and discount are the float64 sums rounded once).

    Step columns are flat (``env * slots + slot``); ``gamma_pow[j] = gamma ** j``.
    """
    slots, stack, gamma_pow = ring.slots, ring.stack, ring.gamma_pow
    for b in range(flat.size):
        env, slot = flat[b] // slots, flat[b] % slots
        last = ring.written[env] - 1
        t = last - (last - slot) % slots
        start = t - ring.pos[flat[b]]
        acc, m, ended_t, ended_tr = 0.0, 0, False, False
        for j in range(ring.n_step):
            u = env * slots + (t + j) % slots
            acc += gamma_pow[j] * np.float64(ring.reward[u])
            m += 1
            ended_t, ended_tr = ring.terminated[u], ring.truncated[u]
            if ended_t or ended_tr:
                break
        out.ret[b], out.term[b], out.trunc[b] = acc, ended_t, ended_tr
        out.discount[b] = 0.0 if ended_t else gamma_pow[m]
        out.steps[b], out.ids[b] = m, ring.step_id[flat[b]]
        for i in range(stack):
            for rows, top in ((out.obs, t), (out.next_obs, t + m)):
                f = top - (stack - 1 - i)
                if f < start:
                    f = start if ring.pad_first else -1
                rows[b, i] = -1 if f < 0 else env * slots + f % slots


# -- a whole read in one call: plan, decode and gather (`frame_store.FrameStore.read`) ---------


# inlined into its callers (numba IR): called per frame with a `FrameLayout`, as a call it
# cost a small read ~30 ns a frame (`table_kernels.table_plan` of 64 frames: 3.0 -> 1.3 us)
@numba.njit(nogil=True, cache=True, inline="always")
def chunk_of(f: int, layout: FrameLayout) -> tuple[int, int, bool]:
    """Flat slot ``f >= 0``: its chunk's key on disk (``env * num_chunks + chunk``), its frame
    in that chunk, and whether that frame is in its env's RAM tail instead (the chunk the env
    is filling, below ``tail_fill``). Every read plans its frames through here (`read_keys`,
    `table_kernels.source_of`)."""
    env, slot = f // layout.slots, f % layout.slots
    c, offset = slot // layout.chunk, slot % layout.chunk
    in_tail = c == layout.next_slot[env] // layout.chunk and offset < layout.tail_fill[env]
    return env * layout.num_chunks + c, offset, in_tail


@numba.njit(nogil=True, cache=True)
def read_keys(flat: np.ndarray, layout: FrameLayout, raw: np.ndarray,
              offset: np.ndarray) -> None:
    """Each frame's chunk key (on disk: ``env * num_chunks + chunk``; then an env's RAM tail,
    ``envs * num_chunks + env``; then the zero frame) into ``raw`` and its frame in that chunk
    into ``offset``."""
    envs = layout.next_slot.size
    tails = envs * layout.num_chunks
    for i in range(flat.size):
        if flat[i] < 0:
            raw[i], offset[i] = tails + envs, 0
            continue
        key, offset[i], in_tail = chunk_of(flat[i], layout)
        raw[i] = tails + key // layout.num_chunks if in_tail else key


@numba.njit(nogil=True, cache=True)
def group_order(keys: np.ndarray) -> np.ndarray:
    """An order of the positions of `keys` (ints >= 0) in which equal keys are adjacent, the
    groups in the order their keys first appear and each group in position order: what a
    read needs to take each chunk once, in linear time (an argsort of a batch's 256 keys
    costs several times more)."""
    n = keys.size
    size = 16
    while size < 2 * n:
        size <<= 1
    seen, group_of = np.full(size, -1, np.int64), np.empty(size, np.int64)
    group, starts = np.empty(n, np.int64), np.zeros(n + 1, np.int64)
    groups = 0
    for i in range(n):
        h = (keys[i] * 40503) & (size - 1)
        while seen[h] != -1 and seen[h] != keys[i]:
            h = (h + 1) & (size - 1)
        if seen[h] == -1:
            seen[h], group_of[h] = keys[i], groups
            groups += 1
        group[i] = group_of[h]
        starts[group[i] + 1] += 1
    for g in range(groups):
        starts[g + 1] += starts[g]
    order = np.empty(n, np.int64)
    for i in range(n):
        order[starts[group[i]]] = i
        starts[group[i]] += 1
    return order


@numba.njit(nogil=True, cache=True)
def chunk_bytes(chunks: ChunkBytes, key: int, num_chunks: int) -> tuple[int, int]:
    """(address, length) of the bytes of chunk `key` on disk: the writer's RAM first, else
    its mapped file, which is then marked used (address 0: the file is not mapped yet). Every
    read takes a chunk's bytes through here (`read_sources`, `table_kernels`)."""
    if key < chunks.ram_src.size and chunks.ram_src[key] != 0:
        return chunks.ram_src[key], chunks.ram_size[key]
    shards = -(-num_chunks // chunks.shard_chunks)
    chunks.used[(key // num_chunks) * shards + (key % num_chunks) // chunks.shard_chunks] = \
        chunks.tick
    return chunks.src[key], chunks.size[key]


@numba.njit(nogil=True, cache=True)
def read_sources(raw: np.ndarray, order: np.ndarray, num_chunks: int, chunks: ChunkBytes,
                 where: np.ndarray, length: np.ndarray, missing: np.ndarray) -> int:
    """Bytes of each distinct chunk on disk a read takes (`ChunkBytes`: the writer's RAM,
    else the mapped file, marked used), into ``where``/``length`` at the frame that opens
    its run of ``order``. Returns how many chunks have neither (their keys in
    ``missing[:count]``, to be mapped first)."""
    count = 0
    disk_keys = chunks.src.size  # envs * num_chunks
    for j in range(order.size):
        i = order[j]
        key = raw[i]
        if key >= disk_keys or (j > 0 and raw[order[j - 1]] == key):
            continue
        where[i], length[i] = chunk_bytes(chunks, key, num_chunks)
        if where[i] == 0:
            missing[count] = key
            count += 1
    return count


@numba.njit(nogil=True, cache=True)
def read_gather(raw: np.ndarray, offset: np.ndarray, order: np.ndarray, where: np.ndarray,
                length: np.ndarray, read: OnePassRead, part: int, parts: int) -> int:
    """``read.out[i]`` = frame ``i`` of a read planned by `read_keys`, `group_order` and
    `read_sources`: a chunk on disk is decoded (lz4, only up to the last frame the read
    takes from it, as `decode_prefixes`) into ``read.scratch`` and its frames copied out at
    once, while they are still in the CPU's cache; a tail's frames come from the layout's
    ``tail_rows``, the zero frame is zeros. Only the chunks (groups of ``order``) numbered
    ``part``, ``part + parts``, ... are taken: `parts` threads calling it with parts
    ``0 .. parts - 1`` share a read, each chunk decoded by one of them (``0, 1``: all).
    Returns 0, or a chunk's decode status with the position of a frame of that chunk in
    ``read.missing[0]``."""
    scratch, out, tail_rows = read.scratch, read.out, read.layout.tail_rows
    disk_keys = read.chunks.src.size
    fb = out.shape[1]
    chunk = read.layout.chunk
    envs = read.layout.next_slot.size
    start, group = 0, -1
    while start < order.size:
        key, last, stop = raw[order[start]], 0, start
        while stop < order.size and raw[order[stop]] == key:
            last = max(last, offset[order[stop]])
            stop += 1
        group += 1
        if group % parts != part:
            start = stop
            continue
        first = order[start]
        if key < disk_keys:
            status = decode_one(where[first], length[first], scratch.ctypes.data,
                                 scratch.size, LZ4, 0, 0, (last + 1) * fb)
            if status != OK:
                read.missing[0] = first
                return status
            base = scratch.ctypes.data
        elif key - disk_keys < envs:
            base = tail_rows.ctypes.data + (key - disk_keys) * chunk * fb
        else:
            base = 0
        for j in range(start, stop):
            i = order[j]
            if base == 0:
                out[i, :] = 0
            else:
                memcpy(out.ctypes.data + i * fb, base + offset[i] * fb, fb)
        start = stop
    return OK


@numba.njit(nogil=True, cache=True)
def read_frames(flat: np.ndarray, read: OnePassRead, part: int, parts: int) -> int:
    """A whole read in one call: `read_keys`, `group_order`, `read_sources`, then
    `read_gather` of share `part` of `parts` (``0, 1``: the whole read; threads sharing a
    read each plan it whole, which costs little beside the decoding). Returns 0; or,
    gathering nothing, the count of chunks whose files are not mapped (keys in
    ``read.missing[:count]``: map them and call again); or ``-status`` of a chunk that fails
    to decode, with a frame of it in ``read.missing[0]``."""
    n = flat.size
    raw, offset = np.empty(n, np.int64), np.empty(n, np.int64)
    read_keys(flat, read.layout, raw, offset)
    order = group_order(raw)
    where, length = np.empty(n, np.int64), np.empty(n, np.int64)
    count = read_sources(raw, order, read.layout.num_chunks, read.chunks, where, length,
                         read.missing)
    if count:
        return count
    return -read_gather(raw, offset, order, where, length, read, part, parts)

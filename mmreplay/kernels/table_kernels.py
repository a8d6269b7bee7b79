"""Compiled reads from a table of every decoded chunk (`storage.chunk_table`).

Plain arrays in, plain arrays out; no files, codecs or torch. A read is planned, then gathered,
with no Python per chunk or per frame. Each frame of a read comes from one *source*::

    src >= 0          row ``src`` of the table's frames (``key * chunk + offset``)
    src = -1 - t      row ``t`` of the RAM tails' frames (``env * chunk + offset``)
    src = -1 - E * chunk   a frame of zeros (stack padding, slot -1)

Loaded on first use through `mmreplay.kernels.tables()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay.kernels import OK
from mmreplay.kernels.numba_kernels import LZ4, decode_one, memcpy


@numba.njit(nogil=True, cache=True)
def table_plan(flat: np.ndarray, slots: int, chunk: int, num_chunks: int,
               next_slot: np.ndarray, tail_fill: np.ndarray, loaded: np.ndarray,
               src: np.ndarray, missing: np.ndarray) -> int:
    """Each frame's source (``src``) and the distinct chunk keys not loaded in the table yet
    (``missing[:count]``, in order of first use; returns count). A slot of an env's chunk
    being filled reads the RAM tail below ``tail_fill``, the chunk (its previous lap) above."""
    envs = next_slot.size
    zero = -1 - envs * chunk
    count = 0
    for i in range(flat.size):
        f = flat[i]
        if f < 0:
            src[i] = zero
            continue
        env, slot = f // slots, f % slots
        c, offset = slot // chunk, slot % chunk
        if c == next_slot[env] // chunk and offset < tail_fill[env]:
            src[i] = -1 - (env * chunk + offset)
            continue
        key = env * num_chunks + c
        src[i] = key * chunk + offset
        if not loaded[key]:
            missing[count] = key
            count += 1
    if count > 1:  # distinct keys, in order of first use
        order = np.argsort(missing[:count], kind="mergesort")
        first = np.empty(count, np.bool_)
        for j in range(count):
            first[order[j]] = j == 0 or missing[order[j]] != missing[order[j - 1]]
        kept = 0
        for j in range(count):
            if first[j]:
                missing[kept] = missing[j]
                kept += 1
        count = kept
    return count


@numba.njit(nogil=True, cache=True)
def table_gather(table: np.ndarray, tails: np.ndarray, src: np.ndarray,
                 out: np.ndarray) -> None:
    """``out[i]`` = the frame at source ``src[i]``; 2-d uint8 arrays, one frame's bytes a row
    (an explicit byte loop, as `numba_kernels.gather_rows`)."""
    n = out.shape[1]
    for i in range(src.size):
        s = src[i]
        if s >= 0:
            for j in range(n):
                out[i, j] = table[s, j]
        elif -1 - s < tails.shape[0]:
            t = -1 - s
            for j in range(n):
                out[i, j] = tails[t, j]
        else:
            for j in range(n):
                out[i, j] = 0


@numba.njit(nogil=True, cache=True)
def _row_source(ram_src: np.ndarray, ram_size: np.ndarray, src: np.ndarray, size: np.ndarray,
                key: int) -> tuple[int, int, bool]:
    """Where the bytes of chunk `key` are: the writer's RAM first, else its mapped file
    (address 0: not mapped yet); and whether they come from the file."""
    if key < ram_src.size and ram_src[key] != 0:
        return ram_src[key], ram_size[key], False
    return src[key], size[key], True


@numba.njit(nogil=True, cache=True)
def table_read(flat: np.ndarray, slots: int, num_chunks: int, next_slot: np.ndarray,
               tail_fill: np.ndarray, tail_rows: np.ndarray, rows: np.ndarray,
               loaded: np.ndarray, src: np.ndarray, size: np.ndarray, ram_src: np.ndarray,
               ram_size: np.ndarray, used: np.ndarray, tick: int, shard_chunks: int,
               sources: np.ndarray, out: np.ndarray, missing: np.ndarray) -> int:
    """A whole read through the table of an lz4 shard store in one call: each frame's
    source (`table_plan`); each chunk the table lacks decoded whole from its bytes (in the
    writer's RAM, ``ram_src``/``ram_size``, else in its mapped file, ``src``/``size``; the
    file marked used at ``tick``) straight into its row, then marked loaded; then the
    gather (`table_gather`). ``chunk`` = ``tail_rows.shape[0] // envs`` frames a chunk.

    Returns 0; or, gathering nothing, the count of chunks whose files are not mapped (keys
    in ``missing[:count]``, maybe repeated: map them and call again; the chunks decoded
    meanwhile stay loaded); or ``-status`` of a chunk that fails to decode, its key in
    ``missing[0]`` (its row is not marked loaded)."""
    envs = next_slot.size
    chunk = tail_rows.shape[0] // envs
    n = rows.shape[1]
    shards = -(-num_chunks // shard_chunks)
    base = rows.ctypes.data
    zero = -1 - envs * chunk
    count = 0
    for i in range(flat.size):
        f = flat[i]
        if f < 0:
            sources[i] = zero
            continue
        env, slot = f // slots, f % slots
        c, offset = slot // chunk, slot % chunk
        if c == next_slot[env] // chunk and offset < tail_fill[env]:
            sources[i] = -1 - (env * chunk + offset)
            continue
        key = env * num_chunks + c
        sources[i] = key * chunk + offset
        if loaded[key]:
            continue
        where, length, in_file = _row_source(ram_src, ram_size, src, size, key)
        if in_file:
            used[env * shards + c // shard_chunks] = tick
            if where == 0:
                missing[count] = key
                count += 1
                continue
        status = decode_one(where, length, base + key * n, n, LZ4, 0, 0, n)
        if status != OK:
            missing[0] = key
            return -status
        loaded[key] = True
    if count:
        return count
    _gather(rows.ctypes.data, n // chunk, tail_rows, sources, out)
    return 0


@numba.njit(nogil=True, cache=True)
def _gather(table: int, fb: int, tails: np.ndarray, sources: np.ndarray,
            out: np.ndarray) -> None:
    """`table_gather` with the table's frames at address `table` (`fb` bytes a frame)."""
    dst = out.ctypes.data
    tail = tails.ctypes.data
    for i in range(sources.size):
        s = sources[i]
        if s >= 0:
            memcpy(dst + i * fb, table + s * fb, fb)
        elif -1 - s < tails.shape[0]:
            memcpy(dst + i * fb, tail + (-1 - s) * fb, fb)
        else:
            out[i, :] = 0

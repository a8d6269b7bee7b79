"""Compiled reads from the decoded-chunk cache (`storage.chunk_table`), eviction included.

Plain arrays in, plain arrays out; no files, codecs or torch. A read is planned, then gathered,
with no Python per chunk or per frame. Each frame of a read comes from one *source*::

    src >= 0          row ``src`` of the table's frames (``row * chunk + offset``)
    src = -1 - t      row ``t`` of the RAM tails' frames (``env * chunk + offset``)
    src = -1 - E * chunk   a frame of zeros (stack padding, slot -1)

A chunk the table lacks gets a row (`claim_row`): its own when the table holds the whole
store, else by CLOCK: the hand skips (and clears) referenced rows and never takes a row the
current read uses (``pin == epoch``); a read needing more rows than there are gets `WIDE`
and nothing claimed (the caller reads it without keeping).

Loaded on first use through `mmreplay.kernels.tables()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay.kernels import OK
from mmreplay.kernels.numba_kernels import LZ4, decode_one, memcpy
from mmreplay.kernels.structs import ChunkBytes, FrameLayout, TableArrays, TableRead

HAND, EPOCH, HELD = 0, 1, 2  # positions in ``state`` (`chunk_table.ChunkTable`)
WIDE = -1000  # a read touching more chunks than the table has rows


@numba.njit(nogil=True, cache=True)
def claim_row(key: int, table: TableArrays, new_read: bool) -> int:
    """The row chunk `key` is to be loaded in (it may hold it already), taken from its
    chunk if another held it, referenced and pinned by the current read (a new one if
    `new_read`); -1 if every row is pinned by the current read."""
    row_of, key_of, ref, pin, state = table.row_of, table.key_of, table.ref, table.pin, table.state
    if new_read:
        state[EPOCH] += 1
    epoch = state[EPOCH]
    row = row_of[key]
    if row < 0:
        count = key_of.size
        if count == row_of.size:  # the whole store: row k is chunk k's
            row = key
        else:
            hand = state[HAND]
            for _ in range(2 * count + 1):
                r = hand
                hand = hand + 1 if hand + 1 < count else 0
                if pin[r] == epoch:
                    continue
                if ref[r]:
                    ref[r] = 0
                    continue
                row = r
                break
            state[HAND] = hand
            if row < 0:
                return -1
        old = key_of[row]
        if old >= 0:
            row_of[old] = -1
        else:
            state[HELD] += 1
        key_of[row], row_of[key] = key, row
    ref[row], pin[row] = 1, epoch
    return row


@numba.njit(nogil=True, cache=True)
def drop_rows(keys: np.ndarray, table: TableArrays) -> None:
    """Forget chunks `keys` (their rows are free)."""
    for key in keys:
        row = table.row_of[key]
        if row >= 0:
            table.row_of[key], table.key_of[row] = -1, -1
            table.state[HELD] -= 1


@numba.njit(nogil=True, cache=True)
def source_of(f: int, layout: FrameLayout) -> tuple[int, int]:
    """A flat slot's chunk key and offset in it; or -1 and its source (above) for a RAM
    tail or the zero frame."""
    envs, chunk = layout.next_slot.size, layout.chunk
    if f < 0:
        return -1, -1 - envs * chunk
    env, slot = f // layout.slots, f % layout.slots
    c, offset = slot // chunk, slot % chunk
    if c == layout.next_slot[env] // chunk and offset < layout.tail_fill[env]:
        return -1, -1 - (env * chunk + offset)
    return env * layout.num_chunks + c, offset


@numba.njit(nogil=True, cache=True)
def table_plan(flat: np.ndarray, layout: FrameLayout, table: TableArrays, src: np.ndarray,
               missing: np.ndarray, missing_rows: np.ndarray) -> int:
    """Each frame's source (``src``), a row claimed for every distinct chunk the table
    lacks (keys ``missing[:count]`` to be loaded into rows ``missing_rows[:count]``, in
    order of first use); returns count, or `WIDE` (and nothing claimed). A slot of an env's
    chunk being filled reads the RAM tail below ``tail_fill``, the chunk (its previous lap)
    above."""
    count = 0
    state = table.state
    state[EPOCH] += 1
    for i in range(flat.size):
        key, offset = source_of(flat[i], layout)
        if key < 0:
            src[i] = offset
            continue
        row = table.row_of[key]
        if row < 0:
            row = claim_row(key, table, False)
            if row < 0:
                drop_rows(missing[:count], table)
                return WIDE
            missing[count], missing_rows[count] = key, row
            count += 1
        else:
            table.ref[row], table.pin[row] = 1, state[EPOCH]
        src[i] = row * layout.chunk + offset
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
def _row_source(chunks: ChunkBytes, key: int) -> tuple[int, int, bool]:
    """Where the bytes of chunk `key` are: the writer's RAM first, else its mapped file
    (address 0: not mapped yet); and whether they come from the file."""
    if key < chunks.ram_src.size and chunks.ram_src[key] != 0:
        return chunks.ram_src[key], chunks.ram_size[key], False
    return chunks.src[key], chunks.size[key], True


@numba.njit(nogil=True, cache=True)
def table_read(flat: np.ndarray, read: TableRead, stack: int = 0) -> int:
    """A whole read through the table of an lz4 shard store in one call: each frame's
    source (`table_plan`); each chunk the table lacks decoded whole from its bytes (in the
    writer's RAM, else in its mapped file, marked used: `ChunkBytes`) straight into the
    row it claims (`claim_row`); then the gather (`gather_frames`; ``stack`` > 0: `flat` is
    a batch's obs and next stacks).

    Returns 0; or, gathering nothing, the count of chunks whose files are not mapped (keys
    in ``read.missing[:count]``, maybe repeated: map them and call again; the chunks decoded
    meanwhile stay in the table); or ``-status`` of a chunk that fails to decode, its key in
    ``read.missing[0]`` (not kept); or `WIDE`."""
    layout, chunks, table, sources, missing = (read.layout, read.chunks, read.table,
                                               read.sources, read.missing)
    chunk, num_chunks = layout.chunk, layout.num_chunks
    rows, state = table.rows, table.state
    n = rows.shape[1]
    shards = -(-num_chunks // chunks.shard_chunks)
    count = 0
    state[EPOCH] += 1
    for i in range(flat.size):
        key, offset = source_of(flat[i], layout)
        if key < 0:
            sources[i] = offset
            continue
        row = table.row_of[key]
        if row < 0:
            where, length, in_file = _row_source(chunks, key)
            if in_file:
                shard = (key // num_chunks) * shards + (key % num_chunks) // chunks.shard_chunks
                chunks.used[shard] = chunks.tick
                if where == 0:
                    missing[count] = key
                    count += 1
                    continue
            row = claim_row(key, table, False)
            if row < 0:
                return WIDE
            status = decode_one(where, length, rows.ctypes.data + row * n, n, LZ4, 0, 0, n)
            if status != OK:
                drop_rows(np.array([key]), table)
                missing[0] = key
                return -status
        else:
            table.ref[row], table.pin[row] = 1, state[EPOCH]
        sources[i] = row * chunk + offset
    if count:
        return count
    gather_frames(rows.ctypes.data, n // chunk, layout.tail_rows, sources, read.out, stack)
    return 0


@numba.njit(nogil=True, cache=True)
def gather_frames(table: int, fb: int, tails: np.ndarray, sources: np.ndarray,
                  out: np.ndarray, stack: int) -> None:
    """`table_gather` with the table's frames at address `table` (`fb` bytes a frame).

    ``stack`` > 0: the sources are a batch's obs and next stacks, ``(2, B, stack)`` in
    order. Each transition's next stack is gathered right after its obs stack, and a frame
    the two share is copied from the obs just written (still in the CPU's cache) instead of
    from the table: a batch of 4-stacks and one-step next stacks reads 5 frames a transition
    from RAM, not 8 (n-step next stacks share 4 - n)."""
    if stack <= 0 or sources.size % (2 * stack):
        for i in range(sources.size):
            _copy_frame(table, fb, tails, sources[i], out, i)
        return
    half = sources.size // 2
    dst = out.ctypes.data
    for first in range(0, half, stack):
        for i in range(first, first + stack):
            _copy_frame(table, fb, tails, sources[i], out, i)
        for i in range(half + first, half + first + stack):
            shared = -1
            for j in range(first, first + stack):
                if sources[j] == sources[i]:
                    shared = j
                    break
            if shared >= 0:
                memcpy(dst + i * fb, dst + shared * fb, fb)
            else:
                _copy_frame(table, fb, tails, sources[i], out, i)


@numba.njit(nogil=True, cache=True)
def _copy_frame(table: int, fb: int, tails: np.ndarray, s: int, out: np.ndarray,
                i: int) -> None:
    """``out[i]`` = the frame at source `s` (the table's frames at address `table`)."""
    if s >= 0:
        memcpy(out.ctypes.data + i * fb, table + s * fb, fb)
    elif -1 - s < tails.shape[0]:
        memcpy(out.ctypes.data + i * fb, tails.ctypes.data + (-1 - s) * fb, fb)
    else:
        out[i, :] = 0

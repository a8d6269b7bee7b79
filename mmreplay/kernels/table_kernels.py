"""Compiled reads from the decoded-chunk cache (`storage.chunk_table`), eviction included.

Plain arrays in, plain arrays out; no files, codecs or torch. A read is planned, then gathered,
with no Python per chunk or per frame. Each frame of a read comes from one *source*::

    src >= 0          row ``src`` of the table's frames (``row * chunk + offset``)
    src = -1 - t      row ``t`` of the RAM tails' frames (``env * chunk + offset``)
    src = -1 - E * chunk   a frame of zeros (stack padding, slot -1)

A chunk the table lacks gets a row (`claim_row`): its own when the table holds the whole
store, else by CLOCK: the hand skips (and clears) referenced rows and never takes a row the
current read uses (``pin == epoch``); a read needing more rows than there are is *wide*
(`WIDE`): the caller reads it without keeping.

Loaded on first use through `mmreplay.kernels.tables()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay.kernels import OK
from mmreplay.kernels.numba_kernels import LZ4, chunk_bytes, chunk_of, decode_one, memcpy
from mmreplay.kernels.structs import FrameLayout, TableArrays, TableRead

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
    chunk = layout.chunk
    if f < 0:
        return -1, -1 - layout.next_slot.size * chunk
    # chunk_of is inlined here: numba's cache of this module is keyed by this file alone, so
    # a change to chunk_of reaches these kernels once this file changes too
    key, offset, in_tail = chunk_of(f, layout)
    if in_tail:
        return -1, -1 - (key // layout.num_chunks * chunk + offset)
    return key, offset


@numba.njit(nogil=True, cache=True)
def table_plan(flat: np.ndarray, layout: FrameLayout, table: TableArrays, src: np.ndarray,
               missing: np.ndarray, missing_rows: np.ndarray) -> tuple[int, bool]:
    """Each frame's source (``src``), a row claimed for every distinct chunk the table
    lacks (keys ``missing[:count]`` to be loaded into rows ``missing_rows[:count]``, in
    order of first use); returns count, and whether the read is wider than the table (it
    stopped at the first chunk it found no row for: the rows claimed so far stay claimed).
    A slot of an env's chunk being filled reads the RAM tail below ``tail_fill``, the chunk
    (its previous lap) above."""
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
                return count, True
            missing[count], missing_rows[count] = key, row
            count += 1
        else:
            table.ref[row], table.pin[row] = 1, state[EPOCH]
        src[i] = row * layout.chunk + offset
    return count, False


@numba.njit(nogil=True, cache=True)
def scratch_plan(flat: np.ndarray, layout: FrameLayout, keys: np.ndarray,
                 src: np.ndarray) -> int:
    """`table_plan` for a read with no table to keep: the distinct chunks on disk the read
    takes (keys sorted into ``keys[:count]``; returns count), to be loaded into rows 0..count-1
    of a scratch table in that order, and each frame's source (``src``: in those rows, or a
    RAM tail, or the zero frame)."""
    n = flat.size
    raw, offset = np.empty(n, np.int64), np.empty(n, np.int64)
    for i in range(n):
        raw[i], offset[i] = source_of(flat[i], layout)
    order = np.argsort(raw)
    count = 0
    for j in range(n):
        i = order[j]
        if raw[i] < 0:
            src[i] = offset[i]
            continue
        if count == 0 or raw[i] != keys[count - 1]:
            keys[count] = raw[i]
            count += 1
        src[i] = (count - 1) * layout.chunk + offset[i]
    return count


@numba.njit(nogil=True, cache=True)
def _load_claimed(keys: np.ndarray, rows: np.ndarray, read: TableRead) -> int:
    """Decode chunks `keys` (rows claimed by `table_plan`) whole from their bytes (in the
    writer's RAM, else in their mapped file, marked used: `ChunkBytes`) straight into their
    rows. Returns 0; or the count of chunks whose files are not mapped (keys in
    ``read.missing[:count]``; their claims dropped, the others' chunks loaded); or
    ``-status`` of a chunk that fails to decode, its key in ``read.missing[0]`` (its claim
    and those not loaded yet dropped)."""
    chunks, table, missing = read.chunks, read.table, read.missing
    num_chunks, table_rows = read.layout.num_chunks, table.rows
    n = table_rows.shape[1]
    count = 0
    for j in range(keys.size):
        key = keys[j]
        where, length = chunk_bytes(chunks, key, num_chunks)
        if where == 0:
            missing[count] = key
            count += 1
            continue
        status = decode_one(where, length, table_rows.ctypes.data + rows[j] * n, n, LZ4, 0, 0, n)
        if status != OK:
            drop_rows(keys[j:], table)
            missing[0] = key
            return -status
    drop_rows(missing[:count], table)
    return count


@numba.njit(nogil=True, cache=True)
def table_read(flat: np.ndarray, read: TableRead, stack: int = 0) -> int:
    """A whole read through the table of an lz4 shard store in one call: `table_plan`, the
    chunks the table lacks decoded (`_load_claimed`), then `gather_frames` (``stack`` > 0:
    `flat` is a batch's obs and next stacks).

    Returns 0; or, gathering nothing, the count of chunks whose files are not mapped (keys
    in ``read.missing[:count]``, maybe repeated: map them and call again; the chunks decoded
    meanwhile stay in the table); or ``-status`` of a chunk that fails to decode, its key in
    ``read.missing[0]`` (not kept); or `WIDE`."""
    keys, rows = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    count, wide = table_plan(flat, read.layout, read.table, read.sources, keys, rows)
    status = _load_claimed(keys[:count], rows[:count], read)  # a wide read's too: kept
    if status:
        return status
    if wide:
        return WIDE
    gather_frames(read.table.rows, read.layout.tail_rows, read.sources, read.out, stack)
    return 0


@numba.njit(nogil=True, cache=True)
def gather_frames(rows: np.ndarray, tails: np.ndarray, sources: np.ndarray, out: np.ndarray,
                  stack: int) -> None:
    """``out[i]`` = the frame at source ``sources[i]`` (see the module docstring) of a table
    whose C-contiguous `rows` hold its frames back to back, ``out.shape[1]`` bytes a frame:
    every read's one gather.

    ``stack`` > 0: the sources are a batch's obs and next stacks, ``(2, B, stack)`` in
    order. Each transition's next stack is gathered right after its obs stack, and a frame
    the two share is copied from the obs just written (still in the CPU's cache) instead of
    from the table: a batch of 4-stacks and one-step next stacks reads 5 frames a transition
    from RAM, not 8 (n-step next stacks share 4 - n)."""
    table, fb = rows.ctypes.data, out.shape[1]
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

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

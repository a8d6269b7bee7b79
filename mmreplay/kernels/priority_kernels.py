"""Compiled kernel of proportional priorities: a whole `update_priorities` in one call.

Plain arrays in, plain arrays out; no files, rings or torch. The caller passes each value's
mass ``(p + eps) ** alpha`` computed by numpy, the one implementation of that expression (the
sampler's `check_valid` compares tree leaves with it bit for bit). One learner update::

    ids --(id map)--> flat slots --(valid?)--> last value per slot wins --(masses finite?)-->
        p[slot] = value, tree leaves + their ancestors' rows rebuilt (`tree_set`)

Nothing is written unless every check passes; a rejected call returns a negative status:

    >= 0   slots written (the first `count` of ``flat_out``/``val_out``, slots increasing)
    BAD_VALUE   a priority is NaN, inf or negative
    OVERFLOW    a mass ``(p + eps) ** alpha`` overflows to inf
    MISSED      an id in ``[0, next_id)`` is not where the id map points while some ids
                are spilled (call again with their slots in ``pre``)

Loaded on first use through `mmreplay.kernels.priorities()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay.kernels.numba_kernels import tree_set

BAD_VALUE, OVERFLOW, MISSED = -1, -2, -3


@numba.njit(nogil=True, cache=True)
def _resolve(ids: np.ndarray, pre: np.ndarray, spills: bool, next_id: int, loc: np.ndarray,
             slot_ids: np.ndarray, valid: np.ndarray, flat: np.ndarray) -> int:
    """Each id's flat slot (-1: unknown or not sampleable); `MISSED` if the map fails one."""
    for i in range(ids.size):
        flat[i] = -1
        k = ids[i]
        if k < 0 or k >= next_id:
            continue
        f = pre[i] if pre.size else loc[k % loc.size]
        if f >= 0 and slot_ids[f] == k:
            if valid[f]:
                flat[i] = f
        elif spills and not pre.size:
            return MISSED
    return 0


@numba.njit(nogil=True, cache=True)
def apply_priorities(ids: np.ndarray, values: np.ndarray, mass: np.ndarray, pre: np.ndarray,
                     spills: bool, next_id: int, loc: np.ndarray, slot_ids: np.ndarray,
                     valid: np.ndarray, p: np.ndarray, sums: np.ndarray,
                     mins: np.ndarray, prefix: np.ndarray, off: np.ndarray, fan: np.ndarray,
                     first: np.ndarray, shift: np.ndarray, leaf0: int, flat_out: np.ndarray,
                     val_out: np.ndarray) -> int:
    """Set the priorities of transition ids (see the module docstring for the statuses).

    An id's slot is ``loc[id % loc.size]`` (or ``pre[i]`` when `pre` is not empty), taken
    only if that slot still holds the id (``slot_ids``) and is ``valid``; other ids are
    ignored (with `spills`, an id the map misses returns `MISSED` unless `pre` is given).
    Of ids landing on one slot the last value wins.
    """
    for i in range(values.size):
        if not (values[i] >= 0.0 and values[i] != np.inf):  # NaN fails both
            return BAD_VALUE
    flat = np.empty(ids.size, np.int64)
    if _resolve(ids, pre, spills, next_id, loc, slot_ids, valid, flat) == MISSED:
        return MISSED
    order = np.argsort(flat, kind="mergesort")  # stable: a slot's ids keep their order
    leaves = np.empty(ids.size)
    count = 0
    for j in range(order.size):
        i = order[j]
        if flat[i] < 0:
            continue
        if not (count and flat_out[count - 1] == flat[i]):
            count += 1
        # a later id of the same slot overwrites an earlier one: the last value wins
        flat_out[count - 1], val_out[count - 1], leaves[count - 1] = flat[i], values[i], mass[i]
    for j in range(count):
        if leaves[j] == np.inf:
            return OVERFLOW
    for j in range(count):
        p[flat_out[j]] = val_out[j]
    tree_set(sums, mins, prefix, off, fan, first, shift, leaf0, flat_out[:count],
             leaves[:count])
    return count

"""Compiled kernels of proportional priorities: a whole priority update in one call.

Plain arrays in, plain arrays out; no files, rings or torch. Each value's mass
``(p + eps) ** alpha`` must be bit for bit numpy's (the sampler's `check_valid` compares tree
leaves with numpy's, and `load` rebuilds the tree with numpy): where `same_pow` finds this
machine's compiled ``**`` equal to numpy's (both the C library's ``pow``), the updates compute
the masses themselves (``mass`` empty); elsewhere (numpy's SIMD ``pow`` on AVX-512 machines) the
caller passes numpy's, after `plain_values` tells it in one pass whether numpy computes them
without a floating-point warning. One learner update::

    ids --(id map)--> flat slots --(valid?)--> last value per slot wins --(masses finite?)-->
        p[slot] = value, marks[slot % period // group] = True,
        tree leaves + their ancestors' rows rebuilt (`tree_set`)

`apply_priorities` takes transition ids, `apply_slot_priorities` flat slots (a slot not
sampleable keeps its priority for later and gets no mass). Nothing is written unless every
check passes; a rejected call returns a negative status:

    >= 0   slots written (the first `count` of `Written`'s ``slots``/``values``, slots
           increasing; ``top[0]`` the largest value written, 0.0 if none)
    BAD_VALUE   a priority is NaN, inf or negative
    OVERFLOW    a mass ``(p + eps) ** alpha`` of a sampleable slot overflows to inf
    MISSED      an id in ``[0, next_id)`` is not where the id map points while some ids
                are spilled (call again with their slots in ``pre``)
    BAD_SLOT    a flat slot lies outside ``[0, p.size)`` (`apply_slot_priorities`)

Loaded on first use through `mmreplay.kernels.priorities()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from mmreplay.kernels.structs import IdMap, Priorities, Written
from mmreplay.kernels.tree_kernels import tree_set

BAD_VALUE, OVERFLOW, MISSED, BAD_SLOT = -1, -2, -3, -4


@numba.njit(nogil=True, cache=True)
def _bad_values(values: np.ndarray) -> bool:
    """Whether a value is NaN, inf or negative."""
    for i in range(values.size):
        if not (values[i] >= 0.0 and values[i] != np.inf):  # NaN fails both
            return True
    return False


@numba.njit(nogil=True, cache=True, inline="always")
def _mass(value: float, eps: float, alpha: float) -> float:
    """The mass of a priority: numpy's ``(p + eps) ** alpha`` where `same_pow` holds."""
    return (value + eps) ** alpha


@numba.njit(nogil=True, cache=True)
def masses(values: np.ndarray, eps: float, alpha: float) -> np.ndarray:
    """`_mass` of every value, the updates' own expression (what `same_pow` compares)."""
    out = np.empty(values.size)
    for i in range(values.size):
        out[i] = _mass(values[i], eps, alpha)
    return out


def same_pow(eps: float, alpha: float) -> bool:
    """Whether `masses` equals numpy's ``(values + eps) ** alpha`` bit for bit on this machine,
    for this `eps` and `alpha`, over probes from 1e-12 to 1e12 (and exact zeros). Both call
    the C library's ``pow`` unless numba or numpy links a vector library (SVML), whose ``pow``
    rounds differently on a large share of inputs, which the probes would meet."""
    if numba.config.USING_SVML:
        return False
    probes = np.concatenate([np.zeros(1), np.geomspace(1e-12, 1e12, 6000),
                             np.linspace(0.0, 4.0, 2001)])
    with np.errstate(over="ignore"):
        want: npt.NDArray[np.float64] = (probes + eps) ** alpha
    return bool(np.array_equal(masses(probes, eps, alpha), want))


@numba.njit(nogil=True, cache=True)
def plain_values(values: np.ndarray, limit: float) -> int:
    """0 if every value is finite, >= 0 and below `limit` (numpy's mass of each is then
    computed without a warning); `BAD_VALUE` if one is NaN, inf or negative; else
    `OVERFLOW` (a value at or above `limit`, whose mass may overflow)."""
    status = 0
    for i in range(values.size):
        v = values[i]
        if not (v >= 0.0 and v != np.inf):  # NaN fails both
            return BAD_VALUE
        if v >= limit:
            status = OVERFLOW
    return status


@numba.njit(nogil=True, cache=True)
def _resolve(ids: np.ndarray, pre: np.ndarray, where: IdMap, flat: np.ndarray) -> int:
    """Each id's flat slot (-1: unknown or not sampleable); `MISSED` if the map fails one."""
    loc = where.loc
    for i in range(ids.size):
        flat[i] = -1
        k = ids[i]
        if k < 0 or k >= where.next_id:
            continue
        f = pre[i] if pre.size else loc[k % loc.size]
        if f >= 0 and where.slot_ids[f] == k:
            if where.valid[f]:
                flat[i] = f
        elif where.spills and not pre.size:
            return MISSED
    return 0


@numba.njit(nogil=True, cache=True)
def _last_per_slot(flat: np.ndarray, values: np.ndarray, mass: np.ndarray, valid: np.ndarray,
                   dest: Priorities, out: Written, leaves: np.ndarray) -> int:
    """The slots of `flat` (-1 skipped) increasing and unique into ``out.slots``, each with
    the last value given for it and its leaf mass (0.0 where not `valid`; ``mass[i]``, or
    `_mass` when `mass` is empty); returns how many."""
    order = np.argsort(flat, kind="mergesort")  # stable: a slot's entries keep their order
    flat_out, val_out = out.slots, out.values
    count = 0
    for j in range(order.size):
        i = order[j]
        f = flat[i]
        if f < 0:
            continue
        if not (count and flat_out[count - 1] == f):
            count += 1
        # a later entry of the same slot overwrites an earlier one: the last value wins
        flat_out[count - 1], val_out[count - 1] = f, values[i]
        if not valid[f]:
            leaves[count - 1] = 0.0
        elif mass.size:
            leaves[count - 1] = mass[i]
        else:
            leaves[count - 1] = _mass(values[i], dest.eps, dest.alpha)
    return count


@numba.njit(nogil=True, cache=True)
def _write(flat: np.ndarray, values: np.ndarray, mass: np.ndarray, valid: np.ndarray,
           dest: Priorities, out: Written) -> int:
    """The shared tail of both updates: last value per slot, overflow check, then writes."""
    leaves = np.empty(flat.size)
    count = _last_per_slot(flat, values, mass, valid, dest, out, leaves)
    for j in range(count):
        if leaves[j] == np.inf:
            return OVERFLOW
    high = 0.0
    marks = dest.marks
    for j in range(count):
        slot = out.slots[j]
        dest.p[slot] = out.values[j]
        high = max(high, out.values[j])
        if marks.size:
            marks[slot % dest.period // dest.group] = True
    out.top[0] = high
    tree_set(dest.tree, out.slots[:count], leaves[:count])
    return count


@numba.njit(nogil=True, cache=True)
def apply_priorities(ids: np.ndarray, values: np.ndarray, mass: np.ndarray, pre: np.ndarray,
                     where: IdMap, dest: Priorities, out: Written) -> int:
    """Set the priorities of transition ids (see the module docstring for the statuses).

    An id's slot is ``where.loc[id % loc.size]`` (or ``pre[i]`` when `pre` is not empty),
    taken only if that slot still holds the id (``slot_ids``) and is ``valid``; other ids
    are ignored (with ``where.spills``, an id the map misses returns `MISSED` unless `pre`
    is given). Of ids landing on one slot the last value wins.
    """
    if _bad_values(values):
        return BAD_VALUE
    flat = np.empty(ids.size, np.int64)
    if _resolve(ids, pre, where, flat) == MISSED:
        return MISSED
    return _write(flat, values, mass, where.valid, dest, out)


@numba.njit(nogil=True, cache=True)
def apply_slot_priorities(slots: np.ndarray, values: np.ndarray, mass: np.ndarray,
                          valid: np.ndarray, dest: Priorities, out: Written) -> int:
    """Set the priorities of flat `slots` (see the module docstring for the statuses): every
    slot's priority is written, its leaf gets its mass if ``valid``, else 0.0. Of entries
    naming one slot the last value wins."""
    for i in range(slots.size):
        if slots[i] < 0 or slots[i] >= dest.p.size:
            return BAD_SLOT
    if _bad_values(values):
        return BAD_VALUE
    return _write(slots, values, mass, valid, dest, out)

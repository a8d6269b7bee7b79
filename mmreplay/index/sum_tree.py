"""Float64 sum tree over a fixed number of leaf masses.

This module owns the data structure the samplers draw slot indices from: a mass per leaf, the
running total, inverse-CDF lookup (`find`) and the smallest positive mass (`min_nonzero`, used for
importance-weight normalisation). It knows nothing about frames, episodes or RNGs: callers pass
targets in, so all randomness stays with the store's generator.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from mmreplay.kernels import lazy_entry, trees
from mmreplay.kernels.structs import TreeArrays

__all__ = ["SumTree", "TreeArrays"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Targets above total() by at most this relative amount are treated as rounding and clamped.
_TARGET_RTOL = 1e-9
_FLOAT_MAX = float(np.finfo(np.float64).max)
# Level shape (see `_level_bits`). Each stored level costs a fixed handful of numpy calls per
# batch, so for batches of ~32 fewer, wider levels win: the root row may have up to 2**_ROOT_BITS
# children (find bisects it once for the whole batch, set rebuilds it whole), rows below it have
# 2**_STEP_BITS (gathered per updated leaf). At least _MIN_LEVELS levels keep small trees binary.
_ROOT_BITS = 10
_STEP_BITS = 5
_MIN_LEVELS = 3

# the compiled kernels called here, each found without a look-up (`kernels.lazy_entry`)
_TREE_DRAW, _TREE_SET = lazy_entry(trees, "tree_draw"), lazy_entry(trees, "tree_set")


def _level_bits(depth: int) -> tuple[int, ...]:
    """Binary depths spanned by each stored level, root first; they sum to ``depth``.

    1 -> (1,); 4 -> (2, 1, 1); 10 -> (4, 3, 3); 20 (a million leaves) -> (10, 5, 5).
    """
    if depth == 0:
        return ()
    step = max(1, min(_STEP_BITS, depth // _MIN_LEVELS))
    below = max(_MIN_LEVELS - 1, math.ceil((depth - _ROOT_BITS) / step))
    below = min(below, depth - 1)  # the root spans at least one binary depth
    return (depth - step * below,) + (step,) * below


def _prefix_rows(kids: FloatArray, out: FloatArray | None = None) -> FloatArray:
    """``[0, k0, k0 + k1, ...]`` per row, summed strictly left to right (np.add.accumulate).

    The one formula for every internal sum, in `set`, `set_all` and `check_valid`: a row's last
    entry is its node's mass, so the tree is a function of its leaves, bit for bit. Sequential
    sums make a row non-decreasing and flat exactly across zero-mass children.
    """
    if out is None:
        out = np.zeros((kids.shape[0], kids.shape[1] + 1), dtype=np.float64)
    np.add.accumulate(kids, axis=1, out=out[:, 1:])  # column 0 stays 0.0
    return out


def _row_min(kids: FloatArray) -> FloatArray:
    """Smallest entry per row (argmin + gather beats np.minimum.reduce on short rows)."""
    return kids[np.arange(kids.shape[0]), kids.argmin(axis=1)]


@dataclass(frozen=True, slots=True)
class _Level:
    """One stored level: views into the tree's node arrays plus its prefix table."""

    first: int  # node id of the level's row 0
    shift: int  # leaf j's ancestor on this level is row j >> shift
    fanout: int
    sums: FloatArray  # (rows,) view of SumTree._sum
    mins: FloatArray  # (rows,) view of SumTree._min
    kid_sums: FloatArray  # (rows, fanout) view of the children's _sum
    kid_mins: FloatArray  # (rows, fanout) view of the children's _min
    prefix: FloatArray  # (rows, fanout + 1) `_prefix_rows(kid_sums)`


class SumTree:
    """Tree whose internal nodes hold the sum (and min) of their children, a few levels deep.

    Leaves are padded to ``P``, the next power of two >= capacity. Nodes keep binary-heap ids (node
    ``i`` sits at binary depth ``floor(log2 i)``, leaf ``j`` is node ``P + j``) but only a few
    depths are stored, as *levels* (`_level_bits`): a node's children are its descendants at the
    next stored depth, and ids at skipped depths are unused. Each internal node also keeps a
    *prefix row*, 0 then the running sums of its children. Capacity 13, stored depths 0, 2, 3, 4::

                                   [1] 9.0                    prefix row [0, 3, 3, 6, 9]
               ___________________/  /  \\  \\___________________
              /                     /    \\                    \\
          [4] 3.0             [5] 0.0    [6] 3.0             [7] 3.0     ids 2, 3 unused
           /    \\              /    \\      /    \\             /     \\
        [8] 1  [9] 2       [10] 0 [11] 0 [12] 3 [13] 0     [14] 3  [15] 0
        1   0  2   0        0  0   0  0   1  2   0  0       3  0    0  0   <- leaves 0..15
                                                                              (13..15 padding)

    ``find(6.5)``: 6.5 < 9 is in the root's 4th slot [6, 9), so child [7] with 0.5 left; [7]'s
    row [0, 3, 3] puts 0.5 in [14]; [14]'s row [0, 3, 3] gives leaf 12. A million leaves store
    depths 0, 10, 15, 20: a root row of 1024 children, then fanout 32 twice.

    Invariants (checked by ``check_valid``):
      * every leaf mass is finite and >= 0; padding leaves are 0.0;
      * each internal node's prefix row is `_prefix_rows` of its children's ``_sum`` and its own
        ``_sum`` is the row's last entry: rebuilt from the children on every update (never patched
        with deltas), so integer-valued masses give exact totals and nothing drifts;
      * ``_min`` mirrors the layout with ``+inf`` for zero-mass leaves and each internal node the
        min of its children, so ``_min[1]`` is the smallest positive mass.
    """

    capacity: int

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool):
            raise TypeError(f"capacity must be an int, got bool {capacity!r}")
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._leaf0 = 1 << (capacity - 1).bit_length()  # P: node id of leaf 0
        depth = self._leaf0.bit_length() - 1  # binary depth of the leaves
        # (rows, fanout) per level; every level's prefix rows live in one array, which the
        # compiled walks take whole with these columns
        shape, top = [], 0
        for b in _level_bits(depth):
            shape.append((1 << top, 1 << b))
            top += b
        sizes = [rows * (fanout + 1) for rows, fanout in shape]
        # sums, mins and prefix rows in one block: a walk or an update touches all three, and
        # one large allocation is backed by more huge pages (numpy asks for them from 4 MiB)
        block = np.zeros(4 * self._leaf0 + sum(sizes), dtype=np.float64)
        self._sum: FloatArray = block[: 2 * self._leaf0]
        self._min: FloatArray = block[2 * self._leaf0 : 4 * self._leaf0]
        self._prefix: FloatArray = block[4 * self._leaf0 :]
        self._min[:] = np.inf
        self._leaf_sums = self._sum[self._leaf0 :]
        self._leaf_mins = self._min[self._leaf0 :]
        self._levels = self._make_levels(depth)
        self._arrays = TreeArrays(  # node arrays are written in place, never moved
            sums=self._sum, mins=self._min, prefix=self._prefix,
            offsets=np.cumsum([0, *sizes], dtype=np.int64)[:-1],  # of each level's prefix rows
            fanouts=np.array([lv.fanout for lv in self._levels], dtype=np.int64),
            firsts=np.array([lv.first for lv in self._levels], dtype=np.int64),
            shifts=np.array([lv.shift for lv in self._levels], dtype=np.int64),
            leaf0=self._leaf0)

    def _make_levels(self, depth: int) -> list[_Level]:
        levels, top, at = [], 0, 0
        for b in _level_bits(depth):
            rows, fanout = 1 << top, 1 << b
            kids = slice(rows * fanout, 2 * rows * fanout)  # ids of the next stored depth
            levels.append(_Level(
                first=rows, shift=depth - top, fanout=fanout,
                sums=self._sum[rows : 2 * rows], mins=self._min[rows : 2 * rows],
                kid_sums=self._sum[kids].reshape(rows, fanout),
                kid_mins=self._min[kids].reshape(rows, fanout),
                prefix=self._prefix[at : at + rows * (fanout + 1)].reshape(rows, fanout + 1),
            ))
            top, at = top + b, at + rows * (fanout + 1)
        return levels

    # ----------------------------------------------------------------------------- queries

    def total(self) -> float:
        """Sum of all leaf masses."""
        return float(self._sum[1])

    def min_nonzero(self) -> float:
        """Smallest strictly positive leaf mass, ``+inf`` if every leaf is zero. O(1)."""
        return float(self._min[1])

    def get(self, indices: npt.ArrayLike) -> FloatArray:
        """Masses at leaf ``indices`` (same shape as ``indices``)."""
        idx = self._check_indices(indices)
        return self._leaf_sums[idx.ravel()].reshape(idx.shape)

    def find(self, targets: npt.ArrayLike) -> IntArray:
        """Leaf ``i`` with ``prefix(i) <= t < prefix(i) + mass(i)`` for each target ``t``.

        Targets must lie in ``[0, total()]``; values above ``total()`` by less than a relative
        1e-9 are rounding and are clamped. A zero-mass leaf is never returned: on each level the
        remainder is clamped below the node's mass, and the first child whose prefix-row entry
        exceeds it is one where the (non-decreasing) row steps up, i.e. a child of positive mass.
        """
        return self.find_checked(self._check_targets(targets))

    def find_checked(self, targets: FloatArray) -> IntArray:
        """`find` of float64 targets the caller knows lie in ``[0, total()]`` (no checks)."""
        out = np.zeros(targets.shape, dtype=np.int64)
        if self._levels:
            tree = self._arrays
            find = trees().tree_find  # plain arrays: numba types them in C
            find(tree.prefix, tree.offsets, tree.fanouts, targets.reshape(-1), out.reshape(-1))
        return out

    def stratified(self, u: FloatArray, beta: float) -> tuple[IntArray, npt.NDArray[np.float32]]:
        """One leaf per equal slice of the mass (``t_b = (b + u_b) * total / B``, ``u`` in
        [0, 1)) and its importance weight ``(mass / min_nonzero) ** -beta`` as float32."""
        if self.total() <= 0.0:
            raise ValueError("cannot draw from a sum tree whose total mass is 0")
        return self.stratified_checked(np.asarray(u, dtype=np.float64), float(beta))

    def stratified_checked(self, u: FloatArray,
                           beta: float) -> tuple[IntArray, npt.NDArray[np.float32]]:
        """`stratified` of float64 `u` and a float `beta` on a tree the caller knows has
        mass (no checks): one compiled call."""
        return _TREE_DRAW(self._arrays, u, beta)  # type: ignore[no-any-return]

    # ----------------------------------------------------------------------------- updates

    def set(self, indices: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Set leaf masses; ``values`` broadcast to ``indices``' shape. Last duplicate wins.

        Validation happens before any write, so a rejected call leaves the tree unchanged.
        """
        idx = self._check_indices(indices).ravel()
        vals = self._check_values(values, shape=np.shape(indices)).ravel()
        if idx.size == 0:
            return
        if idx.size >= self.capacity:  # every leaf (a store loading): one O(N) numpy rebuild
            if idx.size == self.capacity and _is_identity(idx):  # leaves in order: no scatter
                self.set_all(vals)
                return
            self._write_leaves(idx, vals)
            for level in reversed(self._levels):
                self._rebuild(level)
            return
        _TREE_SET(self._arrays, idx, np.ascontiguousarray(vals, dtype=np.float64))

    def set_all(self, values: npt.ArrayLike) -> None:
        """Replace every leaf (``len(values) == capacity``) and rebuild bottom-up in O(N)."""
        vals = self._check_values(values, shape=(self.capacity,))
        self._leaf_sums[: self.capacity] = vals
        self._leaf_mins[: self.capacity] = np.where(vals > 0.0, vals, np.inf)
        for level in reversed(self._levels):
            self._rebuild(level)

    def arrays(self) -> TreeArrays:
        """The node arrays, for a compiled caller that walks the tree (`find_checked` and
        `stratified_checked` in its own kernel) or writes leaves with ``tree_set`` (sorted,
        unique leaves; finite masses >= 0), which keeps every invariant of `check_valid`."""
        return self._arrays

    # ----------------------------------------------------------------------------- invariants

    def check_valid(self) -> None:
        """Raise ``RuntimeError`` if leaves or any internal node of either tree are inconsistent."""
        self._check_leaves()
        for level in reversed(self._levels):  # bottom-up: a corrupt node is named before its parent
            prefix = _prefix_rows(level.kid_sums)
            _check_equal(level.sums, prefix[:, -1], level.first,
                         "sum tree node {} holds {!r}, its children sum to {!r}")
            _check_equal(level.mins, _row_min(level.kid_mins), level.first,
                         "min tree node {} holds {!r}, the min of its children is {!r}")
            bad = np.flatnonzero(np.any(level.prefix != prefix, axis=1))
            if bad.size:
                raise RuntimeError(f"prefix row of sum tree node {level.first + int(bad[0])} "
                                   "disagrees with its children")

    def _check_leaves(self) -> None:
        n = self.capacity
        leaves = self._leaf_sums[:n]
        if not (np.all(np.isfinite(leaves)) and np.all(leaves >= 0.0)):
            raise RuntimeError("sum tree holds a negative or non-finite leaf mass")
        if np.any(self._leaf_sums[n:] != 0.0) or np.any(self._leaf_mins[n:] != np.inf):
            raise RuntimeError("sum tree padding leaves are not 0.0 / +inf")
        if not np.array_equal(self._leaf_mins[:n], np.where(leaves > 0.0, leaves, np.inf)):
            raise RuntimeError("min tree leaves disagree with sum tree leaves")

    # ----------------------------------------------------------------------------- internals

    def _write_leaves(self, idx: IntArray, vals: FloatArray) -> None:
        # Caller guarantees `idx` are leaf indices and `vals` are finite and >= 0.
        self._leaf_sums[idx] = vals
        got = self._leaf_sums[idx]
        if np.not_equal(got, vals).any():  # repeated leaves with different masses
            # numpy does not promise which repeated write lands; np.unique on the reversed batch
            # keeps the first hit there, i.e. the last one here.
            leaves, first = np.unique(idx[::-1], return_index=True)
            self._leaf_sums[leaves] = vals[::-1][first]
            got = self._leaf_sums[idx]
        self._leaf_mins[idx] = np.where(got > 0.0, got, np.inf)

    def _rebuild(self, level: _Level) -> None:
        # Internal nodes are always rebuilt from their children, never patched with deltas.
        level.sums[:] = _prefix_rows(level.kid_sums, out=level.prefix)[:, -1]
        level.mins[:] = _row_min(level.kid_mins)

    def _check_indices(self, indices: npt.ArrayLike) -> IntArray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"leaf indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        # One reduction: as unsigned, a negative index is huge.
        if idx.size and np.maximum.reduce(idx.view(np.uint64), axis=None) >= self.capacity:
            bad = (idx < 0) | (idx >= self.capacity)
            raise IndexError(
                f"leaf index {int(idx[bad].flat[0])} out of range [0, {self.capacity}) "
                f"({int(np.count_nonzero(bad))} bad of {idx.size})"
            )
        return idx

    def _check_values(self, values: npt.ArrayLike, *, shape: tuple[int, ...]) -> FloatArray:
        vals = np.asarray(values, dtype=np.float64)
        if vals.shape != shape:
            try:
                vals = np.broadcast_to(vals, shape)
            except ValueError:
                msg = f"masses of shape {vals.shape} do not fit indices of shape {shape}"
                raise ValueError(msg) from None
        if vals.size == 0 or (np.minimum.reduce(vals, axis=None) >= 0.0
                              and np.maximum.reduce(vals, axis=None) <= _FLOAT_MAX):
            return vals  # a NaN fails both comparisons
        bad = ~(np.isfinite(vals) & (vals >= 0.0))
        pos = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(
            f"masses must be finite and >= 0, got {float(vals.ravel()[pos])!r} at batch "
            f"position {pos} ({int(np.count_nonzero(bad))} bad of {vals.size})"
        )

    def _check_targets(self, targets: npt.ArrayLike) -> FloatArray:
        t = np.asarray(targets, dtype=np.float64)
        total = self.total()
        if total <= 0.0:
            raise ValueError("cannot find() in a sum tree whose total mass is 0")
        limit = total * (1.0 + _TARGET_RTOL)
        if t.size == 0 or (np.minimum.reduce(t, axis=None) >= 0.0
                           and np.maximum.reduce(t, axis=None) <= limit):
            return t  # a NaN fails both comparisons
        bad = ~(np.isfinite(t) & (t >= 0.0) & (t <= limit))
        raise ValueError(
            f"targets must lie in [0, total={total!r}], got {float(t[bad].flat[0])!r} "
            f"({int(np.count_nonzero(bad))} bad of {t.size})"
        )


def _check_equal(got: FloatArray, want: FloatArray, first: int, message: str) -> None:
    """Raise ``RuntimeError(message.format(node, held, want))`` at the first differing node."""
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise RuntimeError(message.format(first + i, float(got[i]), float(want[i])))


def _is_identity(idx: IntArray) -> bool:
    """Whether `idx` is ``0, 1, ..., len - 1``."""
    return bool(idx[0] == 0 and idx[-1] == idx.size - 1 and (np.diff(idx) == 1).all())

"""Float64 sum tree over a fixed number of leaf masses.

This module owns the data structure the samplers draw slot indices from: a mass per leaf, the
running total, inverse-CDF lookup (`find`) and the smallest positive mass (`min_nonzero`, used for
importance-weight normalisation). It knows nothing about frames, episodes or RNGs: callers pass
targets in, so all randomness stays with the store's generator.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

__all__ = ["SumTree"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Targets above total() by at most this relative amount are treated as rounding and clamped.
_TARGET_RTOL = 1e-9
# check_valid() tolerance on internal sums (they are recomputed from children, so 0 in practice).
_CHECK_RTOL = 1e-9


class SumTree:
    """Complete binary tree whose internal nodes hold the sum (and min) of their children.

    Leaves are padded to ``P``, the next power of two >= capacity. Node 1 is the root, node ``i``
    has children ``2i`` and ``2i+1``, leaf ``j`` lives at node ``P + j``. Example, capacity 3::

                        [1] 6.0                 <- root == total()
                      /         \\
               [2] 3.0           [3] 3.0
               /     \\          /      \\
          [4] 1.0  [5] 2.0  [6] 3.0  [7] 0.0    <- leaves 0..2, node 7 is padding
            j=0      j=1      j=2     (pad)

    Invariants (checked by ``check_valid``):
      * every leaf mass is finite and >= 0; padding leaves are 0.0;
      * ``_sum[i] == _sum[2i] + _sum[2i+1]`` for every internal node, computed from the children
        (never by adding deltas), so integer-valued masses give exact totals and nothing drifts;
      * ``_min`` mirrors the layout with ``+inf`` for zero-mass leaves and ``_min[i] ==
        min(_min[2i], _min[2i+1])``, so ``_min[1]`` is the smallest positive mass.
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
        self._depth = self._leaf0.bit_length() - 1  # edges from root to any leaf
        self._sum: FloatArray = np.zeros(2 * self._leaf0, dtype=np.float64)
        self._min: FloatArray = np.full(2 * self._leaf0, np.inf, dtype=np.float64)

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
        return self._sum[self._leaf0 + idx.ravel()].reshape(idx.shape)

    def find(self, targets: npt.ArrayLike) -> IntArray:
        """Leaf ``i`` with ``prefix(i) <= t < prefix(i) + mass(i)`` for each target ``t``.

        Targets must lie in ``[0, total()]``; values above ``total()`` by less than a relative
        1e-9 are rounding and are clamped. A zero-mass leaf is never returned: the walk only
        steps right into subtrees of positive mass, and stepping left from a positive node whose
        right child is 0 lands on a left child equal to the parent, hence positive.
        """
        t = self._check_targets(targets)
        nodes = np.ones(t.size, dtype=np.int64)
        rem = t.ravel().copy()
        for _ in range(self._depth):  # one vectorized step per level for the whole batch
            left = 2 * nodes
            left_mass = self._sum[left]
            go_right = (rem >= left_mass) & (self._sum[left + 1] > 0.0)
            rem = np.where(go_right, rem - left_mass, rem)  # rem >= 0 stays true on the right
            nodes = left + go_right
        return (nodes - self._leaf0).reshape(t.shape)

    # ----------------------------------------------------------------------------- updates

    def set(self, indices: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Set leaf masses; ``values`` broadcast to ``indices``' shape. Last duplicate wins.

        Validation happens before any write, so a rejected call leaves the tree unchanged.
        """
        idx = self._check_indices(indices).ravel()
        vals = self._check_values(values, shape=np.shape(indices)).ravel()
        if idx.size == 0:
            return
        # np.unique on the reversed batch keeps the first hit there, i.e. the last one here.
        leaves, first = np.unique(idx[::-1], return_index=True)
        nodes = self._leaf0 + leaves
        self._write_leaves(nodes, vals[::-1][first])
        for _ in range(self._depth):  # one vectorized step per level, each parent once
            nodes = np.unique(nodes >> 1)
            self._recompute(nodes)

    def set_all(self, values: npt.ArrayLike) -> None:
        """Replace every leaf (``len(values) == capacity``) and rebuild bottom-up in O(N)."""
        vals = self._check_values(values, shape=(self.capacity,))
        p = self._leaf0
        self._write_leaves(np.arange(p, p + self.capacity), vals)
        for level in reversed(range(self._depth)):
            lo, hi = 1 << level, 2 << level
            self._recompute(np.arange(lo, hi))

    # ----------------------------------------------------------------------------- invariants

    def check_valid(self) -> None:
        """Raise ``RuntimeError`` if leaves or any internal node of either tree are inconsistent."""
        self._check_leaves()
        p = self._leaf0
        want_sum = self._sum[2 : 2 * p : 2] + self._sum[3 : 2 * p : 2]  # for nodes 1..P-1
        bad = ~np.isclose(self._sum[1:p], want_sum, rtol=_CHECK_RTOL, atol=0.0)
        if np.any(bad):
            node = int(np.flatnonzero(bad)[0]) + 1
            raise RuntimeError(
                f"sum tree node {node} holds {float(self._sum[node])!r}, "
                f"its children sum to {float(want_sum[node - 1])!r}"
            )
        want_min = np.minimum(self._min[2 : 2 * p : 2], self._min[3 : 2 * p : 2])
        bad = self._min[1:p] != want_min
        if np.any(bad):
            node = int(np.flatnonzero(bad)[0]) + 1
            raise RuntimeError(
                f"min tree node {node} holds {float(self._min[node])!r}, "
                f"the min of its children is {float(want_min[node - 1])!r}"
            )

    def _check_leaves(self) -> None:
        p, n = self._leaf0, self.capacity
        leaves = self._sum[p : p + n]
        if not (np.all(np.isfinite(leaves)) and np.all(leaves >= 0.0)):
            raise RuntimeError("sum tree holds a negative or non-finite leaf mass")
        if np.any(self._sum[p + n :] != 0.0) or np.any(self._min[p + n :] != np.inf):
            raise RuntimeError("sum tree padding leaves are not 0.0 / +inf")
        if not np.array_equal(self._min[p : p + n], np.where(leaves > 0.0, leaves, np.inf)):
            raise RuntimeError("min tree leaves disagree with sum tree leaves")

    # ----------------------------------------------------------------------------- internals

    def _write_leaves(self, nodes: IntArray, vals: FloatArray) -> None:
        # Caller guarantees `nodes` are unique leaf node ids and `vals` are finite and >= 0.
        self._sum[nodes] = vals
        self._min[nodes] = np.where(vals > 0.0, vals, np.inf)

    def _recompute(self, nodes: IntArray) -> None:
        # Internal nodes are always rebuilt from their children, never patched with deltas.
        self._sum[nodes] = self._sum[2 * nodes] + self._sum[2 * nodes + 1]
        self._min[nodes] = np.minimum(self._min[2 * nodes], self._min[2 * nodes + 1])

    def _check_indices(self, indices: npt.ArrayLike) -> IntArray:
        idx = np.asarray(indices)
        if idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"leaf indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        bad = (idx < 0) | (idx >= self.capacity)
        if np.any(bad):
            raise IndexError(
                f"leaf index {int(idx[bad].flat[0])} out of range [0, {self.capacity}) "
                f"({int(np.count_nonzero(bad))} bad of {idx.size})"
            )
        return idx

    def _check_values(self, values: npt.ArrayLike, *, shape: tuple[int, ...]) -> FloatArray:
        vals = np.asarray(values, dtype=np.float64)
        try:
            vals = np.broadcast_to(vals, shape)
        except ValueError:
            msg = f"masses of shape {vals.shape} do not fit indices of shape {shape}"
            raise ValueError(msg) from None
        bad = ~(np.isfinite(vals) & (vals >= 0.0))
        if np.any(bad):
            pos = int(np.flatnonzero(bad.ravel())[0])
            raise ValueError(
                f"masses must be finite and >= 0, got {float(vals.ravel()[pos])!r} at batch "
                f"position {pos} ({int(np.count_nonzero(bad))} bad of {vals.size})"
            )
        return vals

    def _check_targets(self, targets: npt.ArrayLike) -> FloatArray:
        t = np.asarray(targets, dtype=np.float64)
        total = self.total()
        if total <= 0.0:
            raise ValueError("cannot find() in a sum tree whose total mass is 0")
        bad = ~(np.isfinite(t) & (t >= 0.0) & (t <= total * (1.0 + _TARGET_RTOL)))
        if np.any(bad):
            raise ValueError(
                f"targets must lie in [0, total={total!r}], got {float(t[bad].flat[0])!r} "
                f"({int(np.count_nonzero(bad))} bad of {t.size})"
            )
        return t

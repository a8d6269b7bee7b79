"""What both priority samplers share: a table of raw priorities, a sum tree of masses and
the stratified draw from it (`TreePrioritySampler`)."""

from __future__ import annotations

import math

import numpy as np

from mmreplay import validate
from mmreplay.errors import EmptyStoreError, InvalidInputError, InvalidStoreError
from mmreplay.index.samplers.protocol import (
    BoolArray,
    Draw,
    FloatArray,
    IntArray,
    array_nbytes,
)
from mmreplay.index.sum_tree import SumTree
from mmreplay.kernels.structs import TreeDraw


class PriorityTable:
    """Raw priority, transition id and validity per slot; the part both priority samplers share.

    Invariants (``check_valid``):
      * ``p`` is finite, ``0 <= p[s] <= max_p``;
      * ``max_p`` is the largest of 1.0 and every priority ever set, never lowered, so a new
        transition (``p[s] = max_p`` when its id first appears in slot ``s``) is at least as
        likely as any transition seen before it;
      * ``count == valid.sum()`` and every valid slot holds an id >= 0.
    """

    def __init__(self, num_slots: int) -> None:
        self.p: FloatArray = np.zeros(num_slots, np.float64)
        self.ids: IntArray = np.full(num_slots, -1, np.int64)
        self.valid: BoolArray = np.zeros(num_slots, np.bool_)
        self.count = 0
        self.max_p = 1.0

    def admit(self, slots: IntArray, valid: BoolArray, ids: IntArray) -> BoolArray:
        """Record an `update`; return the mask of `slots` whose mass must change rank or value.

        A slot whose id changed holds a new transition and gets ``max_p`` (valid or not, so a
        transition that becomes valid later keeps the priority it got when it appeared).
        """
        new = ids != self.ids[slots]
        self.p[slots[new]] = self.max_p
        self.ids[slots] = ids
        was_valid = self.valid[slots]
        self.count += int(np.count_nonzero(valid)) - int(np.count_nonzero(was_valid))
        self.valid[slots] = valid
        return (valid != was_valid) | (new & valid)

    def set(self, slots: IntArray, priorities: FloatArray) -> None:
        self.p[slots] = priorities
        if priorities.size:
            self.max_p = max(self.max_p, float(priorities.max()))

    def load(self, priorities: FloatArray, slot_ids: IntArray, max_p: float,
             valid: BoolArray) -> None:
        self.p, self.ids, self.valid = priorities.copy(), slot_ids.copy(), valid.copy()
        self.max_p = max_p
        self.count = int(np.count_nonzero(valid))

    def check_valid(self) -> None:
        if not (np.all(np.isfinite(self.p)) and np.all(self.p >= 0.0)):
            raise RuntimeError("priority table holds a negative or non-finite priority")
        if not (self.max_p >= 1.0 and np.all(self.p <= self.max_p)):
            raise RuntimeError(f"max priority {self.max_p!r} is below 1.0 or a held priority")
        if self.count != int(np.count_nonzero(self.valid)):
            raise RuntimeError(f"valid count {self.count} != {np.count_nonzero(self.valid)}")
        if np.any(self.ids[self.valid] < 0):
            raise RuntimeError("a valid slot holds no transition id")


def as_priorities(priorities: np.ndarray, n: int, *, check: bool = True) -> FloatArray:
    """`n` priorities as a contiguous, writable float64 array; with `check`, each finite
    and >= 0 (else `InvalidInputError`)."""
    p = np.asarray(priorities)
    if not (p.dtype == np.float64 and p.flags.c_contiguous and p.flags.writeable):
        p = np.array(p, dtype=np.float64)
    if p.shape != (n,):
        raise InvalidInputError(f"priorities shape {p.shape} != slots shape ({n},)")
    return validate.priority_values(p) if check else p


def as_slots(slots: np.ndarray) -> IntArray:
    """Flat slots as a contiguous, writable int64 array (`TypeError` if not integers)."""
    idx = np.asarray(slots)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"slots must be integers, got dtype {idx.dtype}")
    if not (idx.dtype == np.int64 and idx.flags.c_contiguous and idx.flags.writeable):
        idx = np.array(idx, dtype=np.int64)
    return idx.reshape(-1)


def checked_state(
    num_slots: int, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
    valid: np.ndarray,
) -> tuple[FloatArray, IntArray, BoolArray]:
    """Persisted sampler arrays as the right dtypes, or `InvalidStoreError` saying what is off."""
    p = np.asarray(priorities, dtype=np.float64)
    ids = np.asarray(slot_ids)
    ok = np.asarray(valid)
    want = (num_slots,)
    if p.shape != want or ids.shape != want or ok.shape != want:
        raise InvalidStoreError(
            f"sampler arrays of shapes {p.shape}, {ids.shape}, {ok.shape} != {want}")
    if not (np.issubdtype(ids.dtype, np.integer) and ok.dtype == np.bool_):
        raise InvalidStoreError(f"slot ids dtype {ids.dtype} / valid dtype {ok.dtype} != int/bool")
    if not (np.all(np.isfinite(p)) and np.all(p >= 0.0)):
        raise InvalidStoreError("persisted priorities must be finite and >= 0")
    top = float(p.max(initial=0.0))
    if not (math.isfinite(max_priority) and max_priority >= max(1.0, top)):
        raise InvalidStoreError(f"max priority {max_priority!r} < max(1.0, largest held {top!r})")
    if np.any(ids[ok] < 0):
        raise InvalidStoreError("a valid slot has no persisted transition id (-1)")
    return p, ids.astype(np.int64), ok


class TreePrioritySampler:
    """The part both priority samplers share: raw priorities, transition ids and validity per
    slot (`PriorityTable`), a `SumTree` of their masses (each subclass says which), and the
    stratified draw from it.

    One target per equal slice of the mass: ``t_b = (b + u_b) * total / B``, ``u_b ~ U[0,1)``.
    ``P(i) = m_i / total``, so ``(N P(i))^-beta / max_j (N P(j))^-beta == (m_i / m_min)^-beta``:
    N and the total cancel, and the largest weight (1.0) belongs to the smallest positive mass.
    """

    def __init__(self, num_slots: int, *, alpha: float, eps: float) -> None:
        self.alpha = float(alpha)
        self.eps = float(eps)
        self._table = PriorityTable(num_slots)
        self._tree = SumTree(num_slots)

    def count(self) -> int:
        return self._table.count

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float) -> Draw:
        self._refuse_massless()
        return Draw(*self._tree.stratified_checked(rng.random(batch_size), float(beta)))

    def tree_draw(self, rng: np.random.Generator, batch_size: int, beta: float) -> TreeDraw:
        """`sample` left for a compiled call (`TreeDraw`): the same uniforms."""
        self._refuse_massless()
        return TreeDraw(rng.random(batch_size), True, float(beta), self._tree.arrays())

    def _refuse_massless(self) -> None:
        if self._tree.total() <= 0.0:
            raise EmptyStoreError("cannot sample: every sampleable slot has zero priority mass")

    def slot_ids(self) -> np.ndarray:
        return self._table.ids.copy()

    def max_priority(self) -> float:
        return self._table.max_p

    def probabilities(self) -> np.ndarray:
        """Exact ``P(slot)`` of the next draw for every slot, float64 (O(num_slots); for
        diagnostics and tests)."""
        masses = self._tree.get(np.arange(self._tree.capacity))
        total = self._tree.total()
        return masses / total if total > 0.0 else masses

    def _checked(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
                 valid: np.ndarray) -> tuple[FloatArray, IntArray, BoolArray]:
        """`load`'s arrays, checked (`checked_state`)."""
        return checked_state(self._tree.capacity, priorities, slot_ids, max_priority, valid)

    def nbytes(self) -> int:
        return array_nbytes(self)

    def check_valid(self) -> None:
        self._table.check_valid()
        self._tree.check_valid()

"""`PrioritizedSampler`: proportional priorities, updated in one compiled call."""

from __future__ import annotations

import math

import numpy as np

from mmreplay import validate
from mmreplay.errors import InvalidInputError
from mmreplay.index.samplers.priority import TreePrioritySampler, as_priorities, as_slots
from mmreplay.index.samplers.protocol import Applied, BoolArray, FloatArray, IntArray, SlotMarks
from mmreplay.kernels import lazy_entry
from mmreplay.kernels import priorities as priority_kernels
from mmreplay.kernels.structs import IdMap, Priorities, Written

_NO_SLOTS = np.empty(0, np.int64)
_NO_MASSES = np.empty(0, np.float64)
_NO_MARKS = SlotMarks(np.empty(0, np.bool_), 1, 1)
# the compiled kernels called here, each found without a look-up (`kernels.lazy_entry`)
_APPLY_SLOTS = lazy_entry(priority_kernels, "apply_slot_priorities", check=(0, 1))
_APPLY_IDS = lazy_entry(priority_kernels, "apply_priorities", check=(0, 1))


class PrioritizedSampler(TreePrioritySampler):
    """Proportional prioritization (Schaul et al. 2016): ``P(i) ∝ (p_i + eps)^alpha``.

    Only valid slots carry mass; an invalid slot keeps its priority and id for when it becomes
    valid. Invariant: tree leaf ``s == (p[s] + eps)^alpha`` if ``valid[s]`` else 0.0, exactly (both
    sides are the same float expression). With ``eps == 0`` a zero priority gives a valid slot no
    mass: `count` still counts it, it is never drawn, and a sampler whose valid slots all have
    zero mass raises `EmptyStoreError` from `sample`.

    The tree is a function of its leaves only (`SumTree` rebuilds internal nodes from children),
    so `load` rebuilds exactly the tree that was saved and draws continue identically.
    """

    def __init__(self, num_slots: int, *, alpha: float, eps: float) -> None:
        super().__init__(num_slots, alpha=alpha, eps=eps)
        self._arrays = self._tree.arrays()  # node arrays are written in place, never moved
        # below this a priority's mass cannot overflow (checked without np.errstate's cost)
        # ((1e300 ** (1 / alpha)) ** alpha = 1e300; alpha <= 300 / 307 < 1 never enlarges)
        self._safe_p = 10.0 ** (300.0 / self.alpha) if 300.0 / 307.0 < self.alpha else math.inf
        self._top = np.zeros(1)  # the largest value a compiled update wrote
        self._kernel_masses: bool | None = None  # do the updates compute masses? (first use)
        self._dests: dict[int, Priorities] = {}  # `_dest` by id of its marks

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        self._table.admit(slots, valid, ids)
        self._tree.set(slots, self._masses(self._table.p[slots], valid))

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New raw priorities of flat `slots` in one compiled call (the last value of a slot
        given twice wins; a slot not sampleable keeps it for later). Bad values raise and
        change nothing."""
        idx = as_slots(slots)
        p = as_priorities(priorities, idx.size, check=False)  # the kernel checks the values
        out = self._written(idx.size)  # the arrays the rest holds: made here
        count = _APPLY_SLOTS(idx, p, self._update_masses(p), self._table.valid,
                             self._dest(_NO_MARKS), out)
        self._check_status(count, idx, p)
        self._raise_max(self._top[0])

    def set_id_priorities(self, ids: IntArray, priorities: FloatArray, where: IdMap,
                          pre: IntArray | None = None,
                          marks: SlotMarks | None = None) -> Applied | None:
        """New raw priorities of transition `ids` found sampleable through `where`, in one
        compiled call (the last value of a slot wins; other ids are ignored), marking the
        slots written in `marks`. Returns None, changing nothing, when `where` spills and an
        id needs `pre`: its flat slots (-1 unknown) from `StepRing.spilled`. Bad values
        (NaN, inf, negative) raise and change nothing."""
        kernels = priority_kernels()
        out = self._written(ids.size)
        count = _APPLY_IDS(  # the arrays the rest holds: made here
            ids, priorities, self._update_masses(priorities), _NO_SLOTS if pre is None else pre,
            where, self._dest(_NO_MARKS if marks is None else marks), out)
        if count < 0:
            if count == kernels.MISSED:
                return None
            self._check_status(count, ids, priorities)
        self._raise_max(self._top[0])
        return Applied(out.slots[:count], out.values[:count])

    def _dest(self, marks: SlotMarks) -> Priorities:
        """What a compiled update writes: the priorities, the tree and `marks` (kept for the
        next update with the same marks while the priority array stays the same)."""
        dest = self._dests.get(id(marks))
        if dest is None or dest.p is not self._table.p or dest.marks is not marks.mask \
                or (dest.period, dest.group) != (marks.period, marks.group):
            if len(self._dests) > 8:
                self._dests.clear()
            dest = self._dests[id(marks)] = Priorities(
                self.eps, self.alpha, self._table.p, self._arrays, marks.mask, marks.period,
                marks.group)
        return dest

    def _written(self, size: int) -> Written:
        """Room for what a compiled update of `size` entries reports."""
        return Written(np.empty(size, np.int64), np.empty(size, np.float64), self._top)

    def _raise_max(self, top: float) -> None:
        """`max_priority` becomes `top` (the largest value a compiled update wrote) if larger."""
        if top > self._table.max_p:
            self._table.max_p = float(top)

    def _update_masses(self, values: FloatArray) -> FloatArray:
        """The masses a compiled update takes: none where it computes numpy's own
        (`priority_kernels.same_pow`, probed once), else `_value_masses`."""
        if self._kernel_masses is None:
            self._kernel_masses = priority_kernels().same_pow(self.eps, self.alpha)
        return _NO_MASSES if self._kernel_masses else self._value_masses(values)

    def _value_masses(self, values: FloatArray) -> FloatArray:
        """``(values + eps) ** alpha`` (`_masses`' expression) without np.errstate's cost
        where no value can overflow or be negative; the kernels reject what can."""
        if not priority_kernels().plain_values(values, self._safe_p):  # one compiled pass
            return (values + self.eps) ** self.alpha
        with np.errstate(over="ignore", invalid="ignore"):
            return (values + self.eps) ** self.alpha

    def _check_status(self, count: int, slots: IntArray, values: FloatArray) -> None:
        """Raise the error a rejected compiled update stands for (nothing was written)."""
        if count >= 0:
            return
        kernels = priority_kernels()
        if count == kernels.BAD_SLOT:
            bad = slots[(slots < 0) | (slots >= self._tree.capacity)]
            raise IndexError(f"slot {int(bad[0])} out of range [0, {self._tree.capacity}) "
                             f"({bad.size} bad of {slots.size})")
        if count == kernels.BAD_VALUE:
            validate.priority_values(values)  # raises, saying what arrived
        raise InvalidInputError(f"priority {float(values.max())!r} overflows "
                                f"(p + eps)^alpha with alpha={self.alpha}")

    def priorities(self) -> np.ndarray:
        return self._table.p.copy()

    def priorities_at(self, slots: np.ndarray) -> np.ndarray:
        """Raw priorities of some slots (valid or not)."""
        return self._table.p[slots]

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        p, ids, ok = self._checked(priorities, slot_ids, max_priority, valid)
        self._tree.set_all(self._masses(p, ok))
        self._table.load(p, ids, float(max_priority), ok)

    def check_valid(self) -> None:
        super().check_valid()
        want = self._masses(self._table.p, self._table.valid)
        if not np.array_equal(self._tree.get(np.arange(self._tree.capacity)), want):
            raise RuntimeError("sum tree masses != (priority + eps)^alpha of valid slots")

    def _masses(self, p: FloatArray, valid: BoolArray) -> FloatArray:
        with np.errstate(over="ignore"):  # an overflow to inf is rejected by the caller
            return np.where(valid, (p + self.eps) ** self.alpha, 0.0)

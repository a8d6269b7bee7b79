"""Sampling distributions over flat slots; the store calls only this interface.

A sampler is told which flat slots are sampleable (``update``) and draws
``(slots, weights)`` with a `np.random.Generator` the store owns and passes in.
It knows no frames, files or torch.

Three distributions: `UniformSampler`; `PrioritizedSampler` (proportional,
``P(i) ∝ (p_i + eps)^alpha``) and `RankSampler` (``P(i) ∝ rank_i^-alpha``), both
stratified over a `SumTree` of masses and both `PrioritySampler`s.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from mmreplay import validate
from mmreplay.errors import EmptyStoreError, InvalidInputError, InvalidStoreError
from mmreplay.index.sum_tree import SumTree
from mmreplay.kernels import priorities as priority_kernels
from mmreplay.kernels import samples as sample_kernels
from mmreplay.kernels.structs import IdMap, Priorities, TreeDraw, Written
from mmreplay.spec import StoreSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Draw(NamedTuple):
    """Flat slots drawn and their importance weights (ones when uniform). A named tuple:
    made on every draw, it costs a third of a frozen dataclass."""

    slots: np.ndarray
    weights: np.ndarray


class Applied(NamedTuple):
    """Slots whose priorities an update set (increasing, unique) and the values set."""

    slots: np.ndarray
    priorities: np.ndarray


@dataclass(frozen=True)
class SlotMarks:
    """Where a compiled update marks the slots it writes: ``mask[slot % period // group]``."""

    mask: BoolArray
    period: int
    group: int


_NO_SLOTS = np.empty(0, np.int64)
_NO_MASSES = np.empty(0, np.float64)
_NO_MARKS = SlotMarks(np.empty(0, np.bool_), 1, 1)


class Sampler(Protocol):
    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        """Mark `slots` sampleable where `valid` is True, else give them no mass.

        `ids` are the transition ids now in those slots: a slot whose id changed
        holds a new transition (prioritized samplers give it the max priority).
        """

    def count(self) -> int:
        """Number of sampleable slots."""

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float) -> Draw:
        """Draw `batch_size` slots with replacement (the store checks count > 0 first)."""

    def tree_draw(self, rng: np.random.Generator, batch_size: int, beta: float) -> TreeDraw:
        """`sample`'s draw, left for a compiled call to finish: takes what `sample` takes
        from `rng`, so either gives the same slots."""

    def check_valid(self) -> None:
        """Raise `RuntimeError` if internal state is inconsistent."""

    def nbytes(self) -> int:
        """Bytes of the arrays the sampler holds in RAM."""


class UniformSampler:
    """Uniform over sampleable slots via a 0/1 sum tree.

    A draw picks ``k ~ U{0..count-1}`` and returns the k-th sampleable slot in
    slot order, so the result depends only on the set of sampleable slots and
    the RNG state, not on the history that produced that set (exact resume).
    """

    def __init__(self, num_slots: int) -> None:
        self._tree = SumTree(num_slots)
        self._source: tuple[np.random.BitGenerator, int, int] | None = None  # `_bit_source`

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        self._tree.set(slots, valid.astype(np.float64))

    def count(self) -> int:
        return int(round(self._tree.total()))

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float = 0.0) -> Draw:
        # ``rng.integers``' draws (compiled in `_targets`) keep those of a seed (and of a saved
        # RNG state) the same across versions: the golden stores pin them
        # (tests/test_format.py), so a run resumed by a newer version draws what the old would.
        targets = self._targets(rng, batch_size)
        slots = self._tree.find_checked(targets)  # k + 0.5 < count == total
        return Draw(slots=slots, weights=np.ones(batch_size, np.float32))

    def tree_draw(self, rng: np.random.Generator, batch_size: int,
                  beta: float = 0.0) -> TreeDraw:
        return TreeDraw(self._targets(rng, batch_size), False, 0.0, self._tree.arrays())

    def _targets(self, rng: np.random.Generator, batch_size: int) -> FloatArray:
        """``rng.integers(0, count, batch_size) + 0.5``: the same values and the same
        generator state afterwards, drawn in one compiled call where numpy's draw takes
        32-bit words (2 <= count < 2**32; ~0.7 against ~7 µs for 32)."""
        count = self.count()
        source = self._source
        if source is None or source[0] is not rng.bit_generator:
            source = self._source = _bit_source(rng.bit_generator)
        if not 2 <= count < 1 << 32 or source[1] == 0:
            return rng.integers(0, count, size=batch_size) + 0.5
        out = np.empty(batch_size, np.float64)
        with source[0].lock:  # as numpy holds it while it draws
            sample_kernels().uniform_targets(source[1], source[2], count, out)
        return out

    def check_valid(self) -> None:
        self._tree.check_valid()

    def nbytes(self) -> int:
        return array_nbytes(self)


class PrioritySampler(Sampler, Protocol):
    """A `Sampler` with per-transition priorities: what the store calls beyond `Sampler`."""

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New raw priorities of `slots`; bad values raise and change nothing. Unique slots
        (`PrioritizedSampler` also takes repeats: the last value of a slot wins)."""

    def priorities(self) -> np.ndarray:
        """Raw priority per slot, float64 ``(num_slots,)``, for persistence."""

    def slot_ids(self) -> np.ndarray:
        """Transition id each slot's priority belongs to, int64 ``(num_slots,)``."""

    def max_priority(self) -> float:
        """Priority a new transition enters with."""

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        """Rebuild from persisted arrays; later draws match the sampler that was saved."""



class _PriorityTable:
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


def _as_priorities(priorities: np.ndarray, n: int, *, check: bool = True) -> FloatArray:
    """`n` priorities as a contiguous, writable float64 array; with `check`, each finite
    and >= 0 (else `InvalidInputError`)."""
    p = np.asarray(priorities)
    if not (p.dtype == np.float64 and p.flags.c_contiguous and p.flags.writeable):
        p = np.array(p, dtype=np.float64)
    if p.shape != (n,):
        raise InvalidInputError(f"priorities shape {p.shape} != slots shape ({n},)")
    return validate.priority_values(p) if check else p


def _as_slots(slots: np.ndarray) -> IntArray:
    """Flat slots as a contiguous, writable int64 array (`TypeError` if not integers)."""
    idx = np.asarray(slots)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"slots must be integers, got dtype {idx.dtype}")
    if not (idx.dtype == np.int64 and idx.flags.c_contiguous and idx.flags.writeable):
        idx = np.array(idx, dtype=np.int64)
    return idx.reshape(-1)


def _bit_source(bits: np.random.BitGenerator) -> tuple[np.random.BitGenerator, int, int]:
    """``(bits, next_uint32 address, state address)`` of a numpy bit generator, for
    `sample_kernels.uniform_targets`; addresses 0 if it exposes none (numpy then draws)."""
    try:
        iface = bits.ctypes
        return bits, int(ctypes.cast(iface.next_uint32, ctypes.c_void_p).value or 0), int(
            iface.state_address)
    except (AttributeError, TypeError, ctypes.ArgumentError):
        return bits, 0, 0


def _checked_state(
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


def _stratified_draw(tree: SumTree, rng: np.random.Generator, batch_size: int,
                     beta: float) -> Draw:
    """One target per equal slice of the mass: ``t_b = (b + u_b) * total / B``, ``u_b ~ U[0,1)``.

    ``P(i) = m_i / total``, so ``(N P(i))^-beta / max_j (N P(j))^-beta == (m_i / m_min)^-beta``:
    N and the total cancel, and the largest weight (1.0) belongs to the smallest positive mass.
    """
    _refuse_massless(tree)
    return Draw(*tree.stratified_checked(rng.random(batch_size), float(beta)))


def _stratified_plan(tree: SumTree, rng: np.random.Generator, batch_size: int,
                     beta: float) -> TreeDraw:
    """`_stratified_draw` left for a compiled call (`TreeDraw`): the same uniforms."""
    _refuse_massless(tree)
    return TreeDraw(rng.random(batch_size), True, float(beta), tree.arrays())


def _refuse_massless(tree: SumTree) -> None:
    if tree.total() <= 0.0:
        raise EmptyStoreError("cannot sample: every sampleable slot has zero priority mass")


def _tree_probabilities(tree: SumTree) -> FloatArray:
    masses = tree.get(np.arange(tree.capacity))
    total = tree.total()
    return masses / total if total > 0.0 else masses


class PrioritizedSampler:
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
        self.alpha = float(alpha)
        self.eps = float(eps)
        self._table = _PriorityTable(num_slots)
        self._tree = SumTree(num_slots)
        self._arrays = self._tree.arrays()  # node arrays are written in place, never moved
        # below this a priority's mass cannot overflow (checked without np.errstate's cost)
        # ((1e300 ** (1 / alpha)) ** alpha = 1e300; alpha <= 300 / 307 < 1 never enlarges)
        self._safe_p = 10.0 ** (300.0 / self.alpha) if 300.0 / 307.0 < self.alpha else math.inf
        self._top = np.zeros(1)  # the largest value a compiled update wrote
        self._kernel_masses: bool | None = None  # do the updates compute masses? (first use)

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        self._table.admit(slots, valid, ids)
        self._tree.set(slots, self._masses(self._table.p[slots], valid))

    def count(self) -> int:
        return self._table.count

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float) -> Draw:
        return _stratified_draw(self._tree, rng, batch_size, beta)

    def tree_draw(self, rng: np.random.Generator, batch_size: int, beta: float) -> TreeDraw:
        return _stratified_plan(self._tree, rng, batch_size, beta)

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New raw priorities of flat `slots` in one compiled call (the last value of a slot
        given twice wins; a slot not sampleable keeps it for later). Bad values raise and
        change nothing."""
        idx = _as_slots(slots)
        p = _as_priorities(priorities, idx.size, check=False)  # the kernel checks the values
        kernels = priority_kernels()
        out = self._written(idx.size)
        count = kernels.apply_slot_priorities(idx, p, self._update_masses(p), self._table.valid,
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
        count = kernels.apply_priorities(
            ids, priorities, self._update_masses(priorities), _NO_SLOTS if pre is None else pre,
            where, self._dest(_NO_MARKS if marks is None else marks), out)
        if count < 0:
            if count == kernels.MISSED:
                return None
            self._check_status(count, ids, priorities)
        self._raise_max(self._top[0])
        return Applied(out.slots[:count], out.values[:count])

    def _dest(self, marks: SlotMarks) -> Priorities:
        """What a compiled update writes: the priorities, the tree and `marks`."""
        return Priorities(self.eps, self.alpha, self._table.p, self._arrays, marks.mask,
                          marks.period, marks.group)

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

    def slot_ids(self) -> np.ndarray:
        return self._table.ids.copy()

    def max_priority(self) -> float:
        return self._table.max_p

    def probabilities(self) -> np.ndarray:
        """Exact ``P(slot)`` for every slot, float64 (diagnostics and tests; O(num_slots))."""
        return _tree_probabilities(self._tree)

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        p, ids, ok = _checked_state(self._tree.capacity, priorities, slot_ids, max_priority, valid)
        self._tree.set_all(self._masses(p, ok))
        self._table.load(p, ids, float(max_priority), ok)

    def nbytes(self) -> int:
        return array_nbytes(self)

    def check_valid(self) -> None:
        self._table.check_valid()
        self._tree.check_valid()
        want = self._masses(self._table.p, self._table.valid)
        if not np.array_equal(self._tree.get(np.arange(self._tree.capacity)), want):
            raise RuntimeError("sum tree masses != (priority + eps)^alpha of valid slots")

    def _masses(self, p: FloatArray, valid: BoolArray) -> FloatArray:
        with np.errstate(over="ignore"):  # an overflow to inf is rejected by the caller
            return np.where(valid, (p + self.eps) ** self.alpha, 0.0)


class RankSampler:
    """Rank-based prioritization (Schaul et al. 2016): ``P(i) ∝ (1 / rank_i)^alpha``.

    ``rank 1`` is the largest priority among valid slots; ties go to the smaller slot. ``eps``
    is accepted for a uniform constructor and ignored: adding it does not change the order.

    Ranks are re-sorted lazily. A full sort (``argsort``, O(N log N)) records a *snapshot*: the
    sorted keys ``(-p, slot)`` of the valid slots. A slot whose priority or validity changes
    afterwards is *dirty*; it gets rank ``1 + #{other snapshot keys < its key}`` at once
    (``searchsorted``, O(log N)) and invalid slots get no mass at once; clean slots keep their
    snapshot rank. Each dirty slot moves any other slot's true rank by at most one, so::

        |rank used - exact rank| <= D   for every valid slot, where
        D = number of distinct dirty slots  <=  floor(stale_fraction * count())

    because any `update` or `set_priorities` that makes ``D`` exceed that limit re-sorts before
    returning (``D = 0`` after). ``stale_fraction=0`` keeps ranks exact. Ranks used by dirty slots
    may repeat; the draw is exactly ``P(i) = rank_used_i^-alpha / sum``, and the weights correct
    for that distribution. ``check_valid`` verifies the bound against a fresh sort.

    `priorities()` re-sorts first if anything is dirty, so a saved checkpoint is a re-sort point
    and `load` (which always re-sorts) continues with identical draws.
    """

    def __init__(self, num_slots: int, *, alpha: float, eps: float,
                 stale_fraction: float = 0.01) -> None:
        if not 0.0 <= stale_fraction <= 1.0:
            raise ValueError(f"stale_fraction must lie in [0, 1], got {stale_fraction!r}")
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.stale_fraction = float(stale_fraction)
        self._table = _PriorityTable(num_slots)
        self._tree = SumTree(num_slots)
        self._rank: IntArray = np.zeros(num_slots, np.int64)  # rank used now, 0 = no mass
        self._snap_rank: IntArray = np.zeros(num_slots, np.int64)  # rank at the last sort
        self._snap_keys = np.zeros(0, np.complex128)  # sorted (-p, slot) at the last sort
        self._dirty: BoolArray = np.zeros(num_slots, np.bool_)
        self._num_dirty = 0

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        moved = self._table.admit(slots, valid, ids)
        self._touch(slots[moved])

    def count(self) -> int:
        return self._table.count

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float) -> Draw:
        return _stratified_draw(self._tree, rng, batch_size, beta)

    def tree_draw(self, rng: np.random.Generator, batch_size: int, beta: float) -> TreeDraw:
        return _stratified_plan(self._tree, rng, batch_size, beta)

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._table.set(slots, _as_priorities(priorities, len(slots)))
        self._touch(slots)

    def priorities(self) -> np.ndarray:
        if self._num_dirty:
            self._resort()  # checkpoint == re-sort point, so `load` continues identically
        return self._table.p.copy()

    def slot_ids(self) -> np.ndarray:
        return self._table.ids.copy()

    def max_priority(self) -> float:
        return self._table.max_p

    def ranks(self) -> np.ndarray:
        """Rank each slot is drawn with now (0 = not sampleable), int64 (diagnostics, tests)."""
        return self._rank.copy()

    def probabilities(self) -> np.ndarray:
        """Exact ``P(slot)`` of the next draw for every slot, float64 (O(num_slots))."""
        return _tree_probabilities(self._tree)

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        p, ids, ok = _checked_state(self._tree.capacity, priorities, slot_ids, max_priority, valid)
        self._table.load(p, ids, float(max_priority), ok)
        self._resort()

    def nbytes(self) -> int:
        return array_nbytes(self)

    def check_valid(self) -> None:
        self._table.check_valid()
        self._tree.check_valid()
        if not np.array_equal(self._rank > 0, self._table.valid):
            raise RuntimeError("rank sampler: ranked slots differ from valid slots")
        if not np.array_equal(self._tree.get(np.arange(self._tree.capacity)),
                              self._rank_masses(self._rank)):
            raise RuntimeError("rank sampler: tree masses disagree with rank^-alpha")
        self._check_staleness()

    def _check_staleness(self) -> None:
        if self._num_dirty != int(np.count_nonzero(self._dirty)):
            raise RuntimeError(f"dirty count {self._num_dirty} != {np.count_nonzero(self._dirty)}")
        if self._num_dirty > self._stale_limit():
            raise RuntimeError(f"{self._num_dirty} dirty slots > limit {self._stale_limit()}")
        _, exact = _exact_ranks(self._table.p, self._table.valid)
        off = int(np.abs(self._rank - exact).max(initial=0))
        if off > self._num_dirty:
            raise RuntimeError(f"a rank is {off} off exact with only {self._num_dirty} dirty")

    def _stale_limit(self) -> int:
        return int(self.stale_fraction * self._table.count)

    def _touch(self, slots: IntArray) -> None:
        """Slots whose priority or validity changed: estimate their ranks or re-sort everything."""
        self._num_dirty += int(np.count_nonzero(~self._dirty[slots]))
        self._dirty[slots] = True
        if self._num_dirty > self._stale_limit():
            self._resort()
            return
        ranks = np.where(self._table.valid[slots], self._estimate(slots), 0)
        self._rank[slots] = ranks
        self._tree.set(slots, self._rank_masses(ranks))

    def _estimate(self, slots: IntArray) -> IntArray:
        """``1 + #{snapshot keys of other slots < key(slot)}`` for each slot."""
        less = np.searchsorted(self._snap_keys, _rank_keys(self._table.p[slots], slots))
        own = self._snap_rank[slots]  # the slot's own snapshot key is at position own - 1
        less -= (own >= 1) & (own <= less)
        return less + 1

    def _resort(self) -> None:
        order, self._rank = _exact_ranks(self._table.p, self._table.valid)
        self._snap_rank = self._rank.copy()
        self._snap_keys = _rank_keys(self._table.p[order], order)
        self._tree.set_all(self._rank_masses(self._rank))
        self._dirty[:] = False
        self._num_dirty = 0

    def _rank_masses(self, ranks: IntArray) -> FloatArray:
        safe = np.maximum(ranks, 1).astype(np.float64)
        return np.where(ranks > 0, safe ** -self.alpha, 0.0)


def _rank_keys(p: FloatArray, slots: IntArray) -> npt.NDArray[np.complex128]:
    """Sort keys ``(-p, slot)``: numpy orders complex numbers lexicographically (real, imag)."""
    keys = np.empty(len(slots), np.complex128)
    keys.real = -p
    keys.imag = slots  # exact for slots < 2**53
    return keys


def _exact_ranks(p: FloatArray, valid: BoolArray) -> tuple[IntArray, IntArray]:
    """Valid slots by decreasing priority (ties: smaller slot first); rank per slot (0 = none)."""
    candidates = np.flatnonzero(valid)  # ascending, so the stable sort breaks ties by slot
    order = candidates[np.argsort(-p[candidates], kind="stable")]
    rank = np.zeros(len(p), np.int64)
    rank[order] = np.arange(1, len(order) + 1)
    return order, rank


def make_sampler(spec: StoreSpec) -> Sampler:
    num_slots = spec.num_envs * spec.slots_per_env
    if spec.sampler == "uniform":
        return UniformSampler(num_slots)
    if spec.sampler == "prioritized":
        return PrioritizedSampler(num_slots, alpha=spec.alpha, eps=spec.priority_eps)
    if spec.sampler == "rank":
        return RankSampler(num_slots, alpha=spec.alpha, eps=spec.priority_eps)
    raise NotImplementedError(f"sampler {spec.sampler!r} is not available yet")


def array_nbytes(obj: object, depth: int = 2) -> int:
    """Bytes of the numpy arrays an object holds, looking `depth` attribute levels deep.

    A measurement for ``info``, not persistence: it stays right whatever arrays a sampler
    (and its tree and table) keep. Views are counted as the arrays they look at.
    """
    total = 0
    for value in vars(obj).values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif depth > 1 and hasattr(value, "__dict__") and not isinstance(value, type):
            total += array_nbytes(value, depth - 1)
    return total

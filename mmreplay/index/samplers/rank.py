"""`RankSampler`: rank-based priorities, re-sorted lazily."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from mmreplay.index.samplers.priority import TreePrioritySampler, as_priorities
from mmreplay.index.samplers.protocol import BoolArray, FloatArray, IntArray


class RankSampler(TreePrioritySampler):
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
        super().__init__(num_slots, alpha=alpha, eps=eps)
        self.stale_fraction = float(stale_fraction)
        self._rank: IntArray = np.zeros(num_slots, np.int64)  # rank used now, 0 = no mass
        self._snap_rank: IntArray = np.zeros(num_slots, np.int64)  # rank at the last sort
        self._snap_keys = np.zeros(0, np.complex128)  # sorted (-p, slot) at the last sort
        self._dirty: BoolArray = np.zeros(num_slots, np.bool_)
        self._num_dirty = 0

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        moved = self._table.admit(slots, valid, ids)
        self._touch(slots[moved])

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._table.set(slots, as_priorities(priorities, len(slots)))
        self._touch(slots)

    def priorities(self) -> np.ndarray:
        if self._num_dirty:
            self._resort()  # checkpoint == re-sort point, so `load` continues identically
        return self._table.p.copy()

    def ranks(self) -> np.ndarray:
        """Rank each slot is drawn with now (0 = not sampleable), int64 (diagnostics, tests)."""
        return self._rank.copy()

    def load(self, priorities: np.ndarray, slot_ids: np.ndarray, max_priority: float,
             valid: np.ndarray) -> None:
        p, ids, ok = self._checked(priorities, slot_ids, max_priority, valid)
        self._table.load(p, ids, float(max_priority), ok)
        self._resort()

    def check_valid(self) -> None:
        super().check_valid()
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

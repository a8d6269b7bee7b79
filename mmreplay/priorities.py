"""Priority bookkeeping of a store: one priority column per step slot, kept by the sampler.

Transitions and sequence starts share the column: a sequence's priority is the priority of
its start step. Every write goes through `Priorities.set` (last value wins for a slot given
twice), which tells the sampler, every prioritized sequence index, and the set of step
blocks the next commit must rewrite. Uniform stores have no column (`sampler` is None).

Updates made from device tensors wait in `late` (`mmreplay.late_priorities`): a draw
applies those that are done (`at_draw`); every other write and every commit applies them
all first, so updates take effect in the order they were made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from mmreplay import validate
from mmreplay.errors import InvalidInputError
from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import PrioritizedSampler, PrioritySampler, Sampler, SlotMarks
from mmreplay.index.sequences import sequence_priority
from mmreplay.late_priorities import LatePriorities, wants_late
from mmreplay.spec import StoreSpec

Listener = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class PriorityState:
    """Raw priorities of the sampleable transitions (flat-slot order) and the priority a new
    transition enters with."""

    sampleable: np.ndarray
    max_priority: float


class Priorities:
    """The priority column of one store (see the module doc)."""

    def __init__(self, spec: StoreSpec, sampler: Sampler, ring: StepRing | None = None) -> None:
        self.spec = spec
        self.ring = ring  # where late updates find their ids (`late`)
        self.sampler = None if spec.sampler == "uniform" else cast(PrioritySampler, sampler)
        # step blocks whose priorities changed since the commit: every write marks them in
        # `marks` (a compiled update there too), `commit_fields` moves them into `dirty`
        self.dirty: set[int] = set()
        blocks = -(-spec.slots_per_env // spec.block_slots)
        self.marks = SlotMarks(np.zeros(blocks, np.bool_), spec.slots_per_env, spec.block_slots)
        self.listeners: list[Listener] = []  # told (flat, values) of every write
        self.late = LatePriorities(self._apply_late)

    def require(self, what: str, kinds: tuple[str, ...]) -> PrioritySampler:
        """The sampler, if this store samples one of `kinds`; else `InvalidInputError`."""
        if self.sampler is None or self.spec.sampler not in kinds:
            need = " or ".join(repr(kind) for kind in kinds)
            raise InvalidInputError(f"{what} needs sampler={need}; this store samples "
                                    f"{self.spec.sampler!r}")
        return self.sampler

    def set(self, flat: np.ndarray, values: np.ndarray) -> int:
        """The priority column at these step slots; for a slot given twice the last value
        wins. Returns how many slots were set (late updates applied first)."""
        assert self.sampler is not None  # callers `require` first
        self.late.apply_all()
        flat, first = np.unique(flat[::-1], return_index=True)  # reversed: first = last given
        values = values[::-1][first]
        self.sampler.set_priorities(flat, values)
        self._written(flat, values)
        return int(flat.size)

    def set_sequences(self, ids: Any, td_errors: Any, eta: float,
                      starts_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> int:
        """`ReplayStore.update_sequence_priorities`: R2D2's priority of each sequence (rows
        of `ids`, -1 padding) from its steps' `td_errors`, set at its start's flat slot
        (`starts_of`: flat slots and found mask of start ids); returns how many applied."""
        rows, errors = validate.sequence_priorities(ids, td_errors)
        eta = validate.unit_interval("eta", eta)
        self.require("update_sequence_priorities", ("prioritized",))
        flat, found = starts_of(rows[:, 0])
        values = sequence_priority(rows, errors, eta)
        return self.set(flat[found], values[found])

    def set_ids(self, ids: np.ndarray, values: np.ndarray, ring: StepRing) -> int:
        """The priorities of transition `ids` found sampleable in `ring` (others ignored; the
        last value of a slot wins); returns how many slots were set. NaN, inf or negative
        values raise and change nothing. Proportional stores do it in one compiled call,
        from ids to tree leaves (values checked there). Late updates are applied first."""
        if self.late.queued:  # (`apply_all` of nothing, without the call)
            self.late.apply_all()
        return self._set_ids(ids, values, ring)

    def update(self, ids: Any, values: Any, late: Any = None) -> int | None:
        """`ReplayStore.update_priorities`: queued (`update_later`) if `wants_late`, else
        checked and set now (`set_ids`, in this column's ring, which the caller refreshed)."""
        if wants_late(ids, values, late):
            self.update_later(ids, values)
            return None
        wanted, checked = validate.id_priorities(ids, values)
        self.require("update_priorities", ("prioritized", "rank"))
        assert self.ring is not None  # the store's column is given its ring
        return self.set_ids(wanted, checked, self.ring)

    def update_later(self, ids: Any, values: Any) -> None:
        """`ReplayStore.update_priorities` late: queued (device tensors: no wait for the
        device) for the next draws to apply (`LatePriorities`)."""
        self.require("update_priorities", ("prioritized", "rank"))
        assert self.ring is not None
        self.late.queue(ids, values)

    def at_draw(self) -> None:
        """Before a draw: apply the late updates that are done (`LatePriorities.apply_ready`)
        and raise the error of one that was dropped."""
        late = self.late
        if late.queued:
            late.apply_ready()
        if late.error is not None:
            late.report()

    def _apply_late(self, ids: np.ndarray, values: np.ndarray) -> int:
        assert self.ring is not None
        return self._set_ids(ids, values, self.ring)

    def _set_ids(self, ids: np.ndarray, values: np.ndarray, ring: StepRing) -> int:
        sampler = self.sampler
        if not isinstance(sampler, PrioritizedSampler):
            validate.priority_values(values)
            flat, found = ring.flat_of_ids(ids)
            return self.set(flat[found], values[found])
        where = ring.id_map()
        applied = sampler.set_id_priorities(ids, values, where, marks=self.marks)
        if applied is None:  # some ids live in the ring's spill table
            applied = sampler.set_id_priorities(ids, values, where, ring.spilled(ids),
                                                marks=self.marks)
        assert applied is not None  # their slots given: nothing is missed
        for listener in self.listeners:
            listener(applied.slots, applied.priorities)
        return int(applied.slots.size)

    def _written(self, flat: np.ndarray, values: np.ndarray) -> None:
        """Tell the listeners, and mark the step blocks for the next commit."""
        for listener in self.listeners:
            listener(flat, values)
        self.marks.mask[flat % self.spec.slots_per_env // self.spec.block_slots] = True

    def report_late(self) -> None:
        """Raise the error of a late update that was dropped (after a commit), once."""
        self.late.report()

    def of_starts(self, flat: np.ndarray) -> np.ndarray:
        """The priorities of these step slots (what sequence starts take)."""
        return cast(PrioritizedSampler, self.sampler).priorities_at(flat)

    def state(self, valid: np.ndarray) -> PriorityState | None:
        """The priorities of the slots `valid` marks; None for uniform stores."""
        if self.sampler is None:
            return None
        return PriorityState(sampleable=self.sampler.priorities()[valid],
                             max_priority=float(self.sampler.max_priority()))

    def commit_fields(self) -> dict[str, Any]:
        """What `Committer.commit` persists of the column (and which blocks changed: the
        blocks compiled updates marked move into `dirty`, which the commit then clears).
        Late updates are applied first; the error of one dropped is kept for `report_late`."""
        self.late.apply_all()
        sampler, marked = self.sampler, self.marks.mask
        if marked.any():
            self.dirty.update(np.flatnonzero(marked).tolist())
            marked[:] = False
        return {"priorities": None if sampler is None else sampler.priorities(),
                "max_priority": 1.0 if sampler is None else sampler.max_priority(),
                "prio_dirty": self.dirty}

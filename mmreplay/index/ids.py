"""Where each transition id lives: the ring's id -> flat slot map.

Ids increase by one per recorded step, over all envs; a live id's flat slot is::

    loc[id % loc.size]      if the step column there still holds `id`
    spill[id]               else: a newer id took its entry (envs that advance
                            independently keep old ids for long)

`spill` is pruned of ids whose slot now holds another one when it doubles (amortized
O(1) per id). This module knows no validity, episodes or frames.
"""

from __future__ import annotations

import numpy as np

from mmreplay.kernels.structs import IdMap

PRUNE_AT = 1024  # the smallest spill table that is pruned


class IdIndex:
    """The id -> flat slot map of one ring (see the module doc). `slot_ids` is the ring's
    flat id column (a view: the ring never replaces it), -1 where a slot has no step."""

    def __init__(self, slot_ids: np.ndarray) -> None:
        self.slot_ids = slot_ids
        self.loc = np.full(slot_ids.size, -1, np.int64)
        self.spill: dict[int, int] = {}
        self.prune_at = PRUNE_AT

    def point(self, new_id: int, flat: int) -> None:
        """Point `new_id` at `flat`; an id still held whose entry it takes spills over."""
        key = new_id % self.loc.size
        old = int(self.loc[key])
        if old >= 0:
            held = int(self.slot_ids[old])
            if held >= 0 and held % self.loc.size == key and held != new_id:
                self.spill[held] = old
                if len(self.spill) >= self.prune_at:
                    self.prune()
        self.loc[key] = flat

    def add_spills(self, ids: list[int], flat: list[int]) -> None:
        """Ids a compiled recording displaced from `loc`, at their flat slots."""
        self.spill.update(zip(ids, flat, strict=True))
        if len(self.spill) >= self.prune_at:
            self.prune()

    def prune(self) -> None:
        """Forget spilled ids whose slot now holds another id."""
        ids = np.fromiter(self.spill.keys(), np.int64, len(self.spill))
        flat = np.fromiter(self.spill.values(), np.int64, len(self.spill))
        keep = self.slot_ids[flat] == ids
        self.spill = dict(zip(ids[keep].tolist(), flat[keep].tolist(), strict=True))
        self.prune_at = max(PRUNE_AT, 2 * len(self.spill))

    def rebuild(self, live_ids: np.ndarray, live_flat: np.ndarray) -> None:
        """The map of exactly these live ids (increasing: the newest takes a shared entry),
        after loading."""
        self.loc[:] = -1
        self.loc[live_ids % self.loc.size] = live_flat
        spilled = self.loc[live_ids % self.loc.size] != live_flat
        self.spill = dict(zip(live_ids[spilled].tolist(), live_flat[spilled].tolist(),
                              strict=True))
        self.prune_at = max(PRUNE_AT, 2 * len(self.spill))

    def locate(self, ids: np.ndarray, next_id: int) -> np.ndarray:
        """Flat slot of each id by the map or, where a newer id took its entry, the spill
        table; -1 for ids held nowhere (no validity check)."""
        known = (ids >= 0) & (ids < next_id)
        flat = np.where(known, self.loc[ids % self.loc.size], -1)
        missed = np.flatnonzero(known & ((flat < 0)
                                         | (self.slot_ids[np.maximum(flat, 0)] != ids)))
        if missed.size:
            spill = self.spill
            flat[missed] = [spill.get(i, -1) for i in ids[missed].tolist()] if spill else -1
        return flat

    def as_map(self, valid: np.ndarray, next_id: int) -> IdMap:
        """The map and validity mask as plain arrays for compiled callers (see `IdMap`)."""
        return IdMap(self.loc, self.slot_ids, valid, next_id, bool(self.spill))

"""Blocks of events: what many `StepRing.begin_episodes` / `StepRing.record_step` calls do,
in one compiled call (`kernels.record_kernels.record_events`).

`record_block` passes the ring's columns to the kernel as named structures, then writes
what the kernel leaves (sub-array fields: actions, extras), marks the touched frames and
spills the ids it displaced. ``test_record_block`` holds it equal to the calls one by one.
This module knows no pixels, codecs, RNG or torch.
"""

from __future__ import annotations

import numpy as np

from mmreplay.index.ring import EXTRA_PREFIX, StepRing
from mmreplay.kernels import lazy_entry, records
from mmreplay.kernels.structs import RecordColumns, RecordOut, StepEvents

_RECORD_EVENTS = lazy_entry(records, "record_events")  # found without a look-up


def record_block(ring: StepRing, env_of: np.ndarray, auto: np.ndarray, action: np.ndarray,
                 reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                 extras: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Record events in order, as `StepRing.begin_episodes` (``auto[j]``) or `StepRing.record_step`
    one by one would, in one compiled call; returns each event's new frame slot.

    Every step's env must be running when its turn comes (the caller checked), and no
    env may have `slots_per_env` events or more (`block_fits`). Rows of `action`,
    `reward`, ... of auto events are ignored.
    """
    S, size = ring.slots_per_env, env_of.size
    out = RecordOut(new_flat=np.empty(size, np.int64), step_flat=np.empty(size, np.int64),
                    touched=ring.written.copy(), spill_ids=np.empty(size, np.int64),
                    spill_flat=np.empty(size, np.int64))
    counters = np.array([ring.next_id, ring.next_episode], np.int64)
    flat = ring.steps.reshape(-1)
    events = StepEvents(env_of=env_of, auto=auto, term=terminated, trunc=truncated,
                        reward=reward.astype(np.float32, copy=False))
    cols = RecordColumns(
        slots=S, pos=flat["pos"], episode=flat["episode"], ids=flat["id"],
        has_step=flat["has_step"], terminated=flat["terminated"], truncated=flat["truncated"],
        rewards=flat["reward"], written=ring.written, running=ring.running,
        step_count=ring.step_count, ord_of_frame=ring.ord_of_frame.reshape(-1),
        frame_of_ord=ring.frame_of_ord.reshape(-1), id_loc=ring.ids.loc, counters=counters)
    spills = _RECORD_EVENTS(events, cols, out)
    ring.next_id, ring.next_episode = int(counters[0]), int(counters[1])
    _write_block_records(flat, out.new_flat, out.step_flat, action, extras or {})
    ring.touch_frames(out.touched)
    if spills:
        ring.ids.add_spills(out.spill_ids[:spills].tolist(), out.spill_flat[:spills].tolist())
    return out.new_flat - env_of * S


def block_fits(ring: StepRing, env_of: np.ndarray) -> bool:
    """Whether `record_block` takes these events: fewer than `slots_per_env` per env."""
    return int(np.bincount(env_of, minlength=1).max()) < ring.slots_per_env


def _write_block_records(flat: np.ndarray, new_flat: np.ndarray,
                         step_flat: np.ndarray, action: np.ndarray,
                         extras: dict[str, np.ndarray]) -> None:
    """The sub-array fields the kernel leaves: blank new frames, then the steps' rows."""
    steps = step_flat >= 0
    where = step_flat[steps]
    flat["action"][new_flat] = 0
    flat["action"][where] = action[steps]
    for name, rows in extras.items():
        flat[EXTRA_PREFIX + name][new_flat] = 0
        flat[EXTRA_PREFIX + name][where] = rows[steps]

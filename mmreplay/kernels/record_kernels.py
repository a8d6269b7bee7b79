"""Compiled kernel of recording: a block of episode starts and steps written to a ring in one call.

Plain arrays in, plain arrays out; no frames, files or torch. `record_events` replays, event by
event and in order, exactly what `StepRing.begin_episodes` (an *auto* event: o_0 of a new
episode, the env's running episode truncated first) and `StepRing.record_step` (a step of a
running env) do, on the ring's columns passed as flat ``(num_envs * S,)`` views::

    event j of env e:  auto  ->  truncate the running episode, new frame (pos 0, new episode)
                       step  ->  fill the record of frame written-1 (id, flags, reward),
                                 new frame (pos + 1, same episode)

The caller writes what the kernel cannot (the action and extras sub-arrays of the records,
the dirty-block set, the watchers) from its outputs. Loaded on first use through
`mmreplay.kernels.records()`, never by ``import mmreplay``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay.kernels.structs import RecordColumns, RecordOut, StepEvents


@numba.njit(nogil=True, cache=True)
def _new_frame(e: int, cols: RecordColumns, touched: np.ndarray) -> int:
    """Claim env `e`'s next slot for a new frame (blank record); returns its flat slot."""
    frame = cols.written[e]
    flat = e * cols.slots + frame % cols.slots
    cols.pos[flat] = 0
    cols.episode[flat] = 0
    cols.ids[flat] = -1
    cols.has_step[flat] = False
    cols.terminated[flat] = False
    cols.truncated[flat] = False
    cols.rewards[flat] = 0.0
    cols.ord_of_frame[flat] = cols.step_count[e]
    touched[e] = min(touched[e], frame)
    cols.written[e] = frame + 1
    return flat


@numba.njit(nogil=True, cache=True)
def _step(pf: int, j: int, events: StepEvents, cols: RecordColumns, out: RecordOut,
          spills: int) -> bool:
    """Fill the step record of event `j` at flat slot `pf` and point the next id at it;
    True if the id it displaced from the id map was spilled (at index `spills`)."""
    new_id, id_loc, ids = cols.counters[0], cols.id_loc, cols.ids
    cols.has_step[pf] = True
    ids[pf] = new_id
    cols.terminated[pf] = events.term[j]
    cols.truncated[pf] = events.trunc[j]
    cols.rewards[pf] = events.reward[j]
    key = new_id % id_loc.size
    old = id_loc[key]
    spilled = False
    if old >= 0:
        held = ids[old]
        if held >= 0 and held % id_loc.size == key and held != new_id:
            out.spill_ids[spills] = held
            out.spill_flat[spills] = old
            spilled = True
    id_loc[key] = pf
    return spilled


@numba.njit(nogil=True, cache=True)
def _begin(e: int, cols: RecordColumns, touched: np.ndarray) -> int:
    """An auto event of env `e`: its running episode truncated, a new episode's first frame
    (returns its flat slot)."""
    S, written = cols.slots, cols.written
    if cols.running[e]:
        cols.running[e] = False
        last = written[e] - 2
        if last >= 0 and cols.pos[e * S + (last + 1) % S] != 0:
            cols.truncated[e * S + last % S] = True
            touched[e] = min(touched[e], last)
    f = _new_frame(e, cols, touched)
    cols.episode[f] = cols.counters[1]
    cols.counters[1] += 1
    cols.running[e] = True
    return f


@numba.njit(nogil=True, cache=True)
def record_events(events: StepEvents, cols: RecordColumns, out: RecordOut) -> int:
    """Record every event in order (see the module docstring); returns the spill count.

    ``cols.counters`` is ``[next_id, next_episode]``, updated. Per event: ``out.new_flat``
    the flat slot of its new frame, ``out.step_flat`` the flat slot of its step record (-1
    for auto). ``out.touched[e]`` is lowered to the first frame number touched. An id still
    held whose id-map entry a new id takes goes to ``out.spill_ids``/``out.spill_flat`` (the
    caller's table).
    """
    S, touched = cols.slots, out.touched
    spills = 0
    for j in range(events.env_of.size):
        e = events.env_of[j]
        if events.auto[j]:
            out.new_flat[j] = _begin(e, cols, touched)
            out.step_flat[j] = -1
            continue
        t = cols.written[e] - 1
        pf = e * S + t % S
        if _step(pf, j, events, cols, out, spills):
            spills += 1
        cols.frame_of_ord[e * S + cols.step_count[e] % S] = t
        cols.step_count[e] += 1
        cols.counters[0] += 1
        touched[e] = min(touched[e], t)
        f = _new_frame(e, cols, touched)
        cols.pos[f] = cols.pos[pf] + 1
        cols.episode[f] = cols.episode[pf]
        cols.running[e] = not (events.term[j] or events.trunc[j])
        out.new_flat[j] = f
        out.step_flat[j] = pf
    return spills

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


@numba.njit(nogil=True, cache=True)
def _new_frame(e: int, S: int, pos: np.ndarray, episode: np.ndarray, ids: np.ndarray,
               has_step: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
               rewards: np.ndarray, written: np.ndarray, step_count: np.ndarray,
               ord_of_frame: np.ndarray, touched: np.ndarray) -> int:
    """Claim env `e`'s next slot for a new frame (blank record); returns its flat slot."""
    frame = written[e]
    flat = e * S + frame % S
    pos[flat] = 0
    episode[flat] = 0
    ids[flat] = -1
    has_step[flat] = False
    terminated[flat] = False
    truncated[flat] = False
    rewards[flat] = 0.0
    ord_of_frame[flat] = step_count[e]
    touched[e] = min(touched[e], frame)
    written[e] = frame + 1
    return flat


@numba.njit(nogil=True, cache=True)
def _step(pf: int, new_id: int, term: bool, trunc: bool, reward: float, ids: np.ndarray,
          has_step: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
          rewards: np.ndarray, id_loc: np.ndarray, spill_ids: np.ndarray,
          spill_flat: np.ndarray, spills: int) -> bool:
    """Fill the step record at flat slot `pf` and point id `new_id` at it; True if the id it
    displaced from the id map was spilled (at index `spills`)."""
    has_step[pf] = True
    ids[pf] = new_id
    terminated[pf] = term
    truncated[pf] = trunc
    rewards[pf] = reward
    key = new_id % id_loc.size
    old = id_loc[key]
    spilled = False
    if old >= 0:
        held = ids[old]
        if held >= 0 and held % id_loc.size == key and held != new_id:
            spill_ids[spills] = held
            spill_flat[spills] = old
            spilled = True
    id_loc[key] = pf
    return spilled


@numba.njit(nogil=True, cache=True)
def record_events(env_of: np.ndarray, auto: np.ndarray, term: np.ndarray, trunc: np.ndarray,
                  reward: np.ndarray, S: int, pos: np.ndarray, episode: np.ndarray,
                  ids: np.ndarray, has_step: np.ndarray, terminated: np.ndarray,
                  truncated: np.ndarray, rewards: np.ndarray, written: np.ndarray,
                  running: np.ndarray, step_count: np.ndarray, ord_of_frame: np.ndarray,
                  frame_of_ord: np.ndarray, id_loc: np.ndarray, counters: np.ndarray,
                  new_flat: np.ndarray, step_flat: np.ndarray, touched: np.ndarray,
                  spill_ids: np.ndarray, spill_flat: np.ndarray) -> int:
    """Record every event in order (see the module docstring); returns the spill count.

    ``counters`` is ``[next_id, next_episode]``, updated. Per event: ``new_flat`` the flat
    slot of its new frame, ``step_flat`` the flat slot of its step record (-1 for auto).
    ``touched[e]`` is lowered to the first frame number touched. An id still held whose
    id-map entry a new id takes goes to ``spill_ids``/``spill_flat`` (the caller's table).
    """
    spills = 0
    for j in range(env_of.size):
        e = env_of[j]
        if auto[j]:
            if running[e]:
                running[e] = False
                last = written[e] - 2
                if last >= 0 and pos[e * S + (last + 1) % S] != 0:
                    truncated[e * S + last % S] = True
                    touched[e] = min(touched[e], last)
            f = _new_frame(e, S, pos, episode, ids, has_step, terminated, truncated, rewards,
                           written, step_count, ord_of_frame, touched)
            episode[f] = counters[1]
            counters[1] += 1
            running[e] = True
            new_flat[j] = f
            step_flat[j] = -1
            continue
        t = written[e] - 1
        pf = e * S + t % S
        if _step(pf, counters[0], term[j], trunc[j], reward[j], ids, has_step, terminated,
                 truncated, rewards, id_loc, spill_ids, spill_flat, spills):
            spills += 1
        frame_of_ord[e * S + step_count[e] % S] = t
        step_count[e] += 1
        counters[0] += 1
        touched[e] = min(touched[e], t)
        f = _new_frame(e, S, pos, episode, ids, has_step, terminated, truncated, rewards,
                       written, step_count, ord_of_frame, touched)
        pos[f] = pos[pf] + 1
        episode[f] = episode[pf]
        running[e] = not (term[j] or trunc[j])
        new_flat[j] = f
        step_flat[j] = pf
    return spills

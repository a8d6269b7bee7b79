"""Sequences of consecutive steps: which starts are sampleable, and what a window reads.

A sequence of length T starts at a step t of one env and covers T steps, in one of two modes::

    within one episode (R2D2)      t  t+1 ... t+L-1 | pad ... pad      L = min(T, steps left)
                                   mask True ...      False ...         ids -1 on padding
    across episodes (DreamerV3)    t  t+1 ... end_e | o_0' ... (T steps in all, is_first at o_0')

A start is *valid* (sampleable) iff it has a step, every real frame of its stack is kept, it
lies on the grid (``pos % period == 0`` within episodes; frame number ``% period == 0``
across), and its window is complete:

* within: the episode has ended, or T steps of it are recorded from t on;
* across: T steps of the env are recorded from t on (the window stops at the write position;
  the final observation of an ended episode has no step, so it is skipped: the window goes
  on with the next episode's o_0, flagged ``is_first``).

Validity of every start is one O(1) test per start (episode bounds from ``pos`` and the
running episode; step ordinals from `StepRing`), and a `SequenceIndex` re-tests only the
starts a change can reach (within T steps of a touched frame, and the k oldest kept frames),
so keeping it current costs O(T + k + new steps) per refresh, never O(capacity). A window is
O(T + k) index arithmetic; `SequenceWindows` holds the flat slots of every stack, which the
frame store reads with each distinct chunk decoded once. This module knows no pixels or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import PrioritySampler, Sampler


@dataclass(frozen=True)
class SequenceKey:
    """What a sequence index is for: window length, boundary mode and start grid."""

    length: int
    cross_episodes: bool
    period: int


@dataclass(frozen=True)
class SequenceWindows:
    """Everything a sequence batch needs, as numpy (B sequences of T steps, k-stacks)."""

    obs_slots: np.ndarray        # (B, T, k) flat slots, -1 = zeros (padding or masked step)
    next_obs_slots: np.ndarray   # (B, k) the stack after the last real step
    action: np.ndarray           # (B, T, *action_shape), zero where masked
    reward: np.ndarray           # (B, T) float32 one-step rewards
    terminated: np.ndarray       # (B, T)
    truncated: np.ndarray        # (B, T)
    is_first: np.ndarray         # (B, T) the step is o_0 of its episode
    mask: np.ndarray             # (B, T) False on padding
    ids: np.ndarray              # (B, T) transition ids, -1 on padding
    extras: dict[str, np.ndarray]  # (B, T, *shape) each, zero where masked


class SequenceIndex:
    """The valid starts of one `SequenceKey`, kept current incrementally, in a sampler."""

    def __init__(self, ring: StepRing, key: SequenceKey, sampler: Sampler,
                 priority_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.ring = ring
        self.key = key
        self.sampler = sampler
        # prioritized stores: a start's priority is the store's priority of its step
        self.priority_of = priority_of
        self.valid = np.zeros(ring.num_envs * ring.slots_per_env, bool)
        self._lo = ring.written.copy()  # first frame touched since the last refresh
        ring.watchers.append(self._lo)
        self._oldest = ring.oldest
        self._rebuilds = -1  # forces the first refresh to test every kept frame

    def refresh(self) -> None:
        """Re-test the starts a change since the last refresh can reach."""
        ring = self.ring
        if self._rebuilds != ring.rebuilds:
            self._rebuilds = ring.rebuilds
            env, frames = ring.kept_frames()
            self.valid[:] = False
        elif np.array_equal(self._lo, ring.written) and np.array_equal(self._oldest, ring.oldest):
            return
        else:
            env, frames = self._candidates()
        self._oldest = ring.oldest
        self._lo[:] = ring.written
        flat = env * ring.slots_per_env + frames % ring.slots_per_env
        ok = self.starts_valid(env, frames)
        self.valid[flat] = ok
        self.sampler.update(flat, ok, ring.steps["id"].reshape(-1)[flat])
        if self.priority_of is not None:
            self.set_priorities(flat, self.priority_of(flat))

    def set_priorities(self, flat: np.ndarray, priorities: np.ndarray) -> None:
        """New priorities of start slots (prioritized samplers only)."""
        cast(PrioritySampler, self.sampler).set_priorities(flat, priorities)

    def check_valid(self) -> None:
        """Raise RuntimeError if the incremental starts differ from a full recompute."""
        self.refresh()
        env, frames = self.ring.kept_frames()
        flat = env * self.ring.slots_per_env + frames % self.ring.slots_per_env
        full = np.zeros_like(self.valid)
        full[flat] = self.starts_valid(env, frames)
        if not np.array_equal(full, self.valid):
            bad = np.flatnonzero(full != self.valid)[:10]
            raise RuntimeError(f"sequence starts {self.key} out of date at flat slots "
                               f"{bad.tolist()}")
        if self.sampler.count() != int(full.sum()):
            raise RuntimeError(f"sequence sampler of {self.key} counts {self.sampler.count()} "
                               f"starts, {int(full.sum())} are valid")

    def _candidates(self) -> tuple[np.ndarray, np.ndarray]:
        ring, T = self.ring, self.key.length
        k = ring.spec.frame_stack
        oldest, envs, frames = ring.oldest, [], []
        for e in range(ring.num_envs):
            lo = max(int(self._lo[e]), int(oldest[e]))
            first = max(int(oldest[e]), self._reach_back(e, lo, T))
            new = np.arange(first, ring.written[e])
            gone = np.arange(oldest[e], min(oldest[e] + k, ring.written[e]))
            both = np.union1d(new, gone)
            frames.append(both)
            envs.append(np.full(both.size, e, np.int64))
        return np.concatenate(envs), np.concatenate(frames).astype(np.int64)

    def _reach_back(self, env: int, lo: int, steps: int) -> int:
        """The first frame whose window may reach frame `lo` (T steps back, and one more)."""
        ring = self.ring
        if not self.key.cross_episodes or lo >= ring.written[env]:
            return lo - steps - 1
        o = int(ring.ord_of_frame[env, lo % ring.slots_per_env]) - steps - 1
        first_kept = int(ring.ord_of_frame[env, ring.oldest[env] % ring.slots_per_env])
        if o < first_kept:
            return int(ring.oldest[env])
        return int(ring.frame_of_ord[env, o % ring.slots_per_env])

    def starts_valid(self, env: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Validity of starts at kept frames `t` of `env` (see module doc); O(1) each."""
        ring, key = self.ring, self.key
        cols = ring.steps[env, t % ring.slots_per_env]
        lower = np.maximum(t - ring.spec.frame_stack + 1, t - cols["pos"])
        ok = cols["has_step"] & (lower >= ring.oldest[env])
        if key.cross_episodes:
            ok &= t % key.period == 0
            last = ring.ord_of_frame[env, t % ring.slots_per_env] + key.length - 1
            return ok & (last < ring.step_count[env])
        ok &= cols["pos"] % key.period == 0
        newest = ring.written[env] - 1
        in_running = ring.running[env] & (
            cols["episode"] == ring.steps["episode"][env, newest % ring.slots_per_env])
        return ok & (~in_running | (t + key.length - 1 <= newest - 1))


def windows(ring: StepRing, flat: np.ndarray, key: SequenceKey) -> SequenceWindows:
    """The windows starting at valid flat slots `flat`: O(B * (T + k)) index arithmetic."""
    S, T = ring.slots_per_env, key.length
    env = flat // S
    t = ring.frame_at(flat)
    steps = np.arange(T)
    if key.cross_episodes:
        ords = ring.ord_of_frame[env, t % S][:, None] + steps
        frames = ring.frame_of_ord[env[:, None], ords % S]
        mask = np.ones(frames.shape, bool)
        after = frames[:, -1] + 1
    else:
        frames, mask = _within_episode(ring, env, t, steps)
        after = t + mask.sum(axis=1)
    envs = np.broadcast_to(env[:, None], frames.shape)
    cols = ring.steps[envs, frames % S]
    obs = np.where(mask[..., None], stack_slots(ring, envs, frames, cols["pos"]), -1)
    after_pos = ring.steps["pos"][env, after % S]
    return SequenceWindows(
        obs_slots=obs, next_obs_slots=stack_slots(ring, env, after, after_pos),
        action=_masked(cols["action"], mask), reward=_masked(cols["reward"], mask),
        terminated=cols["terminated"] & mask, truncated=cols["truncated"] & mask,
        is_first=(cols["pos"] == 0) & mask, mask=mask, ids=np.where(mask, cols["id"], -1),
        extras={name: _masked(values, mask) for name, values in ring.extras_at(
            envs * S + frames % S).items()})


def _within_episode(ring: StepRing, env: np.ndarray, t: np.ndarray,
                    steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frames t..t+T-1 and the mask of those that are steps of t's episode before its end."""
    S = ring.slots_per_env
    frames = t[:, None] + steps
    envs = np.broadcast_to(env[:, None], frames.shape)
    cols = ring.steps[envs, frames % S]
    episode = ring.steps["episode"][env, t % S]
    alive = (frames <= ring.written[env][:, None] - 2) & cols["has_step"] & (
        cols["episode"] == episode[:, None])
    ended = cols["terminated"] | cols["truncated"]
    ended_before = np.zeros_like(ended)
    ended_before[:, 1:] = np.cumsum(ended, axis=1)[:, :-1] > 0
    mask = np.cumprod(alive & ~ended_before, axis=1).astype(bool)
    return np.where(mask, frames, t[:, None]), mask


def stack_slots(ring: StepRing, env: np.ndarray, frames: np.ndarray,
                pos: np.ndarray) -> np.ndarray:
    """Flat slots of stack(o_f) for frames `f` at episode positions `pos` (shape + (k,))."""
    k, S = ring.spec.frame_stack, ring.slots_per_env
    q = frames[..., None] - k + 1 + np.arange(k)
    start = (frames - pos)[..., None]
    if ring.spec.stack_padding == "first":
        q = np.maximum(q, start)
    slots = env[..., None] * S + q % S
    return np.where(q >= start, slots, -1)


def _masked(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    wide = mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    return np.where(wide, values, np.zeros((), values.dtype))


def sequence_priority(ids: np.ndarray, td_errors: np.ndarray, eta: float) -> np.ndarray:
    """R2D2's ``eta * max|d| + (1 - eta) * mean|d|`` per row over its real steps (ids >= 0)."""
    real = ids >= 0
    size = np.maximum(real.sum(axis=1), 1)
    d = np.where(real, np.abs(td_errors), 0.0)
    return eta * d.max(axis=1) + (1.0 - eta) * d.sum(axis=1) / size

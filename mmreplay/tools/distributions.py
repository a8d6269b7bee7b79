"""What the sampler draws from and what the data holds, as distributions: `mmreplay plot`.

`sampling_view`: every sampleable id with its exact probability of being drawn (and raw
priority); `distributions`: priorities, per-step rewards, and the lengths and returns of
fully kept, ended episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmreplay.store import ReplayStore
from mmreplay.tools.inspection import episode_table


@dataclass(frozen=True)
class Distributions:
    """What `mmreplay plot` draws: priorities of sampleable transitions (None when uniform),
    per-step rewards of kept steps, and lengths and returns of fully kept, ended episodes."""

    priorities: np.ndarray | None
    rewards: np.ndarray
    episode_lengths: np.ndarray
    episode_returns: np.ndarray


def distributions(store: ReplayStore) -> Distributions:
    ring = store.views.step_columns()
    env, frames = ring.kept_frames()
    cols = ring.steps[env, frames % ring.slots_per_env]
    done = [r for r in episode_table(store) if r.fully_kept and r.status != "running"]
    state = store.views.priority_state()
    return Distributions(
        priorities=None if state is None else state.sampleable,
        rewards=cols["reward"][cols["has_step"]].astype(np.float64),
        episode_lengths=np.array([r.length for r in done], np.int64),
        episode_returns=np.array([r.episode_return for r in done], np.float64))


@dataclass(frozen=True)
class SamplingView:
    """What the sampler draws from: every sampleable id (increasing), the exact probability
    of drawing it, and its raw priority (None for uniform stores). ``next_id`` is the id
    the next transition will get, so ``next_id - 1 - ids`` are the ages in transitions."""

    sampler: str
    ids: np.ndarray
    probabilities: np.ndarray
    priorities: np.ndarray | None
    next_id: int

    @property
    def effective_sample_size(self) -> float:
        """``1 / sum(p^2)``: as many ids as a uniform draw over that many would cover
        (equal to the count for a uniform sampler); 0 when nothing is sampleable."""
        total = float(np.square(self.probabilities).sum())
        return 1.0 / total if total > 0 else 0.0


def sampling_view(store: ReplayStore) -> SamplingView:
    """From the raw priorities: ``(p + eps)^alpha`` (prioritized) or ``rank^-alpha`` with
    exact ranks (rank; the sampler's lazily re-sorted ranks may differ slightly)."""
    ring = store.views.step_columns()
    flat = np.flatnonzero(ring.valid)
    ids = ring.steps["id"].reshape(-1)[flat]
    order = np.argsort(ids, kind="stable")
    state = store.views.priority_state()
    spec = store.spec
    if state is None or ids.size == 0:
        prios = None if state is None else state.sampleable[order]
        probs = np.full(ids.size, 1.0 / ids.size) if ids.size else np.zeros(0)
    else:
        prios = state.sampleable[order]
        if spec.sampler == "rank":
            ranks = np.empty(prios.size)
            ranks[np.lexsort((flat[order], -prios))] = np.arange(1, prios.size + 1)
            mass = ranks ** -spec.alpha
        else:
            mass = (prios + spec.priority_eps) ** spec.alpha
        probs = mass / mass.sum() if mass.sum() > 0 else np.full(ids.size, 1.0 / ids.size)
    return SamplingView(sampler=spec.sampler, ids=ids[order], probabilities=probs,
                        priorities=prios, next_id=int(ring.next_id))

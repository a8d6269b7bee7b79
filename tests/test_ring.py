"""ring: incremental validity equals a full recompute under random operation streams."""

from __future__ import annotations

import numpy as np
import pytest

from mmreplay.index.ring import StepRing
from mmreplay.spec import make_spec


def random_stream(ring: StepRing, rng: np.random.Generator, steps: int) -> None:
    envs = np.arange(ring.num_envs)
    ring.begin_episodes(envs)
    for _ in range(steps):
        op = rng.random()
        if op < 0.05:  # reset one env mid-episode
            ring.begin_episodes(rng.choice(envs, 1))
            continue
        done = rng.random(ring.num_envs) < 0.1
        running = envs[ring.running]
        ring.record_steps(running, np.zeros(running.size, np.int64), rng.normal(size=running.size),
                          done[running], np.zeros(running.size, bool))
        ended = envs[~ring.running]
        if ended.size:
            ring.begin_episodes(ended)
        if rng.random() < 0.3:
            ring.check_valid()


@pytest.mark.parametrize("capacity", [7, 50, 1000])
@pytest.mark.parametrize(("k", "n", "envs"), [(1, 1, 1), (4, 3, 1), (4, 3, 3), (2, 5, 2)])
def test_incremental_validity_matches_full_recompute(capacity, k, n, envs):
    spec = make_spec(capacity=capacity, obs_shape=(1,), frame_stack=k, n_step=n, num_envs=envs)
    ring = StepRing(spec)
    random_stream(ring, np.random.default_rng(capacity + k), steps=3 * capacity // envs + 20)
    ring.check_valid()
    assert (ring.written >= ring.oldest).all()
    kept = ring.written - ring.oldest
    assert (kept <= spec.slots_per_env).all()


def test_check_valid_notices_a_stale_mask():
    spec = make_spec(capacity=20, obs_shape=(1,))
    ring = StepRing(spec)
    random_stream(ring, np.random.default_rng(0), steps=30)
    ring.refresh()
    ring.valid[np.flatnonzero(ring.valid)[0]] = False
    ring._dirty_lo[:] = ring.written  # hide the damage from the incremental path
    with pytest.raises(RuntimeError, match="out of date"):
        ring.check_valid()

"""Prioritized and rank-based replay through the public ReplayStore API."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import frame
from scipy import stats

from mmreplay import InvalidInputError, ReplayStore

OBS = (2, 2)


def make(tmp_path, name="s", **kw):
    kw.setdefault("capacity", 64)
    kw.setdefault("sampler", "prioritized")
    return ReplayStore.create(tmp_path / name, obs_shape=OBS, seed=kw.pop("seed", 0), **kw)


def record(store, steps: int, start: int = 0, done_every: int = 0) -> None:
    store.reset(frame(start, OBS))
    for i in range(1, steps + 1):
        done = bool(done_every) and i % done_every == 0
        store.add(i % 4, 1.0, frame(start + i, OBS), done, False)
        if done:
            store.reset(frame(start + i, OBS))


def exact_probabilities(p: np.ndarray, alpha: float, eps: float) -> np.ndarray:
    mass = (p + eps) ** alpha
    return mass / mass.sum()


def test_sampling_follows_priorities(tmp_path):
    store = make(tmp_path, alpha=0.7)
    record(store, 20, done_every=20)
    ids = store.valid_ids()
    priorities = np.linspace(0.1, 3.0, ids.size)
    assert store.update_priorities(ids, priorities) == ids.size
    counts = np.zeros(ids.size)
    for _ in range(100):
        drawn = store.sample(2000, beta=0.5).ids.numpy()
        counts += np.bincount(drawn - ids[0], minlength=ids.size)
    expected = exact_probabilities(priorities, 0.7, 1e-6) * counts.sum()
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    assert stats.chisquare(counts, np.full(ids.size, counts.sum() / ids.size)).pvalue < 1e-6


def test_importance_weights(tmp_path):
    store = make(tmp_path, alpha=0.6)
    record(store, 10, done_every=10)
    ids = store.valid_ids()
    priorities = np.arange(1, ids.size + 1, dtype=float)
    store.update_priorities(ids, priorities)
    batch = store.sample(500, beta=0.4)
    probs = exact_probabilities(priorities, 0.6, 1e-6)
    want = (ids.size * probs[batch.ids.numpy() - ids[0]]) ** -0.4
    want /= (ids.size * probs.min()) ** -0.4
    np.testing.assert_allclose(batch.weights.numpy(), want, rtol=1e-5)
    assert batch.weights.max() <= 1.0


def test_new_transitions_enter_with_max_priority(tmp_path):
    store = make(tmp_path, n_step=3)
    record(store, 10)
    ids = store.valid_ids()
    store.update_priorities(ids, np.full(ids.size, 0.01))
    store.update_priorities(ids[:1], [5.0])
    for i in range(11, 14):  # windows that open later: new transitions become sampleable
        store.add(0, 0.0, frame(i, OBS), False, False)
    newer = np.setdiff1d(store.valid_ids(), ids)
    assert newer.tolist() == [8, 9, 10]
    priorities = store._sampler.priorities()
    flat, _ = store._ring.flat_of_ids(newer)
    # 8 and 9 arrived (windows still open) when the max was 1.0; 10 arrived after the 5.0
    assert priorities[flat].tolist() == [1.0, 1.0, 5.0]


def test_stale_duplicate_and_bad_updates(tmp_path):
    store = make(tmp_path, capacity=8)
    record(store, 30)
    ids = store.valid_ids()
    applied = store.update_priorities([0, 1, int(ids[0]), int(ids[0])], [9.0, 9.0, 2.0, 3.0])
    assert applied == 1  # ids 0 and 1 were overwritten long ago; duplicate counts once
    flat, _ = store._ring.flat_of_ids(ids[:1])
    assert store._sampler.priorities()[flat[0]] == 3.0  # last value wins
    before = store._sampler.priorities().copy()
    for bad in ([np.nan], [-1.0], [np.inf]):
        with pytest.raises(InvalidInputError, match="priorities"):
            store.update_priorities(ids[:1], bad)
    with pytest.raises(InvalidInputError, match="one per id"):
        store.update_priorities(ids[:2], [1.0])
    assert np.array_equal(before, store._sampler.priorities())


def test_uniform_store_refuses_priority_updates(tmp_path):
    store = make(tmp_path, sampler="uniform")
    record(store, 5)
    with pytest.raises(InvalidInputError, match="prioritized"):
        store.update_priorities([0], [1.0])


@pytest.mark.parametrize("sampler", ["prioritized", "rank"])
def test_priorities_survive_reopen_and_resume_exactly(tmp_path, sampler):
    rng = np.random.default_rng(1)

    def run(store, reopen_at: int | None):
        record(store, 40, done_every=13)
        drawn = []
        for step in range(6):
            if step == reopen_at:
                store.close()
                store = ReplayStore.open(tmp_path / "a")
            batch = store.sample(8, beta=0.5)
            drawn.append(batch.ids.tolist())
            store.update_priorities(batch.ids, rng.random(8) * 3)
        return drawn

    first = run(make(tmp_path, "a", sampler=sampler, capacity=32), reopen_at=3)
    rng = np.random.default_rng(1)
    second = run(make(tmp_path, "b", sampler=sampler, capacity=32), reopen_at=None)
    assert first == second


def test_wraparound_keeps_tree_consistent(tmp_path):
    store = make(tmp_path, capacity=16, frame_stack=4, n_step=3)
    rng = np.random.default_rng(0)
    record(store, 5)
    for i in range(6, 200):
        store.add(0, 1.0, frame(i, OBS), bool(rng.random() < 0.1), False)
        if not store._ring.running[0]:
            store.reset(frame(i, OBS))
        if len(store):
            batch = store.sample(4)
            store.update_priorities(batch.ids, rng.random(4))
    store._sampler.check_valid()
    mass = store._sampler.probabilities()
    valid = store._ring.valid
    assert np.all(mass[~valid] == 0) and np.all(mass[valid] > 0)

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
        store.flush()  # from here only the updates change step blocks
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_updates_match_a_dict_of_last_values(tmp_path, seed):
    """update_priorities (one compiled call) against a naive model: the last value given for
    each id sampleable at update time, in stores whose envs advance independently (so some
    live ids are found only through the ring's spill table) and wrap around."""
    rng = np.random.default_rng(seed)
    store = make(tmp_path, capacity=3 * 11, num_envs=3)
    store.reset(np.stack([frame(0, OBS)] * 3))
    want: dict[int, float] = {}
    spilled = 0
    for step in range(400):
        envs = np.flatnonzero(rng.random(3) < [0.9, 0.5, 0.1])
        if envs.size:
            done = rng.random(envs.size) < 0.05
            store.add(np.zeros(envs.size, np.int64), np.ones(envs.size, np.float32),
                      np.stack([frame(step, OBS)] * envs.size), done, np.zeros(envs.size, bool),
                      env_ids=envs)
            if done.any():
                store.reset(np.stack([frame(step, OBS)] * int(done.sum())), env_ids=envs[done])
        live = store.valid_ids()
        if live.size == 0 or step % 3:
            continue
        spilled += store._ring.id_map().spills
        ids = np.concatenate([rng.choice(live, 6), rng.integers(0, store.counts.transitions + 5,
                                                                4)])
        values = rng.random(ids.size) * 5
        expected = {int(i): float(v) for i, v in zip(ids, values, strict=True)
                    if int(i) in set(live.tolist())}
        assert store.update_priorities(ids, values) == len(expected)
        want.update(expected)
        store._sampler.check_valid()
        keep = [i for i in want if i in set(store.valid_ids().tolist())]
        flat, found = store._ring.flat_of_ids(np.array(keep, np.int64))
        assert found.all()
        np.testing.assert_array_equal(store._sampler.priorities()[flat], [want[i] for i in keep])
    assert spilled > 0  # the spill table was exercised


def test_overflowing_update_changes_nothing(tmp_path):
    store = make(tmp_path, alpha=10.0)
    record(store, 20)
    ids = store.valid_ids()
    before = store._sampler.priorities().copy()
    with pytest.raises(InvalidInputError, match="overflows"):
        store.update_priorities(ids[:3], [1.0, 1e40, 2.0])
    assert np.array_equal(before, store._sampler.priorities())
    store._sampler.check_valid()


def test_update_takes_torch_float32_lists_and_empty_input(tmp_path):
    torch = pytest.importorskip("torch")
    store = make(tmp_path, capacity=16)
    record(store, 40)
    ids = store.valid_ids()
    flat, _ = store._ring.flat_of_ids(ids[:3])
    assert store.update_priorities(torch.tensor(ids[:3]),
                                   torch.tensor([1.5, 2.25, 3.0], dtype=torch.float32)) == 3
    np.testing.assert_array_equal(store._sampler.priorities()[flat], [1.5, 2.25, 3.0])
    assert store.update_priorities(ids[:2].astype(np.int32), np.array([4.0, 5.0], np.float32)) == 2
    assert store.update_priorities([int(ids[2])], [6]) == 1  # Python ints as priorities
    np.testing.assert_array_equal(store._sampler.priorities()[flat], [4.0, 5.0, 6.0])
    assert store.update_priorities(ids[::-1][::2].copy(), np.ones(ids[::2].size)) > 0
    assert store.update_priorities(ids[::2], np.ones(ids[::2].size)) > 0  # a strided view
    for empty in ([], np.empty(0, np.int64), torch.empty(0, dtype=torch.int64)):
        assert store.update_priorities(empty, np.empty(0)) == 0
    with pytest.raises(InvalidInputError, match="ints"):
        store.update_priorities(np.array([1.0]), [1.0])
    store._sampler.check_valid()


def test_ids_past_the_ring_or_negative_are_ignored(tmp_path):
    store = make(tmp_path, capacity=16)
    record(store, 40)
    ids = store.valid_ids()
    before = store._sampler.probabilities()
    past = [store.counts.transitions, store.counts.transitions + 5, 10**12, -1, -(2**62)]
    assert store.update_priorities(past, np.full(len(past), 5.0)) == 0
    np.testing.assert_array_equal(store._sampler.probabilities(), before)
    assert store.update_priorities([10**12, int(ids[-1]), -3], [9.0, 2.0, 9.0]) == 1
    flat, _ = store._ring.flat_of_ids(ids[-1:])
    assert store._sampler.priorities()[flat[0]] == 2.0 and store._sampler.max_priority() < 9.0
    store._sampler.check_valid()


@pytest.mark.parametrize("bad", [np.nan, -1e-30, np.inf, -np.inf])
def test_a_bad_value_changes_nothing_even_for_a_stale_id(tmp_path, bad):
    """Every value is checked before any write, those of ignored ids too: the tree, the
    priorities and the max priority stay as they were."""
    store = make(tmp_path, capacity=16)
    record(store, 40)
    ids = store.valid_ids()
    store.update_priorities(ids, np.linspace(0.5, 3.0, ids.size))
    before = (store._sampler.probabilities(), store._sampler.priorities(),
              store._sampler.max_priority())
    for wanted, values in (([0, int(ids[0])], [bad, 7.0]), ([int(ids[0]), 0], [7.0, bad]),
                           (ids[:3], np.array([7.0, 7.0, bad], np.float32))):
        with pytest.raises(InvalidInputError, match="finite and >= 0"):
            store.update_priorities(wanted, values)
    np.testing.assert_array_equal(store._sampler.probabilities(), before[0])
    np.testing.assert_array_equal(store._sampler.priorities(), before[1])
    assert store._sampler.max_priority() == before[2]
    store._sampler.check_valid()


def test_updated_priorities_of_every_block_are_committed(tmp_path):
    """The compiled update marks the step blocks it writes; a flush saves exactly those
    blocks' priorities, so a reopened store holds every value set."""
    store = make(tmp_path, capacity=64, block_slots=5)
    record(store, 70, done_every=17)
    store.flush()
    ids = store.valid_ids()
    rng = np.random.default_rng(3)
    for part in np.array_split(rng.permutation(ids), 4):
        store.update_priorities(part, rng.random(part.size) * 4)
        store.flush()
    pick = rng.choice(ids, 7)
    store.update_priorities(pick, rng.random(7) + 5)  # left for close to commit
    want = store._sampler.priorities()
    store.close()
    with ReplayStore.open(tmp_path / "s") as again:
        np.testing.assert_array_equal(again._sampler.priorities(), want)
        again._sampler.check_valid()

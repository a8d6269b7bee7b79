"""Blocks of steps recorded in one call (`ReplayStore.add_rows` -> `index.blocks.record_block`,
`FrameStore.append_run`) against the same steps added one ``add`` at a time."""

from __future__ import annotations

import numpy as np
import pytest

from mmreplay import ReplayStore, StepRows

OBS = (2, 3)


def frames(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.integers(0, 255, (*shape, *OBS), dtype=np.uint8)


def make(path, envs: int, capacity: int, extras: bool) -> ReplayStore:
    return ReplayStore.create(path, capacity=capacity, obs_shape=OBS, num_envs=envs, seed=0,
                              frame_stack=2, n_step=2, chunk_frames=4,
                              extras={"h": ((2,), np.float32)} if extras else None)


def stream(rng: np.random.Generator, rows: int, envs: int, running: np.ndarray,
           extras: bool) -> StepRows:
    """Rows of random steps in a valid episode order: an env whose episode ended autoresets."""
    auto = np.zeros((rows, envs), bool)
    term, trunc = np.zeros((rows, envs), bool), np.zeros((rows, envs), bool)
    for t in range(rows):
        auto[t] = ~running | (rng.random(envs) < 0.05)
        end = rng.random(envs)
        term[t], trunc[t] = ~auto[t] & (end < 0.1), ~auto[t] & (end > 0.95)
        running = auto[t] | ~(term[t] | trunc[t])
    return StepRows(env_ids=np.arange(envs), action=rng.integers(0, 4, (rows, envs)),
                    reward=rng.standard_normal((rows, envs)).astype(np.float32),
                    next_obs=frames(rng, rows, envs), terminated=term, truncated=trunc,
                    autoreset=auto,
                    extras={"h": rng.standard_normal((rows, envs, 2)).astype(np.float32)}
                    if extras else None)


def add_each(store: ReplayStore, rows: StepRows) -> None:
    for t in range(np.shape(rows.reward)[0]):
        store.add(rows.action[t], rows.reward[t], rows.next_obs[t], rows.terminated[t],
                  rows.truncated[t], rows.autoreset[t], env_ids=rows.env_ids,
                  extras=None if rows.extras is None else {"h": rows.extras["h"][t]})


def subset(rows: StepRows, envs: list[int]) -> StepRows:
    pick = np.array(envs)
    return StepRows(env_ids=pick, action=rows.action[:, pick], reward=rows.reward[:, pick],
                    next_obs=rows.next_obs[:, pick], terminated=rows.terminated[:, pick],
                    truncated=rows.truncated[:, pick], autoreset=rows.autoreset[:, pick],
                    extras=None if rows.extras is None else {"h": rows.extras["h"][:, pick]})


def assert_same(one: ReplayStore, many: ReplayStore) -> None:
    assert one.counts == many.counts
    a, b = one.views.step_columns(), many.views.step_columns()
    assert np.array_equal(a.steps, b.steps)
    assert np.array_equal(a.written, b.written) and np.array_equal(a.running, b.running)
    ids = one.valid_ids()
    assert ids.tolist() == many.valid_ids().tolist()
    if ids.size:
        x, y = one.get(ids), many.get(ids)
        for name in ("obs", "next_obs", "action", "reward", "discount", "terminated",
                     "truncated", "ids"):
            assert getattr(x, name).equal(getattr(y, name)), name
        assert x.extras.keys() == y.extras.keys()
        for name in x.extras:
            assert x.extras[name].equal(y.extras[name])
    # every id ever given: found (or not) alike, through the id map and its spill table
    every = np.arange(one.counts.transitions)
    assert one.views.step_columns().next_id == many.views.step_columns().next_id
    for store in (one, many):
        store._ring.check_valid()
    assert [one._ring.flat_of_ids(every)[1].tolist()] == [many._ring.flat_of_ids(every)[1]
                                                          .tolist()]


@pytest.mark.parametrize(("envs", "capacity", "extras"), [(1, 7, False), (1, 50, True),
                                                          (3, 37, True), (2, 1000, False)])
def test_blocks_record_what_single_adds_record(tmp_path, envs, capacity, extras):
    rng = np.random.default_rng(envs * 1000 + capacity)
    one = make(tmp_path / "one", envs, capacity, extras)
    many = make(tmp_path / "many", envs, capacity, extras)
    first = frames(rng, envs)
    for store in (one, many):
        store.reset(first)
    running = np.ones(envs, bool)
    for block in range(12):
        rows = stream(rng, int(rng.integers(1, 2 * capacity // envs + 2)), envs, running,
                      extras)
        if envs > 1 and block % 3 == 2:  # some envs only: ids spill as envs drift apart
            rows = subset(rows, [0])
        add_each(one, rows)
        many.add_rows(rows)
        pick = np.asarray(rows.env_ids)
        running[pick] = (rows.autoreset | ~(rows.terminated | rows.truncated))[-1]
        assert_same(one, many)
    for store in (one, many):
        store.flush()
    again = ReplayStore.open(tmp_path / "many", "r")
    assert again.valid_ids().tolist() == one.valid_ids().tolist()
    again.close()


def test_a_block_ending_an_episode_then_stepping_it_is_refused_whole(tmp_path):
    store = make(tmp_path / "s", 1, 20, False)
    store.reset(np.zeros((1, *OBS), np.uint8))
    rng = np.random.default_rng(0)
    rows = stream(rng, 5, 1, np.ones(1, bool), False)
    term = np.array(rows.terminated)
    term[:] = False
    term[2] = True  # row 3 steps an ended episode without an autoreset
    auto = np.zeros_like(term)
    before = store.views.step_columns().steps.copy()
    with pytest.raises(ValueError, match="env 0 whose episode has ended"):
        store.add_rows(StepRows(**{**rows.__dict__, "terminated": term, "autoreset": auto}))
    assert np.array_equal(before, store.views.step_columns().steps)
    assert store.counts.transitions == 0

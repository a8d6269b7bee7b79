"""The public seams tools use: ``add_rows``, ``store.views``, ``reseed``, ``format_version``,
`StepRing.kept_frames`, and the safe-I/O helpers the storage modules share."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from mmreplay import InvalidInputError, ReplayStore, StepRows
from mmreplay.index.ring import StepRing
from mmreplay.spec import make_spec
from mmreplay.storage.safe_io import file_kind, is_json, json_type, strict_equal

OBS = (3, 2)


def frame(value: int) -> np.ndarray:
    return np.full(OBS, value % 256, np.uint8)


def make(tmp_path, name="store", **kw):
    kw.setdefault("capacity", 40)
    kw.setdefault("obs_shape", OBS)
    kw.setdefault("seed", 0)
    return ReplayStore.create(tmp_path / name, **kw)


def rows_of(steps: list[tuple[int, ...]], envs: int, start: int) -> StepRows:
    """Rows of (action, reward, terminated, truncated, autoreset) per row, same for every env;
    the frames count up from `start`."""
    n = len(steps)
    col = np.array(steps).reshape(n, 1, 5).repeat(envs, axis=1)
    frames = np.stack([np.stack([frame(start + t * envs + e) for e in range(envs)])
                       for t in range(n)])
    return StepRows(env_ids=np.arange(envs), action=col[..., 0].astype(np.int64),
                    reward=col[..., 1].astype(np.float32), next_obs=frames,
                    terminated=col[..., 2].astype(bool), truncated=col[..., 3].astype(bool),
                    autoreset=col[..., 4].astype(bool))


# -- add_rows ----------------------------------------------------------------------------------
def test_add_rows_records_what_the_same_adds_record(tmp_path):
    steps = [(1, 1, 0, 0, 0), (2, 0, 1, 0, 0), (0, 0, 0, 0, 1), (3, 2, 0, 0, 0),
             (1, 5, 0, 1, 0), (0, 0, 0, 0, 1), (2, 1, 0, 0, 0)]
    rows = rows_of(steps, 2, 10)
    one, many = make(tmp_path, "one", num_envs=2), make(tmp_path, "many", num_envs=2)
    for store in (one, many):
        store.reset(np.stack([frame(0), frame(1)]))
    for t in range(len(steps)):
        one.add(rows.action[t], rows.reward[t], rows.next_obs[t], rows.terminated[t],
                rows.truncated[t], rows.autoreset[t])
    many.add_rows(rows)
    assert one.counts == many.counts
    assert one.valid_ids().tolist() == many.valid_ids().tolist()
    a, b = one.get(one.valid_ids()), many.get(many.valid_ids())
    for name in ("obs", "next_obs", "action", "reward", "discount", "terminated", "truncated"):
        assert getattr(a, name).equal(getattr(b, name)), name
    assert np.array_equal(one.views.step_columns().steps, many.views.step_columns().steps)


def test_add_rows_checks_every_row_before_recording_any(tmp_path):
    store = make(tmp_path, num_envs=2)
    store.reset(np.stack([frame(0), frame(1)]))
    before = store.views.step_columns().steps.copy()
    ended_then_steps = rows_of([(1, 1, 1, 0, 0), (1, 1, 0, 0, 0)], 2, 5)
    with pytest.raises(InvalidInputError, match="whose episode has ended"):
        store.add_rows(ended_then_steps)
    bad_reward = rows_of([(1, 1, 0, 0, 0), (1, 1, 0, 0, 0)], 2, 5)
    reward = np.array(bad_reward.reward)
    reward[1, 0] = np.nan
    with pytest.raises(InvalidInputError, match="finite"):
        store.add_rows(StepRows(**{**bad_reward.__dict__, "reward": reward}))
    with pytest.raises(InvalidInputError, match=r"\(rows, envs\)"):
        store.add_rows(StepRows(**{**bad_reward.__dict__, "reward": reward[:, :1]}))
    assert store.counts.transitions == 0
    assert np.array_equal(before, store.views.step_columns().steps)


def test_add_rows_takes_the_declared_extras(tmp_path):
    store = make(tmp_path, extras={"h": ((2,), np.float32)})
    store.reset(frame(0))
    rows = rows_of([(1, 1, 0, 0, 0), (2, 1, 0, 0, 0)], 1, 1)
    with pytest.raises(InvalidInputError, match="missing"):
        store.add_rows(rows)
    h = np.arange(4, dtype=np.float32).reshape(2, 1, 2)
    store.add_rows(StepRows(**{**rows.__dict__, "extras": {"h": h}}))
    assert store.get([0, 1]).extras["h"].numpy().tolist() == [[0, 1], [2, 3]]


def test_add_rows_refuses_read_only_stores(tmp_path):
    make(tmp_path).close()
    with ReplayStore.open(tmp_path / "store", "r") as reader, pytest.raises(Exception,
                                                                            match="read-only"):
        reader.add_rows(rows_of([(1, 1, 0, 0, 0)], 1, 1))


# -- views ---------------------------------------------------------------------------------------
def test_step_columns_are_a_read_only_view_of_the_ring(tmp_path):
    store = make(tmp_path, capacity=8)  # slots_per_env 8 + stack: wraps after a few episodes
    number = 0  # frame f of the env holds value f
    for _ in range(4):
        store.reset(frame(number))
        for t in range(4):
            store.add(t, 1.0, frame(number + 1), t == 3, False)
            number += 1
        number += 1
    cols = store.views.step_columns()
    with pytest.raises(ValueError, match="read-only"):
        cols.steps["reward"][0, 0] = 1.0
    env, frames = cols.kept_frames()
    assert (frames >= cols.oldest[env]).all() and (frames < cols.written[env]).all()
    assert frames.size == store.counts.frames_kept
    kept = store.views.read_frames(cols.flat(env, frames))
    assert kept[:, 0, 0].tolist() == [f % 256 for f in frames.tolist()]  # frame f holds f
    assert cols.next_id == store.counts.transitions and cols.valid.sum() == len(store)


def test_read_frames_refuses_slots_outside_the_ring(tmp_path):
    store = make(tmp_path, capacity=8)
    size = store.spec.num_envs * store.spec.slots_per_env
    for slots in ([size], [-1], [[0]], [0.5]):
        with pytest.raises(InvalidInputError, match="slots must be"):
            store.views.read_frames(slots)


def test_priority_state_and_memory(tmp_path):
    assert make(tmp_path, "uniform").views.priority_state() is None
    store = make(tmp_path, sampler="prioritized")
    store.reset(frame(0))
    for t in range(5):
        store.add(0, 0.0, frame(t + 1), False, False)
    store.update_priorities([0, 1], [3.0, 0.5])
    state = store.views.priority_state()
    assert sorted(state.sampleable.tolist()) == [0.5, 1.0, 1.0, 1.0, 3.0]
    assert state.max_priority == 3.0
    mem = store.views.memory()
    assert mem.steps_bytes == store.views.step_columns().steps.nbytes
    assert mem.sampler_bytes > 0 and mem.index_bytes > 0 and mem.tail_frames == 6
    assert mem.cache.budget_bytes >= 0 and mem.cache.chunks >= 0


def test_check_valid_finds_a_corrupted_mask(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0))
    for t in range(6):
        store.add(0, 0.0, frame(t + 1), False, False)
    store.views.check_valid()
    store._ring.valid[int(np.flatnonzero(~store._ring.valid)[0])] = True  # break it
    with pytest.raises(RuntimeError, match="validity mask"):
        store.views.check_valid()


def test_reseed_and_format_version(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0))
    for t in range(9):
        store.add(0, 0.0, frame(t + 1), False, False)
    store.reseed(7)
    first = store.sample(16).ids.tolist()
    store.reseed(7)
    assert store.sample(16).ids.tolist() == first
    assert store.format_version >= 1


# -- kept frames: one implementation, checked against a loop -----------------------------------
@pytest.mark.parametrize("capacity", [7, 50])
def test_ring_kept_frames_matches_a_loop(capacity):
    ring = StepRing(make_spec(capacity=capacity, obs_shape=OBS, num_envs=3))
    rng = np.random.default_rng(capacity)
    ring.begin_episodes(np.arange(3))
    for _ in range(4 * capacity):
        envs = np.flatnonzero(rng.random(3) < 0.7)
        idle = envs[~ring.running[envs]]
        ring.begin_episodes(idle)
        step = envs[ring.running[envs]]
        ring.record_steps(step, np.zeros(step.size, np.int64), np.zeros(step.size, np.float32),
                          rng.random(step.size) < 0.1, np.zeros(step.size, bool))
    env, frames = ring.kept_frames()
    want = [(e, f) for e in range(3) for f in range(int(ring.oldest[e]), int(ring.written[e]))]
    assert list(zip(env.tolist(), frames.tolist(), strict=True)) == want
    assert (ring.written - ring.oldest == ring.slots_per_env).any()  # wrapped


# -- safe_io helpers shared by layout and manifest -------------------------------------------
def test_safe_io_shared_helpers(tmp_path):
    assert strict_equal({"a": [1, 2.0]}, {"a": [1, 2.0]})
    assert not strict_equal(1, 1.0) and not strict_equal(True, 1)
    assert is_json(3, int) and not is_json(True, int)
    assert [json_type(v) for v in ({}, [], "", True, 1, 1.0, None)] == [
        "object", "array", "string", "bool", "int", "float", "null"]
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    assert file_kind(os.lstat(tmp_path / "link").st_mode) == "a symlink"
    assert file_kind(stat.S_IFDIR) == "a directory"

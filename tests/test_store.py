"""ReplayStore facade: API contract, episode edges, bad input, persistence, locking."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import zarr
from conftest import frame

from mmreplay import (
    EmptyStoreError,
    InvalidInputError,
    InvalidStoreError,
    ReadOnlyError,
    ReplayStore,
    StoreLockedError,
    UnknownIdError,
)

OBS = (4, 3)


def make(tmp_path, **kw):
    kw.setdefault("capacity", 64)
    kw.setdefault("obs_shape", OBS)
    kw.setdefault("seed", 0)
    return ReplayStore.create(tmp_path / "store", **kw)


def run_episode(store, start: int, length: int, *, terminated=True, reward=1.0) -> int:
    """Record o_start..o_{start+length}; returns the next free frame value."""
    store.reset(frame(start, OBS))
    for i in range(1, length + 1):
        last = i == length
        store.add(i % 3, reward, frame(start + i, OBS), terminated and last, False)
    return start + length + 1


def snapshot(store):
    ids = store.valid_ids()
    return ids, (store.get(ids) if ids.size else None)


def assert_same_batches(a, b):
    for field in ("obs", "action", "reward", "next_obs", "terminated", "truncated",
                  "discount", "ids"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


# -- contract -----------------------------------------------------------------------


def test_batch_fields_shapes_and_dtypes(tmp_path):
    store = make(tmp_path, frame_stack=4)
    run_episode(store, 0, 10)
    batch = store.sample(5)
    assert batch.obs.shape == (5, 4, *OBS) and batch.obs.dtype == torch.uint8
    assert batch.next_obs.shape == (5, 4, *OBS) and batch.next_obs.dtype == torch.uint8
    assert batch.action.shape == (5,) and batch.action.dtype == torch.int64
    assert batch.reward.dtype == torch.float32 and batch.discount.dtype == torch.float32
    assert batch.terminated.dtype == torch.bool and batch.weights.dtype == torch.float32
    assert batch.ids.dtype == torch.int64 and torch.all(batch.weights == 1)


def test_stack_and_next_stack_by_index_with_zero_padding(tmp_path):
    store = make(tmp_path, frame_stack=3)
    run_episode(store, 10, 4)  # frames 10..14
    batch = store.get([0, 1, 3])
    firsts = batch.obs[:, :, 0, 0].tolist()
    assert firsts == [[0, 0, 10], [0, 10, 11], [11, 12, 13]]
    assert batch.next_obs[:, :, 0, 0].tolist() == [[0, 10, 11], [10, 11, 12], [12, 13, 14]]
    assert batch.terminated.tolist() == [False, False, True]
    assert batch.discount[2] == 0 and batch.discount[0] == pytest.approx(0.99)


def test_first_padding_repeats_o0(tmp_path):
    store = make(tmp_path, frame_stack=3, stack_padding="first")
    run_episode(store, 10, 2)
    assert store.get([0]).obs[0, :, 0, 0].tolist() == [10, 10, 10]


def test_stack_never_reads_previous_episode(tmp_path):
    store = make(tmp_path, frame_stack=4)
    nxt = run_episode(store, 0, 3)
    run_episode(store, nxt, 3)
    batch = store.get([3])  # first step of episode 2
    assert batch.obs[0, :, 0, 0].tolist() == [0, 0, 0, nxt]


def test_n_step_return_and_discount(tmp_path):
    store = make(tmp_path, n_step=3, gamma=0.5)
    store.reset(frame(0, OBS))
    for i, r in enumerate([1.0, 2.0, 4.0, 8.0]):
        store.add(0, r, frame(i + 1, OBS), i == 3, False)
    batch = store.get(store.valid_ids())
    assert batch.ids.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(batch.reward, [1 + 1 + 1, 2 + 2 + 2, 4 + 4, 8])
    np.testing.assert_allclose(batch.discount, [0.125, 0.0, 0.0, 0.0])
    assert batch.next_obs[:, 0, 0, 0].tolist() == [3, 4, 4, 4]


def test_open_window_is_not_sampleable(tmp_path):
    store = make(tmp_path, n_step=3)
    store.reset(frame(0, OBS))
    store.add(0, 1.0, frame(1, OBS), False, False)
    store.add(0, 1.0, frame(2, OBS), False, False)
    assert len(store) == 0
    with pytest.raises(UnknownIdError):
        store.get([0])
    store.add(0, 1.0, frame(3, OBS), False, False)
    assert store.valid_ids().tolist() == [0]


def test_truncated_bootstraps_from_final_observation(tmp_path):
    store = make(tmp_path, gamma=0.9)
    store.reset(frame(0, OBS))
    store.add(1, 1.0, frame(1, OBS), False, True)
    batch = store.get([0])
    assert batch.truncated.tolist() == [True] and batch.terminated.tolist() == [False]
    assert batch.discount.item() == pytest.approx(0.9)
    assert batch.next_obs[0, 0, 0, 0] == 1


def test_reset_of_running_episode_truncates_it(tmp_path):
    store = make(tmp_path, n_step=3)
    store.reset(frame(0, OBS))
    store.add(0, 1.0, frame(1, OBS), False, False)
    store.add(0, 1.0, frame(2, OBS), False, False)
    assert len(store) == 0
    store.reset(frame(3, OBS))
    batch = store.get([0, 1])
    assert batch.truncated.tolist() == [True, True]  # both n-step windows end at the cut
    assert batch.discount.tolist() == pytest.approx([0.99**2, 0.99])
    assert batch.next_obs[:, 0, 0, 0].tolist() == [2, 2]


def test_fifo_capacity_and_eviction(tmp_path):
    store = make(tmp_path, capacity=10, frame_stack=2, chunk_frames=4)
    store.reset(frame(0, OBS))
    for i in range(1, 30):
        store.add(0, 0.0, frame(i, OBS), False, False)
    # frames 20..29 are kept; transition t needs frames t-1..t+1
    assert store.counts.frames_kept == 10
    assert store.valid_ids().tolist() == list(range(21, 29))
    with pytest.raises(UnknownIdError):
        store.get([20])


def test_multi_env_ids_in_env_order_and_autoreset(tmp_path):
    store = make(tmp_path, num_envs=3, capacity=60)
    obs = np.stack([frame(v, OBS) for v in (0, 100, 200)])
    store.reset(obs)
    store.add(np.array([0, 1, 2]), np.zeros(3), obs + 1, np.array([False, True, False]),
              np.zeros(3, bool))
    auto = np.array([False, True, False])
    store.add(np.array([0, 1, 2]), np.ones(3), obs + 2, np.zeros(3, bool), np.zeros(3, bool),
              autoreset=auto)
    assert store.counts.transitions == 5  # env 1's autoreset step has no transition
    batch = store.get(store.valid_ids())
    assert batch.ids.tolist() == [0, 1, 2, 3, 4]
    assert batch.obs[:, 0, 0, 0].tolist() == [0, 100, 200, 1, 201]
    assert batch.terminated.tolist() == [False, True, False, False, False]
    store.add(np.array([0, 1, 2]), np.ones(3), obs + 3, np.zeros(3, bool), np.zeros(3, bool))
    assert store.get([6]).obs[0, 0, 0, 0] == 102  # env 1's new episode starts at o_0 = 102


def test_reset_subset_of_envs(tmp_path):
    store = make(tmp_path, num_envs=2, capacity=40)
    store.reset(np.stack([frame(0, OBS), frame(50, OBS)]))
    store.add(np.array([0, 0]), np.zeros(2), np.stack([frame(1, OBS), frame(51, OBS)]),
              np.zeros(2, bool), np.zeros(2, bool))
    store.reset(frame(60, OBS)[None], env_ids=[1])
    assert store.get([1]).truncated.item() is True
    assert store.get([0]).truncated.item() is False  # env 0 keeps running


def _steps(n: int, value: int) -> tuple:
    """Arguments of an ``add`` of n rows: action 1, reward 1, frames `value`, no flags."""
    return (np.ones(n, np.int64), np.ones(n), np.full((n, *OBS), value % 256, np.uint8),
            np.zeros(n, bool), np.zeros(n, bool))


def test_add_with_env_ids_advances_only_those_envs(tmp_path):
    store = make(tmp_path, num_envs=3, capacity=60, frame_stack=2, n_step=2, gamma=0.5)
    store.reset(np.stack([frame(0, OBS), frame(100, OBS), frame(200, OBS)]))
    store.add(*_steps(2, 1), env_ids=[2, 0])         # rows in env_ids order: ids 0 (env 2), 1
    store.add(*_steps(1, 2), env_ids=[0])
    store.add(*_steps(1, 3), env_ids=[0])
    assert store.counts.frames_written == 3 + 4 and store.counts.transitions == 4
    assert store.valid_ids().tolist() == [1, 2]       # env 0's complete 2-step windows
    batch = store.get([1, 2])
    assert batch.obs[:, :, 0, 0].tolist() == [[0, 0], [0, 1]]
    assert batch.next_obs[:, :, 0, 0].tolist() == [[1, 2], [2, 3]]
    assert batch.reward.tolist() == [1.5, 1.5]
    store.add(*_steps(3, 4))                          # all envs again: env 1's first step
    store.add(*_steps(1, 5), env_ids=[1])
    assert store.get([5]).obs[0, :, 0, 0].tolist() == [0, 100]
    assert store.get([5]).next_obs[0, :, 0, 0].tolist() == [4, 5]


def test_add_with_env_ids_autoreset_and_eviction_per_env(tmp_path):
    store = make(tmp_path, num_envs=2, capacity=8)   # 4 frames per env
    store.reset(np.stack([frame(0, OBS), frame(100, OBS)]))
    for v in range(1, 7):
        store.add(*_steps(1, v), env_ids=[0])
    assert store.counts.frames_kept == 4 + 1  # env 0 evicted its oldest, env 1 kept its o_0
    action, reward, obs, term, trunc = _steps(2, 50)
    store.add(action, reward, obs, term | [False, True], trunc, env_ids=[1, 0])
    store.add(*_steps(1, 60), autoreset=np.array([True]), env_ids=[0])  # o_0 of a new episode
    store.add(*_steps(1, 61), env_ids=[0])
    batch = store.get(store.valid_ids())
    assert batch.obs[-1, 0, 0, 0] == 60 and batch.terminated[-2]
    assert store.counts.episodes == 3


def test_old_ids_of_a_lagging_env_stay_reachable(tmp_path):
    """Env 0 keeps its one transition while env 1 writes many times the store's capacity:
    get and update_priorities still find it, also after a reopen."""
    store = make(tmp_path, num_envs=2, capacity=16, sampler="prioritized")
    store.reset(np.stack([frame(0, OBS), frame(100, OBS)]))
    action, reward, obs, term, trunc = _steps(1, 1)
    store.add(action, reward, obs, term | True, trunc, env_ids=[0])  # id 0, env 0 ends
    for v in range(200):
        store.add(*_steps(1, v), env_ids=[1])
    assert 0 in store.valid_ids().tolist() and store.get([0]).obs[0, 0, 0, 0] == 0
    assert store.update_priorities([0, 199], [5.0, 1.0]) == 2
    store.close()
    with ReplayStore.open(tmp_path / "store") as again:
        assert again.get([0]).next_obs[0, 0, 0, 0] == 1
        assert again.update_priorities([0], [2.0]) == 1


BAD_ENV_ID_ADDS = [
    (dict(env_ids=[1, 1]), "duplicates"),
    (dict(env_ids=[3]), "unknown env id 3"),
    (dict(env_ids=[[0, 1]]), "1-d"),
    (dict(env_ids=[0.5]), "ints"),
    (dict(env_ids=[0, 1, 2], rows=2), "leading dimension"),
    (dict(env_ids=[0], rows=2), "leading dimension"),
    (dict(env_ids=[2, 0], autoreset=np.zeros(3, bool)), "autoreset shape"),
    (dict(env_ids=[2, 0], terminated=np.zeros(2, np.int8)), "bool"),
    (dict(env_ids=[1, 0]), "reset"),  # env 1 ended: needs reset or autoreset
]


@pytest.mark.parametrize(("override", "message"), BAD_ENV_ID_ADDS)
def test_bad_add_with_env_ids_is_rejected_and_changes_nothing(tmp_path, override, message):
    store = make(tmp_path, num_envs=3, capacity=30, frame_stack=2)
    store.reset(np.stack([frame(0, OBS), frame(100, OBS), frame(200, OBS)]))
    action, reward, obs, term, trunc = _steps(3, 1)
    store.add(action, reward, obs, term | [False, True, False], trunc)  # env 1 ends
    before_ids, before = snapshot(store)
    counts = store.counts
    rows = override.pop("rows", len(np.atleast_1d(np.asarray(override["env_ids"]).ravel())))
    args = dict(zip(("action", "reward", "next_obs", "terminated", "truncated"),
                    _steps(rows, 9), strict=True))
    args.update(override)
    with pytest.raises(InvalidInputError, match=message):
        store.add(**args)
    after_ids, after = snapshot(store)
    assert np.array_equal(before_ids, after_ids) and store.counts == counts
    assert_same_batches(before, after)
    store.add(*_steps(2, 2), env_ids=[2, 0])  # and the store still works
    assert store.counts.transitions == 5


def test_single_env_add_with_env_ids(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0, OBS))
    store.add(1, 1.0, frame(1, OBS), False, False, env_ids=[0])          # unbatched rows
    store.add(*_steps(1, 2), env_ids=np.array([0]))                 # batched rows
    store.add(*_steps(0, 0), env_ids=np.zeros(0, np.int64))         # no env: nothing
    assert store.counts.transitions == 2 and store.counts.frames_written == 3


def test_non_image_float_observations(tmp_path):
    store = ReplayStore.create(tmp_path / "s", capacity=100, obs_shape=(4,),
                               obs_dtype=np.float32, frame_stack=2, seed=1)
    store.reset(np.arange(4, dtype=np.float32))
    store.add(1, 0.5, np.arange(4, dtype=np.float32) + 10, True, False)
    batch = store.get([0])
    assert batch.obs.dtype == torch.float32
    assert batch.obs[0].tolist() == [[0, 0, 0, 0], [0, 1, 2, 3]]
    assert batch.next_obs[0, 1].tolist() == [10, 11, 12, 13]


def test_vector_actions(tmp_path):
    store = make(tmp_path, action_shape=(2,), action_dtype=np.float32)
    store.reset(frame(0, OBS))
    store.add(np.array([0.5, -1.0], np.float32), 0.0, frame(1, OBS), True, False)
    assert store.get([0]).action.tolist() == [[0.5, -1.0]]


# -- bad input ----------------------------------------------------------------------

BAD_ADDS = [
    (dict(next_obs=np.zeros((4, 4), np.uint8)), "shape"),
    (dict(next_obs=np.zeros(OBS, np.float32)), "dtype"),
    (dict(reward=float("nan")), "finite"),
    (dict(reward=float("inf")), "finite"),
    (dict(terminated=1), "bool"),
    (dict(action=np.array([1, 2])), "shape"),
    (dict(action=1.5), "int64"),
    (dict(action=np.float64(2.0)), "int64"),
    (dict(action=np.uint64(2**63)), "does not fit"),
    (dict(action=2**63), "does not fit"),
    (dict(terminated=np.float64(0.0)), "bool"),
    (dict(autoreset=np.array([True, False])), "shape"),
]


@pytest.mark.parametrize(("override", "message"), BAD_ADDS)
def test_bad_add_is_rejected_and_changes_nothing(tmp_path, override, message):
    store = make(tmp_path, frame_stack=2)
    run_episode(store, 0, 3, terminated=False)
    before_ids, before = snapshot(store)
    args = dict(action=0, reward=1.0, next_obs=frame(9, OBS), terminated=False, truncated=False)
    args.update(override)
    with pytest.raises(InvalidInputError, match=message):
        store.add(**args)
    after_ids, after = snapshot(store)
    assert np.array_equal(before_ids, after_ids)
    assert_same_batches(before, after)
    store.add(0, 1.0, frame(4, OBS), True, False)  # and the store still works
    assert store.counts.transitions == 4


@pytest.mark.parametrize("action_dtype", ["int64", "uint8"])
def test_plain_scalar_steps_store_what_arrays_store(tmp_path, action_dtype):
    """Single-env adds of plain Python scalars take a short path; its result must be
    exactly what the general path stores for the same values given as numpy arrays."""
    rng = np.random.default_rng(0)
    stores = [make(tmp_path / name, capacity=40, frame_stack=2, n_step=2,
                   action_dtype=action_dtype) for name in ("plain", "arrays")]
    for store in stores:
        store.reset(frame(0, OBS))
    for t in range(1, 100):
        action, reward = int(rng.integers(0, 200)), float(rng.normal() * 1e3)
        term, trunc = bool(rng.random() < 0.08), bool(rng.random() < 0.04)
        obs = frame(int(rng.integers(0, 255)), OBS)
        stores[0].add(action, reward, obs, term, np.bool_(trunc) if t % 2 else trunc)
        stores[1].add(np.array(action, action_dtype), np.float64(reward), obs[None],
                      np.array([term]), np.bool_(trunc))
        if term or trunc:
            for store in stores:
                store.reset(frame(t, OBS))
    a, b = (snapshot(store) for store in stores)
    assert np.array_equal(a[0], b[0]) and a[0].size > 20
    assert_same_batches(a[1], b[1])
    assert np.array_equal(stores[0]._ring.steps, stores[1]._ring.steps)


def test_unbatched_array_steps_store_what_batched_arrays_store(tmp_path):
    """Float observations and shaped actions given unbatched (one env) take the short path
    too; it stores exactly what the general path stores, and refuses what it refuses."""
    rng = np.random.default_rng(1)
    stores = [make(tmp_path / name, capacity=40, obs_shape=(4,), obs_dtype=np.float32,
                   action_shape=(2,), action_dtype=np.float32, n_step=2)
              for name in ("short", "general")]
    for store in stores:
        store.reset(np.zeros(4, np.float32))
    for _ in range(1, 80):
        action = rng.normal(size=2).astype(np.float32)
        obs, reward = rng.normal(size=4).astype(np.float32), np.float32(rng.normal())
        term = bool(rng.random() < 0.1)
        stores[0].add(action, reward, obs, term, False)
        stores[1].add(action[None], np.array([reward]), obs[None], np.array([term]),
                      np.array([False]))
        if term:
            for store in stores:
                store.reset(obs)
    a, b = (snapshot(store) for store in stores)
    assert np.array_equal(a[0], b[0]) and a[0].size > 20
    assert_same_batches(a[1], b[1])
    assert np.array_equal(stores[0]._ring.steps, stores[1]._ring.steps)
    good = np.zeros(4, np.float32)
    for obs, action in ((np.array([0, np.nan, 0, 0], np.float32), np.zeros(2, np.float32)),
                        (good, np.array([np.inf, 0], np.float32))):
        with pytest.raises(InvalidInputError, match="NaN or inf"):
            stores[0].add(action, 0.0, obs, False, False)
    assert np.array_equal(stores[0]._ring.steps, stores[1]._ring.steps)


def test_actions_that_do_not_fit_the_action_dtype_are_refused(tmp_path):
    store = make(tmp_path, action_dtype="int8")
    store.reset(frame(0, OBS))
    for bad in (300, -129, np.int64(128), np.array(1000)):
        with pytest.raises(InvalidInputError, match="does not fit"):
            store.add(bad, 0.0, frame(1, OBS), False, False)
    store.add(np.int64(-128), 0.0, frame(1, OBS), True, False)
    assert store.get([0]).action.tolist() == [-128] and store.counts.transitions == 1


def test_cache_budget_default_and_bad_values(tmp_path):
    small = make(tmp_path / "small")  # 64 frames of 12 bytes: every decoded chunk is cached
    assert small._frames.cache_budget == 64 * 12
    big = make(tmp_path / "big", capacity=4000, obs_shape=(84, 84, 3, 4))  # 1.1 GiB: none
    assert big._frames.cache_budget == 0
    assert make(tmp_path / "set", cache_bytes=5)._frames.cache_budget == 5
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(InvalidInputError, match="cache_bytes"):
            ReplayStore.open(small.path, "r", cache_bytes=bad)
        with pytest.raises(InvalidInputError, match="cache_bytes"):
            make(tmp_path / "bad", cache_bytes=bad)
        assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_add_before_reset(tmp_path):
    store = make(tmp_path)
    with pytest.raises(InvalidInputError, match="reset"):
        store.add(0, 0.0, frame(1, OBS), False, False)
    run_episode(store, 0, 2)
    with pytest.raises(InvalidInputError, match="reset"):
        store.add(0, 0.0, frame(9, OBS), False, False)


def test_wrong_leading_dimension_and_unknown_env(tmp_path):
    store = make(tmp_path, num_envs=2, capacity=20)
    with pytest.raises(InvalidInputError, match="leading dimension"):
        store.reset(np.stack([frame(0, OBS)] * 3))
    with pytest.raises(InvalidInputError, match="unknown env id 5"):
        store.reset(frame(0, OBS)[None], env_ids=[5])
    with pytest.raises(InvalidInputError, match="duplicates"):
        store.reset(np.stack([frame(0, OBS)] * 2), env_ids=[1, 1])
    assert store.counts.frames_written == 0


def test_sample_empty_and_bad_batch_size(tmp_path):
    store = make(tmp_path)
    with pytest.raises(EmptyStoreError):
        store.sample(4)
    run_episode(store, 0, 2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidInputError, match="batch_size"):
            store.sample(bad)


def test_get_rejects_unknown_ids(tmp_path):
    store = make(tmp_path)
    run_episode(store, 0, 3)
    for bad in ([3], [-1], [0, 99]):
        with pytest.raises(UnknownIdError, match="not .*sampleable"):
            store.get(bad)
    with pytest.raises(InvalidInputError):
        store.get([0.5])


def test_create_refuses_bad_config_and_existing_dir(tmp_path):
    with pytest.raises(InvalidInputError, match="stack_padding"):
        make(tmp_path, stack_padding="edge")
    with pytest.raises(InvalidInputError, match="capacity"):
        make(tmp_path, capacity=0)
    with pytest.raises(InvalidInputError, match="obs_dtype"):
        make(tmp_path, obs_dtype=object)
    make(tmp_path).close()
    with pytest.raises(InvalidInputError, match="already exists"):
        make(tmp_path)


# -- persistence --------------------------------------------------------------------


def test_open_rejects_non_store_and_newer_format(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidStoreError, match="not an mmreplay store"):
        ReplayStore.open(tmp_path / "empty")
    with pytest.raises(InvalidStoreError, match="not a directory"):
        ReplayStore.open(tmp_path / "missing")
    make(tmp_path).close()
    path = tmp_path / "store" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(InvalidStoreError, match="newer"):
        ReplayStore.open(tmp_path / "store")


def test_reopen_is_bit_identical(tmp_path):
    store = make(tmp_path, capacity=30, num_envs=2, frame_stack=4, n_step=3, chunk_frames=4)
    rng = np.random.default_rng(0)
    store.reset(np.stack([frame(0, OBS), frame(100, OBS)]))
    prev_done = np.zeros(2, bool)
    for i in range(1, 50):
        done = rng.random(2) < 0.1
        store.add(rng.integers(0, 4, 2), rng.normal(size=2),
                  np.stack([frame(i, OBS), frame(100 + i, OBS)]), done, np.zeros(2, bool),
                  autoreset=prev_done)
        prev_done = done
    ids, before = snapshot(store)
    store.close()
    with ReplayStore.open(tmp_path / "store", mode="r") as again:
        ids2, after = snapshot(again)
    assert np.array_equal(ids, ids2) and ids.size > 10
    assert_same_batches(before, after)


def test_exact_resume_of_the_sampled_sequence(tmp_path):
    store = make(tmp_path, frame_stack=2)
    run_episode(store, 0, 40)
    store.sample(8)
    store.flush()
    expected = [store.sample(16).ids.tolist() for _ in range(3)]
    store.close()  # close flushes the RNG state after those draws: reopen from the flush
    reopened = ReplayStore.open(tmp_path / "store")
    # the close() flush stored the RNG after the three draws; resume continues from there
    cont = [reopened.sample(16).ids.tolist() for _ in range(2)]
    reference = make(tmp_path / "ref", frame_stack=2)
    run_episode(reference, 0, 40)
    reference.sample(8)
    ref_seq = [reference.sample(16).ids.tolist() for _ in range(5)]
    assert ref_seq[:3] == expected and ref_seq[3:] == cont


def test_flush_is_incremental(tmp_path):
    store = make(tmp_path, capacity=4000, block_slots=100, chunk_frames=8)
    run_episode(store, 0, 1000, terminated=False)
    store.flush()
    before = set((tmp_path / "store" / "steps").iterdir())
    for i in range(1001, 1011):
        store.add(0, 0.0, frame(i, OBS), False, False)
    store.flush()
    after = set((tmp_path / "store" / "steps").iterdir())
    assert len(after - before) == 1  # only the block holding the 10 new steps
    assert len(after) == len(before)  # and the file it replaced is gone


def test_frames_array_is_plain_zarr(tmp_path):
    store = make(tmp_path, capacity=20, chunk_frames=4)
    run_episode(store, 0, 9)  # frames 0..9: chunks 0,1 on disk, 8..9 in the tail
    store.close()
    frames = zarr.open_group(str(tmp_path / "store"), mode="r")["frames"]
    assert frames.shape == (1, 20, *OBS)
    assert frames[0, :8, 0, 0].tolist() == list(range(8))


def test_tail_survives_reopen(tmp_path):
    store = make(tmp_path, capacity=20, chunk_frames=8, frame_stack=2)
    run_episode(store, 0, 5)  # every frame still in the RAM tail
    ids, before = snapshot(store)
    store.close()
    with ReplayStore.open(tmp_path / "store") as again:
        assert_same_batches(before, again.get(ids))


@pytest.mark.parametrize("shard_chunks", [1, 0])  # a file per chunk; one shard file
def test_wrap_without_flush_gives_up_old_frames_in_the_manifest(tmp_path, shard_chunks):
    store = make(tmp_path, capacity=16, chunk_frames=4, shard_chunks=shard_chunks)
    run_episode(store, 0, 10, terminated=False)
    store.flush()
    committed = json.loads((tmp_path / "store" / "manifest.json").read_text())
    for i in range(11, 34):  # wraps: files holding committed frames get overwritten
        store.add(0, 0.0, frame(i, OBS), False, False)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["written"] == committed["written"]  # nothing new committed...
    assert manifest["kept_from"][0] > committed["kept_from"][0]  # ...but old frames given up
    # a crash now reopens the committed state minus what was given up, bit-exact
    crashed = ReplayStore.open(tmp_path / "store", mode="r")
    batch = crashed.get(crashed.valid_ids()) if len(crashed) else None
    if batch is not None:
        assert torch.equal(batch.obs[:, 0, 0, 0], batch.ids.to(torch.uint8))


def test_read_only_mode(tmp_path):
    make(tmp_path).close()
    store = ReplayStore.open(tmp_path / "store", mode="r")
    with pytest.raises(ReadOnlyError):
        store.reset(frame(0, OBS))
    with pytest.raises(ReadOnlyError):
        store.flush()
    with pytest.raises(InvalidInputError, match="mode"):
        ReplayStore.open(tmp_path / "store", mode="w")


def test_second_writer_is_refused(tmp_path):
    store = make(tmp_path)
    with pytest.raises(StoreLockedError):
        ReplayStore.open(tmp_path / "store")
    code = f"from mmreplay import ReplayStore; ReplayStore.open({str(tmp_path / 'store')!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "already open for writing" in proc.stderr
    store.close()
    ReplayStore.open(tmp_path / "store").close()


def test_reader_in_other_process_sees_last_flush(tmp_path):
    store = make(tmp_path)
    run_episode(store, 0, 5)
    store.flush()
    store.reset(frame(50, OBS))
    store.add(0, 0.0, frame(51, OBS), True, False)  # not flushed
    code = textwrap.dedent(f"""
        from mmreplay import ReplayStore
        s = ReplayStore.open({str(tmp_path / 'store')!r}, mode="r")
        print(s.valid_ids().tolist())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == [0, 1, 2, 3, 4]


def test_durable_mode_round_trips(tmp_path, monkeypatch):
    synced = []
    real_fsync = __import__("os").fsync
    monkeypatch.setattr("os.fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store = make(tmp_path, durable=True, capacity=16, chunk_frames=4)
    run_episode(store, 0, 9)
    ids, before = snapshot(store)
    count = len(synced)
    store.flush()
    assert len(synced) > count  # chunks, files, manifest and directories were fsynced
    store.close()
    with ReplayStore.open(tmp_path / "store", mode="r") as again:
        assert_same_batches(before, again.get(ids))


def test_single_env_accepts_a_leading_env_dimension(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0, OBS)[None])
    store.add(np.array([1]), np.array([0.5]), frame(1, OBS)[None], np.array([True]),
              np.array([False]))
    assert store.get([0]).next_obs[0, 0, 0, 0] == 1
    with pytest.raises(InvalidInputError, match="obs_shape"):
        store.add(1, 0.5, np.stack([frame(2, OBS)] * 2), False, False)


@pytest.mark.parametrize("shard_chunks", [1, 0])  # a file per chunk; one shard file
def test_reader_never_returns_frames_a_writer_overwrote(tmp_path, shard_chunks):
    writer = make(tmp_path, capacity=32, chunk_frames=4, shard_chunks=shard_chunks)
    writer.reset(frame(0, OBS))
    for i in range(1, 30):
        writer.add(0, 0.0, frame(i, OBS), False, False)
    writer.flush()
    reader = ReplayStore.open(tmp_path / "store", mode="r", cache_bytes=0)
    assert len(reader) == 29
    for i in range(30, 70):  # wraps: committed frames are given up, then overwritten
        writer.add(0, 0.0, frame(i, OBS), False, False)
        if len(reader):
            batch = reader.sample(8)
            # transition id t starts at frame t: a stale read would show a newer frame
            assert torch.equal(batch.obs[:, 0, 0, 0], batch.ids.to(torch.uint8))
            assert torch.equal(batch.next_obs[:, 0, 0, 0], (batch.ids + 1).to(torch.uint8))
    assert len(reader) < 29  # the reader saw the writer give frames up
    with pytest.raises(UnknownIdError):
        reader.get([0])


@pytest.mark.parametrize("shard_chunks", [1, 0])
def test_close_after_a_failed_chunk_write_raises_and_still_releases_the_lock(tmp_path,
                                                                           monkeypatch,
                                                                           shard_chunks):
    import mmreplay.storage.chunk_writer as fs
    import mmreplay.storage.shards as shards
    store = make(tmp_path, chunk_frames=2, shard_chunks=shard_chunks)
    run_episode(store, 0, 3)
    store.flush()
    committed = store.counts.transitions

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "write_atomic", full)
    monkeypatch.setattr(shards, "write_atomic", full)
    store.reset(frame(50, OBS))
    if shard_chunks == 1:
        with pytest.raises(OSError, match="No space"):  # o_0 and the first step fill a chunk
            store.add(0, 0.0, frame(51, OBS), False, False)
    else:
        store.add(0, 0.0, frame(51, OBS), False, False)  # the chunk waits in RAM for its shard
    with pytest.raises(OSError, match="No space"):
        store.close()
    monkeypatch.undo()
    with ReplayStore.open(store.path) as again:  # the lock was released; the last commit
        assert again.counts.transitions == committed

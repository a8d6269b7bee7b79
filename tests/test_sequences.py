"""Per-step extras and sequence replay against the naive reference (tests/reference.py).

The random streams of `test_reference_equivalence` drive a store with declared extras and the
reference through proxies that derive each step's extras from its own arguments, so both get
identical extras. At checkpoints, after flush/close/open and after more steps, every valid
sequence start (`sequence_starts`) and every sequence (`get_sequences`) must equal the
reference's, field by field, in both boundary modes; sampled sequences must be among them
and their starts uniform (chi-square).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reference import ReferenceReplay
from scipy import stats
from test_reference_equivalence import Case, Driver, assert_store_matches

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.errors import EmptyStoreError, UnknownIdError

EXTRAS = {"h": ((2,), np.float32), "c": ((), np.int16)}


def extras_of(action: Any, next_obs: Any) -> dict[str, np.ndarray]:
    """Extras as a function of a step's own arguments (batched or not)."""
    frames = np.asarray(next_obs)
    count = frames[..., 2, 0].astype(np.float32)  # the frame counter the driver encodes
    act = np.asarray(action)
    return {"h": np.stack([count, act.astype(np.float32) * 0.5], axis=-1),
            "c": (act * 100 + count).astype(np.int16)}


class WithExtras:
    """Passes every call through, adding extras to `add` (store or reference alike)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def reset(self, *args: Any, **kwargs: Any) -> None:
        self.target.reset(*args, **kwargs)

    def add(self, action: Any, reward: Any, next_obs: Any, *args: Any, **kwargs: Any) -> None:
        self.target.add(action, reward, next_obs, *args, extras=extras_of(action, next_obs),
                        **kwargs)


def make_pair(case: Case, path: Path) -> tuple[ReplayStore, ReferenceReplay]:
    knobs = {"capacity": case.capacity, "obs_shape": (3, 2), "num_envs": case.num_envs,
             "frame_stack": case.frame_stack, "n_step": case.n_step, "gamma": case.gamma,
             "stack_padding": case.stack_padding}
    store = ReplayStore.create(path, seed=0, extras=EXTRAS, **knobs)
    return store, ReferenceReplay(**knobs)


KEYS = [(1, False, 1), (3, False, 1), (5, False, 2), (4, True, 1), (6, True, 3), (2, True, 1)]


def assert_sequences_match(store: ReplayStore, ref: ReferenceReplay) -> None:
    for length, cross, period in KEYS:
        if length > store.spec.slots_per_env - 1:
            continue
        want = ref.sequences(length, cross_episodes=cross, period=period)
        starts = store.sequence_starts(length, cross_episodes=cross, period=period)
        where = f"length {length} cross {cross} period {period}"
        assert starts.tolist() == sorted(want), (
            f"{where}: starts differ: missing {sorted(set(want) - set(starts.tolist()))[:8]}, "
            f"extra {sorted(set(starts.tolist()) - set(want))[:8]}")
        if starts.size:
            batch = store.get_sequences(starts, length, cross_episodes=cross, period=period)
            assert_batch_equals(batch, [want[i] for i in starts.tolist()], where)


def assert_batch_equals(batch: Any, want: list[dict[str, Any]], where: str) -> None:
    mask = np.array([w["mask"] for w in want])
    assert batch.mask.numpy().tolist() == mask.tolist(), where
    for name in ("ids", "terminated", "truncated", "is_first"):
        assert batch.__getattribute__(name).numpy().tolist() == [w[name] for w in want], \
            f"{where}: {name}"
    obs = np.stack([np.stack(w["obs"]) for w in want])
    assert np.array_equal(batch.obs.numpy(), obs), f"{where}: obs"
    next_obs = np.stack([w["next_obs"] for w in want])
    assert np.array_equal(batch.next_obs.numpy(), next_obs), f"{where}: next_obs"
    action = np.where(mask, np.array([[a or 0 for a in w["action"]] for w in want]), 0)
    assert batch.action.numpy().tolist() == action.tolist(), f"{where}: action"
    reward = np.array([w["reward"] for w in want], np.float32)
    assert np.array_equal(batch.reward.numpy(), reward), f"{where}: reward"
    for name, (shape, dtype) in EXTRAS.items():
        got = batch.extras[name].numpy()
        expect = np.zeros(got.shape, dtype)
        for b, w in enumerate(want):
            for j, e in enumerate(w["extras"]):
                if e is not None:
                    expect[b, j] = e[name]
        assert got.dtype == np.dtype(dtype) and got.shape[2:] == shape, f"{where}: {name}"
        assert np.array_equal(got, expect), f"{where}: extra {name}"
    assert batch.weights.numpy().tolist() == [1.0] * len(want)


def assert_extras_match(store: ReplayStore, ref: ReferenceReplay) -> None:
    """Transition batches: extras are those of step t (the step of `action`)."""
    ids = store.valid_ids()
    if not ids.size:
        return
    expected = ref.expected()
    batch = store.get(ids)
    for name in EXTRAS:
        want = np.stack([expected[i]["extras"][name] for i in ids.tolist()])
        assert np.array_equal(batch.extras[name].numpy(), want), name


SEQ_CASES = {
    "k1_cap7": Case(capacity=7, steps=150),
    "k4_n3_cap50_zero": Case(capacity=50, frame_stack=4, n_step=3, seed=1, steps=250),
    "envs3_k4_cap50_first": Case(capacity=50, num_envs=3, frame_stack=4, stack_padding="first",
                                 seed=3, steps=200, p_subset_add=0.3),
    "envs4_k3_cap30_cuts": Case(capacity=30, num_envs=4, frame_stack=3, n_step=2, p_reset=0.15,
                                p_cut_autoreset=0.05, seed=6, steps=200, p_subset_add=0.2),
    "one_step_episodes": Case(capacity=50, num_envs=2, frame_stack=2, p_terminate=0.5,
                              p_truncate=0.2, seed=7, steps=200),
}


@pytest.mark.parametrize("name", list(SEQ_CASES))
def test_sequences_and_extras_match_reference(tmp_path: Path, name: str) -> None:
    case = SEQ_CASES[name]
    store, ref = make_pair(case, tmp_path / "s")
    driver = Driver(case, WithExtras(store), WithExtras(ref))
    driver.reset(None)
    for step in range(case.steps):
        driver.random_op()
        if step % 7 == 0:
            assert_sequences_match(store, ref)
            for index in store._sequences.indexes.values():
                index.check_valid()
    assert_sequences_match(store, ref)
    assert_extras_match(store, ref)
    assert_store_matches(store, ref)
    store.close()
    store = ReplayStore.open(tmp_path / "s")  # extras persisted, sequence indexes rebuilt
    assert_sequences_match(store, ref)
    assert_extras_match(store, ref)
    driver.store = WithExtras(store)
    for step in range(case.steps // 2):
        driver.random_op()
        if step % 9 == 0:
            assert_sequences_match(store, ref)
    assert_sequences_match(store, ref)
    assert_extras_match(store, ref)
    store.close()
    with ReplayStore.open(tmp_path / "s", mode="r") as reader:
        assert_sequences_match(reader, ref)
        assert_extras_match(reader, ref)


def _filled(tmp_path: Path, **kw: Any) -> tuple[ReplayStore, ReferenceReplay, Driver]:
    case = Case(capacity=kw.pop("capacity", 60), num_envs=2, frame_stack=3, seed=11,
                steps=kw.pop("steps", 200), **kw)
    store, ref = make_pair(case, tmp_path / "s")
    driver = Driver(case, WithExtras(store), WithExtras(ref))
    driver.reset(None)
    for _ in range(case.steps):
        driver.random_op()
    return store, ref, driver


@pytest.mark.parametrize("cross", [False, True])
def test_sampled_sequences_are_valid_and_exact(tmp_path: Path, cross: bool) -> None:
    store, ref, _ = _filled(tmp_path)
    want = ref.sequences(4, cross_episodes=cross)
    batch = store.sample_sequences(64, 4, cross_episodes=cross)
    starts = batch.ids[:, 0].tolist()
    assert set(starts) <= set(want)
    assert batch.obs.shape == (64, 4, 3, 3, 2) and batch.next_obs.shape == (64, 3, 3, 2)
    assert_batch_equals(batch, [want[i] for i in starts], f"cross {cross}")
    if cross:
        assert batch.mask.all()


def test_sampling_resumes_exactly_after_reopen(tmp_path: Path) -> None:
    store, _, _ = _filled(tmp_path)
    store.flush()
    again = ReplayStore.open(tmp_path / "s", mode="r")
    a = [store.sample_sequences(8, 5, cross_episodes=c).ids for c in (False, True)]
    b = [again.sample_sequences(8, 5, cross_episodes=c).ids for c in (False, True)]
    assert all(x.tolist() == y.tolist() for x, y in zip(a, b, strict=True))
    again.close()
    store.close()


@pytest.mark.parametrize(("cross", "period"), [(False, 1), (False, 3), (True, 1)])
def test_starts_are_uniform_over_valid_starts(tmp_path: Path, cross: bool, period: int) -> None:
    store, ref, _ = _filled(tmp_path, capacity=80, steps=300)
    valid = sorted(ref.sequences(6, cross_episodes=cross, period=period))
    draws = 200 * len(valid)
    ids = store.sample_sequences(draws, 6, cross_episodes=cross, period=period).ids[:, 0]
    counts = np.array([np.count_nonzero(ids.numpy() == i) for i in valid])
    assert counts.sum() == draws  # no draw outside the valid starts
    p_value = stats.chisquare(counts).pvalue
    assert p_value > 1e-4, f"chi-square p = {p_value}"
    store.close()


def _snapshot(store: ReplayStore) -> tuple[Any, ...]:
    return (store.counts, store.valid_ids().tolist(), store._ring.steps.tobytes(),
            store._batches.rng.bit_generator.state)


BAD_EXTRAS = [
    None,  # missing
    {"h": np.zeros((2, 2), np.float32)},  # c missing
    {"h": np.zeros((2, 2), np.float32), "c": np.zeros(2, np.int16), "x": np.zeros(2)},
    {"h": np.zeros((2, 3), np.float32), "c": np.zeros(2, np.int16)},  # wrong shape
    {"h": np.zeros((2, 2), np.float32), "c": np.zeros(2, np.float32)},  # float into int
    {"h": np.zeros((2, 2), bool), "c": np.zeros(2, np.int16)},  # bool into float
    [1, 2],
]


@pytest.mark.parametrize("bad", range(len(BAD_EXTRAS)))
def test_bad_extras_raise_and_change_nothing(tmp_path: Path, bad: int) -> None:
    store = ReplayStore.create(tmp_path / "s", capacity=20, obs_shape=(2,), num_envs=2,
                               extras=EXTRAS, seed=0)
    store.reset(np.zeros((2, 2), np.uint8))
    good = {"h": np.ones((2, 2), np.float32), "c": np.ones(2, np.int16)}
    args = (np.array([1, 2]), np.zeros(2), np.ones((2, 2), np.uint8), np.zeros(2, bool),
            np.zeros(2, bool))
    store.add(*args, extras=good)
    before = _snapshot(store)
    with pytest.raises(InvalidInputError, match="extra"):
        store.add(*args, extras=BAD_EXTRAS[bad])
    assert _snapshot(store) == before
    store.close()


def test_extras_refused_by_a_store_without_them(tmp_path: Path) -> None:
    store = ReplayStore.create(tmp_path / "s", capacity=20, obs_shape=(2,), seed=0)
    store.reset(np.zeros(2, np.uint8))
    with pytest.raises(InvalidInputError, match="unknown"):
        store.add(1, 0.0, np.zeros(2, np.uint8), False, False, extras={"h": 1.0})
    assert store.counts.transitions == 0
    store.close()


@pytest.mark.parametrize("extras", [{"1bad": ((), "float32")}, {"h": ((), object)},
                                    {"h": "float32"}, {"h": ((2, 0), "float32")}, [("h",)]])
def test_bad_extra_declarations_raise(tmp_path: Path, extras: Any) -> None:
    with pytest.raises(InvalidInputError):
        ReplayStore.create(tmp_path / "s", capacity=20, obs_shape=(2,), extras=extras)


@pytest.mark.parametrize(("args", "match"), [
    ((8, 0), "length"), ((8, -1), "length"), ((8, 60), "length"), ((8, 2.0), "length"),
    ((0, 4), "batch_size"), ((8, 4, "yes"), "cross_episodes"), ((8, 4, False, 0), "period"),
])
def test_bad_sequence_requests_raise_and_change_nothing(tmp_path: Path, args: tuple[Any, ...],
                                                        match: str) -> None:
    store, _, _ = _filled(tmp_path, capacity=60, steps=50)  # 30 frames per env
    before = _snapshot(store)
    size, length, *rest = args
    kwargs = dict(zip(("cross_episodes", "period"), rest, strict=False))
    with pytest.raises(InvalidInputError, match=match):
        store.sample_sequences(size, length, **kwargs)
    assert _snapshot(store) == before
    store.close()


def test_empty_and_unknown(tmp_path: Path) -> None:
    store = ReplayStore.create(tmp_path / "s", capacity=20, obs_shape=(2,), seed=0)
    with pytest.raises(EmptyStoreError):
        store.sample_sequences(4, 3)
    store.reset(np.zeros(2, np.uint8))
    for i in range(3):
        store.add(0, 1.0, np.full(2, i, np.uint8), False, False)
    with pytest.raises(EmptyStoreError):  # 3 steps of a running episode: no window of 4 yet
        store.sample_sequences(4, 4)
    assert store.sequence_starts(3, cross_episodes=True).tolist() == [0]
    assert store.sample_sequences(2, 3, cross_episodes=True).ids.tolist() == [[0, 1, 2]] * 2
    with pytest.raises(UnknownIdError):
        store.get_sequences([1], 3)  # id 1 has only 2 steps after it in a running episode
    store.close()


def test_extras_format_version_and_old_stores(tmp_path: Path) -> None:
    store = ReplayStore.create(tmp_path / "x", capacity=20, obs_shape=(2,), extras=EXTRAS)
    store.close()
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    assert manifest["spec"]["extras"] == [["c", [], "int16"], ["h", [2], "float32"]]
    store = ReplayStore.create(tmp_path / "y", capacity=20, obs_shape=(2,))
    store.close()
    manifest = json.loads((tmp_path / "y" / "manifest.json").read_text())
    assert manifest["format_version"] in (1, 2) and "extras" not in manifest["spec"]


# ----------------------------------------------------------------------------- prioritized


def _prioritized(tmp_path: Path, steps: int = 250) -> tuple[ReplayStore, Driver]:
    case = Case(capacity=80, num_envs=2, frame_stack=2, seed=12, steps=steps)
    knobs = {"capacity": case.capacity, "obs_shape": (3, 2), "num_envs": case.num_envs,
             "frame_stack": case.frame_stack}
    store = ReplayStore.create(tmp_path / "p", seed=1, sampler="prioritized", alpha=0.7,
                               priority_eps=0.01, **knobs)
    ref = ReferenceReplay(**knobs)
    driver = Driver(case, store, ref)
    driver.reset(None)
    for _ in range(case.steps):
        driver.random_op()
    return store, driver


def r2d2_priority(ids: np.ndarray, td: np.ndarray, eta: float = 0.9) -> list[float]:
    """The naive twin: one Python loop per sequence."""
    out = []
    for row_ids, row_td in zip(ids.tolist(), td.tolist(), strict=True):
        d = [abs(x) for i, x in zip(row_ids, row_td, strict=True) if i >= 0]
        out.append(eta * max(d) + (1 - eta) * sum(d) / len(d))
    return out


@pytest.mark.parametrize("cross", [False, True])
def test_prioritized_sequences_follow_r2d2_priorities(tmp_path: Path, cross: bool) -> None:
    store, _ = _prioritized(tmp_path)
    starts = store.sequence_starts(5, cross_episodes=cross)
    ids = store.get_sequences(starts, 5, cross_episodes=cross).ids.numpy()
    td = np.random.default_rng(0).normal(size=ids.shape) * 2
    assert store.update_sequence_priorities(ids, td) == starts.size
    p = (np.array(r2d2_priority(ids, td)) + 0.01) ** 0.7
    probs = p / p.sum()
    draws = 300 * starts.size
    batch = store.sample_sequences(draws, 5, cross_episodes=cross, beta=0.5)
    got = batch.ids[:, 0].numpy()
    counts = np.array([np.count_nonzero(got == s) for s in starts.tolist()])
    assert counts.sum() == draws
    p_value = stats.chisquare(counts, probs * draws).pvalue
    assert p_value > 1e-4, f"chi-square p = {p_value}"
    where = np.searchsorted(starts, got)
    want_w = (probs[where] / probs.min()) ** -0.5
    np.testing.assert_allclose(batch.weights.numpy(), want_w, rtol=1e-5)
    store.close()


def test_sequence_priorities_persist_and_resume(tmp_path: Path) -> None:
    store, _ = _prioritized(tmp_path)
    batch = store.sample_sequences(16, 6)
    td = np.random.default_rng(1).normal(size=batch.ids.shape)
    assert store.update_sequence_priorities(batch.ids, td) == np.unique(batch.ids[:, 0]).size
    store.flush()
    with ReplayStore.open(tmp_path / "p", mode="r") as again:
        want = [again.sample_sequences(8, 6, beta=0.4) for _ in range(3)]
    got = [store.sample_sequences(8, 6, beta=0.4) for _ in range(3)]
    for a, b in zip(got, want, strict=True):
        assert a.ids.tolist() == b.ids.tolist()
        assert a.weights.tolist() == b.weights.tolist()
    store.close()


def test_stale_and_bad_sequence_priorities(tmp_path: Path) -> None:
    store, driver = _prioritized(tmp_path, steps=120)
    batch = store.sample_sequences(4, 3)
    old = batch.ids.numpy().copy()
    before = _snapshot(store)
    for ids, td in [(old, np.full(old.shape, np.nan)), (old, np.ones((4, 2))), (old[0], 1.0),
                    (old.astype(float), np.ones(old.shape))]:
        with pytest.raises(InvalidInputError):
            store.update_sequence_priorities(ids, td)
        assert _snapshot(store) == before
    padded = np.full_like(old, -1)
    assert store.update_sequence_priorities(padded, np.ones(old.shape)) == 0
    for _ in range(200):  # 40 frames per env: every old start is evicted
        driver.random_op()
    assert store.update_sequence_priorities(old, np.ones(old.shape)) == 0
    fresh = store.sample_sequences(4, 3).ids
    assert store.update_sequence_priorities(fresh, np.ones(old.shape)) == np.unique(
        fresh[:, 0]).size
    with pytest.raises(InvalidInputError, match="prioritized"):
        uniform = ReplayStore.create(tmp_path / "u", capacity=20, obs_shape=(2,))
        uniform.update_sequence_priorities(np.zeros((1, 2), np.int64), np.ones((1, 2)))
    uniform.close()
    store.close()


def test_frame_buffers_are_reused_only_when_no_batch_views_them(tmp_path: Path) -> None:
    store, _, _ = _filled(tmp_path)
    store._sequences._buffers.min_bytes = 0  # pool even these small batches
    first = store.sample_sequences(16, 5)
    kept = first.obs.clone()
    second = store.sample_sequences(16, 5, cross_episodes=True)
    assert torch.equal(first.obs, kept)  # the second batch did not write into the first's
    assert first.obs.data_ptr() != second.obs.data_ptr()
    pointer = second.obs.data_ptr()
    del first, kept, second
    third = store.sample_sequences(16, 5)
    assert third.obs.data_ptr() in {pointer} | {b.ctypes.data for b in
                                                store._sequences._buffers.buffers}
    assert len(store._sequences._buffers.buffers) == 2  # the freed buffers were reused
    store.close()


@pytest.mark.parametrize("cross", [False, True])
def test_keeping_starts_current_tests_only_starts_near_the_change(tmp_path: Path,
                                                                    cross: bool) -> None:
    """After the first build, one more step re-tests O(T + k) starts, not O(capacity)."""
    store, _, driver = _filled(tmp_path, capacity=2000, steps=1500)
    store.sample_sequences(4, 10, cross_episodes=cross)
    index = store._sequences.indexes[next(iter(store._sequences.indexes))]
    tested: list[int] = []
    inner = index.starts_valid

    def counting(env: np.ndarray, t: np.ndarray) -> np.ndarray:
        tested.append(int(t.size))
        return inner(env, t)

    index.starts_valid = counting  # type: ignore[method-assign]
    for _ in range(5):
        driver.add()
        store.sample_sequences(4, 10, cross_episodes=cross)
    assert len(tested) == 5, tested
    # per env: 10 steps back (more across a few episode ends) + the 3 oldest, 2 envs
    assert max(tested) <= 2 * (2 * 10 + 2 + 3 + 2), tested
    index.check_valid()
    store.close()

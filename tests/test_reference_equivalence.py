"""ReplayStore against the naive reference (tests/reference.py) on seeded random streams.

Both receive identical `reset`/`add` calls; at checkpoints during the stream, at its end, and after
flush/close/open, `store.get(store.valid_ids())` must equal `reference.expected()` field by field.

uint8 frames are (3, 2) and encode where they came from, so a mismatch reads directly:

    [[env+1,          episode % 250 + 1],
     [step % 250 + 1, frame // 250 % 250 + 1],
     [frame % 250 + 1, 1                    ]]   (zero padding is the only all-zero frame)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import ReferenceReplay

from mmreplay import ReplayStore

FLOAT32_TOL = {"rtol": 1e-5, "atol": 1e-5}


# ----------------------------------------------------------------------------- comparison


def assert_store_matches(store: Any, reference: ReferenceReplay) -> None:
    """store.get(store.valid_ids()) equals reference.expected(), with a readable first mismatch."""
    expected = reference.expected()
    ids = np.asarray(store.valid_ids())
    want_ids = np.array(sorted(expected), dtype=np.int64)
    assert ids.dtype == np.int64, f"valid_ids dtype {ids.dtype} != int64"
    assert np.all(np.diff(ids) > 0), f"valid_ids not increasing: {ids.tolist()}"
    missing = sorted(set(want_ids.tolist()) - set(ids.tolist()))
    extra = sorted(set(ids.tolist()) - set(want_ids.tolist()))
    assert not missing and not extra, (
        f"valid ids differ: missing {missing[:10]} ({len(missing)}), "
        f"extra {extra[:10]} ({len(extra)})"
    )
    assert len(store) == len(expected), f"len(store) {len(store)} != {len(expected)}"
    if len(ids) == 0:
        return
    batch = store.get(ids)
    _check_field("ids", batch.ids.numpy(), ids, ids)
    for name in ("obs", "next_obs", "action", "terminated", "truncated", "steps"):
        want = np.stack([np.asarray(expected[i][name]) for i in ids.tolist()])
        _check_field(name, getattr(batch, name).numpy(), want, ids)
    for name in ("reward", "discount"):
        want = np.array([expected[i][name] for i in ids.tolist()], dtype=np.float64)
        _check_field(name, getattr(batch, name).numpy(), want, ids, tolerant=True)


def _check_field(
    name: str, got: np.ndarray, want: np.ndarray, ids: np.ndarray, *, tolerant: bool = False
) -> None:
    assert got.shape == want.shape, f"{name} shape {got.shape} != expected {want.shape}"
    if tolerant:
        same = np.isclose(got.astype(np.float64), want, **FLOAT32_TOL)
    else:
        same = got == want
    bad = ~same.reshape(len(ids), -1).all(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"{name} differs for {int(bad.sum())} of {len(ids)} ids "
            f"(bad ids {ids[bad][:10].tolist()}); id {int(ids[first])}:\n"
            f"got\n{got[first]}\nexpected\n{want[first]}"
        )


# ----------------------------------------------------------------------------- the reference itself


def _one(value: int) -> np.ndarray:
    return np.array([value], dtype=np.uint8)


def test_reference_hand_computed_n_step_and_stack() -> None:
    reference = ReferenceReplay(capacity=10, obs_shape=(1,), frame_stack=2, n_step=2, gamma=0.5)
    reference.reset(_one(1))
    reference.add(7, 1.0, _one(2), False, False)
    reference.add(8, 2.0, _one(3), False, False)
    assert list(reference.expected()) == [0]  # step 1's window is not complete yet
    reference.add(9, 3.0, _one(4), True, False)
    got = reference.expected()
    assert list(got) == [0, 1, 2]
    assert got[0]["obs"].tolist() == [[0], [1]] and got[0]["next_obs"].tolist() == [[2], [3]]
    assert (got[0]["reward"], got[0]["discount"], got[0]["terminated"]) == (2.0, 0.25, False)
    assert (got[1]["reward"], got[1]["discount"], got[1]["terminated"]) == (3.5, 0.0, True)
    assert got[2]["next_obs"].tolist() == [[3], [4]] and got[2]["reward"] == 3.0
    assert [got[i]["action"] for i in range(3)] == [7, 8, 9]


def test_reference_cut_by_reset_and_eviction() -> None:
    reference = ReferenceReplay(
        capacity=5, obs_shape=(1,), frame_stack=2, n_step=3, gamma=0.5, stack_padding="first"
    )
    reference.reset(_one(1))
    reference.add(0, 1.0, _one(2), False, False)
    reference.add(1, 1.0, _one(3), False, False)
    assert reference.expected() == {}
    reference.reset(_one(4))  # cuts the running episode: its step 1 becomes truncated
    got = reference.expected()
    assert list(got) == [0, 1]
    assert got[0]["obs"].tolist() == [[1], [1]] and got[0]["next_obs"].tolist() == [[2], [3]]
    assert (got[0]["reward"], got[0]["discount"], got[0]["truncated"]) == (1.5, 0.25, True)
    assert (got[1]["reward"], got[1]["discount"], got[1]["truncated"]) == (1.0, 0.5, True)
    reference.add(2, 1.0, _one(5), False, False)
    reference.add(3, 1.0, _one(6), True, False)  # 6 frames written, 5 kept: o_0 of ep 1 is gone
    got = reference.expected()
    assert list(got) == [2, 3]
    assert got[2]["obs"].tolist() == [[4], [4]] and got[2]["next_obs"].tolist() == [[5], [6]]
    assert (got[2]["discount"], got[2]["terminated"], got[2]["truncated"]) == (0.0, True, False)


# ----------------------------------------------------------------------------- streams


@dataclass(frozen=True)
class Case:
    """One random stream: store configuration plus the odds of each kind of event."""

    capacity: int
    num_envs: int = 1
    frame_stack: int = 1
    n_step: int = 1
    stack_padding: str = "zero"
    gamma: float = 0.9
    obs: str = "uint8"  # "uint8": (3, 2) encoded frames; "float32": (4,) float frames
    steps: int = 400
    p_terminate: float = 0.05
    p_truncate: float = 0.02
    p_reset: float = 0.03  # an op is a reset of some envs, cutting their running episodes
    p_cut_autoreset: float = 0.0  # a running env is autoreset, cutting its episode
    p_restart_by_reset: float = 0.3  # an ended episode restarts by reset rather than autoreset
    check_every: int = 5
    seed: int = 0
    p_subset_add: float = 0.0  # an add steps only a random subset of envs (env_ids)


class Driver:
    """Feeds identical random calls to a store and a reference and tracks env bookkeeping."""

    def __init__(self, case: Case, store: Any, reference: ReferenceReplay) -> None:
        self.case = case
        self.store = store
        self.reference = reference
        self.rng = np.random.default_rng(case.seed)
        n = case.num_envs
        self.running = [False] * n
        self.episode = [0] * n
        self.step = [0] * n
        self.frame_count = [0] * n

    def frame(self, env: int) -> np.ndarray:
        """The next frame of env; its pixels encode (env, episode, step, frame counter)."""
        count = self.frame_count[env]
        self.frame_count[env] += 1
        if self.case.obs == "float32":
            values = [env, self.episode[env], self.step[env], count + self.rng.random()]
            return np.array(values, dtype=np.float32)
        pixels = [
            [env + 1, self.episode[env] % 250 + 1],
            [self.step[env] % 250 + 1, count // 250 % 250 + 1],
            [count % 250 + 1, 1],
        ]
        return np.array(pixels, dtype=np.uint8)

    def reset(self, env_ids: list[int] | None) -> None:
        envs = list(range(self.case.num_envs)) if env_ids is None else env_ids
        frames = [self._new_episode(env) for env in envs]
        obs = frames[0] if self.case.num_envs == 1 else np.stack(frames)
        for target in (self.store, self.reference):
            if env_ids is None:
                target.reset(obs)
            else:
                target.reset(obs, env_ids=np.array(env_ids, dtype=np.int64))

    def _new_episode(self, env: int) -> np.ndarray:
        self.episode[env] += 1
        self.step[env] = 0
        self.running[env] = True
        return self.frame(env)

    def add(self, env_ids: list[int] | None = None) -> None:
        """One step of every env, or of `env_ids` (rows in that order) when given."""
        case, rng = self.case, self.rng
        envs = list(range(case.num_envs)) if env_ids is None else env_ids
        n = len(envs)
        autoreset = np.array(
            [not self.running[e] or rng.random() < case.p_cut_autoreset for e in envs]
        )
        # Autoreset envs get garbage action/reward/flags too: the store must ignore them.
        action = rng.integers(0, 6, size=n).astype(np.int64)
        if case.obs == "float32":
            reward = rng.normal(size=n)
        else:
            reward = rng.integers(-4, 5, size=n) * 0.25
        terminated = rng.random(n) < case.p_terminate
        truncated = rng.random(n) < case.p_truncate  # sometimes both, as gymnasium allows
        frames = [self._next_frame(e, bool(autoreset[i])) for i, e in enumerate(envs)]
        for i, e in enumerate(envs):
            if not autoreset[i] and (terminated[i] or truncated[i]):
                self.running[e] = False
        if env_ids is None:
            args = self._call_args(action, reward, np.stack(frames), terminated, truncated,
                                   autoreset)
        else:
            flags = autoreset if autoreset.any() or rng.random() < 0.5 else None
            args = ((action, reward, np.stack(frames), terminated, truncated),
                    {"autoreset": flags, "env_ids": np.array(env_ids, dtype=np.int64)})
        self.store.add(*args[0], **args[1])
        self.reference.add(*args[0], **args[1])

    def _next_frame(self, env: int, autoreset: bool) -> np.ndarray:
        if autoreset:
            return self._new_episode(env)
        self.step[env] += 1
        return self.frame(env)

    def _call_args(
        self,
        action: np.ndarray,
        reward: np.ndarray,
        frames: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        autoreset: np.ndarray,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.case.num_envs > 1:
            flags = autoreset if autoreset.any() or self.rng.random() < 0.5 else None
            return (action, reward, frames, terminated, truncated), {"autoreset": flags}
        flag: bool | None = bool(autoreset[0])
        if not flag and self.rng.random() < 0.5:
            flag = None
        args = (
            int(action[0]),
            float(reward[0]),
            frames[0],
            bool(terminated[0]),
            bool(truncated[0]),
        )
        return args, {"autoreset": flag}

    def random_op(self) -> None:
        """One reset (of a random subset, or of ended episodes) or one add."""
        case, rng, n = self.case, self.rng, self.case.num_envs
        if rng.random() < case.p_reset:
            if n == 1 or rng.random() < 0.3:
                self.reset(None)
            else:
                size = int(rng.integers(1, n + 1))
                self.reset([int(e) for e in rng.permutation(n)[:size]])
            return
        ended = [e for e in range(n) if not self.running[e]]
        if ended and rng.random() < case.p_restart_by_reset:
            self.reset(None if n == 1 else ended)
            return
        if case.p_subset_add and rng.random() < case.p_subset_add:
            size = int(rng.integers(1, n + 1))
            self.add([int(e) for e in rng.permutation(n)[:size]])
            return
        self.add()


def make_pair(case: Case, path: Path) -> tuple[Any, ReferenceReplay]:
    obs_shape, obs_dtype = ((4,), np.float32) if case.obs == "float32" else ((3, 2), np.uint8)
    knobs = {
        "capacity": case.capacity,
        "obs_shape": obs_shape,
        "num_envs": case.num_envs,
        "frame_stack": case.frame_stack,
        "n_step": case.n_step,
        "gamma": case.gamma,
        "stack_padding": case.stack_padding,
    }
    store = ReplayStore.create(path, obs_dtype=obs_dtype, seed=0, **knobs)
    return store, ReferenceReplay(**knobs)


def reopen(store: Any, path: Path) -> Any:
    store.flush()
    store.close()
    return ReplayStore.open(path)


CASES = {
    "k1_n1_cap7": Case(capacity=7),
    "k4_n3_cap7_zero": Case(capacity=7, frame_stack=4, n_step=3),
    "k4_n3_cap7_first": Case(capacity=7, frame_stack=4, n_step=3, stack_padding="first"),
    "k1_n3_cap50": Case(capacity=50, n_step=3, seed=1),
    "k4_n1_cap50_first": Case(capacity=50, frame_stack=4, stack_padding="first", seed=2),
    "envs3_k4_n3_cap50_zero": Case(capacity=50, num_envs=3, frame_stack=4, n_step=3, seed=3),
    "envs3_k4_n3_cap50_first": Case(
        capacity=50, num_envs=3, frame_stack=4, n_step=3, stack_padding="first", seed=4
    ),
    "envs2_k1_n1_cap9": Case(capacity=9, num_envs=2, seed=5),
    "envs4_k4_n3_cap30_cuts": Case(
        capacity=30,
        num_envs=4,
        frame_stack=4,
        n_step=3,
        p_reset=0.15,
        p_cut_autoreset=0.05,
        seed=6,
    ),
    "one_step_episodes": Case(
        capacity=50,
        num_envs=2,
        frame_stack=4,
        n_step=3,
        p_terminate=0.5,
        p_truncate=0.2,
        seed=7,
    ),
    "shorter_than_stack_first": Case(
        capacity=23,
        num_envs=2,
        frame_stack=4,
        n_step=3,
        stack_padding="first",
        p_terminate=0.25,
        p_truncate=0.1,
        p_reset=0.1,
        seed=8,
    ),
    "cut_by_reset_k4_n3": Case(
        capacity=50,
        frame_stack=4,
        n_step=3,
        p_terminate=0.0,
        p_truncate=0.0,
        p_reset=0.2,
        seed=9,
    ),
    "no_wrap_envs2_k4_n3": Case(
        capacity=2000, num_envs=2, frame_stack=4, n_step=3, steps=200, check_every=29, seed=10
    ),
    "float32_envs2_k4_n3_first": Case(
        capacity=40,
        num_envs=2,
        frame_stack=4,
        n_step=3,
        stack_padding="first",
        obs="float32",
        p_terminate=0.1,
        seed=11,
    ),
    "float32_k1_n1_gamma099": Case(capacity=17, obs="float32", gamma=0.99, seed=12),
    "subsets_envs4_k4_n3_cap30": Case(
        capacity=30, num_envs=4, frame_stack=4, n_step=3, p_subset_add=0.7, p_reset=0.05,
        p_cut_autoreset=0.05, seed=13,
    ),
    "subsets_envs3_k2_n2_cap61_first": Case(
        capacity=61, num_envs=3, frame_stack=2, n_step=2, stack_padding="first",
        p_subset_add=1.0, p_terminate=0.1, seed=14,
    ),
    "subsets_one_env": Case(capacity=11, frame_stack=4, n_step=3, p_subset_add=0.5, seed=15),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_random_stream_matches_reference(case: Case, tmp_path: Path) -> None:
    path = tmp_path / "store"
    store, reference = make_pair(case, path)
    driver = Driver(case, store, reference)
    driver.reset(None)
    assert_store_matches(store, reference)
    for op in range(case.steps):
        driver.random_op()
        if op % case.check_every == 0:
            assert_store_matches(store, reference)
    assert_store_matches(store, reference)
    reopened = reopen(store, path)
    assert_store_matches(reopened, reference)
    reopened.close()


def random_case(seed: int) -> Case:
    """A case with every knob drawn at random (2..12 frames per env, so eviction is constant)."""
    rng = np.random.default_rng(1000 + seed)
    num_envs = int(rng.integers(1, 5))
    return Case(
        capacity=num_envs * int(rng.integers(2, 13)) + int(rng.integers(0, num_envs)),
        num_envs=num_envs,
        frame_stack=int(rng.choice([1, 2, 4])),
        n_step=int(rng.choice([1, 2, 3])),
        stack_padding=str(rng.choice(["zero", "first"])),
        gamma=float(rng.choice([0.9, 0.5])),
        obs=str(rng.choice(["uint8", "float32"])),
        steps=150,
        p_terminate=float(rng.uniform(0.0, 0.4)),
        p_truncate=float(rng.uniform(0.0, 0.2)),
        p_reset=float(rng.uniform(0.0, 0.2)),
        p_cut_autoreset=float(rng.uniform(0.0, 0.1)),
        check_every=3,
        seed=seed,
        p_subset_add=float(rng.choice([0.0, 0.5])),
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_config_matches_reference(seed: int, tmp_path: Path) -> None:
    test_random_stream_matches_reference(random_case(seed), tmp_path)


REOPEN_CASES = [
    "envs3_k4_n3_cap50_first", "shorter_than_stack_first", "k4_n3_cap7_zero",
    "subsets_envs4_k4_n3_cap30",
]


@pytest.mark.parametrize("name", REOPEN_CASES)
def test_stream_continues_after_reopen(name: str, tmp_path: Path) -> None:
    """Closing and reopening mid-stream (running episodes included) changes nothing."""
    case = CASES[name]
    path = tmp_path / "store"
    store, reference = make_pair(case, path)
    driver = Driver(case, store, reference)
    driver.reset(None)
    for op in range(case.steps):
        driver.random_op()
        if op % 40 == 39:
            store = driver.store = reopen(store, path)
            assert_store_matches(store, reference)
    store.close()


def test_get_single_id_matches_reference(tmp_path: Path) -> None:
    """A batch of one id (structured-column views with odd strides) converts to torch."""
    knobs = {"capacity": 8, "obs_shape": (1,), "frame_stack": 2, "n_step": 1, "gamma": 0.9}
    store = ReplayStore.create(tmp_path / "store", **knobs)
    reference = ReferenceReplay(**knobs)
    for target in (store, reference):
        target.reset(_one(1))
        target.add(3, 1.0, _one(2), False, False)
    assert_store_matches(store, reference)  # exactly one valid id: get([0])


def test_terminated_and_truncated_at_same_step(tmp_path: Path) -> None:
    """gymnasium may report both flags (time limit on the terminal step): both are kept."""
    knobs = {"capacity": 8, "obs_shape": (1,), "n_step": 1, "gamma": 0.9}
    store = ReplayStore.create(tmp_path / "store", **knobs)
    reference = ReferenceReplay(**knobs)
    for target in (store, reference):
        target.reset(_one(1))
        target.add(3, 1.0, _one(2), False, False)
        target.add(4, 1.0, _one(3), True, True)
    assert reference.expected()[1]["truncated"] and reference.expected()[1]["terminated"]
    assert_store_matches(store, reference)


# ----------------------------------------------------------------------------- gymnasium


def test_cartpole_vector_env_matches_reference(tmp_path: Path) -> None:
    gym = pytest.importorskip("gymnasium")
    num_envs = 3
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    envs.action_space.seed(0)
    knobs = {
        "capacity": 3 * 70,
        "obs_shape": (4,),
        "num_envs": num_envs,
        "frame_stack": 4,
        "n_step": 3,
        "gamma": 0.9,
        "stack_padding": "zero",
    }
    path = tmp_path / "cartpole"
    store = ReplayStore.create(path, obs_dtype=np.float32, seed=0, **knobs)
    reference = ReferenceReplay(**knobs)
    obs, _ = envs.reset(seed=0)
    store.reset(obs)
    reference.reset(obs)
    autoreset = np.zeros(num_envs, dtype=bool)  # gymnasium's next-step autoreset mask
    for step in range(300):
        action = envs.action_space.sample()
        next_obs, reward, terminated, truncated, _ = envs.step(action)
        store.add(action, reward, next_obs, terminated, truncated, autoreset=autoreset)
        reference.add(action, reward, next_obs, terminated, truncated, autoreset=autoreset)
        autoreset = np.logical_or(terminated, truncated)
        if step % 50 == 0:
            assert_store_matches(store, reference)
    envs.close()
    assert len(reference.expected()) > 100
    assert_store_matches(store, reference)
    reopened = reopen(store, path)
    assert_store_matches(reopened, reference)
    reopened.close()

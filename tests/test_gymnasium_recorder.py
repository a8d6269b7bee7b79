"""`RecordToStore` / `RecordVectorToStore`: a recorded env equals a hand-written loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

from store_compare import assert_stores_equal  # noqa: E402

from mmreplay import InvalidInputError, ReplayStore  # noqa: E402
from mmreplay.integrations.gymnasium import (  # noqa: E402
    RecordToStore,
    RecordVectorToStore,
    create_store_for,
)
from mmreplay.tools import inspection as ins  # noqa: E402

STEPS = 300


def cartpole(max_steps: int = 25) -> gym.Env:
    """CartPole whose episodes end by termination or, often, by truncation."""
    return gym.make("CartPole-v1", max_episode_steps=max_steps)


def store_kw(**kw: object) -> dict[str, object]:
    return {"capacity": 257, "frame_stack": 2, "n_step": 3, "seed": 0, **kw}


@pytest.mark.parametrize("capacity", [257, 97])  # 97: the ring wraps
def test_single_env_recorder_equals_hand_loop(tmp_path: Path, capacity: int) -> None:
    rng_actions = np.random.default_rng(1).integers(0, 2, STEPS)
    hand_env = cartpole()
    hand = create_store_for(hand_env, tmp_path / "hand", **store_kw(capacity=capacity))
    obs, _ = hand_env.reset(seed=7)
    hand.reset(obs)
    finals = []
    for a in rng_actions:
        obs, r, term, trunc, _ = hand_env.step(int(a))
        hand.add(int(a), r, obs, term, trunc)
        if term or trunc:
            finals.append((obs, term, trunc))
            obs, _ = hand_env.reset()
            hand.reset(obs)

    env = cartpole()
    rec = create_store_for(env, tmp_path / "rec", **store_kw(capacity=capacity))
    env = RecordToStore(env, rec)
    env.reset(seed=7)
    for a in rng_actions:
        _, _, term, trunc, _ = env.step(int(a))
        if term or trunc:
            env.reset()
    assert_stores_equal(hand, rec)
    assert any(t for _, _, t in finals) and any(t for _, t, _ in finals)  # both kinds seen
    rec.flush()
    with ReplayStore.open(tmp_path / "rec", mode="r") as again:
        assert_stores_equal(hand, again)


def test_truncated_final_observation_is_kept(tmp_path: Path) -> None:
    env = cartpole(max_steps=5)
    store = create_store_for(env, tmp_path / "s", capacity=64, seed=0)
    env = RecordToStore(env, store)
    env.reset(seed=3)
    for _ in range(5):
        last, _, term, trunc, _ = env.step(0)
    assert trunc and not term
    batch = store.get(store.valid_ids())
    assert batch.truncated.tolist() == [False] * 4 + [True]
    assert not batch.terminated.any()
    np.testing.assert_array_equal(batch.next_obs[-1, 0].numpy(), last)
    assert batch.discount[-1].item() == pytest.approx(0.99)  # bootstraps from the kept frame


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vector_recorder_equals_hand_loop(tmp_path: Path, mode: str) -> None:
    n, seed = 3, 11
    actions = np.random.default_rng(2).integers(0, 2, (STEPS // 3, n))

    def make() -> gym.vector.VectorEnv:
        fns = [lambda: cartpole(max_steps=20)] * n
        cls = gym.vector.SyncVectorEnv if mode == "sync" else gym.vector.AsyncVectorEnv
        return cls(fns)

    hand_env = make()
    hand = create_store_for(hand_env, tmp_path / "hand", **store_kw(capacity=3 * 101))
    obs, _ = hand_env.reset(seed=seed)
    hand.reset(obs)
    auto = np.zeros(n, bool)
    for a in actions:
        obs, r, term, trunc, _ = hand_env.step(a)
        hand.add(a, r, obs, term, trunc, autoreset=auto)
        auto = term | trunc
    hand_env.close()

    env = make()
    rec = create_store_for(env, tmp_path / "rec", **store_kw(capacity=3 * 101))
    env = RecordVectorToStore(env, rec, close_store=False)  # compared below
    env.reset(seed=seed)
    for a in actions:
        env.step(a)
    env.close()
    assert_stores_equal(hand, rec)
    rows = [r.status for r in ins.episode_table(rec)]
    assert "terminated" in rows and "truncated" in rows


def test_vector_reset_mask_resets_only_those_envs(tmp_path: Path) -> None:
    env = gym.vector.SyncVectorEnv([lambda: cartpole(max_steps=50)] * 2)
    store = create_store_for(env, tmp_path / "s", capacity=64, seed=0)
    env = RecordVectorToStore(env, store)
    env.reset(seed=0)
    env.step(np.array([0, 1]))
    env.reset(options={"reset_mask": np.array([False, True])})
    env.step(np.array([1, 1]))
    # env 1's first episode ended truncated after one step; env 0 kept going
    rows = [(r.env, r.length, r.status) for r in ins.episode_table(store)]
    assert rows == [(0, 2, "running"), (1, 1, "truncated"), (1, 1, "running")]
    assert store.counts.frames_written == 3 + 4


def test_recorder_refuses_a_store_of_another_shape(tmp_path: Path) -> None:
    store = ReplayStore.create(tmp_path / "s", capacity=16, obs_shape=(84, 84))
    with pytest.raises(InvalidInputError, match="observation space"):
        RecordToStore(cartpole(), store)
    env = gym.vector.SyncVectorEnv([cartpole] * 2)
    with pytest.raises(InvalidInputError, match="2 envs"):
        RecordVectorToStore(env, create_store_for(cartpole(), tmp_path / "t", capacity=16))


def test_vector_recorder_refuses_same_step_autoreset(tmp_path: Path) -> None:
    env = gym.vector.SyncVectorEnv([cartpole] * 2,
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    store = create_store_for(env, tmp_path / "s", capacity=16)
    with pytest.raises(InvalidInputError, match="NEXT_STEP"):
        RecordVectorToStore(env, store)

"""Record gymnasium envs into a store: one wrapper line added to an existing loop.

    env = RecordToStore(gym.make("CartPole-v1"), store)          # single env
    envs = RecordVectorToStore(gym.make_vec(..., num_envs=8), store)  # vector env

Every ``reset`` writes o_0 (``store.reset``), every ``step`` writes one step
(``store.add``) with the env's own ``terminated`` and ``truncated``, so the final
observation of a truncated episode is kept and the two flags stay apart. Vector envs
must use gymnasium's next-step autoreset (the default of ``SyncVectorEnv`` and
``AsyncVectorEnv``): the step after a finished one is an autoreset step, passed to
``store.add`` as ``autoreset`` (its action and reward are ignored, its observation is
o_0 of the next episode).

The wrapper owns the store it records into: ``env.close()`` flushes and closes it, so
``RecordVectorToStore(envs, create_store_for(envs, path, ...))`` needs no handle to the
store. Pass ``close_store=False`` to keep using the store after the env is closed (sampling
from it, recording more); ``env.close()`` then only flushes it. A store left open when the
program ends is flushed at exit anyway, with a warning (`mmreplay.lifecycle`).
gymnasium is imported only in this module (extra ``atari``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.store import ReplayStore

try:
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('mmreplay.integrations.gymnasium needs gymnasium: '
                      'pip install "mmreplay[atari]"') from exc

__all__ = ["RecordToStore", "RecordVectorToStore", "create_store_for"]


class RecordToStore(gym.Wrapper):
    """A single env whose every ``reset`` and ``step`` is also written to `store`.

    ``close()`` closes the env, then flushes and closes `store` (only flushes it with
    ``close_store=False``).
    """

    def __init__(self, env: gym.Env, store: ReplayStore, *, close_store: bool = True) -> None:
        super().__init__(env)
        _check_store(store, env.observation_space, env.action_space, num_envs=1)
        self.store = store
        self.close_store = close_store

    def close(self) -> None:
        try:
            super().close()
        finally:
            _release(self.store, self.close_store)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self.store.reset(obs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.store.add(action, reward, obs, bool(terminated), bool(truncated))
        return obs, reward, terminated, truncated, info


class RecordVectorToStore(VectorWrapper):
    """A vector env (next-step autoreset) whose every step is also written to `store`.

    ``close()`` closes the envs, then flushes and closes `store` (only flushes it with
    ``close_store=False``).
    """

    def __init__(self, env: VectorEnv, store: ReplayStore, *, close_store: bool = True) -> None:
        super().__init__(env)
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if AutoresetMode(mode) is not AutoresetMode.NEXT_STEP:
            raise InvalidInputError(
                f"RecordVectorToStore needs autoreset_mode=NEXT_STEP, got {mode}: with other "
                f"modes the final observation of an episode is not a step's observation")
        _check_store(store, env.single_observation_space, env.single_action_space,
                     num_envs=env.num_envs)
        self.store = store
        self.close_store = close_store
        self._autoreset = np.zeros(env.num_envs, dtype=bool)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        mask = None if options is None else options.get("reset_mask")
        mask = None if mask is None else np.array(mask, dtype=bool)  # the env pops it
        obs, info = self.env.reset(seed=seed, options=options)
        if mask is None:
            self.store.reset(obs)
            self._autoreset[:] = False
        else:
            self.store.reset(np.asarray(obs)[mask], env_ids=np.flatnonzero(mask))
            self._autoreset[mask] = False
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        self.store.add(actions, rewards, obs, terminated, truncated,
                       autoreset=self._autoreset.copy())
        self._autoreset = np.logical_or(terminated, truncated)
        return obs, rewards, terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        try:
            super().close(**kwargs)
        finally:
            _release(self.store, self.close_store)


def _release(store: ReplayStore, close: bool) -> None:
    """At env close: close the store, or only flush it (a closed one is left alone)."""
    if close:
        store.close()  # idempotent
    elif not store.closed and store.writable:
        store.flush()


def create_store_for(env: gym.Env | VectorEnv, path: str | os.PathLike[str], *, capacity: int,
                     **options: Any) -> ReplayStore:
    """A new store shaped for `env` (observation and action spaces, number of envs).

    `options` go to `ReplayStore.create` (``frame_stack``, ``n_step``, ``seed``, ...).
    """
    if isinstance(env, VectorEnv):
        obs_space, act_space, num_envs = (env.single_observation_space,
                                          env.single_action_space, env.num_envs)
    else:
        obs_space, act_space, num_envs = env.observation_space, env.action_space, 1
    for name, space in (("observation", obs_space), ("action", act_space)):
        if not isinstance(space, gym.spaces.Box | gym.spaces.Discrete):
            raise InvalidInputError(f"{name} space must be a Box or Discrete, got {space}")
    return ReplayStore.create(path, capacity=capacity, obs_shape=obs_space.shape,
                              obs_dtype=obs_space.dtype, num_envs=num_envs,
                              action_shape=act_space.shape, action_dtype=act_space.dtype,
                              **options)


def _check_store(store: ReplayStore, obs_space: Any, act_space: Any, *, num_envs: int) -> None:
    """The store can hold what the env returns (shapes, dtypes, number of envs)."""
    spec = store.spec
    if spec.num_envs != num_envs:
        raise InvalidInputError(f"the env has {num_envs} envs, the store num_envs={spec.num_envs}")
    shape, dtype = getattr(obs_space, "shape", None), getattr(obs_space, "dtype", None)
    if shape is None or tuple(shape) != tuple(spec.obs_shape) \
            or np.dtype(dtype) != np.dtype(spec.obs_dtype):
        raise InvalidInputError(
            f"observation space {obs_space} does not match the store's obs_shape "
            f"{spec.obs_shape} and obs_dtype {np.dtype(spec.obs_dtype)}")
    act_shape = getattr(act_space, "shape", None)
    if act_shape is None or tuple(act_shape) != tuple(spec.action_shape):
        raise InvalidInputError(f"action space {act_space} does not match the store's "
                                f"action_shape {spec.action_shape}")

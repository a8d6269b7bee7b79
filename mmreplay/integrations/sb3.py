"""Stable-Baselines3: `FrameOnceReplayBuffer`, a ``replay_buffer_class`` backed by a store.

    model = DQN("CnnPolicy", VecFrameStack(env, n_stack=4), buffer_size=1_000_000,
                replay_buffer_class=FrameOnceReplayBuffer,
                replay_buffer_kwargs=dict(path="runs/sb3_store", frame_stack=4))

SB3 hands the buffer whole stacks (``obs`` and ``next_obs``, ``(n_envs, *stacked)``);
the buffer keeps only the newest frame of each and lets the store rebuild the stacks::

    SB3 add:     obs = [o_{t-3} o_{t-2} o_{t-1} o_t]   next_obs = [o_{t-2} o_{t-1} o_t o_{t+1}]
    store:       reset(o_0) at an episode start, then add(a_t, r_t, o_{t+1}, terminated, truncated)
    sample:      stacks rebuilt from the store (zeros before o_0, as `VecFrameStack` pads)

Episode edges, per env:

* ``done`` with ``infos[i]["TimeLimit.truncated"]`` ends the episode as truncated (as
  terminated without it, or always with ``handle_timeout_termination=False``); the
  env's next ``obs`` starts a new episode.
* an ``obs`` that is not the env's previous ``next_obs`` (a second ``learn()``, or
  ``load(force_reset=True)``, reset the envs with no done flag) ends the running episode
  as truncated and starts a new one: episodes are never stitched together.
* every ``next_obs`` must be ``obs`` shifted by one frame, and every episode's first
  ``obs`` must be zero-padded, so a rebuilt stack equals what SB3 passed, bit for bit;
  anything else is refused (`ValueError`) before the store changes.

One env without stacking (small vector observations): ``add`` stages the step in RAM
(`StepStage`) and the store records staged steps as one block before anything reads it
(``sample``, ``get``, ``size``, the ``store`` attribute, pickling, ``close``, garbage
collection) or when 256 are staged; ``sample`` hands SB3 tensors viewing the store's arrays.

Pickling (``save_replay_buffer``) flushes the store and keeps only the path, the
configuration and the per-env state above; unpickling reopens the store. Constructing
the buffer on an existing store opens it (``DQN.load`` rebuilds the buffer through the
constructor) after checking it matches; it never wipes one. stable-baselines3 is
imported only here (extra ``sb3``).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from mmreplay import lifecycle
from mmreplay.integrations.step_stage import StepStage
from mmreplay.store import ReplayStore
from mmreplay.torch_batch import ArrayBatch, Batch, frames_tensor

try:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
    from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
    from stable_baselines3.common.preprocessing import is_image_space
    from stable_baselines3.common.type_aliases import ReplayBufferSamples
    from stable_baselines3.common.vec_env import VecNormalize
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('mmreplay.sb3 needs stable-baselines3: pip install "mmreplay[sb3]"') from exc

__all__ = ["FrameOnceReplayBuffer", "StackLayout"]

STATE_VERSION = 1
STAGE_ROWS = 256  # steps of a one-env, unstacked buffer staged in RAM at most (`StepStage`)
_ALL_FOLLOW = np.ones(64, bool)  # `StackLayout.follows` without stacking: read-only rows
_ALL_FOLLOW.flags.writeable = False


# -- stacks <-> frames ----------------------------------------------------------------------
@dataclass(frozen=True)
class StackLayout:
    """Where the frames of a `VecFrameStack` stack sit: ``k`` frames of ``channels``
    channels each, concatenated oldest first along the first or the last axis."""

    obs_shape: tuple[int, ...]
    frame_stack: int
    first: bool  # stacked along axis 0 (channels first) rather than the last axis

    @classmethod
    def of(cls, obs_shape: tuple[int, ...], frame_stack: int,
           channels_order: str | None, image: bool) -> StackLayout:
        if channels_order not in (None, "first", "last"):
            raise ValueError(f"channels_order must be None, 'first' or 'last', "
                             f"got {channels_order!r}")
        if frame_stack == 1:
            return cls(obs_shape, 1, False)
        if not obs_shape:
            raise ValueError(f"frame_stack={frame_stack} needs observations with at least "
                             f"one axis, got shape {obs_shape}")
        if channels_order is None:
            first = cls._guess_first(obs_shape, frame_stack, image)
        else:
            first = channels_order == "first"
        axis = obs_shape[0] if first else obs_shape[-1]
        if axis % frame_stack:
            raise ValueError(
                f"observation shape {obs_shape}: the stacking axis ({'first' if first else 'last'}"
                f", {axis}) is not a multiple of frame_stack={frame_stack}")
        return cls(obs_shape, frame_stack, first)

    @staticmethod
    def _guess_first(shape: tuple[int, ...], k: int, image: bool) -> bool:
        """VecFrameStack's guess, made on the unstacked shape: an image is stacked along
        its first axis iff that is the smallest one; anything else along the last."""
        if not image or len(shape) != 3:
            return False
        first = shape[0] % k == 0 and int(np.argmin((shape[0] // k, *shape[1:]))) == 0
        last = shape[-1] % k == 0 and int(np.argmin((*shape[:-1], shape[-1] // k))) != 0
        if first == last:
            raise ValueError(f"cannot tell whether stacks of shape {shape} are channels first "
                             f"or last: pass replay_buffer_kwargs channels_order='first' or "
                             f"'last' (as given to VecFrameStack)")
        return first

    @property
    def channels(self) -> int:
        if self.frame_stack == 1:
            return 0
        return (self.obs_shape[0] if self.first else self.obs_shape[-1]) // self.frame_stack

    @property
    def frame_shape(self) -> tuple[int, ...]:
        if self.frame_stack == 1:
            return self.obs_shape
        c = self.channels
        return (c, *self.obs_shape[1:]) if self.first else (*self.obs_shape[:-1], c)

    def newest(self, obs: np.ndarray) -> np.ndarray:
        """``(N, *frame_shape)``: the newest frame of each of N stacks."""
        if self.frame_stack == 1:
            return obs
        c = self.channels
        return obs[:, -c:] if self.first else obs[..., -c:]

    def older(self, obs: np.ndarray) -> np.ndarray:
        """Every frame but the newest, per stack."""
        c = self.channels
        return obs[:, :-c] if self.first else obs[..., :-c]

    def shifted(self, obs: np.ndarray) -> np.ndarray:
        """Every frame but the oldest, per stack."""
        c = self.channels
        return obs[:, c:] if self.first else obs[..., c:]

    def follows(self, obs: np.ndarray, next_obs: np.ndarray) -> np.ndarray:
        """Per env: `next_obs` is `obs` shifted by one frame."""
        if self.frame_stack == 1:
            return _ALL_FOLLOW[: obs.shape[0]] if obs.shape[0] <= _ALL_FOLLOW.size \
                else np.ones(obs.shape[0], bool)
        return np.asarray(_flat(self.older(next_obs) == self.shifted(obs)).all(axis=1))

    def fresh(self, obs: np.ndarray) -> np.ndarray:
        """Per env: the stack is an episode's first (zeros before the newest frame)."""
        if self.frame_stack == 1:
            return np.ones(obs.shape[0], bool)
        return np.asarray(~_flat(self.older(obs)).any(axis=1))

    def to_sb3(self, stacks: torch.Tensor) -> torch.Tensor:
        """``(B, k, *frame_shape)`` store stacks -> ``(B, *obs_shape)`` SB3 stacks."""
        size = stacks.shape[0]
        if self.frame_stack == 1:
            return stacks[:, 0]
        if self.first:
            return stacks.reshape(size, *self.obs_shape)
        return torch.movedim(stacks, 1, -2).reshape(size, *self.obs_shape)


# -- one open store per path and process --------------------------------------------------
_OPEN: dict[str, tuple[ReplayStore, int]] = {}
_OPEN_LOCK = threading.Lock()


def _acquire(key: str, opener: Any) -> ReplayStore:
    """The store open at `key` in this process (shared), or a newly opened one.

    ``DQN.load`` builds a buffer on the store, then ``load_replay_buffer`` unpickles a
    second one on the same path while the first still lives: they share one writer.
    """
    with _OPEN_LOCK:
        if key in _OPEN:
            store, refs = _OPEN[key]
            _OPEN[key] = (store, refs + 1)
            return store
        store = opener()
        lifecycle.untrack(store)  # the buffers' finalizers close it, at exit too (`_release`)
        _OPEN[key] = (store, 1)
        return store


def _release(key: str, stage: StepStage | None = None) -> None:
    """Record a buffer's staged steps, then close the store once no buffer shares it."""
    try:
        if stage is not None and not stage.store.closed:
            stage.drain()
    finally:
        _drop(key)


def _drop(key: str) -> None:
    with _OPEN_LOCK:
        if key not in _OPEN:
            return
        store, refs = _OPEN[key]
        if refs > 1:
            _OPEN[key] = (store, refs - 1)
            return
        del _OPEN[key]
    store.close()


def _calling_algorithm() -> OffPolicyAlgorithm | None:
    """The SB3 algorithm whose ``_setup_model`` is constructing this buffer, if any."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, OffPolicyAlgorithm):
            return owner
        frame = frame.f_back
    return None


# -- the buffer -----------------------------------------------------------------------------
class FrameOnceReplayBuffer(ReplayBuffer):
    """An SB3 ``ReplayBuffer`` that keeps every frame once, on disk, in a `ReplayStore`.

    SB3's own arguments come first (``optimize_memory_usage`` is accepted and changes
    nothing: frames are stored once anyway). ``replay_buffer_kwargs``:

    * ``path`` (required): the store's directory; an existing store there is opened.
    * ``frame_stack``: the env's ``VecFrameStack(n_stack=...)``; 1 without stacking.
    * ``n_steps``, ``gamma``: n-step returns, as SB3's ``NStepReplayBuffer``; when
      left out they are taken from the algorithm (``DQN(n_steps=3, gamma=...)``), and
      values that contradict the algorithm's are refused.
    * ``channels_order``: ``"first"``/``"last"`` as given to ``VecFrameStack``
      (default: the same guess it makes).
    * ``seed``: the store's sampling RNG (default: the algorithm's seed).
    * ``store_options``: more ``ReplayStore.create`` options (``codec``, ``cache_bytes``...).

    The store keeps ``buffer_size // n_envs + n_steps`` frames per env.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space,
                 action_space: spaces.Space, device: torch.device | str = "auto",
                 n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, path: str | os.PathLike[str] | None
                 = None, frame_stack: int = 1, n_steps: int | None = None,
                 gamma: float | None = None, channels_order: str | None = None,
                 seed: int | None = None, store_options: dict[str, Any] | None = None) -> None:
        if path is None:
            raise ValueError('FrameOnceReplayBuffer needs a store directory: '
                             'replay_buffer_kwargs=dict(path="runs/store", frame_stack=...)')
        algo = _calling_algorithm()
        n_steps, gamma = _reconcile_n_steps(algo, n_steps, gamma)
        if seed is None and algo is not None:
            seed = algo.seed
        config = dict(buffer_size=buffer_size, n_envs=n_envs,
                      optimize_memory_usage=bool(optimize_memory_usage),
                      handle_timeout_termination=bool(handle_timeout_termination),
                      frame_stack=frame_stack, n_steps=n_steps, gamma=gamma,
                      channels_order=channels_order, seed=seed,
                      store_options=dict(store_options or {}))
        self._setup(str(path), observation_space, action_space, device, config, create=True)

    # -- construction ---------------------------------------------------------------
    def _setup(self, path: str, observation_space: spaces.Space, action_space: spaces.Space,
               device: torch.device | str, config: dict[str, Any], *, create: bool) -> None:
        """Everything `__init__` and `__setstate__` share: check, then open the store."""
        if not isinstance(observation_space, spaces.Box):
            raise ValueError(f"FrameOnceReplayBuffer needs a Box observation space, got "
                             f"{observation_space}")
        if not isinstance(action_space, spaces.Box | spaces.Discrete | spaces.MultiDiscrete
                          | spaces.MultiBinary):
            raise ValueError(f"unsupported action space {action_space}")
        n_envs = _positive_int("n_envs", config["n_envs"])
        frame_stack = _positive_int("frame_stack", config["frame_stack"])
        BaseBuffer.__init__(self, _positive_int("buffer_size", config["buffer_size"]),
                            observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(config["buffer_size"] // n_envs, 1)
        self.optimize_memory_usage = config["optimize_memory_usage"]
        self.handle_timeout_termination = config["handle_timeout_termination"]
        self.n_steps, self.gamma = config["n_steps"], config["gamma"]
        self.path, self._config = path, config
        self.layout = StackLayout.of(tuple(observation_space.shape), frame_stack,
                                     config["channels_order"],
                                     is_image_space(observation_space, check_channels=False))
        self._obs_dtype = np.dtype(observation_space.dtype)
        self._action_dtype = np.dtype(ReplayBuffer._maybe_cast_dtype(action_space.dtype))
        self._running = np.zeros(n_envs, bool)
        self._last_next = np.zeros((n_envs, *self.obs_shape), self._obs_dtype)
        key = os.path.realpath(path)
        self._store = _acquire(key, lambda: self._open_or_create(path, create=create))
        self._stage = _make_stage(self)
        self._finalizer = weakref.finalize(self, _release, key, self._stage)
        try:
            self._check_store()
        except BaseException:
            self._finalizer()
            raise

    @property
    def store(self) -> ReplayStore:
        """The `ReplayStore` behind the buffer, every step added so far recorded in it."""
        self.drain()
        return self._store

    def drain(self) -> None:
        """Record the steps staged in RAM (one unstacked env stages them, see
        `StepStage`); every read of the store does it first."""
        if self._stage is not None:
            self._stage.drain()

    def _open_or_create(self, path: str, *, create: bool) -> ReplayStore:
        root = Path(path)
        if root.is_dir() and any(root.iterdir()):
            return ReplayStore.open(root)
        if not create:
            raise FileNotFoundError(f"the replay store at {path} is gone: cannot reopen it")
        per_env = self.buffer_size + self.n_steps
        return ReplayStore.create(
            root, capacity=max(per_env, 2) * self.n_envs, obs_shape=self.layout.frame_shape,
            obs_dtype=self._obs_dtype, num_envs=self.n_envs,
            frame_stack=self.layout.frame_stack, n_step=self.n_steps, gamma=self.gamma,
            action_shape=(self.action_dim,), action_dtype=self._action_dtype,
            seed=self._config["seed"], **self._config["store_options"])

    def _check_store(self) -> None:
        """The store (perhaps an existing one) is the one this buffer describes."""
        spec = self._store.spec
        want = dict(num_envs=self.n_envs, frame_stack=self.layout.frame_stack,
                    n_step=self.n_steps, obs_shape=self.layout.frame_shape,
                    obs_dtype=self._obs_dtype, action_shape=(self.action_dim,),
                    action_dtype=self._action_dtype, stack_padding="zero",
                    capacity=max(self.buffer_size + self.n_steps, 2) * self.n_envs)
        if self.n_steps > 1:
            want["gamma"] = self.gamma
        for name, value in want.items():
            have = getattr(spec, name)
            if name.endswith("dtype"):
                have, value = np.dtype(have), np.dtype(value)
            elif name.endswith("shape"):
                have, value = tuple(have), tuple(value)
            if have != value:
                raise ValueError(f"the store at {self.path} has {name}={have!r}, this buffer "
                                 f"needs {name}={value!r} (use another path, or the settings "
                                 f"it was made with)")

    def close(self) -> None:
        """Flush and close the store (once no other buffer in this process shares it)."""
        self._finalizer()

    # -- SB3 buffer API -----------------------------------------------------------------
    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray,
            reward: np.ndarray, done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Record one step of every env (see the module docstring for episode edges)."""
        stage = self._stage
        if stage is not None:
            if stage.take(obs, next_obs, action, reward, done, infos):
                return
            stage.drain()  # in order: the staged steps first
        step = self._checked_step(obs, next_obs, action, reward, done, infos)
        if self.n_envs == 1:
            self._add_one(step)
            return
        starts = ~self._running | ~_rows_equal(step.obs, self._last_next)
        starts_at = np.flatnonzero(starts)
        if starts_at.size:
            stale = starts_at[~self.layout.fresh(step.obs[starts_at])]
            if stale.size:
                raise ValueError(
                    f"obs of env {int(stale[0])} starts an episode but its stack holds older "
                    f"frames: the buffer keeps the newest frame only, so an episode must start "
                    f"with a zero-padded stack (VecFrameStack reset)")
            self._store.reset(self.layout.newest(step.obs[starts_at]), env_ids=starts_at)
        self._store.add(step.action, step.reward, self.layout.newest(step.next_obs),
                       step.terminated, step.truncated)
        going = ~(step.terminated | step.truncated)
        self._running = going
        self._last_next[going] = step.next_obs[going]

    def _add_one(self, step: _Step) -> None:
        """`add` of a one-env buffer, with scalar bookkeeping (the same steps and checks)."""
        obs, layout = step.obs, self.layout
        if not self._running[0] or not (obs == self._last_next).all():
            if not layout.fresh(obs)[0]:
                raise ValueError(
                    "obs of env 0 starts an episode but its stack holds older frames: the "
                    "buffer keeps the newest frame only, so an episode must start with a "
                    "zero-padded stack (VecFrameStack reset)")
            self._store.reset(layout.newest(obs)[0])
        ended = bool(step.terminated[0]) or bool(step.truncated[0])
        self._store.add(step.action[0], step.reward[0], layout.newest(step.next_obs)[0],
                       bool(step.terminated[0]), bool(step.truncated[0]))
        self._running[0] = not ended
        if not ended:
            self._last_next[0] = step.next_obs[0]

    def _checked_step(self, obs: Any, next_obs: Any, action: Any, reward: Any, done: Any,
                      infos: list[dict[str, Any]]) -> _Step:
        """`add`'s arguments as arrays of the right shapes, or a ValueError."""
        n = self.n_envs
        shape = (n, *self.obs_shape)
        arrays = [_shaped("obs", obs, shape, self._obs_dtype),
                  _shaped("next_obs", next_obs, shape, self._obs_dtype)]
        act = np.asarray(action)
        if act.size != n * self.action_dim:
            raise ValueError(f"action shape {act.shape}: expected {n} x {self.action_dim} values")
        rew = np.asarray(reward, dtype=np.float32).reshape(-1)
        flags = np.asarray(done).reshape(-1)
        if rew.size != n or flags.size != n or len(infos) != n:
            raise ValueError(f"reward, done and infos need {n} entries each (n_envs), got "
                             f"{rew.size}, {flags.size} and {len(infos)}")
        if not math.isfinite(rew.sum()) and not np.isfinite(rew).all():
            raise ValueError(f"rewards must be finite, got {rew.tolist()}")
        # a sum is finite only if every element is (a sum that overflows checks them all)
        if arrays[0].dtype.kind == "f" and not (math.isfinite(arrays[0].sum())
                                                and math.isfinite(arrays[1].sum())) \
                and not all(np.isfinite(a).all() for a in arrays):
            raise ValueError("obs and next_obs must be finite")
        if not self.layout.follows(arrays[0], arrays[1]).all():
            bad = int(np.flatnonzero(~self.layout.follows(arrays[0], arrays[1]))[0])
            raise ValueError(
                f"next_obs of env {bad} is not its obs shifted by one frame: observations must "
                f"be VecFrameStack stacks of frame_stack={self.layout.frame_stack} frames")
        # As SB3's NStepReplayBuffer: a time-out ends the episode even without `done`.
        timeout = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos]) \
            if self.handle_timeout_termination else np.zeros(n, bool)
        return _Step(obs=arrays[0], next_obs=arrays[1],
                     action=act.reshape(n, self.action_dim).astype(self._action_dtype),
                     reward=rew, terminated=flags.astype(bool) & ~timeout, truncated=timeout)

    def size(self) -> int:
        """Positions filled per env, as SB3's ``ReplayBuffer.size()``: one per ``add`` (where
        every env steps), at most ``buffer_size // n_envs``. ``len(buffer.store)`` is the
        number of transitions that can be sampled now."""
        staged = 0 if self._stage is None else self._stage.size
        return min((self._store.counts.transitions + staged) // self.n_envs, self.buffer_size)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """`batch_size` transitions drawn uniformly by the store (its own seeded RNG)."""
        self.drain()
        if env is not None:  # VecNormalize: through `samples`
            return self.samples(self._store.sample(batch_size), env)
        arrays = self._store.sample_arrays(batch_size, pin_memory=self.device.type == "cuda")
        return _replay_samples(self, arrays)

    def get(self, ids: Any, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """The transitions with these store ids (ids count steps: ``k * n_envs + i`` is
        env ``i``'s step in the k-th ``add``)."""
        self.drain()
        return self.samples(self._store.get(ids), env)

    def _get_samples(self, batch_inds: np.ndarray,
                     env: VecNormalize | None = None) -> ReplayBufferSamples:
        raise NotImplementedError("FrameOnceReplayBuffer has no buffer positions: use "
                                  "sample(batch_size) or get(transition_ids)")

    def samples(self, batch: Batch, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """A store `Batch` as SB3's ``ReplayBufferSamples`` on ``self.device``.

        ``dones`` is 1 for a window that ended in termination (not truncation);
        ``discounts`` is ``None`` for 1-step (SB3 then uses the algorithm's gamma), else
        ``gamma ** m`` for a window of m steps, also after a termination, as SB3's
        ``NStepReplayBuffer`` (the store's own ``Batch.discount`` is 0 there).
        """
        obs, next_obs = self.layout.to_sb3(batch.obs), self.layout.to_sb3(batch.next_obs)
        rewards = batch.reward.reshape(-1, 1)
        if env is not None:
            obs = torch.from_numpy(np.asarray(self._normalize_obs(obs.numpy(), env)))
            next_obs = torch.from_numpy(np.asarray(self._normalize_obs(next_obs.numpy(), env)))
            rewards = torch.from_numpy(self._normalize_reward(rewards.numpy(), env))
        discounts = None
        if self.n_steps > 1:
            assert batch.steps is not None  # store batches carry their window lengths
            discounts = torch.from_numpy(
                (self.gamma ** batch.steps.numpy()).astype(np.float32).reshape(-1, 1))
        fields = dict(observations=obs, actions=batch.action, next_observations=next_obs,
                      dones=batch.terminated.to(torch.float32).reshape(-1, 1),
                      rewards=rewards, discounts=discounts)
        if self.device.type != "cpu":
            fields = {k: None if v is None else v.to(self.device) for k, v in fields.items()}
        return ReplayBufferSamples(**fields)

    # -- pickling (save_replay_buffer / load_replay_buffer) ----------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Path, configuration and per-env state only; the store is flushed first."""
        self.drain()
        self._store.flush()
        counts = self._store.counts
        return dict(version=STATE_VERSION, path=self.path, config=dict(self._config),
                    observation_space=self.observation_space, action_space=self.action_space,
                    device=str(self.device), running=self._running.copy(),
                    last_next=self._last_next.copy(),
                    at=(counts.frames_written, counts.transitions))

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"FrameOnceReplayBuffer pickle version {state.get('version')!r}, "
                             f"expected {STATE_VERSION}")
        self._setup(state["path"], state["observation_space"], state["action_space"],
                    state["device"], state["config"], create=False)
        counts = self._store.counts
        if (counts.frames_written, counts.transitions) == tuple(state["at"]):
            self._running[:] = np.asarray(state["running"], bool)  # shared with the stage
            self._last_next[:] = np.asarray(state["last_next"], self._obs_dtype)
        else:
            warnings.warn(f"the store at {self.path} changed since this buffer was saved: "
                          f"its running episodes end as truncated at the next step",
                          stacklevel=2)


def _make_stage(buf: FrameOnceReplayBuffer) -> StepStage | None:
    """One unstacked env: steps staged in RAM and recorded in blocks (`StepStage`)."""
    if buf.n_envs != 1 or buf.layout.frame_stack != 1:
        return None
    capacity = int(min(STAGE_ROWS, max(buf.buffer_size // 4, 1)))
    return StepStage(buf._store, buf.obs_shape, buf._obs_dtype, buf.action_dim,
                     buf._action_dtype, capacity=capacity,
                     timeouts=buf.handle_timeout_termination, running=buf._running,
                     last_next=buf._last_next)


def _replay_samples(buf: FrameOnceReplayBuffer, batch: ArrayBatch) -> ReplayBufferSamples:
    """`FrameOnceReplayBuffer.samples` of a store's `ArrayBatch` (no VecNormalize): each field
    handed to torch without a copy (``obs``, ``next_obs``: views of one tensor of frames)."""
    both = frames_tensor(batch)  # pinned: the block's own tensor, so copies are tracked
    if buf.layout.frame_stack == 1:
        both = both.reshape(2, both.shape[1], *buf.obs_shape)
        obs, next_obs = both[0], both[1]
    else:
        obs, next_obs = buf.layout.to_sb3(both[0]), buf.layout.to_sb3(both[1])
    rewards = batch.reward.reshape(-1, 1)
    discounts = None
    if buf.n_steps > 1:
        discounts = torch.from_numpy(
            (buf.gamma ** batch.steps).astype(np.float32).reshape(-1, 1))
    fields = dict(observations=obs, actions=torch.from_numpy(batch.action),
                  next_observations=next_obs,
                  dones=torch.from_numpy(batch.terminated.astype(np.float32)[:, None]),
                  rewards=torch.from_numpy(rewards), discounts=discounts)
    if buf.device.type != "cpu":
        fields = {k: None if v is None else v.to(buf.device, non_blocking=True)
                  for k, v in fields.items()}
    return ReplayBufferSamples(**fields)


@dataclass(frozen=True)
class _Step:
    obs: np.ndarray
    next_obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


def _reconcile_n_steps(algo: OffPolicyAlgorithm | None, n_steps: int | None,
                       gamma: float | None) -> tuple[int, float]:
    """n-step settings from the kwargs and the algorithm, or a ValueError if they disagree.

    SB3 passes ``n_steps``/``gamma`` only to its own buffer: ``DQN(n_steps=3)`` with a
    custom class would otherwise train 1-step without a word.
    """
    algo_n = 1 if algo is None else int(algo.n_steps)
    algo_gamma = None if algo is None else float(algo.gamma)
    if n_steps is None and algo_n > 1:
        warnings.warn(f"FrameOnceReplayBuffer takes n_steps={algo_n}, gamma={algo_gamma} from "
                      f"the algorithm: its n-step returns are on", stacklevel=4)
    if n_steps is None:
        n_steps = algo_n
    n_steps = _positive_int("n_steps", n_steps)
    if algo_n > 1 and n_steps != algo_n:
        raise ValueError(f"replay_buffer_kwargs n_steps={n_steps} contradicts the algorithm's "
                         f"n_steps={algo_n}")
    if gamma is None:
        gamma = 0.99 if algo_gamma is None else algo_gamma
    elif n_steps > 1 and algo_gamma is not None and float(gamma) != algo_gamma:
        raise ValueError(f"replay_buffer_kwargs gamma={gamma} contradicts the algorithm's "
                         f"gamma={algo_gamma}: n-step returns would discount differently")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    return n_steps, gamma


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _shaped(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size != math.prod(shape):
        raise ValueError(f"{name} shape {arr.shape} != expected {shape} (n_envs, *obs_shape)")
    if arr.dtype != dtype:
        raise ValueError(f"{name} dtype {arr.dtype} != observation space dtype {dtype}")
    return arr.reshape(shape)


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(_flat(a == b).all(axis=1))


def _flat(a: np.ndarray) -> np.ndarray:
    """``(N, ...)`` -> ``(N, rest)``, also for N = 0."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))

"""Stable-Baselines3: `FrameOnceReplayBuffer`, a ``replay_buffer_class`` backed by a store.

    model = DQN("CnnPolicy", VecFrameStack(env, n_stack=4), buffer_size=1_000_000,
                replay_buffer_class=FrameOnceReplayBuffer,
                replay_buffer_kwargs=dict(path="runs/sb3_store", frame_stack=4))

SB3 (or cleanrl, which feeds SB3's buffer) hands the buffer whole stacks (``obs`` and
``next_obs``, ``(n_envs, *stacked)``); the buffer keeps only the newest frame of each and
lets the store rebuild the stacks::

    add:     obs = [o_{t-3} o_{t-2} o_{t-1} o_t]   next_obs = [o_{t-2} o_{t-1} o_t o_{t+1}]
    store:   reset(o_0) at an episode start, then add(a_t, r_t, o_{t+1}, terminated, truncated)
    sample:  stacks rebuilt from the store, padded before o_0 as the env padded them
             (zeros: `VecFrameStack`; copies of o_0: gymnasium's `FrameStackObservation`)

Episode edges, per env (the rules, and both autoreset modes of gymnasium's vector envs,
in `mmreplay.integrations.sb3_edges`):

* ``done`` with ``infos[i]["TimeLimit.truncated"]`` ends the episode as truncated (as
  terminated without it, or always with ``handle_timeout_termination=False``); so does a
  final observation in ``infos`` without ``done`` (cleanrl passes only terminations).
* an ``obs`` that is not the env's previous ``next_obs`` (a second ``learn()``, or
  ``load(force_reset=True)``, reset the envs with no done flag) ends the running episode
  as truncated and starts a new one: episodes are never stitched together.
* a step's next stack is ``next_obs`` if it is ``obs`` shifted by one frame, else the final
  observation in ``infos`` if that is; a terminated step may have neither (its next state
  is never used); with next-step autoreset, the step that only resets an env is no
  transition. Every episode's first stack is padded alike, so a rebuilt stack equals what
  was passed, bit for bit; anything else is refused (`ValueError`) before the store changes.

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

import os
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from mmreplay.errors import DeviceMemoryError
from mmreplay.integrations.sb3_config import (
    check_spec,
    choice,
    flag,
    positive_int,
    reconcile_n_steps,
)
from mmreplay.integrations.sb3_edges import (
    AUTORESET_MODES,
    EpisodeEdges,
    StepChecker,
    final_observations,
)
from mmreplay.integrations.sb3_layout import PADDINGS, StackLayout
from mmreplay.integrations.sb3_samples import array_fields, batch_fields
from mmreplay.integrations.shared_stores import acquire, release
from mmreplay.integrations.step_stage import StepStage
from mmreplay.store import ReplayStore
from mmreplay.torch_batch import Batch

try:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
    from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
    from stable_baselines3.common.preprocessing import is_image_space
    from stable_baselines3.common.type_aliases import ReplayBufferSamples
    from stable_baselines3.common.vec_env import VecNormalize
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('mmreplay.integrations.sb3 needs stable-baselines3: '
                      'pip install "mmreplay[sb3]"') from exc

__all__ = ["FrameOnceReplayBuffer", "StackLayout"]

STATE_VERSION = 2  # 2: episode edge state (ended, autoreset mode, padding); 1 is read
FLUSH_EVERY = 100_000  # adds between the buffer's own commits of the store (`flush_every`)
STAGE_ROWS = 256  # steps of a one-env, unstacked buffer staged in RAM at most (`StepStage`)


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
    * ``stack_padding``: ``"zero"`` (``VecFrameStack``) or ``"first"`` (gymnasium's
      ``FrameStackObservation``): how an episode's first stack is padded (default: read
      off the first ``add``, which then creates the store; ``"zero"`` when an SB3
      algorithm builds the buffer).
    * ``autoreset_mode``: ``"same-step"`` or ``"next-step"``, the vector env's (default:
      told apart as the stream goes; see `mmreplay.integrations.sb3_edges`).
    * ``flush_every``: the store commits every this many ``add`` calls (default 100,000;
      None: only when the buffer is saved or closed): a crash keeps every step up to the
      last commit, and what the store holds in RAM until a commit stays bounded.
    * ``seed``: the store's sampling RNG (default: the algorithm's seed).
    * ``store_options``: more ``ReplayStore.create`` options (``codec``, ``cache_bytes``...).
    * ``frames_on_device``: every frame once on ``device`` too (docs/guides/device_frames.md),
      ``sample`` gathered there; a store that does not fit stays on the host, with a warning.

    The store keeps ``buffer_size // n_envs + n_steps`` frames per env.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space,
                 action_space: spaces.Space, device: torch.device | str = "auto",
                 n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, path: str | os.PathLike[str] | None
                 = None, frame_stack: int = 1, n_steps: int | None = None,
                 gamma: float | None = None, channels_order: str | None = None,
                 stack_padding: str | None = None, autoreset_mode: str | None = None,
                 flush_every: int | None = FLUSH_EVERY, seed: int | None = None,
                 store_options: dict[str, Any] | None = None,
                 frames_on_device: bool = False) -> None:
        if path is None:
            raise ValueError('FrameOnceReplayBuffer needs a store directory: '
                             'replay_buffer_kwargs=dict(path="runs/store", frame_stack=...)')
        choice("stack_padding", stack_padding, PADDINGS)
        choice("autoreset_mode", autoreset_mode, AUTORESET_MODES)
        algo = _calling_algorithm()
        n_steps, gamma = reconcile_n_steps(algo, n_steps, gamma)
        if seed is None and algo is not None:
            seed = algo.seed
        if stack_padding is None and algo is not None:
            stack_padding = "zero"  # an SB3 algorithm's envs stack with VecFrameStack
        config = dict(buffer_size=buffer_size, n_envs=n_envs,
                      optimize_memory_usage=bool(optimize_memory_usage),
                      handle_timeout_termination=bool(handle_timeout_termination),
                      frame_stack=frame_stack, n_steps=n_steps, gamma=gamma,
                      channels_order=channels_order, stack_padding=stack_padding,
                      autoreset_mode=autoreset_mode, seed=seed,
                      flush_every=None if flush_every is None
                      else positive_int("flush_every", flush_every),
                      store_options=dict(store_options or {}),
                      frames_on_device=flag("frames_on_device", frames_on_device))
        self._setup(str(path), observation_space, action_space, device, config, create=True)

    # -- construction ---------------------------------------------------------------
    def _setup(self, path: str, observation_space: spaces.Space, action_space: spaces.Space,
               device: torch.device | str, config: dict[str, Any], *, create: bool) -> None:
        """Everything `__init__` and `__setstate__` share: check, then open the store
        (or wait for the first ``add`` to show the padding of first stacks)."""
        if not isinstance(observation_space, spaces.Box):
            raise ValueError(f"FrameOnceReplayBuffer needs a Box observation space, got "
                             f"{observation_space}")
        if not isinstance(action_space, spaces.Box | spaces.Discrete | spaces.MultiDiscrete
                          | spaces.MultiBinary):
            raise ValueError(f"unsupported action space {action_space}")
        n_envs = positive_int("n_envs", config["n_envs"])
        frame_stack = positive_int("frame_stack", config["frame_stack"])
        BaseBuffer.__init__(self, positive_int("buffer_size", config["buffer_size"]),
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
        self._checker = StepChecker(n_envs, self.obs_shape, self._obs_dtype, self.action_dim,
                                    self._action_dtype, self.handle_timeout_termination)
        self._edges = EpisodeEdges(self.layout, n_envs, self._obs_dtype,
                                   padding=config["stack_padding"], mode=config["autoreset_mode"])
        self._running, self._last_next = self._edges.running, self._edges.last_next
        self._store: ReplayStore | None = None
        # sample through `ReplayStore.sample` (gathered on the device): as configured, unless
        # this buffer opened the store and its frames did not fit there
        self._frames_on_device = bool(config.get("frames_on_device"))
        self._adds, self._flush_every = 0, config.get("flush_every")
        self._stage: StepStage | None = None
        self._finalizer: weakref.finalize | None = None
        if config["stack_padding"] or not self.layout.stacked or _holds_files(path):
            self._open_store(config["stack_padding"] or "zero", create=create)

    def _open_store(self, padding: str, *, create: bool) -> ReplayStore:
        """Open (or create, with first stacks padded as `padding`) the store at the path."""
        key = os.path.realpath(self.path)
        store = acquire(key, lambda: self._open_or_create(padding, create=create))
        self._store = store
        self._stage = self._new_stage(store)
        self._finalizer = weakref.finalize(self, release, key, self._stage)
        try:
            self._check_store()
        except BaseException:
            self._finalizer()
            raise
        if self.layout.stacked:  # an existing store's padding is the one to keep
            self._edges.padding = self._config["stack_padding"] = store.spec.stack_padding
        return store

    def _new_stage(self, store: ReplayStore) -> StepStage | None:
        """One unstacked env: steps staged in RAM and recorded in blocks (`StepStage`)."""
        if self.n_envs != 1 or self.layout.stacked:
            return None
        capacity = int(min(STAGE_ROWS, max(self.buffer_size // 4, 1)))
        return StepStage(store, self.obs_shape, self._obs_dtype, self.action_dim,
                         self._action_dtype, capacity=capacity,
                         timeouts=self.handle_timeout_termination, edges=self._edges)

    @property
    def store(self) -> ReplayStore:
        """The `ReplayStore` behind the buffer, every step added so far recorded in it."""
        self.drain()
        if self._store is None:
            raise ValueError(
                f"no store at {self.path} yet: the buffer creates it at the first add, where "
                f"it sees how first stacks are padded (or pass stack_padding='zero'/'first')")
        return self._store

    def drain(self) -> None:
        """Record the steps staged in RAM (one unstacked env stages them, see
        `StepStage`); every read of the store does it first."""
        if self._stage is not None:
            self._stage.drain()

    def _open_or_create(self, padding: str, *, create: bool) -> ReplayStore:
        """The store, with its frames on ``self.device`` too if the configuration says so
        and they fit there (else on the host, with a warning)."""
        device = self.device if self._config.get("frames_on_device") else None
        store, self._frames_on_device = _open_with_fallback(
            lambda on: self._open_on(on, padding, create=create), device)
        return store

    def _open_on(self, device: torch.device | None, padding: str, *,
                 create: bool) -> ReplayStore:
        root = Path(self.path)
        if _holds_files(self.path):
            return ReplayStore.open(root, device=device)
        if not create:
            raise FileNotFoundError(f"the replay store at {self.path} is gone: cannot reopen it")
        per_env = self.buffer_size + self.n_steps
        return ReplayStore.create(
            root, capacity=max(per_env, 2) * self.n_envs, obs_shape=self.layout.frame_shape,
            obs_dtype=self._obs_dtype, num_envs=self.n_envs,
            frame_stack=self.layout.frame_stack, n_step=self.n_steps, gamma=self.gamma,
            stack_padding=padding, action_shape=(self.action_dim,),
            action_dtype=self._action_dtype, seed=self._config["seed"], device=device,
            **self._config["store_options"])

    def _check_store(self) -> None:
        """The store (perhaps an existing one) is the one this buffer describes."""
        assert self._store is not None  # called right after opening it
        want = dict(num_envs=self.n_envs, frame_stack=self.layout.frame_stack,
                    n_step=self.n_steps, obs_shape=self.layout.frame_shape,
                    obs_dtype=self._obs_dtype, action_shape=(self.action_dim,),
                    action_dtype=self._action_dtype,
                    capacity=max(self.buffer_size + self.n_steps, 2) * self.n_envs)
        if self.n_steps > 1:
            want["gamma"] = self.gamma
        if self.layout.stacked and self._config["stack_padding"] is not None:
            want["stack_padding"] = self._config["stack_padding"]
        check_spec(self._store.spec, want, self.path)

    def close(self) -> None:
        """Flush and close the store (once no other buffer in this process shares it)."""
        if self._finalizer is not None:
            self._finalizer()

    # -- SB3 buffer API -----------------------------------------------------------------
    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray,
            reward: np.ndarray, done: np.ndarray, infos: Any) -> None:
        """Record one step of every env: ``infos`` as SB3 (a list of dicts) or a gymnasium
        vector env (a dict) gives them; episode edges in `mmreplay.integrations.sb3_edges`."""
        self._adds += 1
        if self._adds == self._flush_every:
            self._adds = 0
            if self._store is not None:
                self.store.flush()  # the steps so far (the stage's too); this one follows
        stage = self._stage
        if stage is not None:
            if stage.take(obs, next_obs, action, reward, done, infos):
                return
            stage.drain()  # in order: the staged steps first
        step = self._checker.check(obs, next_obs, action, reward, done, infos)
        finals = final_observations(infos, self.n_envs, self.obs_shape, self._obs_dtype)
        plan = self._edges.plan(step, finals, "first" if isinstance(infos, dict) else "zero")
        store = self._store
        if store is None:
            store = self._open_store(plan.padding or "zero", create=True)
        newest = self.layout.newest
        if plan.reset_envs.size:
            store.reset(newest(plan.reset_stacks), env_ids=plan.reset_envs)
        rec = plan.recorded
        if rec is None:
            store.add(step.action, step.reward, newest(plan.next_obs), plan.terminated,
                      plan.truncated)
        elif rec.size:
            store.add(step.action[rec], step.reward[rec], newest(plan.next_obs[rec]),
                      plan.terminated[rec], plan.truncated[rec], env_ids=rec)
        self._edges.commit(plan)

    def size(self) -> int:
        """Positions filled per env, as SB3's ``ReplayBuffer.size()``: one per ``add`` (where
        every env steps), at most ``buffer_size // n_envs``. ``len(buffer.store)`` is the
        number of transitions that can be sampled now."""
        if self._store is None:
            return 0
        staged = 0 if self._stage is None else self._stage.size
        return min((self._store.counts.transitions + staged) // self.n_envs, self.buffer_size)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """`batch_size` transitions drawn uniformly by the store (its own seeded RNG);
        with ``frames_on_device``, gathered on the device."""
        store = self.store
        if env is not None or self._frames_on_device:  # VecNormalize, device: `samples`
            return self.samples(store.sample(batch_size), env)
        arrays = store.sample_arrays(batch_size, pin_memory=self.device.type == "cuda")
        return ReplayBufferSamples(**array_fields(arrays, self.layout, self.obs_shape,
                                                  self._n_step_gamma(), self.device))

    def get(self, ids: Any, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """The transitions with these store ids (ids count recorded steps, env by env within
        an ``add``: ``k * n_envs + i`` is env ``i``'s step in the k-th ``add`` as long as no
        step was only a next-step autoreset)."""
        return self.samples(self.store.get(ids), env)

    def _get_samples(self, batch_inds: np.ndarray,
                     env: VecNormalize | None = None) -> ReplayBufferSamples:
        raise NotImplementedError("FrameOnceReplayBuffer has no buffer positions: use "
                                  "sample(batch_size) or get(transition_ids)")

    def samples(self, batch: Batch, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """A store `Batch` (on any device) as SB3's ``ReplayBufferSamples`` on
        ``self.device`` (`mmreplay.integrations.sb3_samples`: dones, discounts)."""
        return ReplayBufferSamples(**batch_fields(batch, self.layout, self._n_step_gamma(),
                                                  self.device, env))

    def _n_step_gamma(self) -> float | None:
        """The gamma of n-step discounts; None for 1-step (SB3 uses the algorithm's)."""
        return self.gamma if self.n_steps > 1 else None

    # -- pickling (save_replay_buffer / load_replay_buffer) ----------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Path, configuration and per-env state only; the store is flushed first."""
        self.drain()
        at = None
        if self._store is not None:
            self._store.flush()
            counts = self._store.counts
            at = (counts.frames_written, counts.transitions)
        edges = self._edges
        return dict(version=STATE_VERSION, path=self.path, config=dict(self._config),
                    observation_space=self.observation_space, action_space=self.action_space,
                    device=str(self.device), running=edges.running.copy(),
                    last_next=edges.last_next.copy(), ended=edges.ended.copy(),
                    mode=edges.mode, at=at)

    def __setstate__(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"FrameOnceReplayBuffer pickle version {version!r}, expected "
                             f"{STATE_VERSION} (or 1)")
        config = dict(state["config"])
        config.setdefault("stack_padding", "zero")  # version 1 took zero padding only
        config.setdefault("autoreset_mode", None)
        config.setdefault("flush_every", FLUSH_EVERY)
        config.setdefault("frames_on_device", False)
        self._setup(state["path"], state["observation_space"], state["action_space"],
                    state["device"], config, create=False)
        counts = None if self._store is None else self._store.counts
        at = None if counts is None else (counts.frames_written, counts.transitions)
        if at == (None if state["at"] is None else tuple(state["at"])):
            edges = self._edges  # arrays shared with the stage: filled in place
            edges.running[:] = np.asarray(state["running"], bool)
            edges.last_next[:] = np.asarray(state["last_next"], self._obs_dtype)
            edges.ended[:] = np.asarray(state.get("ended", np.zeros(self.n_envs)), bool)
            edges.mode = state.get("mode", edges.mode)
        else:
            warnings.warn(f"the store at {self.path} changed since this buffer was saved: "
                          f"its running episodes end as truncated at the next step",
                          stacklevel=2)


def _open_with_fallback(open_on: Callable[[torch.device | None], ReplayStore],
                        device: torch.device | None) -> tuple[ReplayStore, bool]:
    """``open_on(device)`` and True; ``open_on(None)`` and False without a device, or with a
    warning where the store's frames do not fit there."""
    if device is None:
        return open_on(None), False
    try:
        return open_on(device), True
    except DeviceMemoryError as exc:
        warnings.warn(f"FrameOnceReplayBuffer(frames_on_device=True): {exc}; the frames stay "
                      f"on the host and batches are copied to {device}", stacklevel=8)
        return open_on(None), False


def _holds_files(path: str) -> bool:
    root = Path(path)
    return root.is_dir() and any(root.iterdir())

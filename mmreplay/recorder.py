"""Recording steps: ``reset``/``add`` arguments checked, then written to the ring and frames.

`Recorder.add` and `Recorder.reset` check one call's arguments (`validate`); `Recorder.add_rows`
checks a whole block of rows at once and then records them in order, so a caller that
batches many steps (the Ray block taker) pays for the checks once. Either way a rejected
call changes nothing. One fast path: a single-env store's step of plain values
(`Recorder.add_plain_step`, held equal to the general `add` by
``test_store.test_plain_scalar_steps_store_what_arrays_store``). The store holds the lock
and refuses read-only or closed stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mmreplay import validate
from mmreplay.errors import InvalidInputError
from mmreplay.index.blocks import block_fits, record_block
from mmreplay.index.ring import StepRing
from mmreplay.spec import StoreSpec
from mmreplay.storage.frame_store import FrameStore

if TYPE_CHECKING:
    from mmreplay.device_frames import DeviceFrames


@dataclass(frozen=True)
class StepRows:
    """Rows of steps for `ReplayStore.add_rows`: row ``t`` is one ``add`` of the envs
    `env_ids`; every array has a leading ``(rows, len(env_ids))`` shape."""

    env_ids: Any
    action: Any          # (rows, envs, *action_shape)
    reward: Any          # (rows, envs)
    next_obs: Any        # (rows, envs, *obs_shape)
    terminated: Any      # (rows, envs) bool
    truncated: Any       # (rows, envs) bool
    autoreset: Any       # (rows, envs) bool: the row's frame is o_0 of a new episode
    extras: Any = None   # {name: (rows, envs, *shape)}, exactly the declared extras


class Recorder:
    """Appends checked steps and episode starts to one store's ring and frame store."""

    def __init__(self, spec: StoreSpec, ring: StepRing, frames: FrameStore) -> None:
        self.spec = spec
        self.ring = ring
        self.frames = frames
        self.all_envs = np.arange(spec.num_envs, dtype=np.int64)
        self.scalar_step = validate.scalar_step_checker(spec)
        self.device: DeviceFrames | None = None  # a ``device=`` store's ring: written through

    def reset(self, obs: Any, env_ids: Any) -> None:
        """o_0 of a new episode for all envs or the listed ones (see `ReplayStore.reset`)."""
        envs = validate.env_ids(self.spec, env_ids)
        count = 1 if self.spec.num_envs == 1 and env_ids is not None else envs.size
        frames = validate.observations(self.spec, obs, count)
        self.append(envs, self.ring.begin_episodes(envs), frames)

    def add(self, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            autoreset: Any, env_ids: Any, extras: Any) -> None:
        """One step of every env or of the listed ones (see `ReplayStore.add`)."""
        if self.scalar_step is not None and autoreset is None and env_ids is None \
                and extras is None and not self.spec.extras and self.ring.running[0] \
                and self.add_plain_step(action, reward, next_obs, terminated, truncated):
            return
        spec = self.spec
        envs = self.all_envs if env_ids is None else validate.env_ids(spec, env_ids)
        count = envs.size
        frames = validate.observations(spec, next_obs, count, "next_obs")
        auto = validate.flags(spec, "autoreset", autoreset, count)
        term = validate.flags(spec, "terminated", terminated, count)
        trunc = validate.flags(spec, "truncated", truncated, count)
        act, rew = validate.actions(spec, action, count), validate.rewards(spec, reward, count)
        extra = validate.extras(spec, extras, count)
        self._check_running(envs, auto, self.ring.running[envs])
        self.record(envs, act, rew, frames, term, trunc, auto, extra)

    def add_plain_step(self, action: Any, reward: Any, next_obs: Any, terminated: Any,
                       truncated: Any) -> bool:
        """`add`'s fast path: the running step of a single-env store (no autoreset, env ids
        or extras) whose values `validate.scalar_step_checker` finds exactly what the
        general checks would take unchanged; recorded with `FrameStore.append_one`. False,
        recording nothing, when they are not: the general path checks them."""
        assert self.scalar_step is not None
        step = self.scalar_step(action, reward, next_obs, terminated, truncated)
        if step is None:
            return False
        slot = self.ring.record_step(0, *step)
        if self.device is not None:
            self.device.write_one(slot, next_obs)
        self.frames.append_one(0, slot, next_obs)
        return True

    def add_rows(self, rows: StepRows) -> None:
        """Every row of `rows`, checked at once before the first is recorded."""
        envs, act, rew, frames, term, trunc, auto, extras = self._checked_rows(rows)
        # episode order of the whole block, before any write: row t's envs run before it
        before = np.empty_like(auto)
        before[0] = self.ring.running[envs]
        before[1:] = auto[:-1] | ~(term[:-1] | trunc[:-1])
        idle = ~auto & ~before
        if idle.any():
            t = int(np.flatnonzero(idle.any(axis=1))[0])
            self._check_running(envs, auto[t], before[t])
        env_of = np.tile(envs, rew.shape[0])
        if block_fits(self.ring, env_of):
            self.record_rows(envs, act, rew, frames, term, trunc, auto, extras)
            return
        for t in range(rew.shape[0]):
            self.record(envs, act[t], rew[t], frames[t], term[t], trunc[t], auto[t],
                        {name: value[t] for name, value in extras.items()})

    def record_rows(self, envs: np.ndarray, act: np.ndarray, rew: np.ndarray,
                    frames: np.ndarray, term: np.ndarray, trunc: np.ndarray, auto: np.ndarray,
                    extras: dict[str, np.ndarray]) -> None:
        """Checked rows ``(rows, len(envs), ...)`` recorded as `record` would, row after row:
        the ring in one compiled call, then each env's frames in one run."""
        rows, count = rew.shape[0], envs.size
        flat = rows * count
        slots = record_block(
            self.ring, np.tile(envs, rows), auto.reshape(flat),
            act.reshape(flat, *act.shape[2:]), rew.reshape(flat), term.reshape(flat),
            trunc.reshape(flat),
            {k: v.reshape(flat, *v.shape[2:]) for k, v in extras.items()})
        first, spe = slots[:count], self.spec.slots_per_env
        for i, env in enumerate(envs.tolist()):
            if self.device is not None:
                self.device.write(env * spe + (first[i] + np.arange(rows)) % spe, frames[:, i])
            self.frames.append_run(env, int(first[i]), frames[:, i])

    def _checked_rows(self, rows: StepRows) -> tuple[Any, ...]:
        spec = self.spec
        envs = validate.env_ids(spec, rows.env_ids)
        shape = np.shape(rows.reward)
        if len(shape) != 2 or shape[1] != envs.size or shape[0] == 0:
            raise InvalidInputError(f"rows reward shape {shape} != expected (rows >= 1, "
                                    f"{envs.size}) (rows, envs)")
        count = shape[0] * shape[1]

        def flat(value: Any, tail: tuple[int, ...]) -> Any:
            arr = np.asarray(validate.to_numpy(value))
            if arr.shape[:2] != shape:
                raise InvalidInputError(f"rows array of shape {arr.shape} does not start with "
                                        f"(rows, envs) = {shape}")
            return arr.reshape(count, *tail) if arr.shape[2:] == tail else arr

        frames = validate.observations(spec, flat(rows.next_obs, spec.obs_shape), count,
                                       "next_obs")
        act = validate.actions(spec, flat(rows.action, spec.action_shape), count)
        rew = validate.rewards(spec, flat(rows.reward, ()), count)
        flags = [validate.flags(spec, name, flat(getattr(rows, name), ()), count)
                 for name in ("terminated", "truncated", "autoreset")]
        tails = {name: tail for name, tail, _ in spec.extras}
        given = rows.extras
        if isinstance(given, dict):
            given = {k: flat(v, tails.get(k, np.shape(v)[2:])) for k, v in given.items()}
        extras = validate.extras(spec, given, count)
        return (envs, act.reshape(*shape, *spec.action_shape), rew.reshape(shape),
                frames.reshape(*shape, *spec.obs_shape), *(f.reshape(shape) for f in flags),
                {k: v.reshape(*shape, *v.shape[1:]) for k, v in extras.items()})

    @staticmethod
    def _check_running(envs: np.ndarray, auto: np.ndarray, running: np.ndarray) -> None:
        idle = envs[~auto & ~running]
        if idle.size:
            raise InvalidInputError(
                f"add for env {int(idle[0])} whose episode has ended or not begun: call reset "
                f"(or pass autoreset=True for it) first")

    def record(self, envs: np.ndarray, act: np.ndarray, rew: np.ndarray, frames: np.ndarray,
               term: np.ndarray, trunc: np.ndarray, auto: np.ndarray,
               extras: dict[str, np.ndarray] | None = None) -> None:
        """A step after its checks (one row per env of `envs`, each running or `auto`)."""
        extras = extras or {}
        if not auto.any():  # the common case: every listed env steps
            self.append(envs, self.ring.record_steps(envs, act, rew, term, trunc, extras),
                        frames)
            return
        step, again = np.flatnonzero(~auto), np.flatnonzero(auto)
        slots = self.ring.record_steps(envs[step], act[step], rew[step], term[step],
                                       trunc[step], {k: v[step] for k, v in extras.items()})
        self.append(envs[step], slots, frames[step])
        self.append(envs[again], self.ring.begin_episodes(envs[again]), frames[again])

    def append(self, envs: np.ndarray, slots: np.ndarray, frames: np.ndarray) -> None:
        """Frames the ring placed at `slots` of `envs`: to the device ring (if any), then to
        the frame store (which may raise after taking them: a failed chunk write)."""
        if self.device is not None:
            self.device.write(envs * self.spec.slots_per_env + slots, frames)
        self.frames.append(envs, slots, frames)

"""Episode edges of an SB3-style ``add(obs, next_obs, action, reward, done, infos)`` stream:
which envs start an episode, which steps become transitions, and what each transition's next
observation really is. `EpisodeEdges` owns the per-env state; it plans one ``add`` without
changing anything, and `EpisodeEdges.commit` takes the plan once the store recorded it.

Vector envs reset a finished env in one of two ways; the plan handles both, per env::

    same-step (SB3 VecEnvs, gymnasium AutoresetMode.SAME_STEP; cleanrl's dqn_atari.py)
      t     obs=[.. o_t]  next_obs=[.. o_t+1] done   infos: final obs (terminal_observation,
                                                      final_obs, final_observation)
      t+1   obs=R (the next episode's first stack)    -> a new episode starts at R
    next-step (gymnasium AutoresetMode.NEXT_STEP, its default)
      t     obs=[.. o_t]  next_obs=F (final) done     infos: no final obs
      t+1   obs=F  next_obs=R  reward 0, not done     -> no transition: the env only reset;
                                                         a new episode starts at R

The next observation of a recorded step is ``next_obs`` when it is ``obs`` shifted by one
frame, else the final observation in ``infos`` when that is; failing both, a terminated step
is still recorded (its next state is never used: discount 0; cleanrl passes the next
episode's first stack there) and anything else is refused. A final observation in ``infos``
ends the episode (truncated unless ``done`` says terminated: cleanrl passes only
terminations as ``done``). In next-step mode an unflagged end shows at t+1 as an obs that
continues the episode and a ``next_obs`` that is a first stack: the episode ends truncated
at t, and the new one starts at R.

``autoreset_mode=None`` tells the modes apart as the stream goes: final observations in
``infos`` mean same-step; a step as at t+1 above means next-step; from then on the other
mode's steps are refused. The padding of first stacks (`StackLayout.fresh`) is read off the
first episode start when not declared; when both fit (an ``o_0`` of zeros) a gymnasium
stream (``infos`` a dict) is taken to pad with its first frame, an SB3 one with zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.integrations.sb3_layout import PADDINGS, StackLayout, rows_equal

__all__ = ["AUTORESET_MODES", "EdgePlan", "EpisodeEdges", "Finals", "Step", "StepChecker",
           "final_observations"]

SAME_STEP, NEXT_STEP = "same-step", "next-step"
AUTORESET_MODES = (SAME_STEP, NEXT_STEP)
FINAL_KEYS = ("final_obs", "final_observation")  # gymnasium 1.x, gymnasium 0.26-0.29


@dataclass(frozen=True)
class Step:
    """One checked ``add``, every array with a leading ``n_envs`` axis."""

    obs: np.ndarray
    next_obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


@dataclass(frozen=True)
class StepChecker:
    """Turns an ``add``'s arguments into a `Step` of the buffer's shapes, or a ValueError."""

    n_envs: int
    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    action_dim: int
    action_dtype: np.dtype
    timeouts: bool  # handle_timeout_termination: TimeLimit.truncated in infos truncates

    def check(self, obs: Any, next_obs: Any, action: Any, reward: Any, done: Any,
              infos: Any) -> Step:
        n = self.n_envs
        shape = (n, *self.obs_shape)
        arrays = [_shaped("obs", obs, shape, self.obs_dtype),
                  _shaped("next_obs", next_obs, shape, self.obs_dtype)]
        act = np.asarray(action)
        if act.size != n * self.action_dim:
            raise ValueError(f"action shape {act.shape}: expected {n} x {self.action_dim} values")
        rew = np.asarray(reward, dtype=np.float32).reshape(-1)
        flags = np.asarray(done).reshape(-1)
        count = n if isinstance(infos, dict) else len(infos)
        if rew.size != n or flags.size != n or count != n:
            raise ValueError(f"reward, done and infos need {n} entries each (n_envs), got "
                             f"{rew.size}, {flags.size} and {count}")
        if not math.isfinite(rew.sum()) and not np.isfinite(rew).all():
            raise ValueError(f"rewards must be finite, got {rew.tolist()}")
        # a sum is finite only if every element is (a sum that overflows checks them all)
        if arrays[0].dtype.kind == "f" and not (math.isfinite(arrays[0].sum())
                                                and math.isfinite(arrays[1].sum())) \
                and not all(np.isfinite(a).all() for a in arrays):
            raise ValueError("obs and next_obs must be finite")
        # As SB3's NStepReplayBuffer: a time-out ends the episode even without `done`.
        timeout = np.zeros(n, bool)
        if self.timeouts and not isinstance(infos, dict):
            timeout = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
        return Step(obs=arrays[0], next_obs=arrays[1],
                    action=act.reshape(n, self.action_dim).astype(self.action_dtype),
                    reward=rew, terminated=flags.astype(bool) & ~timeout, truncated=timeout)


@dataclass(frozen=True)
class Finals:
    """The final observations an ``add``'s ``infos`` carry: ``obs`` rows where ``mask``."""

    mask: np.ndarray
    obs: np.ndarray | None  # (n_envs, *obs_shape), None when no row is set


@dataclass(frozen=True)
class EdgePlan:
    """What one ``add`` records, per env (see the module docstring)."""

    reset_envs: np.ndarray      # envs whose new episode starts before the step is recorded
    reset_stacks: np.ndarray    # (len(reset_envs), *obs_shape): the first stack of each
    autoreset: np.ndarray       # (n,) next-step reset steps: no transition
    recorded: np.ndarray | None  # envs whose step is recorded; None: every env
    next_obs: np.ndarray        # (n, *obs_shape): a recorded step's true next stack; R else
    terminated: np.ndarray      # (n,) of recorded steps
    truncated: np.ndarray
    padding: str | None         # first stacks' padding, once known
    mode: str | None            # autoreset mode, once known


def final_observations(infos: Any, n: int, shape: tuple[int, ...], dtype: np.dtype) -> Finals:
    """The final observations in SB3 (a list of dicts) or gymnasium (a dict) ``infos``."""
    if isinstance(infos, dict):
        values, mask = _gymnasium_finals(infos, n)
    else:
        values = [info.get("terminal_observation") if isinstance(info, dict) else None
                  for info in infos]
        mask = np.array([v is not None for v in values], bool)
    if not mask.any():
        return Finals(mask, None)
    rows = np.zeros((n, *shape), dtype)
    for i in np.flatnonzero(mask):
        value = np.asarray(values[i])
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(f"the final observation of env {i} in infos has shape "
                             f"{value.shape} and dtype {value.dtype}, expected {shape} {dtype}")
        rows[i] = value
    return Finals(mask, rows)


def _gymnasium_finals(infos: dict[str, Any], n: int) -> tuple[Any, np.ndarray]:
    for key in FINAL_KEYS:
        if key in infos:
            values = infos[key]
            mask = infos.get(f"_{key}")
            mask = np.array([v is not None for v in values], bool) if mask is None \
                else np.asarray(mask, bool).reshape(-1)
            if mask.size != n or len(values) != n:
                raise ValueError(f"infos[{key!r}] has {len(values)} entries and its mask "
                                 f"{mask.size}, expected {n} (n_envs)")
            return values, mask
    return (), np.zeros(n, bool)


class EpisodeEdges:
    """Per-env episode state of a buffer, and the plan of each ``add`` (module docstring).

    ``running``: an episode of the env is open in the store. ``last_next``: the true next
    stack of the env's last recorded step (or its reset stack R), kept after an end.
    ``ended``: the env's last ``add`` ended its episode. The arrays are updated in place
    (a `StepStage` shares them).
    """

    def __init__(self, layout: StackLayout, n_envs: int, dtype: np.dtype, *,
                 padding: str | None, mode: str | None) -> None:
        self.layout = layout
        self.running = np.zeros(n_envs, bool)
        self.ended = np.zeros(n_envs, bool)
        self.last_next = np.zeros((n_envs, *layout.obs_shape), dtype)
        self.padding, self.mode = padding, mode

    def plan(self, step: Step, finals: Finals, hint: str) -> EdgePlan:
        """What to record for `step` (nothing changes); `hint`: the padding to take when
        both fit. A ValueError says what a refused step should have been."""
        same = rows_equal(step.obs, self.last_next)
        follows = self.layout.follows(step.obs, step.next_obs)
        if self.running.all() and same.all() and follows.all() and not finals.mask.any():
            none = np.zeros(0, np.int64)  # every env steps on in its episode
            return EdgePlan(none, step.obs[:0], np.zeros_like(same), None, step.next_obs,
                            step.terminated, step.truncated, self.padding, self.mode)
        mode = self._mode_with(finals)
        auto = self._autoreset_steps(step, finals, same, follows, mode)
        if mode == NEXT_STEP:
            self._check_reset_steps(step, same & ~auto)
        rec = ~auto
        next_obs, term, trunc = self._true_next(step, finals, follows, rec)
        reset_envs = np.flatnonzero(auto | (rec & ~(self.running & same)))
        stacks = step.obs[reset_envs]
        from_next = auto[reset_envs]
        stacks[from_next] = step.next_obs[reset_envs[from_next]]
        padding = self._padding_of(stacks, reset_envs, hint)
        if auto.any():
            mode = NEXT_STEP
        return EdgePlan(reset_envs, stacks, auto, None if rec.all() else np.flatnonzero(rec),
                        next_obs, term, trunc, padding, mode)

    def commit(self, plan: EdgePlan) -> None:
        """The state after the store recorded `plan`."""
        ended = plan.terminated | plan.truncated
        self.running[:] = ~ended
        self.ended[:] = ended
        self.last_next[:] = plan.next_obs
        self.padding, self.mode = plan.padding, plan.mode

    # -- parts of `plan` ----------------------------------------------------------------
    def _mode_with(self, finals: Finals) -> str | None:
        if not finals.mask.any():
            return self.mode
        if self.mode == NEXT_STEP:
            raise ValueError(f"infos carry the final observation of env "
                             f"{int(np.flatnonzero(finals.mask)[0])} (same-step autoreset), but "
                             f"this stream resets next-step (autoreset_mode='next-step')")
        return SAME_STEP

    def _autoreset_steps(self, step: Step, finals: Finals, same: np.ndarray,
                         follows: np.ndarray, mode: str | None) -> np.ndarray:
        """Per env: the step only resets the env (next-step autoreset, t+1 in the docstring):
        obs repeats the last next stack, reward 0, no end, next_obs a first stack."""
        if mode == SAME_STEP:
            return np.zeros_like(same)
        quiet = same & (step.reward == 0) & ~(step.terminated | step.truncated | finals.mask)
        if not quiet.any():
            return quiet
        if not self.layout.stacked:  # nothing in an unstacked obs tells R apart
            return quiet & self.ended
        first = np.zeros_like(same)
        for padding in (PADDINGS if self.padding is None else (self.padding,)):
            first |= self.layout.fresh(step.next_obs, padding)
        after_end = self.ended & (~follows | (mode == NEXT_STEP))
        unflagged_end = self.running & ~follows
        return quiet & first & (after_end | unflagged_end)

    def _check_reset_steps(self, step: Step, missed: np.ndarray) -> None:
        bad = np.flatnonzero(self.ended & missed)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"env {i} ended its episode at the previous add and repeats its final obs now: "
                f"with next-step autoreset this step must only reset it (reward 0, not done, "
                f"next_obs a first stack), got reward {float(step.reward[i])}, terminated "
                f"{bool(step.terminated[i])}, truncated {bool(step.truncated[i])}")

    def _true_next(self, step: Step, finals: Finals, follows: np.ndarray,
                   rec: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per recorded env: its next stack, terminated, truncated (module docstring)."""
        term = step.terminated & rec
        trunc = (step.truncated | (finals.mask & ~step.terminated)) & rec
        need = rec & ~follows
        if not need.any():
            return step.next_obs, term, trunc
        use_final = need & finals.mask
        if finals.obs is not None:
            use_final &= self.layout.follows(step.obs, finals.obs)
        bad = np.flatnonzero(need & ~use_final & ~step.terminated)
        if bad.size:
            raise ValueError(_not_shifted(int(bad[0]), bool(finals.mask[bad[0]]),
                                          self.layout.frame_stack))
        if not use_final.any():  # terminated: next_obs stays (its next state is never used)
            return step.next_obs, term, trunc
        next_obs = step.next_obs.copy()
        next_obs[use_final] = finals.obs[use_final]  # type: ignore[index]
        return next_obs, term, trunc

    def _padding_of(self, stacks: np.ndarray, envs: np.ndarray, hint: str) -> str | None:
        """The padding of these first stacks: the known one (or a ValueError), else the one
        they fit (`hint` when both do)."""
        if not stacks.shape[0] or not self.layout.stacked:
            return self.padding
        if self.padding is not None:
            stale = np.flatnonzero(~self.layout.fresh(stacks, self.padding))
            if stale.size:
                raise ValueError(_stale(int(envs[stale[0]]), self.padding))
            return self.padding
        fits = self.layout.paddings(stacks)
        if not fits:
            raise ValueError(f"the first stacks of envs {envs.tolist()} hold older frames: an "
                             f"episode's first stack must be padded with zeros or with copies "
                             f"of its first frame, all alike (the buffer keeps the newest "
                             f"frame only)")
        return hint if hint in fits else fits[0]


def _stale(env: int, padding: str) -> str:
    want = "zeros" if padding == "zero" else "copies of its first frame"
    return (f"obs of env {env} starts an episode but its stack holds older frames: the buffer "
            f"keeps the newest frame only, so an episode's first stack must be padded with "
            f"{want} (stack_padding={padding!r}, as the store's first episode)")


def _not_shifted(env: int, had_final: bool, k: int) -> str:
    final = "nor is the final observation in infos" if had_final else \
        "and infos carry no final observation for it"
    return (f"next_obs of env {env} is not its obs shifted by one frame, {final}, and the step "
            f"did not terminate: observations must be stacks of frame_stack={k} frames, and "
            f"a truncated step's next_obs its final observation")


def _shaped(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size != math.prod(shape):
        raise ValueError(f"{name} shape {arr.shape} != expected {shape} (n_envs, *obs_shape)")
    if arr.dtype != dtype:
        raise ValueError(f"{name} dtype {arr.dtype} != observation space dtype {dtype}")
    return arr.reshape(shape)

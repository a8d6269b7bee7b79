"""`StepStage`: the steps of a one-env buffer of small observations, held in RAM until a
store records them as one block.

An SB3-style ``add(obs, next_obs, action, reward, done, infos)`` of one unstacked env costs
SB3's own buffer a few row copies; a store records a step through its checks, its ring and
its frame store. The stage keeps the SB3 cost per ``add`` (checked row copies into
preallocated arrays) and hands the store whole blocks (`ReplayStore.add_rows`: checked once,
recorded by one compiled call)::

    add -> take(): shape/dtype/finite checks, rows copied        (refused: nothing staged)
    sample, get, size, pickling, close, a full stage -> drain():
        episode starts found (not running, or obs != the previous next_obs)
        rows: [o_0 of each start as an autoreset row] + one row per step -> store.add_rows

What a drain recorded is in the store like any ``add``: a flush commits it. Rows still
staged are not in the store yet: the buffer drains before anything reads the store (its
``store`` attribute included) and when it is closed or garbage-collected.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mmreplay.integrations.sb3_edges import SAME_STEP, EpisodeEdges
from mmreplay.recorder import StepRows
from mmreplay.store import ReplayStore

# A drain of fewer rows records them call by call: a block's fixed cost is higher.
SMALL_DRAIN = 4


class StepStage:
    """Steps of env 0 of a one-env, unstacked buffer, not yet recorded (see module doc).

    `edges` is the buffer's `EpisodeEdges`, whose arrays `drain` updates in place: whether
    env 0's episode runs, its last recorded ``next_obs``, whether its last step ended it.
    The stage takes a step only where the buffer's own plan would record it as a plain
    step (an episode start where obs is not the last ``next_obs``): a step right after an
    end goes to the buffer until the stream is known to reset same-step.
    """

    def __init__(self, store: ReplayStore, obs_shape: tuple[int, ...], obs_dtype: np.dtype,
                 action_dim: int, action_dtype: np.dtype, *, capacity: int, timeouts: bool,
                 edges: EpisodeEdges) -> None:
        self.store = store
        self.shape, self.dtype = (1, *obs_shape), np.dtype(obs_dtype)
        self.floating = self.dtype.kind == "f"
        self.action_dim, self.timeouts = action_dim, timeouts
        self.capacity = capacity
        self.pairs = np.zeros((capacity, 2, *self.shape), self.dtype)  # obs, next_obs
        # finite check of a staged pair: x . 0 is 0 for finite x, NaN for NaN or inf
        self.flat_pairs = self.pairs.reshape(capacity, -1)
        self.zeros = np.zeros(self.flat_pairs.shape[1], self.dtype)
        self.action = np.zeros((capacity, action_dim), action_dtype)
        self.reward = np.zeros(capacity, np.float32)
        self.terminated = np.zeros(capacity, bool)
        self.truncated = np.zeros(capacity, bool)
        self.size = 0
        self.edges = edges
        self.running, self.last_next, self.ended = edges.running, edges.last_next, edges.ended

    def take(self, obs: Any, next_obs: Any, action: Any, reward: Any, done: Any,
             infos: Any) -> bool:
        """Stage one step if every argument is a plain array of the expected shape and
        dtype with finite values, and ``infos`` as SB3 or gymnasium give them; False
        (nothing staged) for anything else, which the caller's full checks then explain.
        Drains when the stage is full."""
        nd = np.ndarray
        if not (type(obs) is nd and type(next_obs) is nd and type(action) is nd
                and obs.shape == self.shape and next_obs.shape == self.shape
                and obs.dtype == self.dtype and next_obs.dtype == self.dtype
                and action.size == self.action_dim and action.dtype.kind in "biuf"):
            return False
        rew, ended, info = _one(reward), _one(done), _env_info(infos)
        if rew is None or ended is None or info is None:
            return False
        k = self.size
        final = info.get("terminal_observation") is not None
        if not self._plain(k, obs, final, bool(ended)):
            return False
        pair = self.pairs[k]
        pair[0] = obs
        pair[1] = next_obs
        if not math.isfinite(rew) or (
                self.floating and not math.isfinite(self.flat_pairs[k].dot(self.zeros))):
            return False
        if self.action_dim == 1:
            self.action[k, 0] = action.item()
        else:
            self.action[k] = action.reshape(self.action_dim)
        self.reward[k] = rew
        # as SB3's NStepReplayBuffer: a time-out ends the episode as truncated, done or not
        if self.timeouts and info.get("TimeLimit.truncated", False):
            self.terminated[k], self.truncated[k] = False, True
        else:
            self.terminated[k], self.truncated[k] = bool(ended), False
        if final:  # a final observation in infos: the stream resets same-step
            self.edges.mode = SAME_STEP
        self.size = k + 1
        if self.size == self.capacity:
            self.drain()
        return True

    def _plain(self, k: int, obs: np.ndarray, final: bool, done: bool) -> bool:
        """Staging the step records what the buffer's plan would (`EpisodeEdges`)."""
        mode = self.edges.mode
        if final and (mode not in (None, SAME_STEP) or not done):
            return False  # refused, or an end `done` does not flag: the buffer decides
        if mode == SAME_STEP or final:
            return True
        if k:
            after_end = self.terminated[k - 1] or self.truncated[k - 1]
            before = self.pairs[k - 1, 1]
        else:
            after_end, before = self.ended[0], self.last_next
        # obs repeating the ended episode's last next_obs: a next-step reset, perhaps
        return not (after_end and np.array_equal(obs, before))

    def drain(self) -> None:
        """Record every staged step (episode starts first), then empty the stage."""
        count = self.size
        if not count:
            return
        try:
            starts = self._starts(count)
            if count < SMALL_DRAIN:
                self._record_each(count, starts)
            else:
                self.store.add_rows(self._rows(count, starts))
        finally:
            self.size = 0
        last = count - 1
        ended = bool(self.terminated[last] or self.truncated[last])
        self.running[0] = not ended
        self.ended[0] = ended
        self.last_next[0] = self.pairs[last, 1, 0]

    def _starts(self, count: int) -> np.ndarray:
        """Per staged step: its obs starts an episode (none running, or not the previous
        step's next_obs: a reset without a done flag ends the running episode)."""
        width = math.prod(self.shape)
        obs = self.pairs[:count, 0, 0].reshape(count, width)
        before = np.empty_like(obs)
        before[0] = self.last_next[0].reshape(width)
        before[1:] = self.pairs[:count - 1, 1, 0].reshape(count - 1, width)
        idle = np.empty(count, bool)
        idle[0] = not self.running[0]
        idle[1:] = self.terminated[:count - 1] | self.truncated[:count - 1]
        return np.asarray(idle | (obs != before).any(axis=1))

    def _record_each(self, count: int, starts: np.ndarray) -> None:
        store = self.store
        for j in range(count):
            if starts[j]:
                store.reset(self.pairs[j, 0])
            store.add(self.action[j], float(self.reward[j]), self.pairs[j, 1],
                      bool(self.terminated[j]), bool(self.truncated[j]))

    def _rows(self, count: int, starts: np.ndarray) -> StepRows:
        """The staged steps as rows of `ReplayStore.add_rows`: each start an autoreset row
        (its o_0) before its step's row."""
        step_row = np.arange(count) + np.cumsum(starts)
        reset_row = step_row[starts] - 1
        rows = count + int(starts.sum())
        frames = np.empty((rows, *self.shape), self.dtype)
        frames[step_row] = self.pairs[:count, 1]
        frames[reset_row] = self.pairs[:count, 0][starts]
        auto = np.zeros((rows, 1), bool)
        auto[reset_row] = True
        action = np.zeros((rows, 1, self.action_dim), self.action.dtype)
        action[step_row, 0] = self.action[:count]
        reward, term, trunc = (np.zeros((rows, 1), a.dtype) for a in
                               (self.reward, self.terminated, self.truncated))
        reward[step_row, 0] = self.reward[:count]
        term[step_row, 0] = self.terminated[:count]
        trunc[step_row, 0] = self.truncated[:count]
        return StepRows(env_ids=None, action=action, reward=reward, next_obs=frames,
                        terminated=term, truncated=trunc, autoreset=auto)


_NO_INFO: dict[str, Any] = {}


def _env_info(infos: Any) -> dict[str, Any] | None:
    """Env 0's info of SB3 ``infos`` (a list of one dict), or an empty one for gymnasium
    ``infos`` (a dict) without final observations; None for anything else (the buffer's
    plan takes it)."""
    if type(infos) is list:
        return infos[0] if len(infos) == 1 and type(infos[0]) is dict else None
    if type(infos) is dict and "final_obs" not in infos and "final_observation" not in infos:
        return _NO_INFO
    return None


def _one(value: Any) -> float | int | bool | None:
    """The one number `value` holds, as SB3's ``np.array(value)`` reads a one-env reward or
    done (an array of one element, a NumPy or Python scalar, a list of one); None for
    anything else."""
    kind = type(value)
    if kind is float or kind is bool or kind is int:
        return value  # type: ignore[no-any-return]
    if kind is np.ndarray or isinstance(value, np.generic):
        return value.item() if value.size == 1 and value.dtype.kind in "biuf" else None
    if (kind is list or kind is tuple) and len(value) == 1:
        inner = value[0]
        return None if type(inner) in (list, tuple) else _one(inner)
    return None

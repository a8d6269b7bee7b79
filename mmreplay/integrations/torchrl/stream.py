"""Collector batches -> store rows: episode edges, lanes, frames once (`StreamRecorder`).

A batch arrives as ``(R, T)`` rows of steps (R env rows, T steps each in time order; a
flat batch is one row). A row splits into *runs*, the steps of one trajectory::

    row:   t0 t1 t2 | t3 t4 t5 t6 | t7        a run ends after a done step, where the
           traj 4   | traj 9      | traj 12    trajectory id changes, or where pixels do
                                               not continue the previous next pixels

Each run goes to a *lane* (a store env): a 2-d batch's row r is lane r; a flat batch with
one lane uses lane 0; a flat batch with several lanes puts a run that continues a lane's
trajectory there and a new trajectory on a lane whose episode ended. A run that does not
continue its lane begins an episode there (an autoreset row with o_0, the newest frame of
its first ``"pixels"``, after which the lane's previous episode, if still running, reads
as truncated); every step then writes only the newest frame of its ``("next", "pixels")``.

Everything is checked before the first row is written: a stack is the previous one
shifted by one frame, an episode's first stack is its first frame padded as the layout
says ("first": repeated, as CatFrames pads; "zero"), and ``done == terminated | truncated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.integrations.torchrl.layout import KeyLayout
from mmreplay.recorder import StepRows
from mmreplay.store import ReplayStore


@dataclass(frozen=True)
class Steps:
    """One batch as ``(R, T, ...)`` numpy arrays (flags ``(R, T)`` bool)."""

    pixels: np.ndarray
    next_pixels: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    traj: np.ndarray | None
    extras: dict[str, np.ndarray]

    @property
    def done(self) -> np.ndarray:
        return self.terminated | self.truncated


@dataclass(frozen=True)
class Run:
    """Steps ``start:stop`` of row `row`, one trajectory, recorded on `lane`."""

    row: int
    start: int
    stop: int
    lane: int
    begins: bool  # an episode starts at `start` (else it continues the lane's)


def padded_as(stack: np.ndarray, frame_stack: int, padding: str) -> bool:
    """`stack` is an episode's first stack padded as `padding` says: "first", its newest
    frame repeated (CatFrames' default); "zero", zeros before the newest frame."""
    frames = stack.reshape(frame_stack, -1)
    if padding == "first":
        return bool((frames == frames[-1]).all())
    return not frames[:-1].any()


def detect_padding(stack: np.ndarray, frame_stack: int) -> str:
    """"first" if `stack` is its newest frame repeated (CatFrames' default), "zero" if the
    older frames are zeros; "first" when both hold (an all-zero first frame)."""
    for padding in ("first", "zero"):
        if padded_as(stack, frame_stack, padding):
            return padding
    raise InvalidInputError(
        "the first stack of an episode is neither its first frame repeated (CatFrames' "
        "padding) nor zeros then the frame; pass stack_padding='first' or 'zero'")


class StreamRecorder:
    """Records checked batches into a store, lane by lane (see the module doc)."""

    def __init__(self, layout: KeyLayout, num_envs: int) -> None:
        self.layout = layout
        self.num_envs = num_envs
        self.channels = layout.pixels.shape[0] // layout.frame_stack if layout.stacked else 0
        self.traj = np.full(num_envs, -1, np.int64)
        self.running = np.zeros(num_envs, bool)
        self.last_next = np.zeros((num_envs, *layout.pixels.shape), layout.pixels.dtype)

    # -- frames ----------------------------------------------------------------------
    def newest(self, pixels: np.ndarray) -> np.ndarray:
        """The newest frame of each stack (each pixels entry itself when unstacked)."""
        if not self.layout.stacked:
            return pixels
        lead = pixels.shape[: pixels.ndim - 3]
        return pixels[..., -self.channels:, :, :].reshape(*lead, *self.layout.frame_shape)

    def is_start(self, stack: np.ndarray) -> bool:
        """`stack` is an episode's first stack under the layout's padding."""
        if not self.layout.stacked:
            return True
        return padded_as(stack, self.layout.frame_stack, self.layout.stack_padding)

    # -- checks ----------------------------------------------------------------------
    def check(self, steps: Steps) -> np.ndarray:
        """Check shifts; returns where runs begin, ``(R, T)`` bool."""
        if self.layout.stacked:
            c = self.channels
            _refuse(steps.next_pixels[:, :, :-c] != steps.pixels[:, :, c:],
                    "('next', pixels) is not pixels shifted by one frame (a CatFrames stack "
                    "of the same episode)")
        rows, length = steps.reward.shape[:2]
        new = np.zeros((rows, length), bool)
        new[:, 0] = True
        if length > 1:
            same = (steps.pixels[:, 1:] == steps.next_pixels[:, :-1]).reshape(
                rows, length - 1, -1).all(-1)
            new[:, 1:] = steps.done[:, :-1] | ~same
            if steps.traj is not None:
                new[:, 1:] |= steps.traj[:, 1:] != steps.traj[:, :-1]
            if rows > 1 or self.num_envs == 1:  # a row is one env: it cuts only after done
                _refuse((new[:, 1:] & ~steps.done[:, :-1])[..., None],
                        f"a trajectory begins before the one it follows ended (no done "
                        f"step); one env's steps were expected (num_envs={self.num_envs}): "
                        f"a flat batch of several envs needs num_envs=<envs>")
        return new

    def plan(self, steps: Steps, new: np.ndarray) -> list[Run]:
        """The runs of a checked batch, each on its lane, lane state updated as it goes."""
        runs = []
        for row, start in zip(*np.nonzero(new), strict=True):
            stops = np.flatnonzero(new[row, start + 1:])
            stop = int(start + 1 + stops[0]) if stops.size else new.shape[1]
            runs.append(self._place(steps, int(row), int(start), stop, new.shape[0]))
        return runs

    def _place(self, steps: Steps, row: int, start: int, stop: int, rows: int) -> Run:
        first = steps.pixels[row, start]
        traj = -1 if steps.traj is None else int(steps.traj[row, start])
        lane = self._continued(first, traj) if rows == 1 and self.num_envs > 1 else row
        begins = lane < 0 or not (self.running[lane] and np.array_equal(
            first, self.last_next[lane]) and (traj < 0 or traj == self.traj[lane]))
        if begins and not self.is_start(first):
            raise InvalidInputError(
                f"step {start} of row {row} begins an episode (after a done step, a new "
                f"trajectory id or a stack that does not continue the last one), but its "
                f"pixels are not a first stack padded with "
                f"stack_padding={self.layout.stack_padding!r}")
        if lane < 0:
            lane = self._free_lane(traj)
        self.traj[lane], self.running[lane] = traj, not steps.done[row, stop - 1]
        self.last_next[lane] = steps.next_pixels[row, stop - 1]
        return Run(row, start, stop, lane, begins)

    def _continued(self, first: np.ndarray, traj: int) -> int:
        """The lane whose running trajectory this run continues, or -1."""
        if traj < 0:
            raise InvalidInputError(
                f"a flat batch for {self.num_envs} envs needs ('collector', 'traj_ids') to "
                f"tell the envs' trajectories apart; extend (num_envs, T) batches instead")
        for lane in np.flatnonzero(self.running & (self.traj == traj)):
            if np.array_equal(first, self.last_next[lane]):
                return int(lane)
        return -1

    def _free_lane(self, traj: int) -> int:
        free = np.flatnonzero(~self.running)
        if not free.size:
            raise InvalidInputError(
                f"trajectory {traj} begins while all num_envs={self.num_envs} envs hold "
                f"running trajectories: expected at most {self.num_envs} at once")
        return int(free[0])

    # -- writing ---------------------------------------------------------------------
    def record(self, store: ReplayStore, steps: Steps) -> np.ndarray:
        """Check, then write `steps`; returns the ``(R, T)`` transition ids."""
        runs = self.plan(steps, self.check(steps))
        ids = np.empty(steps.reward.shape[:2], np.int64)
        for lane in sorted({run.lane for run in runs}):
            mine = [run for run in runs if run.lane == lane]
            first_id = store.counts.transitions
            store.add_rows(self._rows(steps, lane, mine))
            taken = first_id + np.arange(sum(r.stop - r.start for r in mine))
            at = 0
            for run in mine:
                ids[run.row, run.start:run.stop] = taken[at:at + run.stop - run.start]
                at += run.stop - run.start
        return ids

    def _rows(self, steps: Steps, lane: int, runs: list[Run]) -> StepRows:
        parts = [self._run_rows(steps, run) for run in runs]
        cat = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        extras = {name[2:]: cat[name] for name in cat if name.startswith("x:")}
        return StepRows(env_ids=np.array([lane]), action=cat["action"][:, None],
                        reward=cat["reward"][:, None], next_obs=cat["frame"][:, None],
                        terminated=cat["terminated"][:, None],
                        truncated=cat["truncated"][:, None],
                        autoreset=cat["autoreset"][:, None],
                        extras={k: v[:, None] for k, v in extras.items()})

    def _run_rows(self, steps: Steps, run: Run) -> dict[str, np.ndarray]:
        sl = (run.row, slice(run.start, run.stop))
        rows: dict[str, np.ndarray] = {
            "action": steps.action[sl], "reward": steps.reward[sl],
            "frame": self.newest(steps.next_pixels[sl]), "terminated": steps.terminated[sl],
            "truncated": steps.truncated[sl],
            "autoreset": np.zeros(run.stop - run.start, bool),
            **{f"x:{k}": v[sl] for k, v in steps.extras.items()}}
        if not run.begins:
            return rows
        o0 = self.newest(steps.pixels[run.row, run.start])
        head = {k: np.zeros((1, *v.shape[1:]), v.dtype) for k, v in rows.items()}
        head["frame"], head["autoreset"] = o0[None], np.ones(1, bool)
        return {k: np.concatenate([head[k], v]) for k, v in rows.items()}

    # -- state -----------------------------------------------------------------------
    def forget(self) -> None:
        """After a reload: no lane continues; the next run of each begins an episode."""
        self.traj[:] = -1
        self.running[:] = False


def _refuse(bad: np.ndarray, what: str) -> None:
    """Raise naming the first (row, step) where `bad` (``(R, T, ...)``) holds."""
    rows, length = bad.shape[:2]
    hit = bad.reshape(rows, length, -1).any(-1)
    if hit.any():
        row, step = (int(i[0]) for i in np.nonzero(hit))
        raise InvalidInputError(f"row {row} step {step}: {what}")


def flags(value: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Per-step flags ``(R, T, *flag_shape)`` -> ``(R, T)`` bool (one flag a step)."""
    arr = np.asarray(value)
    if arr.shape[2:] != tuple(shape) or int(np.prod(shape)) != 1:
        raise InvalidInputError(f"{name} per-step shape {arr.shape[2:]} != expected "
                                f"{tuple(shape)} (one flag per step)")
    return arr.reshape(arr.shape[:2]).astype(bool)

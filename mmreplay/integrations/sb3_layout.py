"""`StackLayout`: where the frames of a stacked observation sit, and how an episode's first
stack is padded.

A stack of ``k`` frames of ``c`` channels each, oldest first, concatenated along the first
axis (``channels_order="first"``, gymnasium's ``FrameStackObservation`` on grey frames,
``(4, 84, 84)``) or the last (SB3's ``VecFrameStack`` on ``(84, 84, 1)`` frames)::

    stack  [o_{t-3} o_{t-2} o_{t-1} o_t]     newest(): o_t     older(): o_{t-3} .. o_{t-1}
    next   [o_{t-2} o_{t-1} o_t o_{t+1}]     follows(stack, next): next.older() == stack.shifted()

An episode's first stack holds one real frame, ``o_0``, after ``k - 1`` padding frames:
zeros (``VecFrameStack``, ``FrameStackObservation(padding_type="zero")``) or copies of
``o_0`` (``FrameStackObservation``'s default, ``padding_type="reset"``); the store rebuilds
either (``stack_padding="zero"`` / ``"first"``). Pure array geometry: no store, no torch
beyond `to_sb3`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PADDINGS", "StackLayout", "flat", "rows_equal"]

PADDINGS = ("zero", "first")
_ALL_FOLLOW = np.ones(64, bool)  # `StackLayout.follows` without stacking: read-only rows
_ALL_FOLLOW.flags.writeable = False


@dataclass(frozen=True)
class StackLayout:
    """Where the frames of a stack sit: ``k`` frames of ``channels`` channels each,
    concatenated oldest first along the first or the last axis."""

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
    def stacked(self) -> bool:
        return self.frame_stack > 1

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

    def frames(self, obs: np.ndarray) -> np.ndarray:
        """``(N, k, *frame_shape)``: each of N stacks split into its frames, oldest first."""
        n, k, c = obs.shape[0], self.frame_stack, self.channels
        if self.first:
            return obs.reshape(n, k, *self.frame_shape)
        split = obs.reshape(*obs.shape[:-1], k, c)
        return np.moveaxis(split, -2, 1)

    def follows(self, obs: np.ndarray, next_obs: np.ndarray) -> np.ndarray:
        """Per env: `next_obs` is `obs` shifted by one frame."""
        if self.frame_stack == 1:
            return _ALL_FOLLOW[: obs.shape[0]] if obs.shape[0] <= _ALL_FOLLOW.size \
                else np.ones(obs.shape[0], bool)
        return np.asarray(flat(self.older(next_obs) == self.shifted(obs)).all(axis=1))

    def fresh(self, obs: np.ndarray, padding: str) -> np.ndarray:
        """Per stack: it is an episode's first, padded as `padding` says (``"zero"``: zeros
        before the newest frame; ``"first"``: copies of it)."""
        if self.frame_stack == 1:
            return np.ones(obs.shape[0], bool)
        if padding == "zero":
            return np.asarray(~flat(self.older(obs)).any(axis=1))
        split = self.frames(obs)
        return np.asarray(flat(split[:, :-1] == split[:, -1:]).all(axis=1))

    def paddings(self, obs: np.ndarray) -> tuple[str, ...]:
        """The paddings every one of these first stacks fits (both when ``o_0`` is zeros)."""
        return tuple(p for p in PADDINGS if self.fresh(obs, p).all())

    def to_sb3(self, stacks: torch.Tensor) -> torch.Tensor:
        """``(B, k, *frame_shape)`` store stacks -> ``(B, *obs_shape)`` SB3 stacks."""
        size = stacks.shape[0]
        if self.frame_stack == 1:
            return stacks[:, 0]
        if self.first:
            return stacks.reshape(size, *self.obs_shape)
        return torch.movedim(stacks, 1, -2).reshape(size, *self.obs_shape)


def rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of two ``(N, ...)`` arrays: every value equal."""
    return np.asarray(flat(a == b).all(axis=1))


def flat(a: np.ndarray) -> np.ndarray:
    """``(N, ...)`` -> ``(N, rest)``, also for N = 0."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))

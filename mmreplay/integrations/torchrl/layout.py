"""Where each entry of a collector TensorDict lives in the store, and back (`KeyLayout`).

A TorchRL transition row holds::

    "pixels"            (k*C, H, W) CatFrames stack, or one frame    -> frames, once each
    "action"                                                          -> the step's action
    ("next", "pixels")  the stack (or frame) after the step           -> its newest frame
    ("next", "reward")  (1,) float                                    -> the step's reward
    ("next", "terminated"), ("next", "truncated")                     -> the step's flags
    ("next", "done")    terminated | truncated (checked, rebuilt)
    anything else       ("collector", "traj_ids"), "step_count", ... -> a store extra

The layout is fixed by the first batch a storage sees and saved beside the store as JSON
(`to_dict`/`from_dict`), so a storage reopened on the directory rebuilds the same
TensorDicts. numpy only: the conversion to and from tensors is `storage`'s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.spec import ALLOWED_DTYPES

LAYOUT_VERSION = 1
ACTION = ("action",)
REWARD = ("next", "reward")
TERMINATED = ("next", "terminated")
TRUNCATED = ("next", "truncated")
DONE = ("next", "done")
TRAJ_IDS = ("collector", "traj_ids")
ALWAYS_DROPPED = ("index", "priority_weight")  # the replay buffer's own metadata
Key = tuple[str, ...]


@dataclass(frozen=True)
class Column:
    """One per-step entry: its TensorDict key, per-step shape and dtype."""

    key: Key
    shape: tuple[int, ...]
    dtype: str

    def to_list(self) -> list[Any]:
        return [list(self.key), list(self.shape), self.dtype]

    @classmethod
    def from_list(cls, value: Any) -> Column:
        key, shape, dtype = value
        return cls(tuple(str(k) for k in key), tuple(int(s) for s in shape), str(dtype))


@dataclass(frozen=True)
class KeyLayout:
    """The per-step layout of a stream of TorchRL transitions (see the module doc).

    ``pixels`` is the per-step shape of ``"pixels"`` as extended; ``stacked``: it is a
    CatFrames stack of `frame_stack` frames along dim -3 (else one frame, and samples stack
    `frame_stack` of them the same way). ``frame_shape`` is what the store keeps per frame.
    """

    pixels_key: Key
    pixels: Column
    frame_stack: int
    stacked: bool
    stack_padding: str
    action: Column
    reward: Column
    flag_shape: tuple[int, ...]
    extras: tuple[Column, ...]

    @property
    def frame_shape(self) -> tuple[int, ...]:
        if not self.stacked:
            return self.pixels.shape
        channels, *hw = self.pixels.shape
        per = channels // self.frame_stack
        return tuple(hw) if per == 1 else (per, *hw)

    @property
    def sample_pixels_shape(self) -> tuple[int, ...]:
        """Per-step shape of sampled ``"pixels"``: the extended one, or a stack of frames."""
        if self.stacked or self.frame_stack == 1:
            return self.pixels.shape
        frame = self.pixels.shape
        if len(frame) == 3:  # CatFrames(dim=-3) of (C, H, W) frames
            return (self.frame_stack * frame[0], *frame[1:])
        return (self.frame_stack, *frame)

    def extra_names(self) -> dict[str, Column]:
        """The store's extra names (identifiers), each with its column."""
        return {_extra_name(i, col.key): col for i, col in enumerate(self.extras)}

    def store_extras(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (col.shape, col.dtype) for name, col in self.extra_names().items()}

    def to_dict(self) -> dict[str, Any]:
        return {"version": LAYOUT_VERSION, "pixels_key": list(self.pixels_key),
                "pixels": self.pixels.to_list(), "frame_stack": self.frame_stack,
                "stacked": self.stacked, "stack_padding": self.stack_padding,
                "action": self.action.to_list(), "reward": self.reward.to_list(),
                "flag_shape": list(self.flag_shape),
                "extras": [col.to_list() for col in self.extras]}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KeyLayout:
        if value.get("version") != LAYOUT_VERSION:
            raise InvalidInputError(f"TorchRL layout version {value.get('version')!r} != "
                                    f"supported {LAYOUT_VERSION}")
        return cls(pixels_key=tuple(value["pixels_key"]),
                   pixels=Column.from_list(value["pixels"]),
                   frame_stack=int(value["frame_stack"]), stacked=bool(value["stacked"]),
                   stack_padding=str(value["stack_padding"]),
                   action=Column.from_list(value["action"]),
                   reward=Column.from_list(value["reward"]),
                   flag_shape=tuple(int(s) for s in value["flag_shape"]),
                   extras=tuple(Column.from_list(c) for c in value["extras"]))


def _extra_name(index: int, key: Key) -> str:
    """A store extra name for `key`: an identifier, unique by its index."""
    text = re.sub(r"[^A-Za-z0-9_]", "_", "__".join(key))
    return f"x{index}_{text}"[:64]


def _column(key: Key, shape: tuple[int, ...], dtype: np.dtype, batch_dims: int) -> Column:
    name = str(np.dtype(dtype))
    if name not in ALLOWED_DTYPES:
        raise InvalidInputError(f"entry {key} has dtype {name}; a store keeps "
                                f"{', '.join(ALLOWED_DTYPES)}")
    return Column(key, tuple(int(s) for s in shape[batch_dims:]), name)


def infer_layout(entries: dict[Key, np.ndarray], *, batch_dims: int, pixels_key: Key,
                 frame_stack: int, stacked: bool, stack_padding: str,
                 exclude: tuple[Key, ...] = ()) -> KeyLayout:
    """The layout of a first batch (`entries`: every leaf by key, as numpy arrays)."""
    nxt = ("next", *pixels_key)
    for key in (pixels_key, nxt, ACTION, REWARD, TERMINATED, TRUNCATED):
        if key not in entries:
            raise InvalidInputError(f"a TorchRL transition needs the entry {key}; got keys "
                                    f"{sorted(entries)}")
    col = {key: _column(key, a.shape, a.dtype, batch_dims) for key, a in entries.items()}
    pixels, reward = col[pixels_key], col[REWARD]
    if reward.dtype != "float32" or math.prod(reward.shape) != 1:
        raise InvalidInputError(
            f"('next', 'reward') must be one float32 per step (the store keeps float32 "
            f"rewards; DoubleToFloat converts), got per-step {reward.shape} {reward.dtype}")
    if stacked:
        check_stack_shape(pixels.shape, frame_stack)
    taken = {pixels_key, nxt, ACTION, REWARD, TERMINATED, TRUNCATED, DONE, *exclude}
    extras = tuple(c for k, c in sorted(col.items())
                   if k not in taken and k[-1] not in ALWAYS_DROPPED)
    return KeyLayout(pixels_key=pixels_key, pixels=pixels, frame_stack=frame_stack,
                     stacked=stacked, stack_padding=stack_padding, action=col[ACTION],
                     reward=reward, flag_shape=col[TERMINATED].shape, extras=extras)


def check_stack_shape(shape: tuple[int, ...], frame_stack: int) -> None:
    """A CatFrames stack of `frame_stack` frames: ``(frame_stack * C, H, W)``."""
    if len(shape) != 3 or shape[0] % frame_stack:
        raise InvalidInputError(
            f"stacked pixels must be (frame_stack * C, H, W) with frame_stack={frame_stack} "
            f"(CatFrames(N={frame_stack}, dim=-3)), got per-step shape {shape}")

"""numpy -> torch: the `Batch` handed to learners (the only core module that imports torch).

torch is imported on the first batch built, not by ``import mmreplay``: the ``mmreplay``
command and code that only records or inspects never pay its import (over a second).
`Batch` and `SequenceBatch` are defined without it (their annotations are strings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Batch:
    """A batch of transitions; every field is a torch tensor with leading dim B.

    ``obs``/``next_obs`` are ``(B, frame_stack, *obs_shape)`` in the store's dtype
    (uint8 for pixels: scaling is the model's job). ``reward`` is the n-step
    discounted return, ``discount`` is ``0`` after termination and
    ``gamma ** m`` otherwise, so the target is ``reward + discount * V(next_obs)``.
    ``extras`` holds the store's declared per-step extras of step t (recorded by the
    same ``add`` as ``action``), ``(B, *shape)`` each; empty without extras.
    """

    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    discount: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def make_batch(*, frames: np.ndarray, action: np.ndarray, reward: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray, discount: np.ndarray,
               weights: np.ndarray, ids: np.ndarray,
               extras: dict[str, np.ndarray] | None = None) -> Batch:
    """A `Batch` of CPU tensors.

    `frames` is a fresh C-contiguous ``(2, B, ...)`` array (obs, next_obs) that the
    batch takes over without a copy; the small columns are copied (native order).
    """
    import torch

    both = torch.from_numpy(frames)
    return Batch(
        obs=both[0],
        action=_tensor(action, action.dtype),
        reward=_tensor(reward, np.float32),
        next_obs=both[1],
        terminated=_tensor(terminated, np.bool_),
        truncated=_tensor(truncated, np.bool_),
        discount=_tensor(discount, np.float32),
        weights=_tensor(weights, np.float32),
        ids=_tensor(ids, np.int64),
        extras=tensors(extras or {}),
    )


def tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Fresh native-order tensors of a dict of arrays (each keeps its dtype)."""
    return {name: _tensor(a, a.dtype) for name, a in arrays.items()}


def _tensor(array: np.ndarray, dtype: np.dtype | type) -> torch.Tensor:
    """A fresh, C-contiguous, native-byte-order copy as a tensor."""
    import torch

    native = np.dtype(dtype).newbyteorder("=")
    return torch.from_numpy(np.array(array, dtype=native, order="C", copy=True))


@dataclass(frozen=True)
class SequenceBatch:
    """B sequences of T steps; every field a torch tensor with leading dims (B, T) or B.

    ``obs`` is ``(B, T, frame_stack, *obs_shape)``: the stack of each step (zeros where
    ``mask`` is False). ``reward`` is the one-step reward of each step, ``terminated`` /
    ``truncated`` say the episode ended with that step, ``is_first`` that the step is o_0
    of its episode, ``ids`` the transition id of each step (-1 on padding), ``weights``
    (B,) importance weights (ones when uniform), ``next_obs`` ``(B, frame_stack,
    *obs_shape)`` the stack after the last real step, ``extras`` ``(B, T, *shape)`` each.
    """

    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    is_first: torch.Tensor
    mask: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    next_obs: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def make_sequence_batch(*, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray,
                        reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                        is_first: np.ndarray, mask: np.ndarray, ids: np.ndarray,
                        weights: np.ndarray, extras: dict[str, np.ndarray]) -> SequenceBatch:
    """A `SequenceBatch` of CPU tensors; `obs`/`next_obs` are views of one fresh array
    that the batch takes over without a copy."""
    import torch

    return SequenceBatch(
        obs=torch.from_numpy(obs), next_obs=torch.from_numpy(next_obs),
        action=_tensor(action, action.dtype), reward=_tensor(reward, np.float32),
        terminated=_tensor(terminated, np.bool_), truncated=_tensor(truncated, np.bool_),
        is_first=_tensor(is_first, np.bool_), mask=_tensor(mask, np.bool_),
        ids=_tensor(ids, np.int64), weights=_tensor(weights, np.float32),
        extras=tensors(extras))

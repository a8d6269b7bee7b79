"""numpy -> torch: the `Batch` handed to learners (the only module that imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Batch:
    """A batch of transitions; every field is a torch tensor with leading dim B.

    ``obs``/``next_obs`` are ``(B, frame_stack, *obs_shape)`` in the store's dtype
    (uint8 for pixels: scaling is the model's job). ``reward`` is the n-step
    discounted return, ``discount`` is ``0`` after termination and
    ``gamma ** m`` otherwise, so the target is ``reward + discount * V(next_obs)``.
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

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def make_batch(*, frames: np.ndarray, action: np.ndarray, reward: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray, discount: np.ndarray,
               weights: np.ndarray, ids: np.ndarray) -> Batch:
    """A `Batch` of CPU tensors.

    `frames` is a fresh C-contiguous ``(2, B, ...)`` array (obs, next_obs) that the
    batch takes over without a copy; the small columns are copied (native order).
    """
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
    )


def _tensor(array: np.ndarray, dtype: np.dtype | type) -> torch.Tensor:
    """A fresh, C-contiguous, native-byte-order copy as a tensor."""
    native = np.dtype(dtype).newbyteorder("=")
    return torch.from_numpy(np.array(array, dtype=native, order="C", copy=True))

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


def make_batch(*, obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
               next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
               discount: np.ndarray, weights: np.ndarray, ids: np.ndarray) -> Batch:
    """Wrap numpy arrays (copied, contiguous) as a `Batch` of CPU tensors."""
    return Batch(
        obs=torch.from_numpy(np.ascontiguousarray(obs)),
        action=torch.from_numpy(np.ascontiguousarray(action)),
        reward=torch.from_numpy(reward.astype(np.float32)),
        next_obs=torch.from_numpy(np.ascontiguousarray(next_obs)),
        terminated=torch.from_numpy(terminated.astype(bool)),
        truncated=torch.from_numpy(truncated.astype(bool)),
        discount=torch.from_numpy(discount.astype(np.float32)),
        weights=torch.from_numpy(weights.astype(np.float32)),
        ids=torch.from_numpy(ids.astype(np.int64)),
    )

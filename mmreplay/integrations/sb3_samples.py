"""The fields of SB3's ``ReplayBufferSamples`` made from store batches, on the buffer's device.

Two sources: a `Batch` of tensors (``sample`` of a store with its frames on the device, or
any batch given with a ``VecNormalize``), and an `ArrayBatch` (a plain store's
``sample_arrays``, pinned for a CUDA device: each field handed to torch without a copy, then
copied ``non_blocking``). Fields already on the device are not copied again. The buffer makes
``ReplayBufferSamples(**fields)``; this module imports no SB3.

``dones`` is 1 for a window that ended in termination (not truncation); ``discounts`` is
``None`` for 1-step (SB3 then uses the algorithm's gamma), else ``gamma ** m`` for a window of
m steps, also after a termination, as SB3's ``NStepReplayBuffer`` (the store's own
``Batch.discount`` is 0 there).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmreplay.integrations.sb3_layout import StackLayout
from mmreplay.torch_batch import ArrayBatch, Batch, frames_tensor

Fields = dict[str, Any]  # tensors, and None for 1-step discounts


def batch_fields(batch: Batch, layout: StackLayout, gamma: float | None,
                 device: torch.device, env: Any = None) -> Fields:
    """The fields of a `Batch` (on any device); `gamma` None for 1-step (no discounts);
    through ``env``'s ``normalize_obs``/``normalize_reward`` (a ``VecNormalize``, on the
    host) when given, as SB3's buffers do."""
    obs, next_obs = layout.to_sb3(batch.obs), layout.to_sb3(batch.next_obs)
    rewards = batch.reward.reshape(-1, 1)
    if env is not None:
        obs = torch.from_numpy(np.asarray(env.normalize_obs(obs.cpu().numpy())))
        next_obs = torch.from_numpy(np.asarray(env.normalize_obs(next_obs.cpu().numpy())))
        rewards = torch.from_numpy(env.normalize_reward(rewards.cpu().numpy()).astype(
            np.float32))
    discounts = None
    if gamma is not None:
        assert batch.steps is not None  # store batches carry their window lengths
        # on the batch's device; float64 as numpy's ``gamma ** steps``, then float32
        discounts = (gamma ** batch.steps.to(torch.float64)).to(torch.float32).reshape(-1, 1)
    fields: Fields = dict(observations=obs, actions=batch.action, next_observations=next_obs,
                          dones=batch.terminated.to(torch.float32).reshape(-1, 1),
                          rewards=rewards, discounts=discounts)
    return _on(fields, device, non_blocking=False)


def array_fields(batch: ArrayBatch, layout: StackLayout, obs_shape: tuple[int, ...],
                 gamma: float | None, device: torch.device) -> Fields:
    """The fields of an `ArrayBatch`, each handed to torch without a copy (``obs``,
    ``next_obs``: views of one tensor of frames), then copied ``non_blocking``."""
    frames = batch.frames
    if layout.frame_stack == 1:
        shape = (2, frames.shape[1], *obs_shape)
        if batch.pinned is None:  # numpy's reshape: a few times cheaper than torch's
            both = torch.from_numpy(frames.reshape(shape))
        else:  # pinned: the block's own tensor, so copies are tracked
            both = batch.pinned.reshape(shape)
        obs, next_obs = both[0], both[1]
    else:
        both = frames_tensor(batch)
        if device.type != "cpu" and not layout.first:
            # channels last: the frames moved as they are (page-locked, one copy), the
            # stacks' channels moved on the device, not into pageable memory first
            both = both.to(device, non_blocking=True)
        obs, next_obs = layout.to_sb3(both[0]), layout.to_sb3(both[1])
    discounts = None
    if gamma is not None:
        discounts = torch.from_numpy((gamma ** batch.steps).astype(np.float32).reshape(-1, 1))
    fields: Fields = dict(observations=obs, actions=torch.from_numpy(batch.action),
                          next_observations=next_obs,
                          dones=torch.from_numpy(batch.terminated.astype(np.float32)[:, None]),
                          rewards=torch.from_numpy(batch.reward.reshape(-1, 1)),
                          discounts=discounts)
    return _on(fields, device, non_blocking=True)


def _on(fields: Fields, device: torch.device, *, non_blocking: bool) -> Fields:
    """`fields` on `device` (those there already as they are)."""
    if device.type == "cpu":
        return fields
    return {k: None if v is None else v.to(device, non_blocking=non_blocking)
            for k, v in fields.items()}

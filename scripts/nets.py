"""The networks and the DQN learner the training scripts share (`nature_cnn`, `mlp`,
`QNetwork`, `Learner`). They live apart from common.py because they import torch; scripts
import them from common, which loads this module on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def nature_cnn(in_channels: int) -> nn.Sequential:
    """The Nature-DQN convolutional stack: (in_channels, 84, 84) -> 3136 features (unpack
    it into a larger Sequential to keep the layer indices checkpoints were saved with)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())


def mlp(inputs: int, hidden: tuple[int, ...], out: int) -> nn.Sequential:
    """Flatten, then Linear + ReLU per `hidden` size, then a Linear to `out`."""
    layers: list[nn.Module] = [nn.Flatten()]
    for size in hidden:
        layers += [nn.Linear(inputs, size), nn.ReLU()]
        inputs = size
    return nn.Sequential(*layers, nn.Linear(inputs, out))


class QNetwork(nn.Module):
    """Q-values for states of `state_shape`: the Nature CNN for (stack, 84, 84) frames
    (uint8, scaled by 1/255), an MLP with `hidden` sizes for anything else."""

    def __init__(self, state_shape: tuple[int, ...], num_actions: int, *,
                 hidden: tuple[int, ...] = (120, 84)) -> None:
        super().__init__()
        self.pixels = tuple(state_shape[1:]) == (84, 84)
        if self.pixels:
            self.network = nn.Sequential(*nature_cnn(state_shape[0]), nn.Linear(3136, 512),
                                         nn.ReLU(), nn.Linear(512, num_actions))
        else:
            self.network = mlp(math.prod(state_shape), hidden, num_actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x.float() / 255.0 if self.pixels else x.float())


@dataclass
class Learner:
    """A DQN learner: the online network, its target copy and their Adam optimizer."""

    q: QNetwork
    target: QNetwork
    optimizer: torch.optim.Optimizer

    @classmethod
    def create(cls, state_shape: tuple[int, ...], num_actions: int, lr: float) -> Learner:
        q, target = QNetwork(state_shape, num_actions), QNetwork(state_shape, num_actions)
        target.load_state_dict(q.state_dict())
        return cls(q, target, torch.optim.Adam(q.parameters(), lr=lr))

    def state(self) -> dict[str, Any]:
        """The state dicts a checkpoint holds (tensors and plain numbers only)."""
        return {"q_network": self.q.state_dict(), "target_network": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def load(self, ckpt: dict[str, Any]) -> None:
        self.q.load_state_dict(ckpt["q_network"])
        self.target.load_state_dict(ckpt["target_network"])
        self.optimizer.load_state_dict(ckpt["optimizer"])

    def update(self, batch: Any) -> torch.Tensor:
        """One gradient step of the importance-weighted Huber loss on `batch` (a store batch:
        obs, action, reward, discount, next_obs, weights); returns |TD error| per transition."""
        with torch.no_grad():
            next_value = self.target(batch.next_obs).max(1).values
            td_target = batch.reward + batch.discount * next_value
        q_value = self.q(batch.obs).gather(1, batch.action.view(-1, 1)).squeeze(1)
        huber = F.smooth_l1_loss(q_value, td_target, reduction="none")
        loss = (batch.weights * huber).mean()  # weights are ones for uniform sampling
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return (td_target - q_value).abs().detach()

    def sync_target(self) -> None:
        self.target.load_state_dict(self.q.state_dict())

"""The GPU learner of `bench/bench_gpu.py`: the Nature-CNN DQN update (online + target
network, Huber loss, Adam), eager or captured once in a CUDA graph and replayed on static
inputs (``Adam(capturable=True)``, ``torch.cuda.graph``), and the batch it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from common import QNetwork

ACTIONS = 18
STACK = 4


@dataclass
class DeviceBatch:
    """What the learner reads: every field on its device, obs stacks (B, 4, 84, 84)."""

    obs: torch.Tensor
    next_obs: torch.Tensor
    action: torch.Tensor  # int64
    reward: torch.Tensor  # float32
    discount: torch.Tensor  # float32
    weights: torch.Tensor  # float32


class Learner:
    """One DQN update on a `DeviceBatch`, eager or replayed from a captured CUDA graph;
    returns |td| (on the device)."""

    def __init__(self, device: torch.device, batch_size: int, *, graph: bool) -> None:
        torch.manual_seed(0)
        self.q = QNetwork((STACK, 84, 84), ACTIONS).to(device)
        self.target = QNetwork((STACK, 84, 84), ACTIONS).to(device)
        self.target.load_state_dict(self.q.state_dict())
        self.opt = torch.optim.Adam(self.q.parameters(), lr=1e-4, capturable=graph)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self.static = example_batch(device, batch_size)
            self.static_td = self._capture()

    def _update(self, batch: DeviceBatch) -> torch.Tensor:
        with torch.no_grad():
            target = batch.reward + batch.discount * self.target(batch.next_obs).max(1).values
        q = self.q(batch.obs).gather(1, batch.action.view(-1, 1)).squeeze(1)
        loss = (batch.weights * F.smooth_l1_loss(q, target, reduction="none")).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return (target - q).abs().detach()

    def _capture(self) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graphs says
            for _ in range(3):
                self._update(self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            td = self._update(self.static)
        return td

    def __call__(self, batch: DeviceBatch) -> torch.Tensor:
        if self.graph is None:
            return self._update(batch)
        for name in ("obs", "next_obs", "action", "reward", "discount", "weights"):
            if getattr(batch, name) is not getattr(self.static, name):
                getattr(self.static, name).copy_(getattr(batch, name), non_blocking=True)
        self.graph.replay()
        return self.static_td


def example_batch(device: torch.device, batch_size: int) -> DeviceBatch:
    gen = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 255, (2, batch_size, STACK, 84, 84), generator=gen,
                           dtype=torch.uint8)
    return DeviceBatch(obs=frames[0].to(device), next_obs=frames[1].to(device),
                       action=torch.randint(0, ACTIONS, (batch_size,)).to(device),
                       reward=torch.ones(batch_size, device=device),
                       discount=torch.full((batch_size,), 0.99, device=device),
                       weights=torch.ones(batch_size, device=device))


def from_store(batch: Any, device: torch.device, non_blocking: bool = False) -> DeviceBatch:
    """A store `Batch` (on any device) as the learner's batch on `device`."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)
    return DeviceBatch(obs=move(batch.obs), next_obs=move(batch.next_obs),
                       action=move(batch.action).long(), reward=move(batch.reward),
                       discount=move(batch.discount), weights=move(batch.weights))

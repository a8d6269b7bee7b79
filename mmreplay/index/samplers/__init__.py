"""Sampling distributions over flat slots; the store calls only this interface.

A sampler is told which flat slots are sampleable (``update``) and draws
``(slots, weights)`` with a `np.random.Generator` the store owns and passes in.
It knows no frames, files or torch.

Three distributions: `UniformSampler`; `PrioritizedSampler` (proportional,
``P(i) ∝ (p_i + eps)^alpha``) and `RankSampler` (``P(i) ∝ rank_i^-alpha``), both
stratified over a `SumTree` of masses and both `PrioritySampler`s (their shared part:
`priority.TreePrioritySampler`). Modules: `protocol` (the interface and what a draw returns),
`uniform`, `priority`, `prioritized`, `rank`.
"""

from __future__ import annotations

from mmreplay.index.samplers.prioritized import PrioritizedSampler
from mmreplay.index.samplers.priority import TreePrioritySampler
from mmreplay.index.samplers.protocol import (
    Applied,
    Draw,
    PrioritySampler,
    Sampler,
    SlotMarks,
    array_nbytes,
)
from mmreplay.index.samplers.rank import RankSampler
from mmreplay.index.samplers.uniform import UniformSampler
from mmreplay.kernels.structs import TreeDraw
from mmreplay.spec import StoreSpec

__all__ = ["Applied", "Draw", "PrioritizedSampler", "PrioritySampler", "RankSampler", "Sampler",
           "SlotMarks", "TreeDraw", "TreePrioritySampler", "UniformSampler", "array_nbytes",
           "make_sampler"]

def make_sampler(spec: StoreSpec) -> Sampler:
    num_slots = spec.num_envs * spec.slots_per_env
    if spec.sampler == "uniform":
        return UniformSampler(num_slots)
    if spec.sampler == "prioritized":
        return PrioritizedSampler(num_slots, alpha=spec.alpha, eps=spec.priority_eps)
    if spec.sampler == "rank":
        return RankSampler(num_slots, alpha=spec.alpha, eps=spec.priority_eps)
    raise NotImplementedError(f"sampler {spec.sampler!r} is not available yet")

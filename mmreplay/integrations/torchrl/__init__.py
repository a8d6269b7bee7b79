"""TorchRL: a frame-once storage for TorchRL's replay buffers (extra ``torchrl``).

    rb = make_replay_buffer("runs/rb", 1_000_000, batch_size=32, prefetch=3, frame_stack=4)
    rb.extend(collector_batch)        # CatFrames stacks in, each frame written once
    td = rb.sample()                  # "pixels", "action", ("next", "pixels"), ...

Modules: `layout` (which TensorDict entry is which store column), `stream` (collector
batches -> store rows, episode edges, checks), `storage` (`FrameOnceStorage`), `buffer`
(`FrameOnceSampler`, `FrameOnceWriter`, `FrameOnceReplayBuffer`, `make_replay_buffer`).
torchrl and tensordict are imported only here.
"""

from __future__ import annotations

try:
    import tensordict  # noqa: F401
    import torchrl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('mmreplay.integrations.torchrl needs torchrl: '
                      'pip install "mmreplay[torchrl]"') from exc

from mmreplay.integrations.torchrl.buffer import (
    FrameOnceReplayBuffer,
    FrameOnceSampler,
    FrameOnceWriter,
    make_replay_buffer,
)
from mmreplay.integrations.torchrl.storage import FrameOnceStorage

__all__ = ["FrameOnceReplayBuffer", "FrameOnceSampler", "FrameOnceStorage", "FrameOnceWriter",
           "make_replay_buffer"]

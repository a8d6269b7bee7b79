"""``from mmreplay.sb3 import FrameOnceReplayBuffer``: see `mmreplay.integrations.sb3`."""

from .integrations.sb3 import FrameOnceReplayBuffer, StackLayout

__all__ = ["FrameOnceReplayBuffer", "StackLayout"]

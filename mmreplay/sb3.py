"""``from mmreplay.sb3 import FrameOnceReplayBuffer``: see `mmreplay.integrations.sb3`."""

from mmreplay.integrations.sb3 import FrameOnceReplayBuffer, StackLayout

__all__ = ["FrameOnceReplayBuffer", "StackLayout"]

"""mmreplay: a disk-backed replay memory that keeps every frame exactly once.

    from mmreplay import ReplayStore
    store = ReplayStore.create("runs/buf", capacity=1_000_000, obs_shape=(84, 84), frame_stack=4)
"""

from mmreplay.errors import (
    ClosedStoreError,
    DatasetFormatError,
    DeviceMemoryError,
    EmptyStoreError,
    InvalidInputError,
    InvalidStoreError,
    MmreplayError,
    RateLimiterClosedError,
    RateLimitTimeoutError,
    ReadOnlyError,
    StoreLockedError,
    UnknownIdError,
)
from mmreplay.rate_limit import RateLimiter
from mmreplay.recorder import StepRows
from mmreplay.spec import StoreSpec
from mmreplay.store import ReplayStore
from mmreplay.torch_batch import Batch, SequenceBatch

__all__ = [
    "Batch",
    "ClosedStoreError",
    "DatasetFormatError",
    "DeviceMemoryError",
    "EmptyStoreError",
    "InvalidInputError",
    "InvalidStoreError",
    "MmreplayError",
    "RateLimitTimeoutError",
    "RateLimiter",
    "RateLimiterClosedError",
    "ReadOnlyError",
    "ReplayStore",
    "SequenceBatch",
    "StepRows",
    "StoreLockedError",
    "StoreSpec",
    "UnknownIdError",
]
__version__ = "0.1.0"

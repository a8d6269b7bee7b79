"""mmreplay: a disk-backed replay memory that keeps every frame exactly once.

    from mmreplay import ReplayStore
    store = ReplayStore.create("runs/buf", capacity=1_000_000, obs_shape=(84, 84), frame_stack=4)
"""

from .errors import (
    DatasetFormatError,
    EmptyStoreError,
    InvalidInputError,
    InvalidStoreError,
    MmreplayError,
    ReadOnlyError,
    StoreLockedError,
    UnknownIdError,
)
from .spec import StoreSpec
from .store import ReplayStore
from .torch_batch import Batch, SequenceBatch

__all__ = [
    "Batch",
    "DatasetFormatError",
    "EmptyStoreError",
    "InvalidInputError",
    "InvalidStoreError",
    "MmreplayError",
    "ReadOnlyError",
    "ReplayStore",
    "SequenceBatch",
    "StoreLockedError",
    "StoreSpec",
    "UnknownIdError",
]
__version__ = "0.1.0"

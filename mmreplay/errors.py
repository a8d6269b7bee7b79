"""The exception hierarchy of mmreplay.

Every error the library raises on purpose is a :class:`MmreplayError` and also a
builtin exception of the matching kind, so callers can catch either.
"""

from __future__ import annotations


class MmreplayError(Exception):
    """Base class of every error mmreplay raises on purpose."""


class InvalidInputError(MmreplayError, ValueError):
    """An argument does not match the store (shape, dtype, value, call order)."""


class InvalidStoreError(MmreplayError, ValueError):
    """A directory is not a store, is damaged, or has a format this code cannot read.

    Opening raises it, with a one-line message, for every problem a directory can have:
    malformed or oversized metadata, bad ``.npy`` headers, checksum mismatches, symlinks,
    FIFOs or devices where files belong, and specs that would need too much RAM.
    """


class DatasetFormatError(MmreplayError, ValueError):
    """Files given to an importer are not the dataset format they claim to be.

    Raised, with a one-line message naming the file, for wrong shapes or dtypes, arrays
    whose lengths disagree, pickled or object payloads, truncated or corrupt compression.
    """


class StoreLockedError(MmreplayError, RuntimeError):
    """Another writer (in another process, or an earlier one in this one) holds the store."""


class ClosedStoreError(InvalidInputError):
    """A call on a store after its ``close()`` (reads and writes alike)."""


class ReadOnlyError(MmreplayError, PermissionError):
    """A mutating call on a store opened with ``mode="r"``."""


class EmptyStoreError(MmreplayError, LookupError):
    """Sampling from a store that holds no sampleable transition."""


class UnknownIdError(MmreplayError, KeyError):
    """A transition id that is not (or no longer) sampleable."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


class RateLimitTimeoutError(MmreplayError, TimeoutError):
    """A rate limiter kept an insert or a sample waiting longer than its timeout.

    Nothing was inserted or sampled; the message says which side waited, for how long,
    and where the samples-per-insert error stood against its buffer.
    """


class RateLimiterClosedError(MmreplayError, RuntimeError):
    """An insert or sample waited on (or asked) a rate limiter that was shut down."""


class ObjectStoreError(MmreplayError, OSError):
    """Object storage (a bucket, or a ``file://`` directory) failed a request after its
    retries. The message names the URL and key, never a credential."""


class DeviceMemoryError(MmreplayError, MemoryError):
    """A ``device=`` store whose frames do not fit in the device's free memory."""

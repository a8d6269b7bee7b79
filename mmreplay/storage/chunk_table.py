"""Every decoded chunk of a store in one array: the decoded-chunk cache of small observations.

When the decoded frames of the whole ring fit the cache budget (the default for small
observations, see `validate.cache_budget`), a byte-budgeted LRU of chunks (`ChunkCache`) costs
a dict lookup, an LRU move and a copy of the whole chunk per chunk a read touches. The table
instead gives every chunk key (``env * num_chunks + chunk``) a fixed row, so the compiled read
(`kernels.table_kernels`) finds a frame by arithmetic and copies only the frames it returns::

    rows     (num_keys, chunk_bytes) uint8   row k = decoded chunk k (allocated on first use)
    loaded   (num_keys,) bool                row k holds chunk k as the reader may see it

A row is filled when a chunk is finished by this writer (`put`) or first read from disk or
from RAM; it is never dropped (nothing is evicted: everything fits). Like the LRU it replaces,
it knows keys and bytes only.
"""

from __future__ import annotations

import numpy as np


class ChunkTable:
    """A row of decoded bytes per chunk key, and which rows are loaded."""

    def __init__(self, num_keys: int, chunk_bytes: int, chunk_frames: int) -> None:
        self.num_keys = num_keys
        self.chunk_bytes = chunk_bytes
        self.chunk_frames = chunk_frames
        self.loaded = np.zeros(num_keys, np.bool_)
        self._rows: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        """``(num_keys, chunk_bytes)`` uint8; zero pages cost nothing until written."""
        if self._rows is None:
            self._rows = np.zeros((self.num_keys, self.chunk_bytes), np.uint8)
        return self._rows

    @property
    def frames(self) -> np.ndarray:
        """The rows as ``(num_keys * chunk_frames, frame_bytes)``: one frame a row."""
        return self.rows.reshape(self.num_keys * self.chunk_frames, -1)

    def put(self, key: int, frames: np.ndarray) -> None:
        """Row `key` = these decoded frames (a whole chunk, any dtype); now loaded."""
        self.rows[key] = np.ascontiguousarray(frames).reshape(-1).view(np.uint8)
        self.loaded[key] = True

    def mark(self, keys: np.ndarray) -> None:
        """Rows `keys` were written in place (decoded into `rows`): now loaded."""
        self.loaded[keys] = True

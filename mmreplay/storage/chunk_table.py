"""The decoded-chunk cache: a slot table of rows and one big buffer, read and evicted in the kernel.

A budget of ``R = budget // chunk_bytes`` rows (at least one) of decoded chunks, each chunk key
(``env * num_chunks + chunk``) mapped to the row that holds it, so the compiled read
(`kernels.table_kernels`) finds a frame by arithmetic and copies only the frames it returns,
with no Python per chunk (a Python dict LRU cost a lookup, an LRU move and a copy of the whole
chunk per chunk a read touched)::

    rows     (R, chunk_bytes) uint8     row r = a decoded chunk (allocated on first use)
    row_of   (num_keys,) int64          the row holding key k, or -1
    key_of   (R,) int64                 the key row r holds, or -1
    ref      (R,) uint8                 CLOCK reference bit: set when a read uses the row
    pin      (R,) int64                 the read (epoch) that used the row last
    state    [hand, epoch, held]        CLOCK hand, reads so far, rows holding a key

When the whole store fits (``R >= num_keys``) row k is chunk k's and nothing is ever evicted.
Else a chunk that needs a row takes the first one the CLOCK hand meets that is neither
referenced since its last pass nor used by the current read (`kernels.table_kernels`): a read
touching more chunks than there are rows is told so and read without keeping.

A row is claimed by a read for each chunk it lacks and loaded by that read; a claim whose
load fails is dropped (`drop`). Chunks finished by this writer are put in (`put`). Like the
LRU it replaces, it knows keys and bytes only.
"""

from __future__ import annotations

import numpy as np

from mmreplay.kernels import lazy_entry, tables
from mmreplay.kernels.structs import TableArrays

# the compiled kernels called here, each found without a look-up (`kernels.lazy_entry`)
_CLAIM_ROW, _DROP_ROWS = lazy_entry(tables, "claim_row"), lazy_entry(tables, "drop_rows")

HAND, EPOCH, HELD = 0, 1, 2  # positions in `state`


class ChunkTable:
    """Rows of decoded chunks, which key each holds, and the CLOCK state of their eviction."""

    def __init__(self, num_keys: int, chunk_bytes: int, chunk_frames: int,
                 budget_bytes: int | None = None) -> None:
        whole = num_keys * chunk_bytes
        count = num_keys if budget_bytes is None or budget_bytes >= whole else max(
            1, budget_bytes // chunk_bytes)
        self.num_keys, self.num_rows = num_keys, count
        self.chunk_bytes = chunk_bytes
        self.chunk_frames = chunk_frames
        self.row_of = np.full(num_keys, -1, np.int64)
        self.key_of = np.full(count, -1, np.int64)
        self.ref = np.zeros(count, np.uint8)
        self.pin = np.zeros(count, np.int64)
        self.state = np.zeros(3, np.int64)
        self._rows: np.ndarray | None = None
        self._arrays: TableArrays | None = None

    @property
    def whole(self) -> bool:
        """True when every chunk has its own row (nothing is ever evicted)."""
        return self.num_rows == self.num_keys

    @property
    def rows(self) -> np.ndarray:
        """``(R, chunk_bytes)`` uint8; zero pages cost nothing until written."""
        if self._rows is None:
            self._rows = np.zeros((self.num_rows, self.chunk_bytes), np.uint8)
        return self._rows

    @property
    def frames(self) -> np.ndarray:
        """The rows as ``(R * chunk_frames, frame_bytes)``: one frame a row."""
        return self.rows.reshape(self.num_rows * self.chunk_frames, -1)

    def arrays(self) -> TableArrays:
        """The table's arrays, as the compiled reads take them (made once: they never move)."""
        if self._arrays is None:
            self._arrays = TableArrays(self.rows, self.row_of, self.key_of, self.ref, self.pin,
                                       self.state)
        return self._arrays

    @property
    def held(self) -> int:
        """Rows holding a chunk now."""
        return int(self.state[HELD])

    def put(self, key: int, frames: np.ndarray) -> None:
        """Chunk `key` = these decoded frames (a whole chunk, any dtype), in its row or in a
        row taken from another chunk."""
        row = _CLAIM_ROW(key, self.arrays(), True)
        self.rows[row] = np.ascontiguousarray(frames).reshape(-1).view(np.uint8)

    def drop(self, keys: np.ndarray) -> None:
        """Forget chunks `keys` (claimed by a read whose load failed): their rows are free."""
        _DROP_ROWS(keys, self.arrays())

    def clear(self) -> None:
        """Forget every chunk."""
        self.drop(np.flatnonzero(self.row_of >= 0))

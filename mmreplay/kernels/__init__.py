"""The compiled kernels of the read path, imported on first use.

`numba_kernels` holds every compiled operation (chunk decode and gather, ring lookups,
sum-tree walks) with plain-array signatures: it knows no files, manifests or torch. It loads
numba, its on-disk cache and the C symbols it binds, so it is imported on a store's first read
or sparse priority update through `compiled()`, never by ``import mmreplay``: opening a store
for ``mmreplay info`` never loads it. `priority_kernels` (masses and a whole priority update
in one call), `table_kernels` (reads from a table of every decoded chunk), `record_kernels`
(a block of recorded steps in one call) and `sample_kernels` (a batch drawn, looked up and
read in one call) are loaded the same way, through `priorities()`, `tables()`, `records()`
and `samples()`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# Status of one chunk's decode (`numba_kernels.decode_chunks`, `codec.ChunkCodec.check`).
OK, TOO_SHORT, BAD_CRC, BAD_HEADER, NO_DECODE = 0, 1, 2, 3, 4


@functools.cache
def compiled() -> ModuleType:
    """`mmreplay.kernels.numba_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.numba_kernels")


@functools.cache
def priorities() -> ModuleType:
    """`mmreplay.kernels.priority_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.priority_kernels")


@functools.cache
def tables() -> ModuleType:
    """`mmreplay.kernels.table_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.table_kernels")


@functools.cache
def records() -> ModuleType:
    """`mmreplay.kernels.record_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.record_kernels")


@functools.cache
def samples() -> ModuleType:
    """`mmreplay.kernels.sample_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.sample_kernels")

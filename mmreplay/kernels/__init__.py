"""The compiled kernels of the read path, imported on first use.

`numba_kernels` holds every compiled operation (chunk decode and gather, ring lookups,
sum-tree walks) with plain-array signatures: it knows no files, manifests or torch. It loads
numba, its on-disk cache and the C symbols it binds, so it is imported on a store's first read
or sparse priority update through `compiled()`, never by ``import mmreplay``: opening a store
for ``mmreplay info`` never loads it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Status of one chunk's decode (`numba_kernels.decode_chunks`, `codec.ChunkCodec.check`).
OK, TOO_SHORT, BAD_CRC, BAD_HEADER, NO_DECODE = 0, 1, 2, 3, 4


def compiled() -> ModuleType:
    """`mmreplay.kernels.numba_kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels.numba_kernels")

"""Imports paid on first use, not by ``import mmreplay``.

The compiled kernels (`kernels`: numba, its on-disk cache, the C symbols they bind) load on
a store's first read or sparse priority update; opening a store for ``mmreplay info`` never
loads them.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def kernels() -> ModuleType:
    """`mmreplay.kernels`, imported on the first call."""
    return importlib.import_module("mmreplay.kernels")

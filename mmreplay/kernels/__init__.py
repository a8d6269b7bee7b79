"""The compiled kernels of the read path, imported on first use.

`numba_kernels` holds the compiled read path (chunk decode and gather, ring lookups) with
plain-array signatures: it knows no files, manifests or torch. It loads numba, its on-disk
cache and the C symbols it binds, so it is imported on a store's first read or sparse priority
update through `compiled()`, never by ``import mmreplay``: opening a store for ``mmreplay
info`` never loads it. `tree_kernels` (sum-tree walks), `priority_kernels` (masses and a whole
priority update in one call), `table_kernels` (reads from a table of every decoded chunk),
`record_kernels` (a block of recorded steps in one call) and `sample_kernels` (a batch drawn,
looked up and read in one call) are loaded the same way, through `trees()`, `priorities()`,
`tables()`, `records()` and `samples()`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

# Status of one chunk's decode (`numba_kernels.decode_chunks`, `codec.ChunkCodec.check`).
OK, TOO_SHORT, BAD_CRC, BAD_HEADER, NO_DECODE = 0, 1, 2, 3, 4


def _loader(module: str) -> Callable[[], ModuleType]:
    """A function that imports ``mmreplay.kernels.<module>`` on its first call (then cached)."""

    @functools.cache
    def load() -> ModuleType:
        return importlib.import_module(f"mmreplay.kernels.{module}")

    load.__doc__ = f"`mmreplay.kernels.{module}`, imported on the first call."
    return load


compiled = _loader("numba_kernels")
trees = _loader("tree_kernels")
priorities = _loader("priority_kernels")
tables = _loader("table_kernels")
records = _loader("record_kernels")
samples = _loader("sample_kernels")


class Entry:
    """A compiled kernel called with arguments of one type each call, past numba's typing.

    numba types every argument of every call to pick the compiled code: a plain array in C,
    a named tuple in Python (several µs for the nested named tuples of `kernels.structs`,
    more than some kernels take to run). An `Entry`'s first call goes through the dispatcher
    (which compiles the kernel or loads it from numba's cache); later calls go straight to the
    compiled code of that call's argument types, as long as each array argument still has
    the first call's dtype, dimensions, layout and writability (checked here, else the
    dispatcher is asked again). Only the array arguments at positions `check` are checked
    (all of them if None): a caller leaves out the arrays it allocates itself with fixed
    dtypes, and tuple arguments are never checked: their owners build them the same way every
    call (`kernels.structs`: arrays of fixed dtypes, Python ints, bools). A kernel of plain
    arrays and scalars needs no `Entry`: numba types those in C.
    """

    __slots__ = ("_kernel", "_compiled", "_arrays", "_check")

    def __init__(self, kernel: Any, check: tuple[int, ...] | None = None) -> None:
        self._kernel = kernel
        self._check = check
        self._compiled: Any = None
        self._arrays: tuple[tuple[int, Any, int, int], ...] = ()

    def __call__(self, *args: Any) -> Any:
        run = self._compiled
        if run is not None:
            # `_look`, inline: this is per call. A dtype equal to the bound one is not always
            # the same object (numba's returned arrays, ``astype``): identity first, then ==
            for i, dtype, ndim, flags in self._arrays:
                a = args[i]
                if type(a) is not np.ndarray or a.ndim != ndim \
                        or a.flags.num & _LAYOUT != flags \
                        or (a.dtype is not dtype and a.dtype != dtype):
                    return self._kernel(*args)
            return run(*args)
        result = self._kernel(*args)
        self._bind(args)
        return result

    def _bind(self, args: tuple[Any, ...]) -> None:
        """Keep the compiled code of these argument types, and how their arrays look."""
        key = tuple(self._kernel.typeof_pyval(a) for a in args)
        found = self._kernel.overloads.get(key)
        if found is None:
            return  # typed otherwise than here (literals, ...): always ask the dispatcher
        self._arrays = tuple((i, *_look(a)) for i, a in enumerate(args)
                             if type(a) is np.ndarray and (self._check is None
                                                            or i in self._check))
        self._compiled = found.entry_point


_LAYOUT = 0x1 | 0x2 | 0x100 | 0x400  # numpy's C_CONTIGUOUS, F_CONTIGUOUS, ALIGNED, WRITEABLE


def _look(a: Any) -> tuple[Any, ...]:
    """What numba's type of an array argument depends on: dtype, dimensions, layout and
    writability."""
    if type(a) is not np.ndarray:
        return ()
    return a.dtype, a.ndim, a.flags.num & _LAYOUT


_ENTRIES: dict[tuple[int, tuple[int, ...] | None], Entry] = {}


def entry(kernel: Any, check: tuple[int, ...] | None = None) -> Entry:
    """The `Entry` of a compiled kernel checking the arrays at `check` (made on first use)."""
    key = (id(kernel), check)
    found = _ENTRIES.get(key)
    if found is None:
        found = _ENTRIES[key] = Entry(kernel, check)
    return found


def lazy_entry(load: Callable[[], ModuleType], name: str,
               check: tuple[int, ...] | None = None) -> Entry:
    """The `Entry` of kernel `name` of the module `load` imports, that import left to its
    first call: what a module keeps as a constant, so that a call finds its `Entry` without
    `entry`'s look-up and importing the module imports no kernels."""
    found = Entry(None, check)

    def first_call(*args: Any) -> Any:  # replaced by the kernel, then called once
        found._kernel = kernel = getattr(load(), name)
        return kernel(*args)

    found._kernel = first_call
    return found

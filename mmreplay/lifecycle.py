"""Writers a program never closed: flushed and closed at normal interpreter exit, with a warning.

A store commits only on ``flush``/``close``; a program that records and then simply ends
(``RecordVectorToStore(envs, create_store_for(...))`` without a handle to the store) would
otherwise leave nothing behind. `track` puts every writable store in a weak set; at exit
(`atexit`, so only a normal exit: the end of the main module, ``sys.exit``, an uncaught
exception) each one still open is closed, which flushes it, with a `RuntimeWarning` naming
its path. The set holds weak references, so a store the program dropped is still garbage
collected (without a flush: only ``close`` or the exit hook commits).

A crash is unchanged: SIGKILL, ``os._exit`` or a power cut run no hook, and the store
reopens at its last committed flush, as always.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from typing import Protocol, TypeVar


class Closable(Protocol):
    """What the exit hook needs of a store."""

    @property
    def path(self) -> os.PathLike[str] | str: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_guard = threading.Lock()
_registered = False


S = TypeVar("S", bound=Closable)


def track(store: S) -> S:
    """Flush and close `store` at interpreter exit unless the program closed it first;
    returns `store`."""
    global _registered
    with _guard:
        if not _registered:  # registered after zarr/numcodecs: atexit runs it before theirs
            atexit.register(close_unclosed)
            _registered = True
        _open.add(store)
    return store


def untrack(store: Closable) -> None:
    """Leave `store` to an owner that closes it at exit itself (no warning for it)."""
    with _guard:
        _open.discard(store)


def close_unclosed() -> list[str]:
    """Close every tracked store still open, warning for each; returns their paths."""
    closed = []
    for store in list(_open):
        if store.closed:
            continue
        _warn(f"the store at {store.path} was never closed; flushing it at exit (call "
              f"store.close() or use `with` to commit it yourself)")
        try:
            store.close()
        except Exception as exc:  # one store's failure must not keep the others unflushed
            _warn(f"flushing {store.path} at exit failed: {exc}")
            continue
        closed.append(str(store.path))
    return closed


def _warn(message: str) -> None:
    """One stderr line, ``mmreplay: RuntimeWarning: ...`` (no source line: there is no
    caller to point at during exit)."""
    warnings.warn_explicit(message, RuntimeWarning, filename="mmreplay", lineno=0,
                           module="mmreplay.lifecycle")

"""One open `ReplayStore` per path and process, shared by the SB3 buffers built on it.

``DQN.load`` builds a buffer on the store, then ``load_replay_buffer`` unpickles a second one
on the same path while the first still lives: both must write through one store (a store
has one writer). `acquire` counts the buffers on a path; `release` (a buffer's finalizer)
records the buffer's staged steps and closes the store when the last buffer goes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mmreplay import lifecycle
from mmreplay.integrations.step_stage import StepStage
from mmreplay.store import ReplayStore

__all__ = ["acquire", "release"]

_OPEN: dict[str, tuple[ReplayStore, int]] = {}
_OPEN_LOCK = threading.Lock()


def acquire(key: str, opener: Callable[[], ReplayStore]) -> ReplayStore:
    """The store open at `key` (a real path) in this process, or ``opener()``'s."""
    with _OPEN_LOCK:
        if key in _OPEN:
            store, refs = _OPEN[key]
            _OPEN[key] = (store, refs + 1)
            return store
        store = opener()
        lifecycle.untrack(store)  # the buffers' finalizers close it, at exit too (`release`)
        _OPEN[key] = (store, 1)
        return store


def release(key: str, stage: StepStage | None = None) -> None:
    """Record a buffer's staged steps, then close the store once no buffer shares it."""
    try:
        if stage is not None and not stage.store.closed:
            stage.drain()
    finally:
        _drop(key)


def _drop(key: str) -> None:
    with _OPEN_LOCK:
        if key not in _OPEN:
            return
        store, refs = _OPEN[key]
        if refs > 1:
            _OPEN[key] = (store, refs - 1)
            return
        del _OPEN[key]
    store.close()

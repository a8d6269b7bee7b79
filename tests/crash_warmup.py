"""Imported by `test_crash.py`'s forkserver (a preload), never by a test: records a short
stream of every crash config into a throwaway store, so that the numba kernels a writer
runs are loaded in the server and every forked writer starts with them (instead of loading
them from numba's cache itself, ~1 s a writer). The store is closed (its chunk-writer
thread joined) before the server forks anything."""

from __future__ import annotations

import tempfile
from pathlib import Path

from crash_writer import Stream, StreamConfig

from mmreplay import ReplayStore

WARM_OPS = 120
CONFIGS = (StreamConfig(capacity=64), StreamConfig(capacity=80, num_envs=2, p_reset=0.05,
                                                     p_cut=0.02))


def warm() -> None:
    with tempfile.TemporaryDirectory(prefix="crash_warmup_") as tmp:
        for n, config in enumerate(CONFIGS):
            store = ReplayStore.create(Path(tmp) / str(n), **config.store_kwargs())
            stream = Stream(config)
            for i in range(WARM_OPS):
                op = stream.op(i)
                op.apply(store)
                if op.flush:
                    store.flush()
            store.close()


warm()

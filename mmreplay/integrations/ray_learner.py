"""The learner's side of `mmreplay.integrations.ray`: batches sampled by a store actor."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch
from numcodecs import blosc

from mmreplay.integrations.ray_support import ACTOR_DIED, BATCH_FIELDS, ray, wait_for_actor
from mmreplay.prefetch import BatchPrefetcher
from mmreplay.torch_batch import Batch
from mmreplay.validate import to_numpy


class RemoteBatches:
    """The learner's side: an endless iterator of `Batch` es sampled by a store actor.

    Keeps `prefetch` ``sample`` calls in flight, so the store actor works while the learner
    does; with `background` a thread also takes the answers and decodes them into torch
    batches (up to 2 ready), so ``next()`` rarely waits. Priority updates are sent without
    waiting (at most `max_pending_updates` pending). Set ``it.beta`` to anneal; batches
    already asked for keep the old value. `waits` holds the latest waits in ``next()``
    (seconds). With `compress` the stacks cross Ray as lz4 bytes (faster than raw arrays
    here: ``scripts/bench/bench_ray.py``); `batches_per_call` > 1 spreads a call's overhead over
    several small batches (drawn together, so later ones see older priorities).
    """

    def __init__(self, actor: Any, batch_size: int, *, prefetch: int = 4, beta: float = 0.4,
                 max_pending_updates: int = 8, restart_wait_s: float = 60.0,
                 compress: bool = True, batches_per_call: int = 1,
                 background: bool = True) -> None:
        self.actor, self.batch_size, self._beta = actor, batch_size, beta
        self.compress, self.batches_per_call = compress, max(1, batches_per_call)
        self.prefetch, self.max_pending_updates = max(1, prefetch), max(1, max_pending_updates)
        self.restart_wait_s = restart_wait_s
        self.waits: deque[float] = deque(maxlen=10_000)
        self._ready: deque[dict[str, Any]] = deque()
        self._samples: deque[Any] = deque()
        self._updates: deque[Any] = deque()
        self._thread = BatchPrefetcher(self._fetch, batch_size, prefetch=2, beta=beta) \
            if background else None

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = value
        if self._thread is not None:
            self._thread.beta = value

    def __iter__(self) -> RemoteBatches:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        if self._thread is not None:
            batch = next(self._thread)
        else:
            batch = self._fetch(self.batch_size, self._beta)
        self.waits.append(time.perf_counter() - start)
        return batch

    def _fetch(self, batch_size: int, beta: float) -> Batch:
        if not self._ready:
            self._ready.extend(self._next_call(batch_size, beta))
        return to_batch(self._ready.popleft())

    def _next_call(self, batch_size: int, beta: float) -> list[dict[str, Any]]:
        """The answer of the oldest `sample` call in flight (topped up to `prefetch`)."""
        while True:
            while len(self._samples) < self.prefetch:
                self._samples.append(self.actor.sample.remote(
                    batch_size, beta, self.compress, self.batches_per_call))
            try:
                return ray.get(self._samples.popleft())
            except ACTOR_DIED:  # the store restarts: wait for the new process, ask again
                self._samples.clear()
                wait_for_actor(self.actor, self.restart_wait_s)

    def update_priorities(self, ids: Any, priorities: Any) -> None:
        """Send new priorities without waiting (ids the store no longer has are ignored)."""
        while len(self._updates) >= self.max_pending_updates:
            self._settle_update()
        self._updates.append(self.actor.update_priorities.remote(
            np.asarray(to_numpy(ids)), np.asarray(to_numpy(priorities))))

    def _settle_update(self) -> None:
        try:
            ray.get(self._updates.popleft())
        except ACTOR_DIED:
            pass  # lost with a store process: those priorities were not committed either

    def close(self) -> None:
        """Stop the thread, wait for the pending priority updates, drop prefetched samples."""
        if self._thread is not None:
            self._thread.close()
        while self._updates:
            self._settle_update()
        self._samples.clear()
        self._ready.clear()


def to_batch(arrays: dict[str, Any]) -> Batch:
    """Torch tensors from what `StoreActor.sample` returned: arrays Ray hands out read-only
    are copied on purpose; lz4 stacks are decoded straight into fresh arrays."""
    out: dict[str, Any] = {}
    for name in BATCH_FIELDS:
        value = arrays[name]
        if isinstance(value, tuple):
            data, shape, dtype = value
            decoded = np.empty(shape, dtype)
            blosc.decompress(data, decoded)
            out[name] = torch.from_numpy(decoded)
        else:
            out[name] = torch.from_numpy(np.array(value))
    return Batch(**out)

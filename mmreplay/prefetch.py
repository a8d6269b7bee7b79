"""Background batch production: draw the next batches while the learner computes.

`BatchPrefetcher` owns one daemon thread that calls a sampling function (the
store's ``sample``, which takes the store's lock) and keeps up to `prefetch`
batches ready in a queue. Decoding chunks and building tensors then overlaps
the learner's forward/backward pass, which releases the GIL inside torch.
It knows nothing of frames, rings or samplers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from mmreplay.errors import InvalidInputError
from mmreplay.torch_batch import Batch

SampleFn = Callable[[int, float], Batch]


class BatchPrefetcher(Iterator[Batch]):
    """An endless iterator of batches drawn ahead by a background thread.

    ``beta`` may be changed between batches (agents anneal it); a change
    applies to batches drawn after it, so up to `prefetch` batches already
    waiting keep the old value. An error in the thread (e.g. an empty store)
    is raised by the next ``next()``. Use as a context manager or call ``close``.
    """

    def __init__(self, sample: SampleFn, batch_size: int, *, prefetch: int = 2,
                 beta: float = 0.4, workers: int = 1) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidInputError(f"prefetch must be a positive int, got {prefetch!r}")
        self.beta = beta
        self._sample = sample
        self._batch_size = batch_size
        self._queue: queue.Queue[object] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        # more than one worker only pays where `sample` waits outside the store's lock (a
        # store read from a bucket waits for the network); batches then arrive in any order
        self._threads = [threading.Thread(target=self._run, name="mmreplay-prefetch",
                                          daemon=True) for _ in range(workers)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: object = self._sample(self._batch_size, self.beta)
            except BaseException as exc:  # handed to the consumer, then stop
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __next__(self) -> Batch:
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert isinstance(item, Batch)
        return item

    def close(self) -> None:
        """Stop the thread and drop batches not yet taken. Idempotent."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

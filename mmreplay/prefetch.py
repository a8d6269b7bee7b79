"""Background batch production: draw the next batches while the learner computes.

`BatchPrefetcher` owns one daemon thread that calls a sampling function (the
store's ``sample``, which takes the store's lock) and keeps up to `prefetch`
batches ready in a queue. Decoding chunks and building tensors then overlaps
the learner's forward/backward pass, which releases the GIL inside torch.

`BatchPipeline` is the same iterator for a store whose frames arrive over a network (a
bucket): a batch is drawn, fetched and assembled in three steps, and up to `prefetch`
batches are between the first and the last at once, so their round trips overlap::

    draw      (store's lock, in order, on the store's RNG)   b1  b2  b3 ...
    fetch     (no lock, concurrently)                          b1..b3 in flight
    assemble  (store's lock, in draw order)                  b1      b2  b3 ...

Draws happen in order on one RNG and batches come out in that order, so without a
writer the sequence equals that of plain ``sample`` calls. Neither knows frames, rings
or samplers.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mmreplay.errors import InvalidInputError
from mmreplay.torch_batch import Batch

SampleFn = Callable[[int, float], Any]  # a Batch, or what `receive` turns into one
Receive = Callable[[Any], Batch]
# how the thread polls a full queue for room (see `BatchPrefetcher._put`): the first pause,
# doubled after each miss up to the last, so a batch taken t seconds after the queue filled is
# replaced within min(t, POLL_MAX_S). Polls need the GIL: at most 2 ms apart they made a
# Nature-CNN learner step 15-30% slower on a loaded 2-core machine; 8 ms, within the noise.
POLL_S = 0.000_25
POLL_MAX_S = 0.008


class BatchPrefetcher(Iterator[Batch]):
    """An endless iterator of batches drawn ahead by a background thread.

    ``beta`` may be changed between batches (agents anneal it); a change
    applies to batches drawn after it, so up to `prefetch` batches already
    waiting keep the old value. An error in the thread (e.g. an empty store)
    is raised by the next ``next()``. Use as a context manager or call ``close``.

    ``receive`` runs in the consumer's thread on each item the threads made, before
    ``next()`` returns it (`DeviceMover.receive`: hand a batch copied on a side stream over
    to the consumer's stream); without it, items are batches.

    `workers` threads call `sample`; a sequence of functions gives each thread its own (one
    thread a function: read-only views of one store, each with its own lock). Batches then
    arrive in any order. ``on_close`` runs once the threads stopped.
    """

    def __init__(self, sample: SampleFn | Sequence[SampleFn], batch_size: int, *,
                 prefetch: int = 2, beta: float = 0.4, workers: int = 1,
                 receive: Receive | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidInputError(f"prefetch must be a positive int, got {prefetch!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(f"workers must be a positive int, got {workers!r}")
        self.beta = beta
        self._receive = _as_batch if receive is None else receive
        self._on_close = on_close
        self._batch_size = batch_size
        self._prefetch = prefetch
        self._queue: queue.Queue[object] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        samplers = list(sample) if isinstance(sample, Sequence) else [sample] * workers
        self._threads = [threading.Thread(target=self._run, args=(fn,), daemon=True,
                                          name="mmreplay-prefetch") for fn in samplers]
        for thread in self._threads:
            thread.start()

    def _run(self, sample: SampleFn) -> None:
        while not self._stop.is_set():
            try:
                item: object = sample(self._batch_size, self.beta)
            except BaseException as exc:  # handed to the consumer, then stop
                item = exc
            if not self._put(item) or isinstance(item, BaseException):
                return

    def _put(self, item: object) -> bool:
        """Queue `item` for the consumer; False once closed.

        While the queue is full the thread polls it (sleeps of `POLL_S` doubling up to
        `POLL_MAX_S`) instead of waiting on it: a thread waiting on a full queue is woken by
        the consumer's ``get``, inside ``next()``, and wakes up wanting the GIL the consumer
        needs to return. On a loaded 2-core machine that made a learner wait ~4 ms for a
        ready batch beside a Nature-CNN step; polling, ~0.06 ms.
        """
        pause = POLL_S
        while not self._stop.is_set():
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        return False

    def __next__(self) -> Batch:
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return self._receive(item)

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
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_batch(item: object) -> Batch:
    assert isinstance(item, Batch)
    return item


class BatchPipeline(BatchPrefetcher):
    """`BatchPrefetcher` with up to `prefetch` batches fetched at once (see the module doc).

    ``draw(batch_size, beta)`` returns a plan (under the store's lock), ``fetch(plan)``
    brings its frames near (no lock; several at once), ``assemble(plan, batch_size,
    beta)`` makes the batch (under the lock). Up to `prefetch` plans are in flight and up
    to `prefetch` finished batches wait in the queue.
    """

    def __init__(self, draw: Callable[[int, float], Any], fetch: Callable[[Any], None],
                 assemble: Callable[[Any, int, float], Any], batch_size: int, *,
                 prefetch: int = 2, beta: float = 0.4, receive: Receive | None = None) -> None:
        self._draw, self._fetch, self._assemble = draw, fetch, assemble
        self._fetchers = ThreadPoolExecutor(max(1, prefetch) if isinstance(prefetch, int)
                                            else 1, thread_name_prefix="mmreplay-pipeline")
        try:
            super().__init__(self._unused, batch_size, prefetch=prefetch, beta=beta,
                             receive=receive)
        except BaseException:
            self._fetchers.shutdown(wait=False)
            raise

    def _unused(self, batch_size: int, beta: float) -> Batch:
        raise AssertionError("a pipeline draws, fetches and assembles instead")

    def _run(self, sample: SampleFn) -> None:
        flight: deque[tuple[Any, float, Future[None]]] = deque()
        try:
            while not self._stop.is_set():
                while len(flight) < self._prefetch:  # keep `prefetch` batches in flight
                    beta = self.beta
                    plan = self._draw(self._batch_size, beta)
                    flight.append((plan, beta, self._fetchers.submit(self._fetch, plan)))
                plan, beta, fetched = flight.popleft()
                fetched.result()  # a fetch that failed for good raises here
                if not self._put(self._assemble(plan, self._batch_size, beta)):
                    return
        except BaseException as exc:  # handed to the consumer, then stop
            self._put(exc)
        finally:
            self._fetchers.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the thread, drop batches not yet taken, cancel fetches not started."""
        super().close()
        self._fetchers.shutdown(wait=False, cancel_futures=True)  # the store's close waits

"""Batch production of one store: `sample`, `sample_arrays`, `batches`, sequences and `get`.

The facade (`store.py`) calls only this class for batches. It picks the path a store's
setup needs and nothing else::

    sample / sample_arrays / get      Reader (frame store)    or DeviceReader (``device=``)
    sample_sequences / get_sequences  SequenceReader          or DeviceReader
    batches                           BatchPrefetcher thread  (workers > 1: read-only views, or
                                                               reads shared by threads)
                                      BatchPipeline           (a store read from a bucket)

Every draw takes the store's lock, is refused on a closed store, and waits first on the
store's rate limiter (`admission.LimiterSlot.sampling`). The store's random generator is
`rng` here: every draw uses it, `ReplayStore.reseed` replaces it, a flush persists it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from mmreplay import validate
from mmreplay.admission import LimiterSlot
from mmreplay.device_reader import DeviceReader
from mmreplay.errors import InvalidInputError
from mmreplay.prefetch import BatchPipeline, BatchPrefetcher, Receive
from mmreplay.reader import Planned, Reader
from mmreplay.sampling_processes import SamplingProcesses
from mmreplay.sequence_reader import SequenceArrays, SequenceReader, sequence_key
from mmreplay.spec import StoreSpec
from mmreplay.storage.remote_frames import RemoteChunks, fill_on_batches
from mmreplay.torch_batch import (
    ArrayBatch,
    Batch,
    FrameSetBatch,
    SequenceBatch,
    make_batch,
    make_sequence_batch,
)

# A read-only view of the store's directory for one prefetch worker, from its seed: the
# view's batch maker and how to close the view.
OpenView = Callable[[int], tuple["BatchMaker", Callable[[], None]]]


class BatchMaker:
    """The batches of one store (see the module doc). `refuse_closed(what)` raises on a
    closed store; `open_view` (None for a writable store) opens a read-only view for a
    prefetch worker."""

    def __init__(self, spec: StoreSpec, lock: threading.RLock, reader: Reader,
                 sequences: SequenceReader, limits: LimiterSlot, device: DeviceReader | None,
                 rng: np.random.Generator, *, refuse_closed: Callable[[str], None],
                 open_view: OpenView | None) -> None:
        self.spec, self.lock, self.reader, self.sequences = spec, lock, reader, sequences
        self.limits = limits
        self.device = device  # None once the store is closed: its memory goes back
        self.rng = rng
        self.refuse_closed, self.open_view = refuse_closed, open_view
        self.prefetchers: weakref.WeakSet[BatchPrefetcher | SamplingProcesses] = \
            weakref.WeakSet()

    def stop(self) -> None:
        """Close the rate limiter (waking prefetch threads waiting on it) and every
        prefetcher; not under the store's lock (their threads may be waiting for it)."""
        self.limits.close()
        for it in list(self.prefetchers):
            it.close()

    # -- transitions ------------------------------------------------------------------
    def sample(self, batch_size: int, beta: float) -> Batch:
        """`ReplayStore.sample`: read from the frame store, or for a ``device=`` store
        planned on the CPU and gathered on its device."""
        device = self.device
        if device is None:
            return make_batch(self.sample_arrays(batch_size, beta, False))
        with self.limits.sampling(_items(batch_size)), self.lock:
            self.refuse_closed("sample")
            size, beta = validate.batch_size(batch_size), validate.beta(beta)
            return device.sample(self.rng, size, beta)

    def sample_arrays(self, batch_size: int, beta: float, pin_memory: bool,
                      out: np.ndarray | None = None) -> ArrayBatch:
        with self.limits.sampling(_items(batch_size)), self.lock:
            self.refuse_closed("sample")
            size, beta = validate.batch_size(batch_size), validate.beta(beta)
            self._check_out(out, size, pin_memory)
            return self.reader.sample(self.rng, size, beta, pin_memory=bool(pin_memory),
                                      out=out)

    def sample_frame_set(self, batch_size: int, beta: float, pin_memory: bool,
                         out: np.ndarray | None = None) -> FrameSetBatch:
        """`sample_arrays`' draw as a `FrameSetBatch`; `out` as there (room for every frame
        of the stacks: the distinct ones are its first rows)."""
        with self.limits.sampling(_items(batch_size)), self.lock:
            self.refuse_closed("sample")
            size, beta = validate.batch_size(batch_size), validate.beta(beta)
            self._check_out(out, size, pin_memory)
            return self.reader.sample_frame_set(self.rng, size, beta, pin_memory=pin_memory,
                                                out=out)

    def _check_out(self, out: np.ndarray | None, size: int, pin_memory: bool) -> None:
        """`out`, if given, holds every frame of a batch of `size` stacks
        (`validate.frames_out`)."""
        if out is not None:
            validate.frames_out(out, 2 * size * self.spec.frame_stack * self.spec.frame_bytes,
                                bool(pin_memory))

    def get(self, ids: Any) -> Batch:
        """`ReplayStore.get`; under the store's lock."""
        ids = validate.transition_ids(ids)
        return self.device.get(ids) if self.device else make_batch(self.reader.get(ids))

    # -- sequences --------------------------------------------------------------------
    def sample_sequences(self, batch_size: int, length: int, cross_episodes: bool,
                         period: int, beta: float) -> SequenceBatch:
        """`ReplayStore.sample_sequences`."""
        with self.limits.sampling(_items(batch_size) * _items(length)), self.lock:
            self.refuse_closed("sample_sequences")
            size, beta = validate.batch_size(batch_size), validate.beta(beta)
            key = sequence_key(self.spec, length, cross_episodes, period)
            if self.device is not None:
                return self.device.sample_sequences(key, self.rng, size, beta)
            return _sequence_batch(self.sequences.sample_batch(key, self.rng, size, beta))

    def get_sequences(self, length: int, cross_episodes: bool, period: int,
                      ids: Any) -> SequenceBatch:
        """`ReplayStore.get_sequences`; under the store's lock."""
        key = sequence_key(self.spec, length, cross_episodes, period)
        ids = validate.transition_ids(ids)
        if self.device is not None:
            return self.device.get_sequences(key, ids)
        return _sequence_batch(self.sequences.get(key, ids))

    # -- batches drawn ahead ----------------------------------------------------------
    def prefetcher(self, batch_size: int, prefetch: int, beta: float, pin_memory: bool,
                   device: Any, workers: int, remote: RemoteChunks | None,
                   processes: bool = False) -> BatchPrefetcher | SamplingProcesses:
        """`_prefetcher`, or with `processes` `_processes`; `stop` closes either."""
        it = (self._processes(batch_size, prefetch, beta, pin_memory, device, workers, remote)
              if processes else
              self._prefetcher(batch_size, prefetch, beta, pin_memory, device, workers, remote))
        self.prefetchers.add(it)
        return it

    def _processes(self, batch_size: int, prefetch: int, beta: float, pin_memory: bool,
                   device: Any, workers: int, remote: RemoteChunks | None
                   ) -> SamplingProcesses | BatchPrefetcher:
        """``batches(..., processes=True)``: `workers` sampling processes, each with a
        read-only view of the store's directory (`sampling_processes`); with a `device`,
        they sample frame sets, which a prefetch thread copies there (`DeviceMover`; on
        CUDA from the slots page-locked, each held until its copy is done)."""
        if self.open_view is None or remote is not None or self.device is not None:
            raise InvalidInputError(
                "batches(processes=True) needs a local store opened read-only "
                "(ReplayStore.open(path, mode='r')) with no device=; a writable store shares "
                "each read among `workers` threads instead (processes=False)")
        if pin_memory:
            raise InvalidInputError(
                "batches(processes=True, pin_memory=True): the processes' batches are in "
                "shared memory; pass device= to have them copied to a device")
        mover = None
        if device is not None:
            from mmreplay.device_batches import DeviceMover  # imports torch

            mover = DeviceMover(device)
        with self.lock:
            self.refuse_closed("batches")
            seeds = self.rng.integers(0, 1 << 63, size=max(1, _items(workers))).tolist()
        procs = SamplingProcesses(self.open_view, self.spec, batch_size, workers=workers,
                                  prefetch=prefetch, beta=beta, seeds=seeds,
                                  frame_sets=mover is not None)
        if mover is None:
            return procs

        def upload(size: int, b: float) -> Any:
            procs.beta = b
            arrays = procs.next_arrays()
            staged = mover.upload(arrays)
            if staged.event is not None:  # from a locked slot the copy is only queued
                procs.release_after(arrays, staged.event)
            return staged

        try:
            if mover.cuda:
                procs.page_lock(mover.device)
            return BatchPrefetcher(upload, batch_size, prefetch=prefetch, beta=beta,
                                   receive=mover.receive, on_close=procs.close)
        except BaseException:
            procs.close()
            raise

    def _prefetcher(self, batch_size: int, prefetch: int, beta: float, pin_memory: bool,
                    device: Any, workers: int, remote: RemoteChunks | None) -> BatchPrefetcher:
        """What `batches` iterates: a prefetch thread, or for a bucket store (`remote`) the
        pipeline; with a `device`, each batch copied there by the thread (`DeviceMover`);
        for a ``device=`` store, its own batches, gathered on its device."""
        if self.device is not None:  # handed to the consumer's stream in its thread
            _refuse_device_options(pin_memory, device, workers)
            return BatchPrefetcher(self.sample, batch_size, prefetch=prefetch, beta=beta,
                                   receive=self.device.receive)
        finish: Callable[[Any], Any] = make_batch
        receive: Receive | None = None
        if device is not None:
            from mmreplay.device_batches import DeviceMover  # imports torch

            mover = DeviceMover(device)
            finish, receive, pin_memory = mover.upload, mover.receive, mover.pin_memory
        if remote is not None:
            _refuse_bucket_options(workers, pin_memory and device is None)
            return self._pipeline(remote, batch_size, prefetch, beta, finish, receive)
        # with a device, the frame set: each distinct frame read and copied once
        draw = BatchMaker.sample_frame_set if device is not None else BatchMaker.sample_arrays
        makers, close_views = self._read_only_views(workers)
        threads = workers  # a thread a view; else one thread, whose reads `workers` share
        if not makers and isinstance(workers, int) and workers > 1:
            close_views, threads = self._shared_reads(workers), 1

        def sampler(source: BatchMaker) -> Callable[[int, float], Any]:
            return lambda size, b: finish(draw(source, size, b, pin_memory))

        try:
            return BatchPrefetcher([sampler(m) for m in makers] or sampler(self), batch_size,
                                   prefetch=prefetch, beta=beta, workers=threads,
                                   receive=receive, on_close=close_views)
        except BaseException:
            close_views()
            raise

    def _pipeline(self, remote: RemoteChunks, batch_size: int, prefetch: int, beta: float,
                  finish: Callable[[ArrayBatch], Any], receive: Receive | None) -> BatchPipeline:
        """`batches` of a store read from a bucket: up to `prefetch` batches' chunks fetched
        at once, drawn and assembled in order under the lock (`BatchPipeline`)."""
        fill_on_batches(remote)  # ``cache_fill=None``: the filler, if the store fits the cache

        def draw(size: int, b: float) -> Planned:
            with self.lock:
                self.refuse_closed("batches")
                return self.reader.plan(self.rng, size, b)

        def assemble(planned: Planned, size: int, b: float) -> Any:
            with self.lock:
                self.refuse_closed("batches")
                arrays = self.reader.assemble(planned, self.rng, size, b)
            return finish(arrays)

        return BatchPipeline(draw, lambda planned: remote.prefetch(planned.chunks), assemble,
                             batch_size, prefetch=prefetch, beta=beta, receive=receive)

    def _shared_reads(self, workers: int) -> Callable[[], None]:
        """For `workers` threads sampling a writable store: every read of its frames shared
        among them (`FrameReader.use_threads`), and how to stop that. One prefetch thread
        draws under the lock; a second one only waited for the lock (on 2 cores, batch 256:
        673 batches/s with one, 603 with two; one worker 459-473)."""
        with self.lock:
            self.refuse_closed("batches")
            release = self.reader.frames.reader.use_threads(workers)

        def stop() -> None:
            with self.lock:
                release()

        return stop

    def _read_only_views(self, workers: int
                         ) -> tuple[list[BatchMaker], Callable[[], None]]:
        """For `workers` threads sampling a read-only store: one read-only view of its
        directory each (its own lock, index and RNG, seeded from the store's; no frame
        cache: the views share the OS page cache), so their compiled reads run at once, and
        how to close them all. None for one worker or a writable store (a view sees only
        what the writer committed)."""
        if not isinstance(workers, int) or workers <= 1 or self.open_view is None:
            return [], _nothing  # (`BatchPrefetcher` refuses a bad `workers`)
        with self.lock:
            seeds = self.rng.integers(0, 1 << 63, size=workers).tolist()
        closers: list[Callable[[], None]] = []
        makers: list[BatchMaker] = []
        try:
            for seed in seeds:
                maker, close = self.open_view(seed)
                makers.append(maker)
                closers.append(close)
        except BaseException:
            _call_all(closers)
            raise
        return makers, functools.partial(_call_all, closers)


def _refuse_device_options(pin_memory: bool, device: Any, workers: int) -> None:
    """A ``device=`` store gathers its batches on its device: copying options do not apply."""
    if pin_memory or device is not None or workers != 1:
        raise InvalidInputError(
            f"batches(pin_memory={pin_memory!r}, device={device!r}, workers={workers!r}): "
            f"this store keeps its frames on its device and gathers batches there; expected "
            f"the defaults (pin_memory=False, device=None, workers=1)")


def _refuse_bucket_options(workers: int, pin_memory: bool) -> None:
    """A bucket store's pipeline fetches `prefetch` batches at once into pageable memory."""
    if workers != 1:
        raise InvalidInputError(f"batches(workers={workers!r}) is for local stores; a "
                                f"bucket store's pipeline fetches `prefetch` batches at once")
    if pin_memory:
        raise InvalidInputError("batches(pin_memory=True) is for local stores; a bucket "
                                "store's pipeline assembles into pageable memory")


def _call_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


def _nothing() -> None:
    """Closing no views."""


def _items(value: Any) -> int:
    """A count the rate limiter can take (0 for what the argument checks will refuse)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _sequence_batch(arrays: SequenceArrays) -> SequenceBatch:
    win = arrays.windows
    return make_sequence_batch(
        obs=arrays.obs, next_obs=arrays.next_obs, action=win.action, reward=win.reward,
        terminated=win.terminated, truncated=win.truncated, is_first=win.is_first,
        mask=win.mask, ids=win.ids, weights=arrays.weights, extras=win.extras)

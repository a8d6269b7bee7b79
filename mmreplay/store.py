"""`ReplayStore`: the public facade — create/open, record, sample, flush. Orchestration only.

Directory layout (a zarr v3 group; see README "On-disk format")::

    <root>/zarr.json                 zarr group
    <root>/frames/...                every frame once (`frame_store`)
    <root>/manifest.json             commit point (`manifest`)
    <root>/steps/bNNNNNN.gGGGGGGGG.npy   step-column blocks, copy-on-write per generation
    <root>/tail/tail.gGGGGGGGG.npy       the unfinished frame chunk of every env
    <root>/tmp/                      temp files of in-flight atomic writes
    <root>/lock                      flock'ed by the one writer

Index arithmetic lives in `ring`, frame bytes in `frame_store`, sampling
policy in `samplers`, commits and loading in `commit`, open-time checks in
`manifest`/`layout`/`safe_io`, torch conversion in `torch_batch`. The store's own
collaborators: `recorder` (reset/add), `reader` (transition reads beside a writer),
`sequence_reader` (the sequence API), `priorities` (the priority column); opening in
`opening`; with ``device=``, `device_reader` (every kept frame once in a device's memory).

Tools read a store through its public methods and its read-only views (``store.views``,
see `views`) only.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from mmreplay import lifecycle, validate
from mmreplay.device_frames import check_fits
from mmreplay.device_reader import DeviceReader, open_device
from mmreplay.errors import ClosedStoreError, InvalidInputError, ReadOnlyError
from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import make_sampler
from mmreplay.index.sequences import sequence_priority
from mmreplay.mirror import Mirror
from mmreplay.opening import open_store
from mmreplay.prefetch import BatchPipeline, BatchPrefetcher, Receive
from mmreplay.priorities import Priorities
from mmreplay.rate_limit import LimiterSlot, RateLimiter, steps_in_call
from mmreplay.reader import Planned, Reader
from mmreplay.recorder import Recorder, StepRows
from mmreplay.remote import BucketMethods
from mmreplay.sequence_reader import SequenceArrays, SequenceReader, sequence_key
from mmreplay.spec import StoreSpec, make_spec
from mmreplay.storage.commit import Committer, release_lock, rng_from_state, take_lock
from mmreplay.storage.frame_store import FrameStore, create_frames_array
from mmreplay.storage.layout import store_dictionary
from mmreplay.storage.manifest import MAX_RAM_BYTES
from mmreplay.storage.remote_frames import RemoteChunks, fill_on_batches
from mmreplay.storage.safe_io import TMP_DIR
from mmreplay.storage.zstd_dict import parse_dictionary
from mmreplay.torch_batch import (
    ArrayBatch,
    Batch,
    FrameSetBatch,
    SequenceBatch,
    make_batch,
    make_sequence_batch,
)
from mmreplay.validate import CacheBytes
from mmreplay.views import StoreViews

F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run `method` under the store's lock (a prefetch thread may sample concurrently)."""

    @functools.wraps(method)
    def wrapper(self: ReplayStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(F, wrapper)


def _reading(method: F) -> F:
    """`_locked`, and refused on a closed store (`ClosedStoreError`), not answered from RAM."""

    @functools.wraps(method)
    def wrapper(self: ReplayStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            _refuse_closed(self, method.__name__)
            return method(self, *args, **kwargs)

    return cast(F, wrapper)


def _refuse_closed(store: ReplayStore, what: str) -> None:
    if store.closed:
        raise ClosedStoreError(f"{what} on a closed store ({store.path}): open it again with "
                               f"ReplayStore.open")


def _check_writable(store: ReplayStore, what: str) -> None:
    _refuse_closed(store, what)
    if not store.writable:
        raise ReadOnlyError(f"{what} on a store opened read-only (mode='r')")


@dataclass(frozen=True)
class StoreCounts:
    """Totals since creation (written, transitions, episodes) and what is kept now."""

    frames_written: int
    frames_kept: int
    transitions: int
    episodes: int
    sampleable: int


class ReplayStore(BucketMethods):
    """A disk-backed replay memory that keeps every frame once (see README)."""

    # -- construction -------------------------------------------------------------
    def __init__(self, root: Path, spec: StoreSpec, *, writable: bool, durable: bool,
                 cache_bytes: CacheBytes, lock_fd: int | None, remote: RemoteChunks | None = None,
                 manifest: dict[str, Any] | None = None, device: Any = None) -> None:
        """Use `create` or `open`. With `manifest` (checked), load the store it commits."""
        self.path, self.spec, self.writable, self.durable = root, spec, writable, durable
        self._lock_fd: int | None = None
        self._ring = StepRing(spec)
        self._commits = Committer(root, spec, durable=durable)
        self._frames = _frame_store(root, spec, writable, durable, cache_bytes,
                                    functools.partial(self._commits.give_up_chunks, self._ring),
                                    remote, manifest)
        self._sampler = make_sampler(spec)
        self._recorder = Recorder(spec, self._ring, self._frames)
        self._reader = Reader(root, self._ring, self._frames, self._sampler, writable=writable)
        self._priorities = Priorities(spec, self._sampler, self._ring)
        self._sequences = _sequence_reader(spec, self._reader, self._priorities)
        self._lock = threading.RLock()
        self.views = StoreViews(self._lock, self._reader, self._priorities, self._sequences)
        self._prefetchers: weakref.WeakSet[BatchPrefetcher] = weakref.WeakSet()
        self._limits = LimiterSlot()
        self._closed = False
        rng = _start(manifest, writable, self._commits, self._ring, self._frames,
                     self._priorities, self._reader)
        self._rng = np.random.default_rng() if rng is None else rng
        self._lock_fd = lock_fd
        self._device = _open_device(device, spec, self._reader, self._sequences, self._recorder,
                                    self._commits)

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, capacity: int, obs_shape: Any,
               obs_dtype: Any = np.uint8, num_envs: int = 1, frame_stack: int = 1,
               n_step: int = 1, gamma: float = 0.99, stack_padding: str = "zero",
               action_shape: Any = (), action_dtype: Any = np.int64, seed: int | None = None,
               durable: bool = False, cache_bytes: int | str | None = None, extras: Any = None,
               mirror: str | None = None, storage_options: dict[str, str] | None = None,
               rate_limiter: RateLimiter | None = None, device: Any = None,
               **options: Any) -> ReplayStore:
        """Create a new, empty store at `path` (which must not exist or be empty).

        `extras` declares per-step columns ``{name: (shape, dtype)}`` that every ``add`` takes
        and every batch returns. `mirror` (a URL) pushes every flush there in the background,
        with `storage_options` where the AWS variables do not say (docs/object-storage.md).
        `rate_limiter`: see `set_rate_limiter`. ``codec="zstd-dict"`` takes ``dictionary=``
        (docs/compression.md). ``cache_bytes="all"`` keeps every frame decoded in RAM.
        ``device="cuda"``: every frame once in GPU memory too (docs/guides/device_frames.md).
        """
        dictionary = options.pop("dictionary", None)
        spec = make_spec(capacity=capacity, obs_shape=obs_shape, obs_dtype=obs_dtype,
                         num_envs=num_envs, frame_stack=frame_stack, n_step=n_step, gamma=gamma,
                         stack_padding=stack_padding, action_shape=action_shape,
                         action_dtype=action_dtype, extras=extras, **options)
        store = _create(cls, Path(path), spec, durable, validate.cache_bytes(cache_bytes),
                        dictionary, seed=seed, rate_limiter=rate_limiter, device=device)
        return lifecycle.track(store).attach_mirror(mirror, storage_options, False)

    @classmethod
    def open(cls, path: str | os.PathLike[str], mode: str = "r+", *, durable: bool = False,
             cache_bytes: int | str | None = None, max_ram_bytes: int = MAX_RAM_BYTES,
             mirror: str | None = None, storage_options: dict[str, str] | None = None,
             cache_dir: str | os.PathLike[str] | None = None, take_over: bool = False,
             rate_limiter: RateLimiter | None = None, local: Any = None, cache_fill: Any = None,
             device: Any = None) -> Any:
        """Open an existing store: ``mode="r+"`` to write, ``"r"`` read-only.

        The directory is untrusted: every file is checked (see `manifest`) before anything is
        allocated; a spec (or ``cache_bytes="all"``) needing more than `max_ram_bytes` is refused.

        A URL `path` (``s3://...``) opens read-only, chunks fetched into `cache_dir` (at most
        `cache_bytes`, whole files in the background: `cache_fill`); `mirror` as in `create`;
        ``mode="r+"`` with `local` pulls it there and mirrors back (docs/object-storage.md).
        `device` as in `create` (a local store only): its kept frames are decoded there now.
        """
        return open_store(cls, path, mode, durable=durable, cache_bytes=cache_bytes,
                          max_ram_bytes=max_ram_bytes, mirror=mirror,
                          storage_options=storage_options, cache_dir=cache_dir,
                          take_over=take_over, rate_limiter=rate_limiter, local=local,
                          cache_fill=cache_fill, device=device)

    # -- recording ----------------------------------------------------------------
    @_locked
    def reset(self, obs: Any, env_ids: Any = None) -> None:
        """Write o_0 of a new episode for all envs, or for the listed `env_ids`.

        A running episode in a listed env ends as truncated at its last step.
        """
        _check_writable(self, "reset")
        self._recorder.reset(obs, env_ids)

    def add(self, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            autoreset: Any = None, env_ids: Any = None, *, extras: Any = None) -> None:
        """Record one step of every env, or of the listed `env_ids` (each once; every argument
        then has a leading ``len(env_ids)`` dimension, the other envs wait). Autoreset rule:
        README. `extras` (``{name: array}``, the declared ones) belong to this step, like
        `action`. With a rate limiter, waits first until the learners let these steps in."""
        limits, steps = self._limits, self.spec.num_envs  # the hot path: no calls
        if limits.limiter is not None and (env_ids is not None or autoreset is not None):
            steps = _steps(steps, env_ids, autoreset)  # fewer steps than envs
        with self._lock:
            lease = limits.lease  # the rate limiter's lease (`mmreplay.admission`)
            if lease is None:  # no rate limiter
                _check_writable(self, "add")
                self._recorder.add(action, reward, next_obs, terminated, truncated,
                                   autoreset, env_ids, extras)
                return
            lease.busy = True
            if lease.used + steps <= lease.limit:  # admitted without the limiter's lock
                try:
                    _check_writable(self, "add")
                    self._recorder.add(action, reward, next_obs, terminated, truncated,
                                       autoreset, env_ids, extras)
                    lease.used += steps  # counted once recorded: a refused add never is
                finally:
                    lease.busy = False
                if lease.wake:  # someone waits on the limiter
                    limits.limiter.settle()
                return
            lease.busy = False  # spent or revoked: the limiter's lock decides
            limiter = limits.limiter  # held with the lease (both set under this lock)
        step = (action, reward, next_obs, terminated, truncated, autoreset, env_ids, extras)
        _add_waited(self, limiter, steps, step)

    @_locked
    def add_rows(self, rows: StepRows) -> None:
        """Record many ``add`` calls at once: row ``t`` of every array in `rows` is one
        ``add(..., env_ids=rows.env_ids)``. Every row is checked (shapes, dtypes, values,
        episode order) before the first is recorded, so a bad block changes nothing."""
        _check_writable(self, "add")
        self._recorder.add_rows(rows)

    # -- rate limiting ------------------------------------------------------------
    def set_rate_limiter(self, limiter: RateLimiter | None) -> None:
        """Make `add` (and blocks of steps) wait on `limiter`'s inserts and `sample`, `batches`,
        `sample_sequences` on its samples; None removes it. The limiter takes the counters this
        store committed (so a resumed run keeps its ratio) and counts this store's steps as inserts;
        every flush commits its counters (``mmreplay info`` shows them). Only a writable store takes
        one, and `close` closes it (waiters wake with `RateLimiterClosedError`)."""
        _set_rate_limiter(self, limiter)

    @property
    def rate_limiter(self) -> RateLimiter | None:
        """The rate limiter in use, if any (see `set_rate_limiter`)."""
        return self._limits.limiter

    def rate_limiter_state(self) -> dict[str, Any] | None:
        """The limiter's counters: live if one is attached, else as last committed."""
        return self._limits.state(self._commits.committed.get("rate_limiter"))

    # -- reading ------------------------------------------------------------------
    def sample(self, batch_size: int, beta: float = 0.4) -> Batch:
        """`batch_size` sampleable transitions, with replacement. Uniform by default; with
        ``sampler="prioritized"``/``"rank"`` the draw follows the priorities and
        ``batch.weights`` are importance weights with exponent `beta`. With a rate limiter,
        waits first until the writers let `batch_size` samples out."""
        return _sample(self, batch_size, beta)

    def sample_arrays(self, batch_size: int, beta: float = 0.4, *,
                      pin_memory: bool = False) -> ArrayBatch:
        """`sample` as numpy arrays (see docs/guides/performance.md: reuse, `pin_memory`)."""
        return _sample_arrays(self, batch_size, beta, pin_memory)

    def batches(self, batch_size: int, *, prefetch: int = 2, beta: float = 0.4,
                pin_memory: bool = False, device: Any = None, workers: int = 1
                ) -> BatchPrefetcher:
        """An endless iterator of ``sample(batch_size, beta)`` batches drawn ahead.

        A thread keeps `prefetch` batches ready (a bucket store: `prefetch` more in flight,
        fetched at once), overlapping the learner's work. Set ``it.beta`` to anneal. Draws
        happen in order when the thread makes them, so with concurrent ``add`` calls the
        sequence depends on timing (use plain ``sample`` where bit-exact replays matter).
        ``pin_memory``, ``device``, ``workers``: see docs/guides/gpu.md."""
        _refuse_closed(self, "batches")
        validate.batch_size(batch_size), validate.beta(beta)
        it = _prefetcher(self, batch_size, prefetch, beta, pin_memory, device, workers)
        self._prefetchers.add(it)
        return it

    @_locked
    def update_priorities(self, ids: Any, priorities: Any, *, late: bool | None = None
                          ) -> int | None:
        """Set new priorities (e.g. |TD error|) for sampled ids; returns how many applied.
        Ids not sampleable are ignored, the last value of a duplicate wins; NaN, inf or
        negative priorities raise and change nothing. CUDA tensors (or ``late=True``): queued,
        None returned, applied by later draws (docs/guides/device_frames.md "Late priority")."""
        _check_writable(self, "update_priorities")
        self._reader.refresh()
        return self._priorities.update(ids, priorities, late)

    @_reading
    def get(self, ids: Any) -> Batch:
        """The transitions with these ids; raises `UnknownIdError` if any is not sampleable."""
        ids = validate.transition_ids(ids)
        return self._device.get(ids) if self._device else make_batch(self._reader.get(ids))

    def sample_sequences(self, batch_size: int, length: int, *, cross_episodes: bool = False,
                         period: int = 1, beta: float = 0.4) -> SequenceBatch:
        """`batch_size` sequences of `length` consecutive steps of one env, with replacement,
        uniform over valid starts (or by priority in prioritized stores).

        ``cross_episodes=False`` (R2D2): a sequence stays in one episode, padded and masked
        past its end; starts at episode positions divisible by `period`. ``True``
        (DreamerV3): `length` consecutive steps of the env, ``is_first`` marking each new
        episode, never padded. See README "Sequences". With a rate limiter, waits first
        until the writers let ``batch_size * length`` samples (steps) out.
        """
        return _sample_sequences(self, batch_size, length, cross_episodes, period, beta)

    @_reading
    def get_sequences(self, ids: Any, length: int, *, cross_episodes: bool = False,
                      period: int = 1) -> SequenceBatch:
        """The sequences starting at these transition ids (each a valid start, see
        `sequence_starts`), with weights 1; raises `UnknownIdError` otherwise."""
        key = sequence_key(self.spec, length, cross_episodes, period)
        if self._device is not None:
            return self._device.get_sequences(key, validate.transition_ids(ids))
        return _sequence_batch(self._sequences.get(key, validate.transition_ids(ids)))

    @_locked
    def sequence_starts(self, length: int, *, cross_episodes: bool = False,
                        period: int = 1) -> np.ndarray:
        """The transition ids of every valid sequence start, increasing."""
        key = sequence_key(self.spec, length, cross_episodes, period)
        return self._sequences.start_ids(key)

    @_locked
    def update_sequence_priorities(self, ids: Any, td_errors: Any, *, eta: float = 0.9) -> int:
        """New priorities of sampled sequences from their per-step TD errors; returns how
        many sequences were applied.

        `ids` are a `SequenceBatch`'s ``(B, T)`` ids (-1 on padding, ignored) and
        `td_errors` the ``(B, T)`` TD errors of those steps. A sequence's priority is
        R2D2's ``eta * max|d| + (1 - eta) * mean|d|`` over its real steps; it is the
        priority of its start step in the store's priority column (persisted with it).
        Sequences whose start is no longer a valid start are ignored; for duplicate starts
        the last value wins; NaN or inf TD errors raise and change nothing.
        """
        _check_writable(self, "update_sequence_priorities")
        return _set_sequence_priorities(self, ids, td_errors, eta)

    @_locked
    def valid_ids(self) -> np.ndarray:
        """Every sampleable transition id, increasing."""
        self._reader.refresh()
        return self._reader.ids(self._ring.valid_flat())

    @_locked
    def __len__(self) -> int:
        self._reader.refresh()
        return self._sampler.count()

    @property
    @_locked
    def counts(self) -> StoreCounts:
        """How much the store has seen and holds now."""
        return _counts(self._ring, len(self))

    # -- for tools, besides the read-only `views` --------------------------------------
    @_locked
    def reseed(self, seed: int | None) -> None:
        """Restart the store's random generator from `seed` (saved by the next flush)."""
        self._rng = np.random.default_rng(seed)

    @property
    def format_version(self) -> int:
        """On-disk format version of the committed manifest."""
        return int(self._commits.committed["format_version"])

    # -- persistence --------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Number of the last committed manifest."""
        return self._commits.generation

    def flush(self, *, wait_mirror: bool = False) -> None:
        """Commit what changed since the last flush; a mirror pushes it (`wait_mirror`: now)."""
        _flush(self, wait_mirror)

    def close(self) -> None:
        """Stop prefetchers, flush (if writable) and release the writer lock. Idempotent."""
        _close(self)

    @property
    def closed(self) -> bool:
        """True once `close` ran: every later read or write raises `ClosedStoreError`."""
        return self._closed

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ReplayStore({str(self.path)!r}, capacity={self.spec.capacity}, "
                f"num_envs={self.spec.num_envs}, sampleable={len(self)})")


def _frame_store(root: Path, spec: StoreSpec, writable: bool, durable: bool,
                 cache_bytes: CacheBytes, before_chunk_write: Callable[..., Any],
                 remote: RemoteChunks | None, manifest: dict[str, Any] | None) -> FrameStore:
    return FrameStore(root, spec, writable=writable, durable=durable,
                      cache_bytes=validate.cache_budget(spec, cache_bytes),
                      before_chunk_write=before_chunk_write,
                      fetch=None if remote is None else remote.ensure,
                      dictionary=None if manifest is None else store_dictionary(root, manifest))


def _sequence_reader(spec: StoreSpec, reader: Reader, priorities: Priorities) -> SequenceReader:
    """The sequence API's index, told of every priority change (prioritized stores)."""
    sequences = SequenceReader(reader, lambda: make_sampler(spec),
                               None if spec.sampler == "uniform" else priorities.of_starts)
    priorities.listeners.append(sequences.set_priorities)
    reader.before_draw = priorities.at_draw  # late priority updates, applied by draws
    return sequences


def _create(cls: type[ReplayStore], root: Path, spec: StoreSpec, durable: bool,
            cache_bytes: CacheBytes, dictionary: Any = None, *, seed: int | None = None,
            rate_limiter: RateLimiter | None = None, device: Any = None) -> ReplayStore:
    """A new store's files at `root` (absent or an empty directory), opened for writing,
    seeded and flushed; a "zstd-dict" store takes `dictionary` (bytes) if given. A
    `device` too small for its frames is refused before any file is made."""
    if dictionary is not None:
        dictionary = parse_dictionary(spec.codec, dictionary)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise InvalidInputError(f"{root} already exists and is not an empty directory")
    if device is not None:
        check_fits(spec, device)
    create_frames_array(root, spec)
    store = cls(root, spec, writable=True, durable=durable, cache_bytes=cache_bytes,
                lock_fd=take_lock(root), device=device)
    if dictionary is not None:
        store._frames.set_dictionary(dictionary)
    store.reseed(seed)
    store.set_rate_limiter(rate_limiter)
    store.flush()
    return store


def _set_sequence_priorities(store: ReplayStore, ids: Any, td_errors: Any, eta: float) -> int:
    rows, errors = validate.sequence_priorities(ids, td_errors)
    eta = validate.unit_interval("eta", eta)
    store._priorities.require("update_sequence_priorities", ("prioritized",))
    flat, found = store._sequences.starts_of(rows[:, 0])
    values = sequence_priority(rows, errors, eta)
    return store._priorities.set(flat[found], values[found])


def _commit(store: ReplayStore) -> None:
    """One generation: frames on disk first, then steps, priorities, RNG and limiter counters
    named by a new manifest (`Committer.commit`). Under the store's lock."""
    store._reader.refresh()  # new transitions get their priorities before they are saved
    if store.durable:
        store._frames.sync()
    else:
        store._frames.drain()  # the manifest may only name chunks that are on disk
    store._commits.commit(store._ring, store._frames.tail_frames(),
                          store._rng.bit_generator.state, **store._priorities.commit_fields(),
                          rate_limiter=store.rate_limiter_state(),
                          dictionary=store._frames.dictionary_record())
    store._ring.dirty_blocks.clear()
    store._priorities.dirty.clear()


def _counts(ring: StepRing, sampleable: int) -> StoreCounts:
    return StoreCounts(frames_written=int(ring.written.sum()),
                       frames_kept=int((ring.written - ring.oldest).sum()),
                       transitions=ring.next_id, episodes=ring.next_episode,
                       sampleable=sampleable)


def _flush(store: ReplayStore, wait_mirror: bool) -> None:
    with store._lock:
        _check_writable(store, "flush")
        _commit(store)
    if store.mirror is not None:
        store.mirror.notify(store.generation, wait=wait_mirror)
    store._priorities.report_late()  # a late update dropped at this commit


def _close(store: ReplayStore) -> None:
    store._limits.close()  # wakes prefetch threads waiting on it
    for it in list(store._prefetchers):
        it.close()  # before taking the lock: their threads may be waiting for it
    with store._lock:
        if store._closed:
            return
        try:
            if store.writable:
                store.flush()
        finally:
            store._closed = True
            store._device = None  # its memory goes back to the device
            lock_fd, store._lock_fd = store._lock_fd, None
            _close_parts(store._frames, store._commits, lock_fd, store.remote, store.mirror)


def _pipeline(store: ReplayStore, batch_size: int, prefetch: int, beta: float,
              finish: Callable[[ArrayBatch], Any], receive: Receive | None) -> BatchPipeline:
    """`batches` of a store read from a bucket: up to `prefetch` batches' chunks fetched at
    once, drawn and assembled in order under the lock (`BatchPipeline`)."""
    remote = store.remote
    assert remote is not None
    fill_on_batches(remote)  # ``cache_fill=None``: the filler, if the store fits the cache

    def draw(size: int, b: float) -> Planned:
        with store._lock:
            _refuse_closed(store, "batches")
            return store._reader.plan(store._rng, size, b)

    def assemble(planned: Planned, size: int, b: float) -> Any:
        with store._lock:
            _refuse_closed(store, "batches")
            arrays = store._reader.assemble(planned, store._rng, size, b)
        return finish(arrays)

    return BatchPipeline(draw, lambda planned: remote.prefetch(planned.chunks), assemble,
                         batch_size, prefetch=prefetch, beta=beta, receive=receive)


def _prefetcher(store: ReplayStore, batch_size: int, prefetch: int, beta: float,
                pin_memory: bool, device: Any, workers: int) -> BatchPrefetcher:
    """What `batches` iterates: a prefetch thread, or for a bucket store the pipeline;
    with a `device`, each batch copied there by the thread (`DeviceMover`); for a ``device=``
    store, its own batches, gathered on its device."""
    if store._device is not None:
        _refuse_device_options(pin_memory, device, workers)
        return BatchPrefetcher(store.sample, batch_size, prefetch=prefetch, beta=beta)
    finish: Callable[[Any], Any] = make_batch
    receive: Receive | None = None
    if device is not None:
        from mmreplay.device_batches import DeviceMover  # imports torch

        mover = DeviceMover(device)
        finish, receive, pin_memory = mover.upload, mover.receive, mover.pin_memory
    if store.remote is not None:
        if workers != 1:
            raise InvalidInputError(f"batches(workers={workers!r}) is for local stores; a "
                                    f"bucket store's pipeline fetches `prefetch` batches at once")
        if pin_memory and device is None:
            raise InvalidInputError("batches(pin_memory=True) is for local stores; a bucket "
                                    "store's pipeline assembles into pageable memory")
        return _pipeline(store, batch_size, prefetch, beta, finish, receive)

    draw = _sample_frame_set if device is not None else _sample_arrays  # frame set: each
    views = _read_only_views(store, workers)  # distinct frame read and copied once

    def sampler(source: ReplayStore) -> Callable[[int, float], Any]:
        return lambda size, b: finish(draw(source, size, b, pin_memory))

    try:
        return BatchPrefetcher([sampler(view) for view in views] or sampler(store), batch_size,
                               prefetch=prefetch, beta=beta, workers=workers, receive=receive,
                               on_close=functools.partial(_close_all, views))
    except BaseException:
        _close_all(views)
        raise


def _refuse_device_options(pin_memory: bool, device: Any, workers: int) -> None:
    """A ``device=`` store gathers its batches on its device: copying options do not apply."""
    if pin_memory or device is not None or workers != 1:
        raise InvalidInputError(
            f"batches(pin_memory={pin_memory!r}, device={device!r}, workers={workers!r}): "
            f"this store keeps its frames on its device and gathers batches there; expected "
            f"the defaults (pin_memory=False, device=None, workers=1)")


def _close_all(stores: list[ReplayStore]) -> None:
    for each in stores:
        each.close()


def _read_only_views(store: ReplayStore, workers: int) -> list[ReplayStore]:
    """For `workers` threads sampling a read-only store: one read-only view of its directory
    each (its own lock, index and RNG, seeded from the store's; no frame cache: the views
    share the OS page cache), so their compiled reads run at once. None for one worker or a
    writable store (a view sees only what the writer committed)."""
    if not isinstance(workers, int) or workers <= 1 or store.writable:
        return []  # (`BatchPrefetcher` refuses a bad `workers`)
    with store._lock:
        seeds = store._rng.integers(0, 1 << 63, size=workers).tolist()
    views: list[ReplayStore] = []
    try:
        for seed in seeds:
            views.append(ReplayStore.open(store.path, mode="r", cache_bytes=0))
            views[-1].reseed(seed)
    except BaseException:
        for view in views:
            view.close()
        raise
    return views


def _sample(store: ReplayStore, batch_size: int, beta: float) -> Batch:
    """`sample`: read from the frame store, or for a ``device=`` store planned on the CPU
    and gathered on its device."""
    device = store._device
    if device is None:
        return make_batch(_sample_arrays(store, batch_size, beta, False))
    with store._limits.sampling(_items(batch_size)), store._lock:
        _refuse_closed(store, "sample")
        size, beta = validate.batch_size(batch_size), validate.beta(beta)
        return device.sample(store._rng, size, beta)


def _sample_arrays(store: ReplayStore, batch_size: int, beta: float,
                   pin_memory: bool) -> ArrayBatch:
    with store._limits.sampling(_items(batch_size)), store._lock:
        _refuse_closed(store, "sample")
        size, beta = validate.batch_size(batch_size), validate.beta(beta)
        return store._reader.sample(store._rng, size, beta, pin_memory=bool(pin_memory))


def _sample_frame_set(store: ReplayStore, batch_size: int, beta: float,
                      pin_memory: bool) -> FrameSetBatch:
    with store._limits.sampling(_items(batch_size)), store._lock:
        _refuse_closed(store, "sample")
        size, beta = validate.batch_size(batch_size), validate.beta(beta)
        return store._reader.sample_frame_set(store._rng, size, beta, pin_memory=pin_memory)


def _steps(num_envs: int, env_ids: Any, autoreset: Any) -> int:
    """How many steps one `add` brings (what the rate limiter counts as inserts, and what
    `cancel_insert` takes back if the add is refused): its env rows less autoreset rows."""
    return steps_in_call(num_envs if env_ids is None else int(np.size(env_ids)), autoreset)


def _add_waited(store: ReplayStore, limiter: RateLimiter, steps: int,
                step: tuple[Any, ...]) -> None:
    """`add` once `limiter` let these steps in under its lock (counted there, taken back
    if the store refuses them); the store holds a new lease from then on."""
    limiter.await_insert(steps)
    try:
        lease = limiter.lease(store.spec.num_envs)
        with store._lock:
            store._limits.hold(limiter, lease)
            _check_writable(store, "add")
            store._recorder.add(*step)
    except BaseException:
        limiter.cancel_insert(steps)  # refused: these steps were never inserts
        raise


def _set_rate_limiter(store: ReplayStore, limiter: RateLimiter | None) -> None:
    if limiter is not None:
        _check_writable(store, "set_rate_limiter")
    with store._lock:
        store._limits.attach(limiter, store._commits.committed.get("rate_limiter"),
                             inserts=store._ring.next_id, capacity=store.spec.capacity)


def _sample_sequences(store: ReplayStore, batch_size: int, length: int, cross_episodes: bool,
                      period: int, beta: float) -> SequenceBatch:
    with store._limits.sampling(_items(batch_size) * _items(length)), store._lock:
        _refuse_closed(store, "sample_sequences")
        size, beta = validate.batch_size(batch_size), validate.beta(beta)
        key = sequence_key(store.spec, length, cross_episodes, period)
        if store._device is not None:
            return store._device.sample_sequences(key, store._rng, size, beta)
        return _sequence_batch(store._sequences.sample_batch(key, store._rng, size, beta))


def _items(value: Any) -> int:
    """A count the rate limiter can take (0 for what the argument checks will refuse)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _sequence_batch(arrays: SequenceArrays) -> SequenceBatch:
    win = arrays.windows
    return make_sequence_batch(
        obs=arrays.obs, next_obs=arrays.next_obs, action=win.action, reward=win.reward,
        terminated=win.terminated, truncated=win.truncated, is_first=win.is_first,
        mask=win.mask, ids=win.ids, weights=arrays.weights, extras=win.extras)


def _start(manifest: dict[str, Any] | None, writable: bool, commits: Committer,
           ring: StepRing, frames: FrameStore, priorities: Priorities,
           reader: Reader) -> np.random.Generator | None:
    """Load `manifest` (if any; returns its RNG); a writer then opens the readers lock and
    sweeps. On failure, closes what the store opened."""
    try:
        rng = None if manifest is None else _load(manifest, commits, ring, frames, priorities,
                                                  reader)
        if writable:
            (commits.root / TMP_DIR).mkdir(exist_ok=True)
            commits.open_readers()
            if manifest is not None:
                commits.sweep()
        return rng
    except BaseException:
        _close_parts(frames, commits)
        raise


def _open_device(device: Any, spec: StoreSpec, reader: Reader, sequences: SequenceReader,
                 recorder: Recorder, commits: Committer) -> DeviceReader | None:
    """`open_device` (None without a `device`); on failure, closes what the store opened."""
    try:
        return open_device(device, spec, reader, sequences, recorder)
    except BaseException:
        _close_parts(reader.frames, commits)
        raise


def _close_parts(frames: FrameStore, commits: Committer, lock_fd: int | None = None,
                 remote: RemoteChunks | None = None, mirror: Mirror | None = None) -> None:
    """Close the mirror (pushing the last generation), the frame store, the committer (it
    may fail to delete retired files: they are swept later), the writer lock and a bucket
    store's cache, whatever the one before raised."""
    try:
        if mirror is not None:
            mirror.close()
    finally:
        _close_files(frames, commits, lock_fd, remote)


def _close_files(frames: FrameStore, commits: Committer, lock_fd: int | None,
                 remote: RemoteChunks | None) -> None:
    try:
        frames.close()
    finally:
        try:
            commits.close()
        finally:
            if lock_fd is not None:
                release_lock(lock_fd)
            if remote is not None:  # a store read from a bucket: its cache goes
                remote.close()
                shutil.rmtree(commits.root, ignore_errors=True)


def _load(manifest: dict[str, Any], commits: Committer, ring: StepRing, frames: FrameStore,
          priorities: Priorities, reader: Reader) -> np.random.Generator:
    """Fill the RAM parts from a manifest that passed `check_manifest`; returns the RNG."""
    commits.load_ring(manifest, ring)
    tail = commits.load_tail(manifest, frames.tail)
    frames.load_tail(tail, ring.written % ring.slots_per_env)
    sampler = priorities.sampler
    if sampler is None:
        reader.update_all_slots()
    else:
        sampler.load(commits.load_priorities(manifest), ring.steps["id"].reshape(-1),
                     float(manifest["max_priority"]), ring.valid)
    commits.committed = manifest
    return rng_from_state(manifest["rng"])

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
collaborators: `recorder` (reset/add), `batching` (every batch: sample, batches, sequences,
get), `reader` (transition reads beside a writer), `sequence_reader` (the sequence API),
`priorities` (the priority column), `admission` (a rate limiter's admission of each add and
sample), `persistence` (load, commit, close); opening in `opening`; with ``device=``,
`device_reader` (every kept frame once in a device's memory).

Tools read a store through its public methods and its read-only views (``store.views``,
see `views`) only.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from mmreplay import lifecycle, validate
from mmreplay.admission import LimiterSlot
from mmreplay.batching import BatchMaker
from mmreplay.device_frames import check_fits
from mmreplay.errors import ClosedStoreError, InvalidInputError, ReadOnlyError
from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import make_sampler
from mmreplay.opening import open_store
from mmreplay.persistence import StoreFiles
from mmreplay.prefetch import BatchPrefetcher
from mmreplay.priorities import Priorities
from mmreplay.rate_limit import RateLimiter
from mmreplay.reader import Reader
from mmreplay.recorder import Recorder, StepRows
from mmreplay.remote import BucketMethods
from mmreplay.sampling_processes import SamplingProcesses
from mmreplay.sequence_reader import SequenceReader, sequence_key
from mmreplay.spec import StoreSpec, make_spec
from mmreplay.storage.commit import Committer, take_lock
from mmreplay.storage.frame_store import FrameStore, create_frames_array
from mmreplay.storage.layout import store_dictionary
from mmreplay.storage.manifest import MAX_RAM_BYTES
from mmreplay.storage.remote_frames import RemoteChunks
from mmreplay.storage.zstd_dict import parse_dictionary
from mmreplay.torch_batch import ArrayBatch, Batch, SequenceBatch
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
        self._limits = LimiterSlot(self._lock, spec.num_envs)
        self._closed = False
        self._files = StoreFiles(self._commits, self._reader, self._priorities, durable=durable)
        rng = self._files.start(manifest, writable)
        self._lock_fd = lock_fd
        self._batches = BatchMaker(
            spec, self._lock, self._reader, self._sequences, self._limits,
            self._files.open_device(device, spec, self._sequences, self._recorder),
            np.random.default_rng() if rng is None else rng,
            refuse_closed=functools.partial(_refuse_closed, weakref.proxy(self)),  # no cycle
            open_view=None if writable else functools.partial(_open_view, type(self), root))

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
        self._limits.insert(self._record, (action, reward, next_obs, terminated, truncated,
                                           autoreset, env_ids, extras), env_ids, autoreset)

    def _record(self, step: tuple[Any, ...]) -> None:
        """`add`'s recording, under the lock once the rate limiter (if any) admitted it."""
        _check_writable(self, "add")
        self._recorder.add(*step)

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
        if limiter is not None:
            _check_writable(self, "set_rate_limiter")
        with self._lock:
            self._limits.attach(limiter, self._commits.committed.get("rate_limiter"),
                                inserts=self._ring.next_id, capacity=self.spec.capacity)

    @property
    def rate_limiter(self) -> RateLimiter | None:
        """The rate limiter in use, if any (see `set_rate_limiter`)."""
        return cast(RateLimiter | None, self._limits.limiter)

    def rate_limiter_state(self) -> dict[str, Any] | None:
        """The limiter's counters: live if one is attached, else as last committed."""
        return self._limits.state(self._commits.committed.get("rate_limiter"))

    # -- reading ------------------------------------------------------------------
    def sample(self, batch_size: int, beta: float = 0.4) -> Batch:
        """`batch_size` sampleable transitions, with replacement. Uniform by default; with
        ``sampler="prioritized"``/``"rank"`` the draw follows the priorities and
        ``batch.weights`` are importance weights with exponent `beta`. With a rate limiter,
        waits first until the writers let `batch_size` samples out."""
        return self._batches.sample(batch_size, beta)

    def sample_arrays(self, batch_size: int, beta: float = 0.4, *, pin_memory: bool = False,
                      out: np.ndarray | None = None) -> ArrayBatch:
        """`sample` as numpy arrays (see docs/guides/performance.md: reuse, `pin_memory`).
        `out`: a C-contiguous, writable 1-D uint8 array of at least the batch's frame bytes
        (``2 * batch_size * frame_stack * frame_bytes``) that the frames are written into
        (the batch's ``frames`` view it)."""
        return self._batches.sample_arrays(batch_size, beta, pin_memory, out)

    def batches(self, batch_size: int, *, prefetch: int = 2, beta: float = 0.4,
                pin_memory: bool = False, device: Any = None, workers: int = 1,
                processes: bool = False) -> BatchPrefetcher | SamplingProcesses:
        """An endless iterator of ``sample(batch_size, beta)`` batches drawn ahead.

        A thread keeps `prefetch` batches ready (a bucket store: `prefetch` more in flight,
        fetched at once), overlapping the learner's work. Set ``it.beta`` to anneal. Draws
        happen in order when the thread makes them, so with concurrent ``add`` calls the
        sequence depends on timing (use plain ``sample`` where bit-exact replays matter).
        ``pin_memory``, ``device``, ``workers``, ``processes`` (a read-only store sampled by
        `workers` processes): see docs/guides/gpu.md."""
        _refuse_closed(self, "batches")
        validate.batch_size(batch_size), validate.beta(beta)
        return self._batches.prefetcher(batch_size, prefetch, beta, pin_memory, device,
                                        workers, self.remote, bool(processes))

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
        return self._batches.get(ids)

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
        return self._batches.sample_sequences(batch_size, length, cross_episodes, period, beta)

    @_reading
    def get_sequences(self, ids: Any, length: int, *, cross_episodes: bool = False,
                      period: int = 1) -> SequenceBatch:
        """The sequences starting at these transition ids (each a valid start, see
        `sequence_starts`), with weights 1; raises `UnknownIdError` otherwise."""
        return self._batches.get_sequences(length, cross_episodes, period, ids)

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
        return self._priorities.set_sequences(ids, td_errors, eta, self._sequences.starts_of)

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
        self._batches.rng = np.random.default_rng(seed)

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
        with self._lock:
            _check_writable(self, "flush")
            self._files.commit(self._batches.rng.bit_generator.state, self.rate_limiter_state())
        if self.mirror is not None:
            self.mirror.notify(self.generation, wait=wait_mirror)
        self._priorities.report_late()  # a late update dropped at this commit

    def close(self) -> None:
        """Stop prefetchers, flush (if writable) and release the writer lock. Idempotent."""
        self._batches.stop()  # before taking the lock: their threads may be waiting for it
        with self._lock:
            if self._closed:
                return
            try:
                if self.writable:
                    self.flush()
            finally:
                self._closed = True
                self._batches.device = None  # its memory goes back to the device
                lock_fd, self._lock_fd = self._lock_fd, None
                self._files.close(lock_fd, self.remote, self.mirror)
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


def _counts(ring: StepRing, sampleable: int) -> StoreCounts:
    return StoreCounts(frames_written=int(ring.written.sum()),
                       frames_kept=int((ring.written - ring.oldest).sum()),
                       transitions=ring.next_id, episodes=ring.next_episode,
                       sampleable=sampleable)


def _open_view(cls: type[ReplayStore], root: Path,
               seed: int) -> tuple[BatchMaker, Callable[[], None]]:
    """A read-only view of the store at `root` for one prefetch worker, seeded with `seed`
    (`BatchMaker.prefetcher`): its batch maker, and how to close it."""
    view = cls.open(root, mode="r", cache_bytes=0)
    view.reseed(seed)
    return view._batches, view.close

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
`manifest`/`layout`/`safe_io`, torch conversion in `torch_batch`.
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

from mmreplay import validate
from mmreplay.errors import (
    EmptyStoreError,
    InvalidInputError,
    InvalidStoreError,
    ReadOnlyError,
    UnknownIdError,
)
from mmreplay.index.ring import StepRing
from mmreplay.index.samplers import PrioritizedSampler, PrioritySampler, make_sampler
from mmreplay.index.sequences import SequenceKey, sequence_priority
from mmreplay.prefetch import BatchPrefetcher
from mmreplay.sequence_reader import SequenceArrays, SequenceReader
from mmreplay.spec import StoreSpec, make_spec
from mmreplay.storage.commit import Committer, readers_shared, rng_from_state, take_lock
from mmreplay.storage.frame_store import FrameStore, create_frames_array
from mmreplay.storage.layout import check_store_files
from mmreplay.storage.manifest import (
    MANIFEST,
    MAX_RAM_BYTES,
    check_manifest,
    check_ram,
    check_root,
    parse_spec,
    read_manifest,
)
from mmreplay.storage.safe_io import TMP_DIR
from mmreplay.torch_batch import Batch, SequenceBatch, make_batch, make_sequence_batch

READER_RETRIES = 5
OPEN_RETRIES = 32  # read-only opens raced by commits; only a live writer makes one retry
F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run `method` under the store's lock (a prefetch thread may sample concurrently)."""

    @functools.wraps(method)
    def wrapper(self: ReplayStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(F, wrapper)


@dataclass(frozen=True)
class StoreCounts:
    """Totals since creation (written, transitions, episodes) and what is kept now."""

    frames_written: int
    frames_kept: int
    transitions: int
    episodes: int
    sampleable: int


class ReplayStore:
    """A disk-backed replay memory that keeps every frame once (see README)."""

    # -- construction -------------------------------------------------------------
    def __init__(self, root: Path, spec: StoreSpec, *, writable: bool, durable: bool,
                 cache_bytes: int | None, lock_fd: int | None) -> None:
        self.path = root
        self.spec = spec
        self.writable = writable
        self.durable = durable
        self._lock_fd = lock_fd
        self._ring = StepRing(spec)
        self._envs = np.arange(spec.num_envs, dtype=np.int64)
        self._any_slot = np.ones(spec.num_envs * spec.slots_per_env, bool)
        self._scalar_step = validate.scalar_step_checker(spec)
        self._frames = FrameStore(root, spec, writable=writable, durable=durable,
                                  cache_bytes=validate.cache_budget(spec, cache_bytes),
                                  before_chunk_write=self._before_chunk_write)
        self._sampler = make_sampler(spec)
        self._sequences = SequenceReader(
            self._ring, self._frames, lambda: make_sampler(spec),
            None if spec.sampler == "uniform" else self._start_priorities)
        self._rng = np.random.default_rng()
        self._commits = Committer(root, spec, durable=durable)
        self._prio_dirty: set[int] = set()
        self._lock = threading.RLock()
        self._manifest_key: tuple[int, int, int] | None = None
        self._prefetchers: weakref.WeakSet[BatchPrefetcher] = weakref.WeakSet()
        self._closed = False

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, capacity: int, obs_shape: Any,
               obs_dtype: Any = np.uint8, num_envs: int = 1, frame_stack: int = 1,
               n_step: int = 1, gamma: float = 0.99, stack_padding: str = "zero",
               action_shape: Any = (), action_dtype: Any = np.int64, seed: int | None = None,
               durable: bool = False, cache_bytes: int | None = None, extras: Any = None,
               **options: Any) -> ReplayStore:
        """Create a new, empty store at `path` (which must not exist or be empty).

        `extras` declares per-step columns ``{name: (shape, dtype)}`` that every ``add``
        then takes and every batch returns (e.g. a recurrent state, a log-probability).
        """
        spec = make_spec(capacity=capacity, obs_shape=obs_shape, obs_dtype=obs_dtype,
                         num_envs=num_envs, frame_stack=frame_stack, n_step=n_step, gamma=gamma,
                         stack_padding=stack_padding, action_shape=action_shape,
                         action_dtype=action_dtype, extras=extras, **options)
        cache_bytes = validate.cache_bytes(cache_bytes)
        root = Path(path)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise InvalidInputError(f"{root} already exists and is not an empty directory")
        create_frames_array(root, spec)
        (root / TMP_DIR).mkdir()
        store = cls(root, spec, writable=True, durable=durable, cache_bytes=cache_bytes,
                    lock_fd=take_lock(root))
        store._rng = np.random.default_rng(seed)
        store._commits.open_readers()
        store.flush()
        return store

    @classmethod
    def open(cls, path: str | os.PathLike[str], mode: str = "r+", *, durable: bool = False,
             cache_bytes: int | None = None,
             max_ram_bytes: int = MAX_RAM_BYTES) -> ReplayStore:
        """Open an existing store: ``mode="r+"`` to write, ``"r"`` read-only.

        The directory is untrusted: every file is checked (see `manifest`) before anything
        is allocated, and a store whose spec needs more than `max_ram_bytes` is refused.
        Any problem raises `InvalidStoreError`.
        """
        cache_bytes = validate.cache_bytes(cache_bytes)
        if mode not in ("r", "r+"):
            raise InvalidInputError(f"mode must be 'r' or 'r+', got {mode!r}")
        root = Path(path)
        check_root(root)
        if mode == "r":
            return cls._open_reader(root, durable=durable, cache_bytes=cache_bytes,
                                    max_ram_bytes=max_ram_bytes)
        lock_fd = take_lock(root)
        try:
            return cls._open_checked(root, writable=True, durable=durable,
                                     cache_bytes=cache_bytes, lock_fd=lock_fd,
                                     max_ram_bytes=max_ram_bytes)
        except BaseException:
            os.close(lock_fd)
            raise

    @classmethod
    def _open_reader(cls, root: Path, *, durable: bool, cache_bytes: int | None,
                     max_ram_bytes: int) -> ReplayStore:
        """Open read-only beside a possibly live writer.

        A writer deletes the files of the generation it replaced after it commits,
        but not while a reader holds the shared lock on ``root/readers`` (see
        `readers_shared`). Without that lock (a store no writer has opened since it
        existed, or a writer that ignores it) a reader that read the old manifest may
        find a file missing. That is only damage if the manifest is still the one the reader read:
        otherwise a commit raced the open, and the open starts again. "Still the
        one" compares contents, not (inode, mtime, size), which a writer committing
        within one clock tick can repeat with a recycled inode.
        """
        with readers_shared(root):
            for attempt in range(OPEN_RETRIES):
                manifest = read_manifest(root)
                try:
                    return cls._open_checked(root, writable=False, durable=durable,
                                             cache_bytes=cache_bytes, lock_fd=None,
                                             max_ram_bytes=max_ram_bytes, manifest=manifest)
                except InvalidStoreError:
                    if attempt + 1 == OPEN_RETRIES or read_manifest(root) == manifest:
                        raise
        raise AssertionError("unreachable")  # the last attempt returns or raises

    @classmethod
    def _open_checked(cls, root: Path, *, writable: bool, durable: bool,
                      cache_bytes: int | None,
                      lock_fd: int | None, max_ram_bytes: int,
                      manifest: dict[str, Any] | None = None) -> ReplayStore:
        if manifest is None:
            manifest = read_manifest(root)
        spec = parse_spec(manifest)
        check_ram(spec, max_ram_bytes)
        check_manifest(manifest, spec)
        check_store_files(root, manifest, spec)  # all before the first allocation
        store = cls(root, spec, writable=writable, durable=durable, cache_bytes=cache_bytes,
                    lock_fd=None)
        try:
            store._load(manifest)
            if writable:
                (root / TMP_DIR).mkdir(exist_ok=True)
                store._commits.open_readers()
                store._commits.sweep()
        except BaseException:
            store._frames.close()
            store._commits.close()
            raise
        store._lock_fd = lock_fd
        return store

    # -- recording ----------------------------------------------------------------
    @_locked
    def reset(self, obs: Any, env_ids: Any = None) -> None:
        """Write o_0 of a new episode for all envs, or for the listed `env_ids`.

        A running episode in a listed env ends as truncated at its last step.
        """
        self._check_writable("reset")
        if self.spec.num_envs == 1 and env_ids is not None:
            envs = validate.env_ids(self.spec, env_ids)
            frames = validate.observations(self.spec, obs, 1)
        else:
            envs = validate.env_ids(self.spec, env_ids)
            frames = validate.observations(self.spec, obs, envs.size)
        slots = self._ring.begin_episodes(envs)
        self._frames.append(envs, slots, frames)

    @_locked
    def add(self, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            autoreset: Any = None, env_ids: Any = None, *, extras: Any = None) -> None:
        """Record one step of every env, or of the listed `env_ids` (each at most once;
        every argument then has a leading ``len(env_ids)`` dimension and the other envs
        do not advance). See README for the autoreset rule. `extras` (``{name: array}``,
        exactly the declared ones) belong to this step, like `action`."""
        self._check_writable("add")
        if self._scalar_step is not None and autoreset is None and env_ids is None \
                and extras is None and not self.spec.extras and self._ring.running[0]:
            step = self._scalar_step(action, reward, next_obs, terminated, truncated)
            if step is not None:  # else: not plain scalars; the general path checks them
                self._frames.append_one(0, self._ring.record_step(0, *step), next_obs)
                return
        spec = self.spec
        envs = self._envs if env_ids is None else validate.env_ids(spec, env_ids)
        count = envs.size
        frames = validate.observations(spec, next_obs, count, "next_obs")
        auto = validate.flags(spec, "autoreset", autoreset, count)
        term = validate.flags(spec, "terminated", terminated, count)
        trunc = validate.flags(spec, "truncated", truncated, count)
        act, rew = validate.actions(spec, action, count), validate.rewards(spec, reward, count)
        extra = validate.extras(spec, extras, count)
        self._record(envs, act, rew, frames, term, trunc, auto, extra)

    def _record(self, envs: np.ndarray, act: np.ndarray, rew: np.ndarray, frames: np.ndarray,
                term: np.ndarray, trunc: np.ndarray, auto: np.ndarray,
                extras: dict[str, np.ndarray] | None = None) -> None:
        """`add` after its argument checks (arrays of the right shapes and dtypes, one row
        per env of `envs`); refuses steps of envs whose episode is not running."""
        idle = envs[~auto & ~self._ring.running[envs]]
        if idle.size:
            raise InvalidInputError(
                f"add for env {int(idle[0])} whose episode has ended or not begun: call reset "
                f"(or pass autoreset=True for it) first")
        extras = extras or {}
        if not auto.any():  # the common case: every listed env steps
            self._frames.append(
                envs, self._ring.record_steps(envs, act, rew, term, trunc, extras), frames)
            return
        step, again = np.flatnonzero(~auto), np.flatnonzero(auto)
        slots = self._ring.record_steps(envs[step], act[step], rew[step], term[step],
                                        trunc[step], {k: v[step] for k, v in extras.items()})
        self._frames.append(envs[step], slots, frames[step])
        self._frames.append(envs[again], self._ring.begin_episodes(envs[again]), frames[again])

    # -- reading ------------------------------------------------------------------
    @_locked
    def sample(self, batch_size: int, beta: float = 0.4) -> Batch:
        """`batch_size` sampleable transitions, with replacement.

        Uniform by default; with ``sampler="prioritized"``/``"rank"`` the draw follows
        the priorities and ``batch.weights`` are importance weights with exponent `beta`.
        """
        size = validate.batch_size(batch_size)
        beta = validate.beta(beta)
        for _ in range(READER_RETRIES):
            self._refresh()
            if self._sampler.count() == 0:
                raise EmptyStoreError(
                    "cannot sample: the store holds no sampleable transition yet")
            draw = self._sampler.sample(self._rng, size, beta)
            batch = self._batch(draw.slots, draw.weights)
            if self._still_valid(draw.slots):
                return batch
        raise InvalidStoreError(f"{self.path}: a writer overwrote frames while they were read "
                                f"{READER_RETRIES} times in a row; try again")

    def batches(self, batch_size: int, *, prefetch: int = 2,
                beta: float = 0.4) -> BatchPrefetcher:
        """An endless iterator of ``sample(batch_size, beta)`` batches drawn ahead.

        A background thread keeps `prefetch` batches ready, so decoding overlaps
        the learner's work. Set ``it.beta`` to anneal. Draws happen when the
        thread makes them, so with concurrent ``add`` calls the exact sequence
        depends on timing (use plain ``sample`` where bit-exact replays matter).
        """
        validate.batch_size(batch_size)
        validate.beta(beta)
        it = BatchPrefetcher(self.sample, batch_size, prefetch=prefetch, beta=beta)
        self._prefetchers.add(it)
        return it

    @_locked
    def update_priorities(self, ids: Any, priorities: Any) -> int:
        """Set new priorities (e.g. |TD error|) for sampled ids; returns how many applied.

        Ids no longer (or not yet) sampleable are ignored; for duplicates the last value
        wins; NaN, inf or negative priorities raise and change nothing.
        """
        self._check_writable("update_priorities")
        wanted = validate.transition_ids(ids)
        values = validate.priorities(priorities, wanted.size)
        sampler = self._priority_sampler()
        if sampler is None:
            raise InvalidInputError(
                f"update_priorities needs sampler='prioritized' or 'rank'; this store samples "
                f"{self.spec.sampler!r}")
        self._refresh()
        if isinstance(sampler, PrioritizedSampler):  # one compiled call: ids to tree leaves
            applied = sampler.set_id_priorities(wanted, values, self._ring.id_map())
            if applied is None:  # some ids live in the ring's spill table
                applied = sampler.set_id_priorities(wanted, values, self._ring.id_map(),
                                                    self._ring.spilled(wanted))
            assert applied is not None  # `pre` given: nothing is missed
            self._priorities_set(applied.slots, applied.priorities)
            return int(applied.slots.size)
        flat, found = self._ring.flat_of_ids(wanted)
        return self._set_step_priorities(sampler, flat[found], values[found])

    @_locked
    def get(self, ids: Any) -> Batch:
        """The transitions with these ids; raises `UnknownIdError` if any is not sampleable."""
        wanted = validate.transition_ids(ids)
        self._refresh()
        flat, found = self._ring.flat_of_ids(wanted)
        if not found.all():
            bad = wanted[~found][:5].tolist()
            raise UnknownIdError(f"transition ids {bad} are not (or no longer) sampleable")
        batch = self._batch(flat, np.ones(flat.size, np.float32))
        if not self._still_valid(flat):
            raise UnknownIdError("some of these transitions were overwritten by the writer "
                                 "while they were read")
        return batch

    @_locked
    def sample_sequences(self, batch_size: int, length: int, *, cross_episodes: bool = False,
                         period: int = 1, beta: float = 0.4) -> SequenceBatch:
        """`batch_size` sequences of `length` consecutive steps of one env, with replacement,
        uniform over valid starts (or by priority in prioritized stores).

        ``cross_episodes=False`` (R2D2): a sequence stays in one episode, padded and masked
        past its end; starts at episode positions divisible by `period`. ``True``
        (DreamerV3): `length` consecutive steps of the env, ``is_first`` marking each new
        episode, never padded. See README "Sequences".
        """
        size, beta = validate.batch_size(batch_size), validate.beta(beta)
        key = self._sequence_key(length, cross_episodes, period)
        for _ in range(READER_RETRIES):
            self._refresh()  # the step priorities that starts take
            index = self._sequences.index(key)
            if index.sampler.count() == 0:
                raise EmptyStoreError(f"cannot sample: no valid start for sequences of "
                                      f"{key.length} steps yet")
            arrays = self._sequences.sample(key, self._rng, size, beta)
            if self._still_valid_starts(key, arrays.starts):
                return _sequence_batch(arrays)
        raise InvalidStoreError(f"{self.path}: a writer overwrote frames while they were read "
                                f"{READER_RETRIES} times in a row; try again")

    @_locked
    def get_sequences(self, ids: Any, length: int, *, cross_episodes: bool = False,
                      period: int = 1) -> SequenceBatch:
        """The sequences starting at these transition ids (each a valid start, see
        `sequence_starts`), with weights 1; raises `UnknownIdError` otherwise."""
        wanted = validate.transition_ids(ids)
        key = self._sequence_key(length, cross_episodes, period)
        self._refresh()
        index = self._sequences.index(key)
        flat, found = self._ring.flat_of_ids(wanted, valid=index.valid)
        if not found.all():
            bad = wanted[~found][:5].tolist()
            raise UnknownIdError(f"ids {bad} are not (or no longer) valid starts of sequences "
                                 f"of {key.length} steps")
        arrays = self._sequences.read(key, flat, np.ones(flat.size, np.float32))
        if not self._still_valid_starts(key, flat):
            raise UnknownIdError("some of these sequences were overwritten by the writer "
                                 "while they were read")
        return _sequence_batch(arrays)

    @_locked
    def sequence_starts(self, length: int, *, cross_episodes: bool = False,
                        period: int = 1) -> np.ndarray:
        """The transition ids of every valid sequence start, increasing."""
        key = self._sequence_key(length, cross_episodes, period)
        self._refresh()
        flat = np.flatnonzero(self._sequences.index(key).valid)
        return np.sort(self._ring.steps["id"].reshape(-1)[flat])

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
        self._check_writable("update_sequence_priorities")
        rows, errors = validate.sequence_priorities(ids, td_errors)
        eta = validate.unit_interval("eta", eta)
        sampler = self._priority_sampler()
        if sampler is None or self.spec.sampler != "prioritized":
            raise InvalidInputError(f"update_sequence_priorities needs sampler='prioritized'; "
                                    f"this store samples {self.spec.sampler!r}")
        self._refresh()
        values = sequence_priority(rows, errors, eta)
        flat, found = self._ring.flat_of_ids(rows[:, 0], valid=self._any_slot)
        found &= self._sequences.valid_starts(flat)
        return self._set_step_priorities(sampler, flat[found], values[found])

    def _set_step_priorities(self, sampler: PrioritySampler, flat: np.ndarray,
                             values: np.ndarray) -> int:
        """The priority column at these step slots (transitions and sequence starts); for a
        slot given twice the last value wins. Returns how many slots were set."""
        flat, first = np.unique(flat[::-1], return_index=True)  # reversed: first = last given
        values = values[::-1][first]
        sampler.set_priorities(flat, values)
        self._priorities_set(flat, values)
        return int(flat.size)

    def _priorities_set(self, flat: np.ndarray, values: np.ndarray) -> None:
        """After the sampler took new priorities of these step slots: the sequence indexes
        take them too, and their step blocks are saved by the next flush."""
        self._sequences.set_priorities(flat, values)
        self._prio_dirty.update((flat % self.spec.slots_per_env // self.spec.block_slots).tolist())

    def _start_priorities(self, flat: np.ndarray) -> np.ndarray:
        sampler = self._priority_sampler()
        assert sampler is not None  # only prioritized stores ask
        return cast(PrioritizedSampler, sampler).priorities_at(flat)

    def _sequence_key(self, length: Any, cross_episodes: Any, period: Any) -> SequenceKey:
        key = SequenceKey(*validate.sequence_key(self.spec, length, cross_episodes, period))
        if self.spec.sampler == "rank":
            raise InvalidInputError("sequences are sampled uniformly or by proportional "
                                    "priority; this store samples 'rank'")
        return key

    def _still_valid_starts(self, key: SequenceKey, flat: np.ndarray) -> bool:
        """After a read: False if a writer gave up any of these starts meanwhile."""
        return not self._follow_writer() or bool(self._sequences.index(key).valid[flat].all())

    @_locked
    def valid_ids(self) -> np.ndarray:
        """Every sampleable transition id, increasing."""
        self._refresh()
        flat = self._ring.valid_flat()
        return np.sort(self._ring.steps["id"].reshape(-1)[flat])

    @_locked
    def __len__(self) -> int:
        self._refresh()
        return self._sampler.count()

    @property
    @_locked
    def counts(self) -> StoreCounts:
        """How much the store has seen and holds now."""
        ring = self._ring
        return StoreCounts(
            frames_written=int(ring.written.sum()),
            frames_kept=int((ring.written - ring.oldest).sum()),
            transitions=ring.next_id, episodes=ring.next_episode, sampleable=len(self))

    def _refresh(self) -> None:
        self._follow_writer()
        slots, valid = self._ring.refresh()
        if slots.size:  # most samples of a learner that adds between them change nothing
            self._sampler.update(slots, valid, self._ring.steps["id"].reshape(-1)[slots])

    def _follow_writer(self) -> bool:
        """Read-only: give up the frames a writer has given up since; True if any were.

        A writer commits a manifest that gives frames up *before* it overwrites
        them, so a reader that re-checks the manifest after reading frames knows
        whether what it read may have changed underneath it.
        """
        if self.writable:
            return False
        try:
            st = os.stat(self.path / MANIFEST)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._manifest_key:
                return False
            self._manifest_key = key
            kept = np.asarray(read_manifest(self.path)["kept_from"], dtype=np.int64)
        except (OSError, InvalidStoreError, ValueError, TypeError):
            return False  # the writer's business; this reader keeps its generation
        if kept.shape != self._ring.kept_from.shape or (kept <= self._ring.kept_from).all():
            return False
        np.maximum(self._ring.kept_from, kept, out=self._ring.kept_from)
        self._ring.rebuild_validity()
        self._update_all_slots()
        return True

    def _update_all_slots(self) -> None:
        """Tell the sampler the validity and id of every slot (after a full rebuild)."""
        ring = self._ring
        self._sampler.update(np.arange(ring.valid.size), ring.valid, ring.steps["id"].reshape(-1))

    def _still_valid(self, flat: np.ndarray) -> bool:
        """After a read: False if a writer gave up any of these transitions meanwhile."""
        return not self._follow_writer() or bool(self._ring.valid[flat].all())

    def _batch(self, flat: np.ndarray, weights: np.ndarray) -> Batch:
        look = self._ring.lookup(flat)
        frames = self._frames.read(np.stack([look.obs_slots, look.next_obs_slots]))
        return make_batch(frames=frames, action=look.action, reward=look.reward,
                          terminated=look.terminated,
                          truncated=look.truncated, discount=look.discount, weights=weights,
                          ids=look.ids, extras=look.extras, steps=look.steps)

    # -- persistence --------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Number of the last committed manifest."""
        return self._commits.generation

    @_locked
    def flush(self) -> None:
        """Commit everything recorded so far; writes only what changed since the last flush."""
        self._check_writable("flush")
        self._refresh()  # new transitions get their priorities before they are saved
        if self.durable:
            self._frames.sync()
        else:
            self._frames.drain()  # the manifest may only name chunks that are on disk
        sampler = self._priority_sampler()
        self._commits.commit(
            self._ring, self._frames.tail_frames(), self._rng.bit_generator.state,
            priorities=None if sampler is None else sampler.priorities(),
            max_priority=1.0 if sampler is None else sampler.max_priority(),
            prio_dirty=self._prio_dirty)
        self._ring.dirty_blocks.clear()
        self._prio_dirty.clear()

    def close(self) -> None:
        """Stop prefetchers, flush (if writable) and release the writer lock. Idempotent."""
        for it in list(self._prefetchers):
            it.close()  # before taking the lock: their threads may be waiting for it
        with self._lock:
            if self._closed:
                return
            try:
                if self.writable:
                    self.flush()
            finally:
                self._closed = True
                self._frames.close()
                try:
                    self._commits.close()  # may fail to delete retired files: swept later
                finally:
                    if self._lock_fd is not None:
                        os.close(self._lock_fd)
                        self._lock_fd = None

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ReplayStore({str(self.path)!r}, capacity={self.spec.capacity}, "
                f"num_envs={self.spec.num_envs}, sampleable={len(self)})")

    # -- persistence helpers --------------------------------------------------------
    def _before_chunk_write(self, env: int, first: int, last: int) -> None:
        """The frame store is about to write chunks ``first..last`` of `env` with the frames
        they hold now over older ones: see `Committer.give_up`."""
        end = last * self.spec.chunk_frames + self._frames.chunk_slots(last)  # past the last slot
        last_new = self._ring.frame_at(np.array([env * self.spec.slots_per_env + end - 1]))[0]
        self._commits.give_up(env, int(last_new), end - first * self.spec.chunk_frames)

    def _load(self, manifest: dict[str, Any]) -> None:
        """Fill the RAM parts from a manifest that passed `check_manifest`."""
        commits, ring = self._commits, self._ring
        commits.load_ring(manifest, ring)
        tail = commits.load_tail(manifest, self._frames.tail)
        self._frames.load_tail(tail, ring.written % self.spec.slots_per_env)
        sampler = self._priority_sampler()
        if sampler is None:
            self._update_all_slots()
        else:
            sampler.load(commits.load_priorities(manifest), ring.steps["id"].reshape(-1),
                         float(manifest["max_priority"]), ring.valid)
        self._rng = rng_from_state(manifest["rng"])
        commits.committed = manifest

    def _priority_sampler(self) -> PrioritySampler | None:
        """The sampler, when it keeps priorities (``sampler != "uniform"``)."""
        if self.spec.sampler == "uniform":
            return None
        return cast(PrioritySampler, self._sampler)

    def _check_writable(self, what: str) -> None:
        if self._closed:
            raise InvalidInputError(f"{what} on a closed store")
        if not self.writable:
            raise ReadOnlyError(f"{what} on a store opened read-only (mode='r')")


def _sequence_batch(arrays: SequenceArrays) -> SequenceBatch:
    win = arrays.windows
    return make_sequence_batch(
        obs=arrays.obs, next_obs=arrays.next_obs, action=win.action, reward=win.reward,
        terminated=win.terminated, truncated=win.truncated, is_first=win.is_first,
        mask=win.mask, ids=win.ids, weights=arrays.weights, extras=win.extras)

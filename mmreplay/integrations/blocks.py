"""Blocks of steps: what one writer sends to a store in one call, and how a store takes it.

A block holds T rows of the writer's E envs (its vector env steps them together)::

    env_ids     (E,)                 the store's env ids this writer owns
    action      (T, E, *action)      row t is one ``store.add(..., env_ids=env_ids)``
    reward      (T, E) float32
    terminated  (T, E) bool
    truncated   (T, E) bool
    autoreset   (T, E) bool          True: frames[t, e] is o_0 of a new episode (a reset)
    frames      (T, E, *obs)         raw, or zstd bytes (`frames_zstd`) with their shape
    priorities  (T, E) float64       optional initial priorities (computed by the actor)
    stream      int                  the writer's stream number (see `BlockTaker`)

A reset is a row with ``autoreset`` True, so one rectangular format carries whole
streams. Rows are applied in order; nothing is applied unless the whole block checks.
The stream number protects episodes across a store restart: a row that continues an
episode is taken only if the store saw that env's previous row in this process under
the same stream number; otherwise the block is refused (nothing applied) and the
writer starts fresh episodes. This module imports no Ray.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard
from numcodecs import blosc

from mmreplay import validate
from mmreplay.errors import InvalidInputError, RateLimitTimeoutError
from mmreplay.index.sum_tree import SumTree
from mmreplay.recorder import StepRows
from mmreplay.store import ReplayStore


@dataclass(frozen=True)
class StepBlock:
    """T rows of steps of E envs (see module docstring). `frames` or `frames_zstd` is set."""

    env_ids: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    autoreset: np.ndarray
    stream: int
    frames: np.ndarray | None = None
    frames_zstd: bytes | None = None
    frames_shape: tuple[int, ...] = ()
    frames_dtype: str = "uint8"
    priorities: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.reward.shape[0])

    @property
    def steps(self) -> int:
        """Rows that are steps (not resets): the transitions this block adds."""
        return int((~self.autoreset).sum())

    @property
    def nbytes(self) -> int:
        """Bytes of payload (arrays and compressed frames) this block carries."""
        arrays = (self.env_ids, self.action, self.reward, self.terminated, self.truncated,
                  self.autoreset, self.frames, self.priorities)
        return sum(a.nbytes for a in arrays if a is not None) + len(self.frames_zstd or b"")

    def frame_array(self) -> np.ndarray:
        """The frames as an array (decoded when they travel compressed)."""
        if self.frames is not None:
            return self.frames
        if self.frames_zstd is None:
            raise InvalidInputError("block has neither frames nor frames_zstd")
        dtype = np.dtype(self.frames_dtype)
        want = int(np.prod(self.frames_shape)) * dtype.itemsize
        try:  # at most `want` bytes come out, whatever the frame header claims
            raw = zstandard.ZstdDecompressor().decompress(self.frames_zstd, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise InvalidInputError(f"frames_zstd is not a zstd frame of {want} bytes "
                                    f"({exc})") from None
        if len(raw) != want:
            raise InvalidInputError(f"frames_zstd holds {len(raw)} bytes, expected {want} for "
                                    f"shape {self.frames_shape} of {dtype}")
        return np.frombuffer(raw, dtype=dtype).reshape(self.frames_shape)


def compress_frames(frames: np.ndarray) -> bytes:
    """lz4 through c-blosc, no shuffle: sampled stacks sent to learners (cheap to encode on
    the learner's critical path; docs/compression.md)."""
    return bytes(blosc.compress(np.ascontiguousarray(frames), b"lz4", 1, blosc.NOSHUFFLE))


def compress_block_frames(frames: np.ndarray) -> bytes:
    """zstd level 1, one frame a block: a block's frames travel actor -> store 2.8-5.3x
    smaller than lz4 for about the same CPU (measured on five games, docs/compression.md)."""
    return zstandard.ZstdCompressor(level=1).compress(np.ascontiguousarray(frames).data)


def make_block(*, env_ids: np.ndarray, action: np.ndarray, reward: np.ndarray,
               frames: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
               autoreset: np.ndarray, stream: int, compress: bool = False,
               priorities: np.ndarray | None = None) -> StepBlock:
    """A block from row-major arrays (frames compressed with zstd when `compress`)."""
    packed: dict[str, Any] = {"frames": frames}
    if compress:
        packed = {"frames_zstd": compress_block_frames(frames), "frames_shape": tuple(frames.shape),
                  "frames_dtype": frames.dtype.str}
    return StepBlock(env_ids=env_ids, action=action, reward=reward, terminated=terminated,
                     truncated=truncated, autoreset=autoreset, stream=stream,
                     priorities=priorities, **packed)


@dataclass(frozen=True)
class BlockAck:
    """A store's answer to one block.

    `accepted` False: refused because an env's stream did not continue here (a store
    restart in between), or `timed_out` waiting for the store's rate limiter; nothing
    was applied. `seq` numbers accepted blocks within one store process (`incarnation`);
    every block with ``seq <= flushed_seq`` is committed.
    """

    accepted: bool
    incarnation: str
    seq: int
    flushed_seq: int
    first_id: int = -1  # id of the block's first step (ids follow in row-major order)
    timed_out: bool = False


@dataclass(frozen=True)
class FlushInfo:
    """What one flush committed: blocks up to `seq` of this store process, `transitions`
    transitions in all (``counts.transitions``), as manifest `generation`."""

    incarnation: str
    seq: int
    transitions: int
    generation: int


@dataclass
class FlushSchedule:
    """Flush after `every_steps` steps (checked as blocks arrive) or `every_s` seconds
    after the first step not yet flushed (checked by a `FlushTimer`), whichever first."""

    every_steps: int = 10_000
    every_s: float = 30.0
    steps: int = 0
    last: float = field(default_factory=time.monotonic)
    pending_since: float | None = None  # when the oldest unflushed step was taken

    def due(self, new_steps: int) -> bool:
        """Count `new_steps` taken; True when as many as `every_steps` wait for a flush."""
        self.steps += new_steps
        if new_steps and self.pending_since is None:
            self.pending_since = time.monotonic()
        return self.steps >= self.every_steps

    def seconds_left(self) -> float | None:
        """Until the unflushed steps are `every_s` old (<= 0: due); None if there are none."""
        if self.pending_since is None:
            return None
        return self.pending_since + self.every_s - time.monotonic()

    def done(self) -> None:
        self.steps, self.last, self.pending_since = 0, time.monotonic(), None


@dataclass
class TakerTimes:
    """Where a `BlockTaker`'s time went (seconds, since it started): checking blocks
    (decoding zstd frames included), waiting on the rate limiter, applying them to the
    store, flushing. What a profile of a store actor needs, at the cost of a few clock
    reads per block."""

    blocks: int = 0
    check_s: float = 0.0
    limiter_wait_s: float = 0.0
    apply_s: float = 0.0
    flush_s: float = 0.0


class BlockTaker:
    """Applies blocks to one writable store and tracks each env's stream (RAM only).

    Thread-safe: blocks are applied and flushes made under one lock, so a `FlushTimer`
    can flush while blocks arrive. A block waits on the store's rate limiter (if any)
    outside that lock, for its steps, before it is applied. `times` says where the time
    went (`TakerTimes`).
    """

    def __init__(self, store: ReplayStore, *, incarnation: str,
                 schedule: FlushSchedule | None = None) -> None:
        self.store = store
        self.incarnation = incarnation
        self.schedule = schedule or FlushSchedule()
        self.stream = np.full(store.spec.num_envs, -1, np.int64)  # -1: no stream yet
        self.open = np.zeros(store.spec.num_envs, bool)  # the env's last row left it running
        self.seq = 0
        self.flushed_seq = 0
        self.times = TakerTimes()
        self._lock = threading.RLock()

    def take(self, block: StepBlock, *, timeout_s: float | None = None) -> BlockAck:
        """Check the whole block, wait for the rate limiter (`timeout_s`, None: its own),
        then apply the block row by row; flush when the schedule says."""
        times, t0 = self.times, time.perf_counter()
        times.blocks += 1
        rows = check_block(self.store, block)
        envs = rows.env_ids
        continues = ~block.autoreset[0]
        t1 = time.perf_counter()
        times.check_s += t1 - t0
        if ((self.stream[envs] != block.stream) | ~self.open[envs])[continues].any():
            return BlockAck(False, self.incarnation, -1, self.flushed_seq)
        limiter = self.store.rate_limiter
        if limiter is not None:
            try:
                if timeout_s is None:
                    limiter.await_insert(block.steps)
                else:
                    limiter.await_insert(block.steps, timeout_s)
            except RateLimitTimeoutError:
                self.open[envs] = False  # the writer's next block must start afresh
                return BlockAck(False, self.incarnation, -1, self.flushed_seq, timed_out=True)
            finally:
                times.limiter_wait_s += time.perf_counter() - t1
        try:
            with self._lock:
                t2 = time.perf_counter()
                ack = self._apply(block, rows)
                times.apply_s += time.perf_counter() - t2
        except BaseException:
            if limiter is not None:
                limiter.cancel_insert(block.steps)
            raise
        if self.schedule.due(block.steps):
            self.flush()
        return ack

    def _apply(self, block: StepBlock, rows: CheckedRows) -> BlockAck:
        envs = rows.env_ids
        first_id = self.store.counts.transitions if block.priorities is not None else -1
        self.store.add_rows(StepRows(envs, rows.action, rows.reward, rows.frames,
                                     rows.terminated, rows.truncated, rows.autoreset))
        self.stream[envs] = block.stream
        last = block.autoreset[-1] | ~(block.terminated[-1] | block.truncated[-1])
        self.open[envs] = last
        if block.priorities is not None:
            steps = ~block.autoreset.reshape(-1)
            ids = first_id + np.arange(int(steps.sum()))
            self.store.update_priorities(ids, block.priorities.reshape(-1)[steps])
        self.seq += 1
        return BlockAck(True, self.incarnation, self.seq, self.flushed_seq, first_id)

    def flush(self) -> FlushInfo:
        """Commit now; says what was committed."""
        with self._lock:
            t0 = time.perf_counter()
            self.store.flush()
            self.times.flush_s += time.perf_counter() - t0
            self.flushed_seq = self.seq
            self.schedule.done()
            return FlushInfo(self.incarnation, self.seq, self.store.counts.transitions,
                             self.store.generation)

    def flush_if_old(self) -> float | None:
        """Flush if the oldest unflushed step is `every_s` old; the seconds until the next
        check is needed (None: nothing waits for a flush)."""
        with self._lock:
            left = self.schedule.seconds_left()
            if left is not None and left <= 0:
                self.flush()
                return None
            return left


def warm_up_kernels() -> None:
    """Load the compiled kernels a flush uses (numba's cache takes seconds to load in a
    fresh process), so that the first timed flush keeps its deadline."""
    tree = SumTree(4)
    tree.set(np.array([1]), np.array([1.0]))


class FlushTimer:
    """A thread that keeps the time promise of `FlushSchedule.every_s` when no block
    arrives: it flushes `every_s` after the first step not yet flushed, so at most
    `every_s` seconds of acknowledged steps are ever at risk. Not in the data path: it
    only sleeps until the next deadline and takes the taker's lock to flush. A failed
    flush is kept in `error` and tried again at the next deadline."""

    def __init__(self, taker: BlockTaker) -> None:
        self.taker = taker
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmreplay-flush-timer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warm_up_kernels()  # a process's first flush would load them: seconds, not ms
        every = self.taker.schedule.every_s
        wait: float | None = self.taker.flush_if_old()
        while not self._stop.wait(every if wait is None else max(wait, 0.001)):
            try:
                wait = self.taker.flush_if_old()
            except Exception as exc:  # noqa: BLE001 - kept for the owner; retried later
                self.error, wait = exc, every

    def close(self) -> None:
        """Stop the thread (a flush under way finishes first). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=30)


@dataclass(frozen=True)
class CheckedRows:
    """A block's arrays after the store's checks, cast to the store's dtypes."""

    env_ids: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    frames: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    autoreset: np.ndarray


def check_block(store: ReplayStore, block: StepBlock) -> CheckedRows:
    """Shapes, dtypes, values and episode order of a whole block, checked at once.

    Raises `InvalidInputError` before anything is applied, so a bad block changes nothing.
    """
    spec = store.spec
    envs = np.asarray(block.env_ids)
    if envs.ndim != 1 or envs.size == 0 or envs.dtype.kind not in "iu":
        raise InvalidInputError(f"block env_ids must be a non-empty 1-d int array, got "
                                f"{envs.dtype} {envs.shape}")
    rows = (block.rows, envs.size)
    frames = block.frame_array()
    wants = {"reward": rows, "terminated": rows, "truncated": rows, "autoreset": rows,
             "action": (*rows, *spec.action_shape), "frames": (*rows, *spec.obs_shape)}
    got = {"reward": block.reward, "terminated": block.terminated,
           "truncated": block.truncated, "autoreset": block.autoreset,
           "action": block.action, "frames": frames}
    if block.priorities is not None:
        wants["priorities"], got["priorities"] = rows, block.priorities
    for name, want in wants.items():
        if np.shape(got[name]) != want:
            raise InvalidInputError(f"block {name} shape {np.shape(got[name])} != expected "
                                    f"{want} (rows, envs, ...)")
    if block.rows == 0:
        raise InvalidInputError("block has no rows")
    checked = _check_values(store, block, frames)
    _check_episode_order(block)
    return checked


def _check_values(store: ReplayStore, block: StepBlock, frames: np.ndarray) -> CheckedRows:
    """Every row at once with the store's own argument checks (dtypes, finite values)."""
    spec, count, shape = store.spec, block.reward.size, block.reward.shape
    envs = validate.env_ids(spec, block.env_ids)
    validate.observations(spec, frames.reshape(count, *spec.obs_shape), count, "frames")
    action = validate.actions(spec, block.action.reshape(count, *spec.action_shape), count)
    reward = validate.rewards(spec, block.reward.reshape(count), count)
    flags = [validate.flags(spec, name, getattr(block, name).reshape(count), count)
             for name in ("terminated", "truncated", "autoreset")]
    if block.priorities is not None:
        if spec.sampler == "uniform":
            raise InvalidInputError("block carries priorities but the store samples uniformly")
        validate.priorities(block.priorities.reshape(count), count)
    return CheckedRows(envs, action.reshape(*shape, *spec.action_shape), reward.reshape(shape),
                       frames, *(f.reshape(shape) for f in flags))


def _check_episode_order(block: StepBlock) -> None:
    """Within the block, a row after an episode's end must be a reset (autoreset)."""
    ended = (block.terminated | block.truncated) & ~block.autoreset
    bad = ended[:-1] & ~block.autoreset[1:]
    if bad.any():
        t, e = np.argwhere(bad)[0].tolist()
        raise InvalidInputError(
            f"block row {t + 1} continues env {int(block.env_ids[e])} after its episode ended "
            f"at row {t}: that row must have autoreset=True")
